"""The single-process ground truth of pipeline x context parallelism.

One process plays the ``cp`` ranks of one pipeline replica: each has its own copy of the
model, given its cp rank's slot over an in-process group
(:func:`~zerobubble.runtime.sequence.cp.context_parallel` with a
:class:`~zerobubble.parallel.ep.LocalGroup`), and runs the single-replica reference
(:func:`~zerobubble.reference.step.reference_step`; with segments
:func:`~zerobubble.reference.step.segment_reference_step` at the rank's own cuts) on its two
chunks of every sequence (of every segment; :func:`~zerobubble.runtime.sequence.cp.shard_batch`)
in a thread of its own. The threads
take turns as :func:`~zerobubble.reference.ep.ep_replicas_step`'s do (each draws from its
own generator state), and meet where the cp ranks meet: at each attention layer's gather of
keys and values and at its backward's return of their gradients, which hand the same
blocks between the threads that the process group hands between ranks. Every op then sees
what it sees on its cp rank, so the pipeline equals this bitwise by construction; the cp
ranks' gradients are summed in cp-rank order (the mesh's cp reduction, before dp's).

Under tensor parallelism the threads cannot play the cp ranks: each would run tp's DTensor
collectives over the tp ranks of its process, and the other processes' threads would have
to meet them there in the same order. Then each process plays its own cp rank over the
job's real cp group instead (:func:`cp_rank_shards`, :func:`sum_over_cp`,
:func:`gathered_over_cp`: the tp reference on the rank's chunks, its layers given a
:class:`~zerobubble.runtime.sequence.cp.ProcessExchange` of the group), as the tp reference
plays its own tp rank over the tp mesh: the same collectives as the pipeline's, so bitwise
by construction again.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zerobubble.parallel.dp import sum_in_rank_order
from zerobubble.reference.ep import TurnTaking
from zerobubble.reference.step import Share, segment_reference_step
from zerobubble.reference.step import reference_step as replica_step
from zerobubble.runtime.microbatch import CountFn
from zerobubble.runtime.sequence.cp import (
    ContextShards,
    ProcessExchange,
    context_parallel,
    refuse_segments,
    shard_step,
)

__all__ = ["context_reference_step", "cp_rank_shards", "gathered_over_cp", "sum_over_cp"]


def context_reference_step(
    run: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    part: tuple[tuple[Any, ...], dict[str, Any], Any],
    m: int,
    cp: int,
    share: Share,
    count_fn: CountFn,
    cuts: Sequence[int] | None = None,
    **common: Any,
) -> list[Tensor]:
    """One dp replica's step over its ``cp`` ranks (see the module docstring): ``part`` is
    its whole sequences ``(args, kwargs, target)``, ``share`` the global batch's count (over
    every dp and cp rank); with ``cuts`` (sequence segments) each rank runs the segment
    reference (:func:`~zerobubble.reference.step.segment_reference_step`) on its chunks of
    every segment, cut at its own tokens' cuts. Returns the cp ranks' per-microbatch losses,
    cp-rank-major (each its chunks' share of the microbatch's loss), and leaves the
    gradients summed in cp-rank order in ``run``'s ``.grad``."""
    args, kwargs, target = part
    device = next((p.device for p in run.parameters()), torch.device("cpu"))
    turned = TurnTaking(cp, device)
    group = turned.group(0, cp)
    shards = [ContextShards(cp, r, None if cuts is None else tuple(cuts)) for r in range(cp)]
    replicas = []
    for r in range(cp):
        rep = copy.deepcopy(run)
        context_parallel(rep, shards[r], group, "reference")
        if cuts is not None:
            refuse_segments(rep, "reference")
        replicas.append(rep)

    def rank(r: int) -> list[Tensor]:
        a, k, t = shard_step(shards[r], args, kwargs, target)
        local = shards[r].local_cuts
        if local is not None:
            return segment_reference_step(
                replicas[r], loss_fn, *a, target=t, microbatches=m, cuts=local,
                count_fn=count_fn, share=share, **common, **k,
            )[0]  # fmt: skip
        return replica_step(
            replicas[r], loss_fn, *a, target=t, microbatches=m, count_fn=count_fn,
            share=share, **common, **k,
        )[0]  # fmt: skip

    losses = turned.run(rank)
    _sum_into(run, replicas)
    return [loss for mine in losses for loss in mine]


def _sum_into(run: nn.Module, replicas: Sequence[nn.Module]) -> None:
    """The replicas' gradients summed in cp-rank order into ``run``'s ``.grad``."""
    for p, *reps in zip(run.parameters(), *(r.parameters() for r in replicas), strict=True):
        total: Tensor | None = None
        for q in reps:
            if q.grad is not None:
                total = q.grad.clone() if total is None else total + q.grad
        p.grad = total


def cp_rank_shards(model: nn.Sequential, cp: int, group: dist.ProcessGroup) -> ContextShards:
    """This process's cp rank of ``group`` (``cp`` ranks, checked), its context-aware layers
    of ``model`` given their slot over the real group; returns the rank's layout."""
    size = dist.get_world_size(group)
    if size != cp:
        raise ValueError(
            f"reference_step: cp={cp} but cp_group has {size} ranks; pass the mesh's cp_group "
            "(the ranks that share this process's sequences)"
        )
    shards = ContextShards(cp, dist.get_rank(group))
    context_parallel(model, shards, ProcessExchange(group), "reference")
    return shards


def sum_over_cp(g: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``g`` summed over ``group`` in cp-rank order, as the mesh's cp reduction sums it
    (:func:`~zerobubble.parallel.dp.sum_in_rank_order`; a DTensor's local shard, laid out
    again as ``g``); collective over ``group``."""
    local = g.to_local() if isinstance(g, DTensor) else g
    total = sum_in_rank_order(local.contiguous(), group)
    if not isinstance(g, DTensor):
        return total
    return DTensor.from_local(total, g.device_mesh, g.placements, shape=g.shape, stride=g.stride())


def gathered_over_cp(losses: Sequence[Tensor], group: dist.ProcessGroup) -> list[Tensor]:
    """Every cp rank's losses of ``group``, cp-rank-major (as the threaded reference returns
    them); collective over ``group``."""
    parts = ProcessExchange(group).gather(torch.stack([x.detach() for x in losses]))
    return [loss for part in parts for loss in part.unbind(0)]
