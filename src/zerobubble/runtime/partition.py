"""Cut an ordered list of layers into a schedule's virtual stages.

Stage ``s`` gets a contiguous slice of layers in model order. Each rank builds
only the stages the schedule places on it, so a rank never holds (or, with a
layer factory, never even constructs) the layers of other ranks.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zerobubble.schedule.ir import Schedule

LayerSource = Sequence[nn.Module] | nn.Sequential | Callable[[int], nn.Module]
"""An ordered list of layers (or ``nn.Sequential``), or a factory ``i -> layer i``."""


def stage_bounds(
    num_layers: int, num_stages: int, boundaries: Sequence[int] | None = None
) -> tuple[range, ...]:
    """The layer range of each stage.

    Without ``boundaries`` every stage gets ``num_layers // num_stages`` layers
    and the ``r = num_layers % num_stages`` remaining ones go one each to the
    interior stages 1, 2, ... in model order, then to stage 0, then to the last
    stage: the first and last stages also carry the embedding and the loss, so
    they are the last to grow.

    ``boundaries`` are the ``num_stages - 1`` cut points: stage ``s`` gets the
    layers ``[boundaries[s-1], boundaries[s])`` (with 0 and ``num_layers`` at
    the ends), so they must increase strictly inside ``(0, num_layers)``.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} stages (every stage needs at "
            "least one layer); use fewer devices or chunks, or split the model into more layers"
        )
    if boundaries is None:
        base, extra = divmod(num_layers, num_stages)
        interior = list(range(1, num_stages - 1))
        order = [*interior, 0, num_stages - 1] if num_stages > 1 else [0]
        sizes = [base] * num_stages
        for s in order[:extra]:
            sizes[s] += 1
        cuts, at = [], 0
        for n in sizes[:-1]:
            at += n
            cuts.append(at)
    else:
        cuts = list(boundaries)
        if len(cuts) != num_stages - 1:
            raise ValueError(
                f"boundaries has {len(cuts)} cut points but {num_stages} stages need "
                f"{num_stages - 1} (stage s gets layers [cut[s-1], cut[s]))"
            )
        for k, c in enumerate(cuts):
            if not isinstance(c, int) or not 0 < c < num_layers:
                raise ValueError(
                    f"boundary #{k} = {c!r} must be an integer in [1, {num_layers - 1}] "
                    f"(the model has {num_layers} layers)"
                )
            if k and c <= cuts[k - 1]:
                raise ValueError(
                    f"boundaries must increase strictly: boundary #{k} = {c} follows "
                    f"{cuts[k - 1]}, which would leave stage {k} without layers"
                )
    edges = [0, *cuts, num_layers]
    return tuple(range(edges[s], edges[s + 1]) for s in range(num_stages))


def build_stage_modules(
    source: LayerSource,
    schedule: Schedule,
    rank: int,
    *,
    num_layers: int | None = None,
    boundaries: Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> dict[int, nn.Sequential]:
    """The ``nn.Sequential`` of every virtual stage that ``schedule`` places on ``rank``.

    Args:
        source: The model's layers in order (they are deep-copied, so the caller's
            model is left untouched and can be dropped), or a factory called only
            for the layer indices this rank needs (it must build layer ``i``
            identically on every rank, e.g. by seeding with ``i``).
        schedule: Gives the number of stages and their placement.
        rank: This process's pipeline rank (a device of the schedule).
        num_layers: Required with a factory; must match the list's length otherwise.
        boundaries: Explicit cut points (see :func:`stage_bounds`).
        device: Where to move the stage modules.
    """
    if not 0 <= rank < schedule.num_devices:
        raise ValueError(f"rank {rank} is not a device of a {schedule.num_devices}-device schedule")
    is_list = isinstance(source, nn.Sequential | Sequence)
    if is_list:
        layers = list(source)
        if num_layers is not None and num_layers != len(layers):
            raise ValueError(f"num_layers={num_layers} but the model has {len(layers)} layers")
        num_layers = len(layers)
    elif num_layers is None:
        raise ValueError("a layer factory needs num_layers (how many layers the model has)")
    bounds = stage_bounds(num_layers, schedule.num_stages, boundaries)
    out: dict[int, nn.Sequential] = {}
    for s in schedule.stages_of_device[rank]:
        built = [copy.deepcopy(layers[i]) if is_list else source(i) for i in bounds[s]]
        stage = nn.Sequential(*built)
        out[s] = stage.to(device) if device is not None else stage
    return out
