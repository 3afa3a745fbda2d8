"""The single-process ground truth a pipeline run must reproduce bitwise.

With random ops (dropout) the ground truth is the model run stage by stage on each
microbatch, every stage's forward seeded as the executor seeds it
(:class:`~zerobubble.runtime.rng.StageRng`): pass the executor's seed, its step
number and the pipeline's cut (``num_stages``, ``boundaries``) to
:func:`reference_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zerobubble.parallel.partition import model_name, stage_bounds
from zerobubble.runtime.loss_terms import (
    TermWeight,
    collect_loss_terms,
    gather_terms,
    segments_refusal,
    weighted_objective,
)
from zerobubble.runtime.loss_terms import term_weight as weight_of
from zerobubble.runtime.microbatch import (
    CountFn,
    batch_count,
    batch_size,
    default_count_fn,
    loss_scales,
    split_batch,
    split_tree,
)
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.sequence.batch import cut_value, sequence_length
from zerobubble.runtime.sequence.kv import (
    KV,
    SegmentContext,
    add_past_grads,
    cut_pairs,
    flat_past,
    past_leaves,
    segment_inputs,
    segment_scope,
)
from zerobubble.runtime.shapes import tensor_leaves

__all__ = [
    "Share",
    "as_sequential",
    "dp_reference_step",
    "reference_step",
    "segment_reference_step",
]


@dataclass(frozen=True)
class Share:
    """A batch that is one data-parallel replica's part of a global batch: what the replica's
    executor normalises by, summed over the replicas (``over_dp``)."""

    total: Any
    """The global batch's rows, or with a ``count_fn`` its count (the replicas' summed)."""
    replicas: int
    """How many replicas share the batch (the loss terms' weight counts them)."""


def as_sequential(layers: Sequence[nn.Module] | nn.Sequential) -> nn.Sequential:
    """``layers`` as one nn.Sequential; parameter names are ``"<layer index>.<name>"``.

    An nn.Sequential is returned as is (slices of one keep the original indices).
    """
    return layers if isinstance(layers, nn.Sequential) else nn.Sequential(*layers)


def reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    *args: Any,
    target: Any = None,
    microbatches: int | None = None,
    seed: int | None = None,
    step: int = 0,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    count_fn: CountFn | None = None,
    terms: dict[str, list[Tensor]] | None = None,
    term_weight: TermWeight = "mean",
    share: Share | None = None,
    **kwargs: Any,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of plain autograd over the microbatches, in microbatch order.

    Takes the batch as :meth:`~zerobubble.pipeline.Pipeline.step` does:
    ``reference_step(layers, loss_fn, *args, target=..., microbatches=M, **kwargs)``,
    ``args`` and ``kwargs`` tensors or pytrees (a tokenizer's mapping) for the first
    layer, ``target`` a tensor or pytree for ``loss_fn``, split by the same rule
    (:func:`~zerobubble.runtime.microbatch.split_tree`: every tensor whose dim 0 is the
    batch is split, everything else goes to every microbatch). The short form
    ``reference_step(layers, loss_fn, x, target, m)`` is the same call for one tensor ``x``.

    Clears ``.grad``, then for j = 0..M-1 runs microbatch j's ``(*args_j, **kwargs_j)``
    through the layers and back-propagates ``loss_j * scale_j`` (:func:`loss_scales`),
    what a pipeline computes; the gradients stay in ``.grad`` for an optimizer.

    With a ``seed``, the layers of each stage (``num_stages`` cut as
    :func:`~zerobubble.parallel.partition.stage_bounds` cuts them, with
    ``boundaries``) run under the generator state of ``(seed, step, stage, j)``,
    as :attr:`~zerobubble.executor.ExecutorOptions.seed` makes the
    pipeline do in its step number ``step``; without one they draw from the
    process's generators as they are. With ``count_fn`` (default: ``loss_fn.count_fn``
    where the loss declares one, as the pipeline does), every microbatch's loss is
    ``loss_fn(output, target_j, count_fn(target))`` and is back-propagated
    unscaled, as the executor does with the same ``count_fn``.

    Loss terms the layers add (:func:`~zerobubble.runtime.loss_terms.add_loss_term`) are
    collected over the microbatch's forward in layer order, and what is back-propagated
    (and returned) is the objective, ``loss_fn``'s loss plus every term in name order,
    weighted as ``term_weight`` says (as
    :attr:`~zerobubble.runtime.options.ExecutorOptions.term_weight`, one replica:
    :func:`~zerobubble.runtime.loss_terms.weighted_objective`), as a pipeline's last stage
    roots it; ``terms``, if given, gets each term's per-microbatch values (raw, detached),
    as :meth:`~zerobubble.pipeline.Pipeline.step` does. ``share``: the batch is one dp
    replica's part (:class:`Share`; :mod:`~zerobubble.reference.compose` passes it).

    Returns:
        The unscaled per-microbatch losses (detached 0-dim tensors) and a copy
        of every gradient, keyed by the user's parameter names, as
        :meth:`~zerobubble.pipeline.Pipeline.named_parameters` names them (the layer's
        key and name, or the layer's own ``source_name``; a shared parameter once,
        under its first name).
    """
    args, target, m, n = _batch(args, target, microbatches, kwargs)
    model = as_sequential(layers)
    inputs = split_tree((args, kwargs), m, n)
    targets = split_tree(target, m, n)
    bounds = stage_bounds(len(model), num_stages, boundaries)
    stages = _Stages(model, bounds, _rng(model, (args, kwargs), seed), step)
    weight = weight_of(term_weight, m, 1 if share is None else share.replicas)
    scales, extra = _scales(default_count_fn(loss_fn, count_fn), target, n, m, share)
    for p in model.parameters():
        p.grad = None
    losses, per_mb = [], []
    for j, ((aj, kj), tj, scale) in enumerate(zip(inputs, targets, scales, strict=True)):
        with collect_loss_terms(model) as found:
            # the last stage's forward holds the loss and the objective
            last = partial(_objective, loss_fn, tj, extra, found, scale, weight)
            root, loss = stages.run(j, aj, kj, last)
        root.backward()
        losses.append(loss)
        per_mb.append({n: t.detach() for n, t in found.items()})
    if terms is not None:
        gather_terms(per_mb, terms)
    return losses, _user_grads(model)


def _batch(
    args: tuple, target: Any, microbatches: int | None, kwargs: dict
) -> tuple[tuple, Any, int, int]:
    """:func:`reference_step`'s batch as ``(args, target, M, N)``: the short form
    ``(x, target, m)`` read as the long one, and the inputs' and target's batch checked
    to agree."""
    if target is None:
        if len(args) == 3 and isinstance(args[2], int) and microbatches is None and not kwargs:
            x, target, microbatches = args
            args = (x,)
        else:
            raise ValueError(
                "reference_step takes the batch as Pipeline.step does: reference_step(layers, "
                "loss_fn, *args, target=..., microbatches=M, **kwargs), or the short form "
                "reference_step(layers, loss_fn, x, target, m); target= is missing"
            )
    if microbatches is None:
        raise ValueError("reference_step needs microbatches= (how many per step, M)")
    n = batch_size((args, kwargs), "the input batch (reference_step's arguments)")
    n_target = batch_size(target, "target")
    if n_target != n:
        if len(args) == 1 and not kwargs and isinstance(args[0], Tensor):
            shapes = f"target has shape {_shape(target)} and x {tuple(args[0].shape)}"
        else:
            shapes = f"target has a batch of {n_target} and the inputs one of {n}"
        raise ValueError(f"{shapes}: they must share the batch (first) dimension")
    return args, target, microbatches, n


def _rng(model: nn.Sequential, batch: Any, seed: int | None) -> StageRng | None:
    """The stages' seeding (None without a seed), drawing on the device the layers live on
    (else the batch's), as on a pipeline's stages."""
    if seed is None:
        return None
    leaves = tensor_leaves(batch)
    fallback = leaves[0].device if leaves else torch.device("cpu")
    return StageRng(seed, next((p.device for p in model.parameters()), fallback))


def _scales(
    count_fn: CountFn | None, target: Any, n: int, m: int, share: Share | None = None
) -> tuple[list[float], tuple[Tensor | int, ...]]:
    """Each microbatch's loss weight and ``loss_fn``'s extra arguments, as the executor has
    them: ``n_j / N`` without a ``count_fn``; 1 and the batch's count with one (``N`` and
    the count the global batch's for one replica's ``share``)."""
    if count_fn is None:
        sizes = [len(t) for t in torch.tensor_split(torch.empty(n), m)]
        return (loss_scales(sizes) if share is None else [k / share.total for k in sizes]), ()
    return [1.0] * m, (batch_count(count_fn, target) if share is None else share.total,)


def _objective(
    loss_fn: Callable[..., Tensor],
    target: Any,
    extra: tuple[Tensor | int, ...],
    found: dict[str, Tensor],
    scale: float,
    weight: float | None,
    out: Any,
) -> tuple[Tensor, Tensor]:
    """A microbatch's root and objective from the last stage's ``out``, as the last stage
    forms them (:func:`~zerobubble.runtime.loss_terms.weighted_objective`)."""
    return weighted_objective(loss_fn(out, target, *extra), found, scale, weight)


def _shape(t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__


def _user_grads(model: nn.Sequential) -> dict[str, Tensor]:
    """A copy of every gradient under the user's name of its parameter (:func:`model_name`)."""
    keys = tuple(model._modules)
    out: dict[str, Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        key, _, rest = name.partition(".")
        out[model_name(f"{keys.index(key)}.{rest}", keys, list(model))] = p.grad.clone()
    return out


def dp_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[tuple[Tensor, Tensor]],
    m: int,
    *,
    term_weight: TermWeight = "mean",
) -> tuple[list[list[Tensor]], dict[str, Tensor]]:
    """One data-parallel step in the order a ``(pp, dp)`` mesh computes it (no random ops).

    ``parts[r]`` is replica ``r``'s ``(x, target)``. Per replica, in microbatch order,
    ``loss_j * n_j / N`` is back-propagated (``N`` the global batch: all parts
    together) into fresh gradients; the replicas' gradients are then summed in rank
    order, ``((g_0 + g_1) + g_2) + ...``, which is what the dp all-reduce gives
    bitwise for two replicas (see :mod:`zerobubble.parallel.dp` for more). The sums
    are left in ``.grad``. A microbatch's loss is its objective: ``loss_fn``'s plus the
    layers' loss terms, weighted as in :func:`reference_step` with ``dp = len(parts)``.

    Returns:
        Each replica's unscaled per-microbatch losses, and a copy of every summed gradient.
    """
    model = as_sequential(layers)
    total = sum(len(x) for x, _ in parts)
    weight = weight_of(term_weight, m, len(parts))
    summed: dict[str, Tensor] = {}
    losses: list[list[Tensor]] = []
    for x, target in parts:
        for p in model.parameters():
            p.grad = None
        mine = []
        for xj, tj in zip(split_batch(x, m), split_batch(target, m), strict=True):
            with collect_loss_terms(model) as found:
                root, loss = weighted_objective(
                    loss_fn(model(xj), tj), found, len(xj) / total, weight
                )
            root.backward()
            mine.append(loss)
        losses.append(mine)
        for n, p in model.named_parameters():
            if p.grad is not None:
                summed[n] = p.grad.clone() if n not in summed else summed[n] + p.grad
    for n, p in model.named_parameters():
        p.grad = summed.get(n)
    return losses, {n: g.clone() for n, g in summed.items()}


def segment_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    *args: Any,
    target: Any,
    microbatches: int,
    cuts: Sequence[int],
    count_fn: CountFn | None = None,
    seed: int | None = None,
    step: int = 0,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    share: Share | None = None,
    **kwargs: Any,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of a segment schedule's arithmetic in one process (the ground truth of
    :attr:`~zerobubble.runtime.options.ExecutorOptions.cuts`).

    The batch is taken and split as :func:`reference_step` takes it; every sequence is
    cut at ``cuts`` (``0 = b0 < ... < bk = T``) into unit ``u = j * k + i``, microbatch
    j's tokens ``[b_i, b_i+1)``. Per microbatch the segments run forward in order, each
    attending fresh leaves of the earlier segments' keys and values
    (:mod:`~zerobubble.runtime.sequence.kv`), and its loss is
    ``loss_fn(output, target_u, count_fn(target))``; backward runs last segment first,
    each segment's roots its loss and its own keys and values with the gradients the
    later segments sent back (summed, last segment first). A microbatch's loss is the sum
    of its segments' in order, and every parameter's gradient is the per-unit gradients
    added in backward order (microbatch by microbatch, last segment first, as the
    weight-gradient store adds them): what the pipeline's chunks compute, so a segment schedule
    equals this bitwise. ``seed``, ``step``, ``num_stages`` and ``boundaries`` seed each
    stage's random ops per unit, as the executor does.

    Returns:
        The per-microbatch losses (detached) and a copy of every gradient (left in
        ``.grad`` too), keyed as :func:`reference_step` keys them.
    """
    count_fn = default_count_fn(loss_fn, count_fn)
    if count_fn is None:
        raise ValueError(
            "segment_reference_step needs count_fn: a segment's loss is its tokens' share of "
            "the batch loss, loss_fn(output, target, count_fn(target))"
        )
    model = as_sequential(layers)
    k = len(cuts) - 1
    pairs = cut_pairs(cuts, sequence_length(target, "target"))
    n = batch_size((args, kwargs), "the input batch (segment_reference_step's arguments)")
    inputs = split_tree((args, kwargs), microbatches, n)
    targets = split_tree(target, microbatches, n)
    total = batch_count(count_fn, target) if share is None else share.total
    bounds = stage_bounds(len(model), num_stages, boundaries)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    stages = _Stages(model, bounds, None if seed is None else StageRng(seed, device), step)
    params = list(model.parameters())
    for p in params:
        p.grad = None
    losses: list[Tensor] = []
    per_unit: list[tuple[Tensor | None, ...]] = []
    for j, ((aj, kj), tj) in enumerate(zip(inputs, targets, strict=True)):
        units = [j * k + i for i in range(k)]
        seg_losses, contexts = _segments_forward(stages, pairs, units, (aj, kj, tj), loss_fn, total)
        per_unit.extend(reversed(_segments_backward(seg_losses, contexts, params)))
        losses.append(sum(seg_losses[1:], seg_losses[0]).detach())
    for unit in per_unit:  # in backward order, as the weight-gradient store adds them
        for p, g in zip(params, unit, strict=True):
            if g is not None:
                p.grad = local_sum(p.grad, g)
    return losses, _user_grads(model)


def local_sum(acc: Tensor | None, g: Tensor) -> Tensor:
    """``acc + g`` shard by shard (a copy of ``g`` when ``acc`` is None): a DTensor's own
    ``+`` and ``clone()`` would move a ``Partial`` gradient (a sequence-parallel norm's,
    each tp rank's share of the sum) to another layout, where the pipeline's store adds
    each rank's shares as they are."""
    if not isinstance(g, DTensor):
        return g.clone() if acc is None else acc + g
    local = g.to_local().clone() if acc is None else cast(DTensor, acc).to_local() + g.to_local()
    return DTensor.from_local(local, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())


T = TypeVar("T")


class _Stages:
    """The model cut at ``bounds`` into stages run in order, each stage's random ops seeded
    per unit as the executor seeds them (``rng``, None: the process's generators)."""

    def __init__(
        self, model: nn.Sequential, bounds: Sequence[range], rng: StageRng | None, step: int
    ) -> None:
        self.model, self.bounds, self.rng, self.step = model, bounds, rng, step

    def run(self, unit: int, args: Any, kwargs: Any, last: Callable[[Any], T]) -> T:
        """The stages on one unit's ``(*args, **kwargs)``; the last stage's forward ends with
        ``last`` (the loss), inside its seeding."""
        h: Any = None
        for s, layer_range in enumerate(self.bounds):
            with nullcontext() if self.rng is None else self.rng.scope(self.step, s, unit):
                for x in layer_range:
                    h = self.model[x](*args, **kwargs) if x == 0 else self.model[x](h)
                if s == len(self.bounds) - 1:
                    return last(h)
        raise AssertionError("no stage")  # bounds has num_stages >= 1 ranges


def _segments_forward(
    stages: _Stages,
    pairs: Sequence[tuple[int, int]],
    units: Sequence[int],
    batch: tuple[Any, Any, Any],
    loss_fn: Callable[..., Tensor],
    total: Any,
) -> tuple[list[Tensor], list[SegmentContext]]:
    """One microbatch's segments forward in order (``batch``: its args, kwargs and target),
    each attending fresh leaves of the earlier segments' keys and values: every segment's
    loss and context. Loss terms are refused (each segment would add its own)."""
    args, kwargs, target = batch
    contexts: list[SegmentContext] = []
    seg_losses: list[Tensor] = []
    for (start, end), unit in zip(pairs, units, strict=True):
        context = SegmentContext(start, past_leaves([c.new_kv() for c in contexts]))
        a_seg, k_seg = cut_value(args, start, end), segment_inputs(kwargs, start, end)
        last = partial(_segment_loss, loss_fn, cut_value(target, start, end), total)
        with segment_scope([stages.model], context), collect_loss_terms(stages.model) as found:
            h = stages.run(unit, a_seg, k_seg, last)
        if found:
            raise segments_refusal(f"the layers added loss terms {sorted(found)}")
        seg_losses.append(h)
        contexts.append(context)
    return seg_losses, contexts


def _segment_loss(loss_fn: Callable[..., Tensor], target: Any, total: Any, out: Any) -> Tensor:
    return loss_fn(out, target, total)


def _segments_backward(
    seg_losses: Sequence[Tensor], contexts: Sequence[SegmentContext], params: Sequence[Tensor]
) -> list[tuple[Tensor | None, ...]]:
    """One microbatch's backward, last segment first: each segment roots its loss and its
    own keys and values with the gradients the later segments sent back (summed, last
    segment first); returns each segment's parameter gradients, in segment order."""
    sent: dict[int, list[KV | None]] = {}  # gradients of earlier keys and values
    grads: list[tuple[Tensor | None, ...]] = [() for _ in seg_losses]
    for i in reversed(range(len(seg_losses))):
        roots, root_grads = [seg_losses[i]], [torch.ones_like(seg_losses[i])]
        for kv, kv_grad in zip(contexts[i].new_kv(), sent.get(i, []), strict=False):
            if kv_grad is not None:
                roots.extend(kv)
                root_grads.extend(kv_grad)
        leaves = flat_past(contexts[i].past)
        got = torch.autograd.grad(roots, [*params, *leaves], root_grads, allow_unused=True)
        grads[i] = tuple(got[: len(params)])
        add_past_grads(sent, got[len(params) :], i)
    return grads
