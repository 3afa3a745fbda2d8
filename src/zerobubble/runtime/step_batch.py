"""One step's batch as this rank's stages use it: stage 0's microbatches, the last stage's
targets and the weights of their losses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zerobubble.runtime.microbatch import CountFn, batch_count, batch_size, split_tree
from zerobubble.runtime.shapes import to_device

__all__ = ["RESERVED", "StepBatch", "split_step"]

RESERVED = frozenset({"mb", "loss_scale", "num_items", "segment", "term_weight"})
"""Keyword names of :meth:`StageChunk.forward` that stage-0 keyword arguments cannot take."""


@dataclass
class StepBatch:
    """One step's microbatches: stage 0's inputs, the last stage's targets and weights."""

    inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None = None
    targets: list[Any] | None = None
    scales: list[float] | None = None
    num_items: torch.Tensor | int | None = None


def split_step(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    target: object,
    microbatches: int,
    *,
    rank: int,
    first: bool,
    last: bool,
    count_fn: CountFn | None,
    device: torch.device,
    over_dp: Callable[[Any], Any],
) -> StepBatch:
    """Split what a rank holding stage 0 (``first``) and/or the last stage (``last``) needs.

    The rule: the batch size N is dim 0 of the first tensor with a dim (depth-first
    through ``args`` then ``kwargs``; for ``target``, through it); every tensor whose
    dim 0 is N is split into the M microbatches as ``torch.tensor_split`` does, every
    other value (0-dim tensors, tensors of another length, None, numbers...) goes
    unchanged to every microbatch.
    ``over_dp(n)`` sums the batch's size (or count) over the data-parallel replicas, so
    the losses are weighted by the global batch (``n_j / N`` each, or ``count_fn``'s
    count). Raises ValueError for a reserved keyword or a missing batch or target.
    """
    M = microbatches
    taken = sorted(set(kwargs) & RESERVED)
    if taken:
        raise ValueError(
            f"step() keyword argument(s) {', '.join(taken)} are reserved for the runtime "
            "(StageChunk.forward's own); rename the stage-0 argument or pass it positionally"
        )
    batch = StepBatch()
    if first:
        if not args and not kwargs:
            raise ValueError(f"rank {rank} holds stage 0: step() needs the batch x")
        n = batch_size((args, kwargs), "the input batch (step's arguments)")
        batch.inputs = [to_device(mb, device) for mb in split_tree((args, kwargs), M, n)]
    if last:
        if target is None:
            raise ValueError(f"rank {rank} holds the last stage: step() needs target for the loss")
        n = batch_size(target, "target")
        batch.targets = [to_device(t, device) for t in split_tree(target, M, n)]
        if count_fn is None:
            sizes = [len(t) for t in torch.tensor_split(torch.empty(n), M)]
            total = over_dp(n)  # loss_scales' n_j / N, N the global batch
            batch.scales = [k / total for k in sizes]
        else:
            batch.num_items = over_dp(batch_count(count_fn, target, device))
            batch.scales = [1.0] * M
    return batch
