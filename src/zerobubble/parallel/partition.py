"""Cut an ordered list of layers into a schedule's virtual stages.

Stage ``s`` gets a contiguous slice of layers in model order. Each rank builds
only the stages the schedule places on it, so a rank never holds (or, with a
layer factory, never even constructs) the layers of other ranks.

A stage module names its parameters ``"<index in the stage>.<name>"``;
:func:`layer_keys` and :func:`model_name` give them back the names they had in
the user's model (``"3.attn.qkv.weight"``), so parameters, gradients and state
dicts can be matched against the unpipelined model. A layer cut out of a bigger
model can name its state itself with a method ``source_name(name) -> str`` (the
Hugging Face adapter's layers give ``"model.layers.3.self_attn.q_proj.weight"``);
:func:`model_name` then uses it instead of ``"<layer key>.<name>"``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

from zerobubble.parallel.tied import find_shared, tie_local_replicas
from zerobubble.schedule.ir import Schedule

LayerSource = Sequence[nn.Module] | nn.Sequential | nn.ModuleList | Callable[[int], nn.Module]
"""Ordered layers (a list, ``nn.Sequential``, ``nn.ModuleList``) or a factory ``i -> layer i``."""


def stage_bounds(
    num_layers: int, num_stages: int, boundaries: Sequence[int] | None = None
) -> tuple[range, ...]:
    """The layer range of each stage.

    Without ``boundaries`` every stage gets ``num_layers // num_stages`` layers
    and the ``r = num_layers % num_stages`` remaining ones go one each to the
    interior stages 1, 2, ... in model order, then to stage 0, then to the last
    stage: the first and last stages also carry the embedding and the loss, so
    they are the last to grow.

    ``boundaries`` (e.g. from :func:`zerobubble.profile.balance.balanced_boundaries`)
    are ``[0, b_1, ..., b_{S-1}, num_layers]``: stage ``s`` gets the layers
    ``[b_s, b_{s+1})``, so they must increase strictly from 0 to ``num_layers``.
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
        edges = [0]
        for n in sizes:
            edges.append(edges[-1] + n)
    else:
        edges = list(boundaries)
        if len(edges) != num_stages + 1:
            raise ValueError(
                f"boundaries has {len(edges)} entries but {num_stages} stages need "
                f"{num_stages + 1}: [0, b_1, ..., {num_layers}] (stage s gets layers "
                "[b_s, b_{s+1}))"
            )
        if edges[0] != 0 or edges[-1] != num_layers:
            raise ValueError(
                f"boundaries must start at 0 and end at the layer count {num_layers}, got {edges}"
            )
        for s in range(num_stages):
            if not isinstance(edges[s + 1], int) or edges[s + 1] <= edges[s]:
                raise ValueError(
                    f"boundaries must increase strictly: {edges} leaves stage {s} without "
                    f"layers (b_{s} = {edges[s]}, b_{s + 1} = {edges[s + 1]})"
                )
    return tuple(range(edges[s], edges[s + 1]) for s in range(num_stages))


def model_layers(source: LayerSource | nn.Module) -> LayerSource:
    """The layers of ``source``: itself when it is a layer list, Sequential, ModuleList or
    factory; a whole model's ``pipeline_layers()`` (its layers in order, the documented way
    for one's own ``nn.Module`` to say where it may be cut). Any other module is refused: its
    ``forward`` may do what no list of layers does (a residual around two of them, a loop)."""
    if not isinstance(source, nn.Module) or isinstance(source, nn.Sequential | nn.ModuleList):
        return source
    cut = getattr(source, "pipeline_layers", None)
    if cut is None:
        raise ValueError(
            f"{type(source).__name__} is a whole model, not its layers: pass the layers in "
            "order (a list, nn.Sequential or nn.ModuleList, each layer's output the next one's "
            "input) or give the model a pipeline_layers() method that returns them"
        )
    layers = cut()
    if isinstance(layers, nn.Sequential | nn.ModuleList):
        return layers
    if not isinstance(layers, Sequence) or not all(isinstance(x, nn.Module) for x in layers):
        raise ValueError(
            f"{type(source).__name__}.pipeline_layers() returned {type(layers).__name__}: "
            "return the layers in order (a list, nn.Sequential or nn.ModuleList of modules)"
        )
    return list(layers)


def layer_keys(source: LayerSource, num_layers: int | None = None) -> tuple[str, ...]:
    """The name of every layer in the user's model, in order.

    The keys of an ``nn.Sequential`` or ``nn.ModuleList`` (``"0"``, ``"1"``, ... or the
    names of an ``OrderedDict``-built Sequential), else the index as a string (a list,
    or a factory, which needs ``num_layers``). A layer that appears twice keeps both
    of its keys.
    """
    if isinstance(source, nn.Sequential | nn.ModuleList):
        # Not named_children(): it skips a module at its second place.
        keys = tuple(source._modules)
    elif isinstance(source, Sequence):
        keys = tuple(str(i) for i in range(len(source)))
    elif num_layers is None:
        raise ValueError("a layer factory needs num_layers (how many layers the model has)")
    else:
        keys = tuple(str(i) for i in range(num_layers))
    if num_layers is not None and num_layers != len(keys):
        raise ValueError(f"num_layers={num_layers} but the model has {len(keys)} layers")
    return keys


def model_name(
    stage_name: str, keys: Sequence[str], layers: Sequence[nn.Module] | nn.Sequential = ()
) -> str:
    """A stage module's parameter or buffer name as the user's model spells it.

    ``stage_name`` is ``"<i>.<rest>"`` as ``nn.Sequential`` names the ``i``-th layer
    of the stage; ``keys`` are the stage's layer keys (its slice of :func:`layer_keys`).
    ``layers`` (the stage's layers, e.g. the stage module) lets a layer with a
    ``source_name`` method name ``<rest>`` itself.
    """
    local, dot, rest = stage_name.partition(".")
    if not (dot and local.isdigit() and int(local) < len(keys)):
        raise ValueError(
            f"{stage_name!r} is not '<layer index>.<name>' of a stage with {len(keys)} layers"
        )
    i = int(local)
    namer = getattr(layers[i], "source_name", None) if i < len(layers) else None
    if namer is not None:
        return str(namer(rest))
    return f"{keys[i]}.{rest}"


def build_stage_modules(
    source: LayerSource,
    schedule: Schedule,
    rank: int,
    *,
    num_layers: int | None = None,
    boundaries: Sequence[int] | None = None,
    device: torch.device | str | None = None,
    copy_layers: bool = True,
) -> dict[int, nn.Sequential]:
    """The ``nn.Sequential`` of every virtual stage that ``schedule`` places on ``rank``.

    Args:
        source: The model's layers in order (deep-copied unless ``copy_layers`` is
            False, so the caller's model is left untouched and can be dropped), or a
            factory called only for the layer indices this rank needs (it must build
            layer ``i`` identically on every rank, e.g. by seeding with ``i``).
        schedule: Gives the number of stages and their placement.
        rank: This process's pipeline rank (a device of the schedule).
        num_layers: Required with a factory; must match the list's length otherwise.
        boundaries: Explicit cut points (see :func:`stage_bounds`).
        device: Where to move the stage modules.
        copy_layers: False: the stages are made of the caller's layer objects
            themselves (no memory for a copy). A parameter tied across two stages
            of this rank is then replaced in the later stage's module by a
            Parameter on the same data.

    Shared parameters (:mod:`~zerobubble.parallel.tied`): layers of one stage that
    share a Parameter keep sharing it (one copy memo per stage); stages of this
    rank that share one get a replica each on one memory. A factory's layers
    cannot be tied across stages (no rank sees them all): that raises ValueError.
    """
    if not 0 <= rank < schedule.num_devices:
        raise ValueError(f"rank {rank} is not a device of a {schedule.num_devices}-device schedule")
    layers: list[nn.Module] = []
    factory: Callable[[int], nn.Module] | None = None
    if isinstance(source, nn.Sequential | nn.ModuleList | Sequence):
        layers = list(source)
        if num_layers is not None and num_layers != len(layers):
            raise ValueError(f"num_layers={num_layers} but the model has {len(layers)} layers")
        num_layers = len(layers)
    elif num_layers is None:
        raise ValueError("a layer factory needs num_layers (how many layers the model has)")
    else:
        factory = source
    bounds = stage_bounds(num_layers, schedule.num_stages, boundaries)
    out: dict[int, nn.Sequential] = {}
    for s in schedule.stages_of_device[rank]:
        if factory is None:
            picked = [layers[i] for i in bounds[s]]
            built = copy.deepcopy(picked) if copy_layers else picked
        else:
            built = [factory(i) for i in bounds[s]]
        stage = nn.Sequential(*built)
        out[s] = stage.to(device) if device is not None else stage
    tie_local_replicas(out, find_shared(source, layer_keys(source, num_layers), bounds))
    if factory is not None:
        _refuse_factory_ties(out)  # find_shared cannot see a factory's ties; refuse those here
    return out


def _refuse_factory_ties(stages: dict[int, nn.Sequential]) -> None:
    first: dict[int, tuple[int, str]] = {}
    for s, stage in sorted(stages.items()):
        for name, p in stage.named_parameters():
            t, n = first.setdefault(id(p), (s, name))
            if t != s:
                raise ValueError(
                    f"the layer factory's layers share a parameter between stage {t} ({n!r}) "
                    f"and stage {s} ({name!r}); a tie across stages needs every rank to see "
                    "it: pass the layers as a list (or nn.Sequential) instead of a factory"
                )
