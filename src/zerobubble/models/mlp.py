"""A tiny MLP as an ordered list of layers, for tests and demos."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["build_mlp", "mlp_loss"]


def build_mlp(
    sizes: Sequence[int], *, seed: int = 0, activation: type[nn.Module] = nn.Tanh
) -> nn.Sequential:
    """Layers ``Linear(sizes[i], sizes[i+1])`` each followed by ``activation`` except the last.

    Each list item is one ``nn.Sequential(Linear, activation)`` (the last is a
    bare Linear), so a partitioner cuts between whole layers. Parameters come
    from ``seed``; the global RNG is left untouched.
    """
    if len(sizes) < 2 or any(s < 1 for s in sizes):
        raise ValueError(f"build_mlp needs >= 2 positive sizes, got {list(sizes)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = []
        for i, (a, b) in enumerate(itertools.pairwise(sizes)):
            last = i == len(sizes) - 2
            layers.append(nn.Linear(a, b) if last else nn.Sequential(nn.Linear(a, b), activation()))
    return nn.Sequential(*layers)


def mlp_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error."""
    return F.mse_loss(output, target)
