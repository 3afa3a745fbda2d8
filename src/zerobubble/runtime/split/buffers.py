"""Buffers across a recomputation: a forward run again for B or W updates nothing twice.

A module's forward may update its buffers (BatchNorm's running statistics and its
batch count). Plain autograd runs each forward once; activation checkpointing runs a
region's forward again in B, and the graph-level split a module's forward again in W,
which would count every microbatch twice. :func:`restored` runs such a re-run and
then puts every buffer it changed back, bitwise (and the buffer objects, for a module
that rebinds its buffers). Changes are found by comparing the bits with a copy taken
before, not by version counters: BatchNorm's kernel updates the running statistics in
place without bumping theirs.

The re-run reads the buffers as they are when it runs (the forwards of later
microbatches may have updated them since): that changes nothing for BatchNorm in
training, whose output uses the batch's statistics, not the running ones; a module
whose output reads a buffer that it also updates would recompute other values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["restored"]


@contextmanager
def restored(module: nn.Module) -> Iterator[None]:
    """Inside: a re-run of ``module``'s forward; after (also on an error): its buffers
    bitwise as before it. Costs a copy and a comparison of the buffers; only the
    buffers that changed are written back."""
    before = [
        (owner, name, b, b.detach().clone())
        for owner in module.modules()
        for name, b in owner._buffers.items()
        if b is not None
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, b, copy in before:
                if owner._buffers.get(name) is not b:
                    owner._buffers[name] = b
                if not _same_bits(b, copy):
                    # Through .data, as BatchNorm's kernel writes them: a version bump
                    # would fail the graphs that saved the buffer (for eval mode's use).
                    data = b.data
                    if data.shape != copy.shape:
                        data.resize_(copy.shape)
                    data.copy_(copy)


def _same_bits(a: Tensor, b: Tensor) -> bool:
    """Bitwise equality (NaN equals the same NaN, -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    try:
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    except RuntimeError:  # a layout that has no byte view
        return torch.equal(a, b)
