"""The ground truth of pipeline x tensor parallelism: the same layout without pipelining.

What a ``(pp, tp)`` pipeline computes bitwise is not the single-process model (a row-wise
parallel layer adds its ``tp`` partial sums after the matmul, which rounds otherwise), but
the same tensor-parallel layout run without pipelining: the model cut into the pipeline's
stages, each stage module parallelized with the same plan over a mesh of the ``tp`` ranks
alone (:func:`~zerobubble.parallel.tp.parallelize_stage`), and plain autograd over the
microbatches, in microbatch order. Its collectives are the pipeline's, on the same
shapes, in the same order per microbatch; the B/W split only defers the weight
gradients, whose local matmuls are the same.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from zerobubble.parallel.loss import LossParallel
from zerobubble.parallel.parallelize import StagePlan, TensorParallel
from zerobubble.parallel.partition import layer_keys, model_name, stage_bounds
from zerobubble.parallel.tied import TiedParam, find_shared, laid_out_as
from zerobubble.reference.step import (
    Share,
    as_sequential,
    local_sum,
    reference_step,
    segment_reference_step,
)
from zerobubble.runtime.loss_terms import TermWeight
from zerobubble.runtime.microbatch import CountFn

__all__ = ["tp_layers", "tp_reference_step"]


def tp_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    *args: Any,
    target: Any,
    microbatches: int,
    tp_mesh: DeviceMesh,
    tp_plan: StagePlan = None,
    sequence_parallel: bool = False,
    loss_parallel: bool | None = None,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    copy_layers: bool = True,
    seed: int | None = None,
    step: int = 0,
    count_fn: CountFn | None = None,
    terms: dict[str, list[Tensor]] | None = None,
    term_weight: TermWeight = "mean",
    share: Share | None = None,
    cuts: Sequence[int] | None = None,
    tie_parts: dict[str, list[Tensor | None]] | None = None,
    **kwargs: Any,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of ``layers`` in ``num_stages`` stages parallelized over ``tp_mesh``, unpipelined.

    Collective over ``tp_mesh``: each of its ranks calls it with the same batch, as each
    tp rank of a pipeline's first and last stage gets it. The layers are cut as a
    :class:`~zerobubble.pipeline.Pipeline` cuts them (``num_stages``, ``boundaries``:
    :func:`~zerobubble.parallel.partition.stage_bounds`), each stage is an
    ``nn.Sequential`` of its layers parallelized with ``tp_plan`` (one plan, a function
    ``(stage, stage module) -> plan``, or None: the default plan) and
    ``sequence_parallel``, the last stage's LM head leaving its logits sharded over the
    vocabulary as ``loss_parallel`` says (the pipeline's rule:
    :class:`~zerobubble.parallel.loss.LossParallel`, so the loss runs the same
    vocab-parallel cross-entropy), and :func:`~zerobubble.reference.step.reference_step` runs
    the stages in order on the microbatches (``seed`` and ``step`` seed stage ``s``'s
    random ops as the executor does), or with ``cuts`` (sequence segments)
    :func:`~zerobubble.reference.step.segment_reference_step` runs them on each microbatch's
    segments. Give the pipeline's cut: a plan may differ per stage, and the stage decides
    where its layers' layouts meet the boundary's.

    ``copy_layers`` False parallelizes the caller's layers themselves (a layer with a
    DTensor parameter is taken as parallelized already, as by an earlier call) and leaves
    the gradients in their ``.grad``, so that an optimizer over them can step; True
    (default) works on a deep copy. A parameter tied across stages gets a replica per
    stage, as the pipeline's stages hold it, and its gradient is the stages' summed in
    stage order (:mod:`~zerobubble.parallel.tied`), under its first name (not left in
    ``.grad``). Given ``tie_parts``, a tie's stage gradients are not summed: they go there,
    under its first name, one per holder stage (laid out as the parameter), for a caller
    that sums them over the dp replicas first, as the pipeline does.

    Returns:
        The unscaled per-microbatch losses and a copy of every gradient (a DTensor where
        the parameter is one: this rank's shard), keyed by the user's parameter names as
        :meth:`~zerobubble.pipeline.Pipeline.named_parameters` names them.
    """
    model = as_sequential(layers)
    keys = layer_keys(model)
    bounds = stage_bounds(len(model), num_stages, boundaries)
    ties = [t for t in find_shared(model, keys, bounds) if len(t.local) > 1]
    source = copy.deepcopy(list(model)) if copy_layers else list(model)
    loss = LossParallel(num_stages - 1, loss_fn, loss_parallel)
    tp = TensorParallel(tp_mesh, tp_plan, sequence_parallel, loss)
    stages = _tp_stages(source, bounds, tp, copy_stages=bool(ties))
    common: dict[str, Any] = {"seed": seed, "step": step, "num_stages": num_stages}
    common.update(boundaries=list(range(num_stages + 1)), count_fn=count_fn, share=share)
    if cuts is not None:
        losses, _ = segment_reference_step(
            stages, loss_fn, *args, target=target, microbatches=microbatches, cuts=cuts,
            **common, **kwargs,
        )  # fmt: skip
    else:
        losses, _ = reference_step(
            stages, loss_fn, *args, target=target, microbatches=microbatches, terms=terms,
            term_weight=term_weight, **common, **kwargs,
        )  # fmt: skip
    return losses, _with_ties(_stage_grads(stages, keys, bounds), stages, ties, tie_parts)


def _tp_stages(
    source: Sequence[nn.Module], bounds: Sequence[range], tp: TensorParallel, copy_stages: bool
) -> list[nn.Sequential]:
    """``source`` cut at ``bounds`` into stage modules, each parallelized by ``tp`` as the
    pipeline's stage is (``copy_stages``: each a copy, for ties: a replica per stage)."""
    stages = []
    for s, layer_range in enumerate(bounds):
        stage = nn.Sequential(*(source[i] for i in layer_range))
        if copy_stages:
            stage = copy.deepcopy(stage)
        tp.apply(s, stage)
        stages.append(stage)
    return stages


def tp_layers(
    model: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    *,
    tp_mesh: DeviceMesh,
    tp_plan: StagePlan = None,
    sequence_parallel: bool = False,
    loss_parallel: bool | None = None,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
) -> nn.Sequential:
    """``model``'s layers in place, each stage of the pipeline's cut parallelized as
    :func:`tp_reference_step` parallelizes it, as one ``nn.Sequential`` under ``model``'s
    keys (running it runs the stages in order): a replica of the expert-parallel reference
    (:func:`~zerobubble.reference.ep.threaded_ep_reference_step`'s ``parallelize``).
    ValueError for parameters tied across stages (each stage would need its own replica)
    and for a plan that puts hooks on a stage module itself (lost in the flat form)."""
    keys = layer_keys(model)
    bounds = stage_bounds(len(model), num_stages, boundaries)
    tied = [t.name for t in find_shared(model, keys, bounds) if len(t.local) > 1]
    if tied:
        raise ValueError(
            f"tp_layers: parameters tied across stages ({', '.join(map(repr, tied))}) need a "
            "replica per stage; use tp_reference_step"
        )
    loss = LossParallel(num_stages - 1, loss_fn, loss_parallel)
    tp = TensorParallel(tp_mesh, tp_plan, sequence_parallel, loss)
    stages = _tp_stages(list(model), bounds, tp, copy_stages=False)
    for s, stage in enumerate(stages):
        if stage._forward_hooks or stage._forward_pre_hooks:
            raise ValueError(
                f"tp_layers: the plan of stage {s} hooks the stage module itself, which the "
                "flat layers cannot keep; name its layers in the plan instead"
            )
    return nn.Sequential(OrderedDict(zip(keys, [x for st in stages for x in st], strict=True)))


def _with_ties(
    grads: dict[str, Tensor], stages: Sequence[nn.Sequential], ties: Sequence[TiedParam],
    tie_parts: dict[str, list[Tensor | None]] | None,
) -> dict[str, Tensor]:  # fmt: skip
    """``grads`` with each tie under its first name only: its stage gradients summed (or,
    given ``tie_parts``, put there unsummed)."""
    for tie in ties:
        parts = _tie_parts(stages, tie)
        for name in tie.source_names:  # the gradients' keys: the user's names
            grads.pop(name, None)
        if tie_parts is not None:
            tie_parts[tie.source_names[0]] = parts
        elif (total := sum_parts(parts)) is not None:
            grads[tie.source_names[0]] = total
    return grads


def _tie_parts(stages: Sequence[nn.Sequential], tie: TiedParam) -> list[Tensor | None]:
    """Each holder stage's gradient of ``tie``, laid out as the parameter."""
    parts: list[Tensor | None] = []
    for s in tie.stages:
        p = stages[s].get_parameter(tie.local[s][0])
        parts.append(None if p.grad is None else laid_out_as(p.grad, p, tie.name))
    return parts


def reduced_over_tp(g: Tensor) -> Tensor:
    """``g`` with a ``Partial`` placement reduced (the tp all-reduce), other layouts as is."""
    if isinstance(g, DTensor) and any(p.is_partial() for p in g.placements):
        done = [Replicate() if p.is_partial() else p for p in g.placements]
        return g.redistribute(g.device_mesh, done)
    return g


def sum_parts(parts: Sequence[Tensor | None]) -> Tensor | None:
    """A tie's stage gradients summed in stage order (shard by shard), as the pipeline's tie
    reduction sums them; None if no stage has one."""
    total: Tensor | None = None
    for g in parts:
        if g is not None:
            total = local_sum(total, g)
    return total


def _stage_grads(
    stages: Sequence[nn.Sequential], keys: Sequence[str], bounds: Sequence[range]
) -> dict[str, Tensor]:
    """A copy of every gradient in its layout, keyed by the user's parameter names (a
    parameter two layers of a stage share, once)."""
    grads: dict[str, Tensor] = {}
    seen: set[int] = set()
    for s, stage in enumerate(stages):
        stage_keys = keys[bounds[s].start : bounds[s].stop]
        for name, p in stage.named_parameters():
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                grads[model_name(name, stage_keys, stage)] = _copy(p.grad)
    return grads


def _copy(g: Tensor) -> Tensor:
    """A copy of ``g`` in its layout: a DTensor's ``clone()`` would reduce a ``Partial``
    gradient (a sequence-parallel norm's) to ``Replicate``, which the pipeline's is not."""
    if not isinstance(g, DTensor):
        return g.clone()
    local = g.to_local().clone()
    return DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())
