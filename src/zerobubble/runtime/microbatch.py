"""Splitting a batch into microbatches and weighting their losses."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["loss_scales", "split_batch"]


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
