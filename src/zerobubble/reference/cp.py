"""The single-process ground truth of pipeline x context parallelism.

One process plays the ``cp`` ranks of one pipeline replica: each has its own copy of the
model, given its cp rank's slot over an in-process group
(:func:`~zerobubble.runtime.sequence.cp.context_parallel` with a
:class:`~zerobubble.parallel.ep.LocalGroup`), and runs the single-replica reference
(:func:`~zerobubble.reference.step.reference_step`) on its two chunks of every sequence
(:func:`~zerobubble.runtime.sequence.cp.shard_batch`) in a thread of its own. The threads
take turns as :func:`~zerobubble.reference.ep.ep_replicas_step`'s do (each draws from its
own generator state), and meet where the cp ranks meet: at each attention layer's gather of
keys and values and at its backward's return of their gradients, which hand the same
blocks between the threads that the process group hands between ranks. Every op then sees
what it sees on its cp rank, so the pipeline equals this bitwise by construction; the cp
ranks' gradients are summed in cp-rank order (the mesh's cp reduction, before dp's).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.parallel.ep import Turns
from zerobubble.reference.ep import _Generators, _TurnGroup
from zerobubble.reference.step import Share
from zerobubble.reference.step import reference_step as replica_step
from zerobubble.runtime.microbatch import CountFn
from zerobubble.runtime.sequence.cp import ContextShards, context_parallel, shard_batch

__all__ = ["context_reference_step"]


def context_reference_step(
    run: nn.Sequential,
    loss_fn: Callable[..., Tensor],
    part: tuple[tuple[Any, ...], dict[str, Any], Any],
    m: int,
    cp: int,
    share: Share,
    count_fn: CountFn,
    **common: Any,
) -> list[Tensor]:
    """One dp replica's step over its ``cp`` ranks (see the module docstring): ``part`` is
    its whole sequences ``(args, kwargs, target)``, ``share`` the global batch's count (over
    every dp and cp rank). Returns the cp ranks' per-microbatch losses, cp-rank-major (each
    its chunks' share of the microbatch's loss), and leaves the gradients summed in cp-rank
    order in ``run``'s ``.grad``."""
    args, kwargs, target = part
    device = next((p.device for p in run.parameters()), torch.device("cpu"))
    turns, gens = Turns(cp), _Generators(cp, device)
    group = _TurnGroup(turns, 0, cp, gens)
    replicas = []
    for r in range(cp):
        rep = copy.deepcopy(run)
        context_parallel(rep, ContextShards(cp, r), group, "reference")
        replicas.append(rep)
    losses: list[list[Tensor]] = [[] for _ in range(cp)]
    failed: list[BaseException] = []

    def thread(r: int) -> None:
        shards = ContextShards(cp, r)
        a = shard_batch(args, shards, "the input batch")
        k = shard_batch(kwargs, shards, "the input batch")
        t = shard_batch(target, shards, "target")
        try:
            turns.begin(r)
            gens.enter(r)
            losses[r] = replica_step(
                replicas[r], loss_fn, *a, target=t, microbatches=m, count_fn=count_fn,
                share=share, **common, **k,
            )[0]  # fmt: skip
            gens.leave(r)
            turns.end(r)
        except BaseException as e:
            failed.append(e)
            turns.abort()

    threads = [threading.Thread(target=thread, args=(r,)) for r in range(cp)]
    with gens.kept():
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    if failed:
        raise failed[0]
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
