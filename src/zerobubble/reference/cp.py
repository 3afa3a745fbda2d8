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
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.reference.ep import TurnTaking
from zerobubble.reference.step import Share, segment_reference_step
from zerobubble.reference.step import reference_step as replica_step
from zerobubble.runtime.microbatch import CountFn
from zerobubble.runtime.sequence.cp import (
    ContextShards,
    context_parallel,
    refuse_segments,
    shard_step,
)

__all__ = ["context_reference_step"]


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
