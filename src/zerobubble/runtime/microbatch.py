"""Splitting a batch into microbatches and weighting their losses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from zerobubble.runtime.shapes import map_tensors, tensor_leaves

__all__ = [
    "CountFn",
    "batch_count",
    "batch_size",
    "default_count_fn",
    "loss_scales",
    "split_batch",
    "split_tree",
    "token_count",
]

CountFn = Callable[[Any], Tensor | int]
"""``count_fn(target) -> count`` over a whole batch's target (e.g. its non-ignored tokens)."""


def split_batch(x: Tensor, m: int) -> list[Tensor]:
    """Split ``x`` along dim 0 into ``m`` microbatches, as ``torch.tensor_split`` does.

    Sizes differ by at most one (the first ``N % m`` get the extra sample). The
    pieces are views.
    """
    if m < 1:
        raise ValueError(f"the number of microbatches must be >= 1, got {m}")
    if x.dim() == 0:
        raise ValueError("cannot split a 0-dim tensor into microbatches; give it a batch dim")
    n = x.shape[0]
    if n < m:
        raise ValueError(
            f"cannot split a batch of {n} samples into {m} microbatches: every microbatch "
            f"needs a sample; use at most {n} microbatches or a batch of at least {m}"
        )
    return list(torch.tensor_split(x, m, dim=0))


def batch_size(tree: Any, what: str) -> int:
    """The batch size of a pytree: dim 0 of its first tensor with a dim (depth-first)."""
    for t in tensor_leaves(tree):
        if t.dim() > 0:
            return t.shape[0]
    raise ValueError(
        f"{what} holds no tensor with a batch dimension to split into microbatches; "
        "pass at least one tensor whose dim 0 is the batch"
    )


def split_tree(tree: Any, m: int, n: int) -> list[Any]:
    """``tree`` as ``m`` microbatches of a batch of ``n``: every tensor whose dim 0 is
    ``n`` is split as :func:`split_batch` does; every other leaf (0-dim tensors, tensors
    of another length, None, numbers, strings...) is passed unchanged to each microbatch.
    """
    parts: dict[int, list[Tensor]] = {}

    def piece(j: int):
        def pick(t: Tensor) -> Tensor:
            if t.dim() == 0 or t.shape[0] != n:
                return t
            if id(t) not in parts:
                parts[id(t)] = split_batch(t, m)
            return parts[id(t)][j]

        return pick

    return [map_tensors(tree, piece(j)) for j in range(m)]


def loss_scales(sizes: Sequence[int]) -> list[float]:
    """``n_j / N`` per microbatch, so that ``sum_j scale_j * mean_loss_j`` is the batch mean.

    Backward from each ``scale_j * mean_loss_j`` then accumulates the gradient of
    the full-batch mean loss.
    """
    if not sizes:
        raise ValueError("loss_scales needs at least one microbatch size")
    if any(n < 1 for n in sizes):
        raise ValueError(f"microbatch sizes must be >= 1, got {list(sizes)}")
    total = sum(sizes)
    return [n / total for n in sizes]


def token_count(ignore_index: int = -100) -> CountFn:
    """A ``count_fn``: the number of target entries that are not ``ignore_index``.

    For a causal LM whose loss shifts the labels inside the loss, count the shifted
    labels instead (``lambda t: (t[..., 1:] != -100).sum()``).
    """

    def count(target: Tensor) -> Tensor:
        return (target != ignore_index).sum()

    return count


def default_count_fn(loss_fn: object, count_fn: CountFn | None) -> CountFn | None:
    """``count_fn``, else the one ``loss_fn`` declares as its ``count_fn`` attribute.

    A loss that is only right normalised by a count of the whole batch (a causal LM's
    tokens: :class:`~zerobubble.interop.hf.CausalLMLoss`) carries its count, so a pipeline
    built with it trains that objective without the caller naming the count; a
    ``count_fn`` passed explicitly wins.
    """
    if count_fn is not None:
        return count_fn
    own = getattr(loss_fn, "count_fn", None)
    return own if callable(own) else None


def batch_count(
    count_fn: CountFn, target: object, device: torch.device | None = None
) -> Tensor | int:
    """``count_fn(target)`` over the whole batch, checked: a positive scalar (a tensor one
    moved to ``device`` if given). ``target`` is whatever ``step`` was given as target.

    Every microbatch's loss is divided by it, so it must be known before the first
    backward; a zero count (every target ignored) would make every gradient NaN.
    """
    n = count_fn(target)
    if isinstance(n, Tensor):
        if n.dim() != 0 or n.is_complex() or n.dtype is torch.bool:
            raise ValueError(
                f"count_fn must return an int or a real 0-dim tensor, got a {n.dtype} tensor "
                f"of shape {tuple(n.shape)}; reduce it with .sum()"
            )
        if device is not None:
            n = n.to(device)
        value = n.item()
    elif isinstance(n, int) and not isinstance(n, bool):
        value = n
    else:
        raise ValueError(f"count_fn must return an int or a 0-dim tensor, got {type(n).__name__}")
    if not value > 0:
        raise ValueError(
            f"count_fn returned {value} for the whole batch: no target counts (every one is "
            "ignored?), so the normalised loss is undefined; skip this batch or fix the count"
        )
    return n
