"""Per-microbatch randomness: the generator state of each (step, stage, microbatch).

A schedule runs the forwards of a step in its own order, so random ops (dropout)
drawing from one running generator would see different numbers under different
schedules. Instead every forward of stage ``s`` on microbatch ``j`` in step ``k``
starts from a generator state derived from ``(seed, k, s, j)`` alone, and the
state the caller had is put back afterwards. The same derivation seeds
:func:`~zerobubble.runtime.reference.reference_step`, which therefore draws
exactly what any pipelined run draws; a replayed forward draws the same again.

Backward ops draw nothing new: autograd keeps dropout's mask from the forward; the
split layers (:mod:`~zerobubble.runtime.split`) recompute nothing; and a forward that
is recomputed (activation checkpointing's B, :mod:`~zerobubble.runtime.recompute`, or
the graph-level split's W, :mod:`~zerobubble.runtime.split.fallback`) runs from the
generator state its F started from, so it draws F's numbers again.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["StageRng", "derive_seed"]

_MASK63 = (1 << 63) - 1


def derive_seed(seed: int, step: int, stage: int, mb: int) -> int:
    """A 63-bit seed for ``(seed, step, stage, mb)``; distinct tuples give unrelated seeds.

    A cryptographic hash rather than arithmetic on the fields, so that neighbouring
    steps, stages or microbatches do not get correlated generator streams.
    """
    for name, v in (("step", step), ("stage", stage), ("mb", mb)):
        if v < 0:
            raise ValueError(f"{name} must be >= 0 to derive a seed, got {v}")
    if not -(1 << 63) <= seed < (1 << 63):
        raise ValueError(f"seed must fit in a signed 64-bit integer, got {seed}")
    packed = struct.pack("<qqqq", seed, step, stage, mb)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"zerobubble-rng").digest()
    return int.from_bytes(digest, "little") & _MASK63


class StageRng:
    """Seeds the default generators of the CPU and of ``device`` for one stage's forward.

    Args:
        seed: The run's seed (:attr:`~zerobubble.runtime.executor.ExecutorOptions.seed`).
        device: The stage's device; for an accelerator its default generator is
            seeded too (``torch.get_device_module(device.type)``, so CUDA and others
            alike), the CPU's always (CPU-side random ops of a stage).
    """

    def __init__(self, seed: int, device: torch.device | str) -> None:
        self.seed = seed
        self.device = torch.device(device)
        derive_seed(seed, 0, 0, 0)  # refuse a bad seed here, not at the first forward
        self._cpu = torch.Generator()
        self._acc = None if self.device.type == "cpu" else torch.Generator(self.device)

    @contextmanager
    def scope(self, step: int, stage: int, mb: int) -> Iterator[None]:
        """Inside: the default generators start at ``(seed, step, stage, mb)``'s state.

        The states they had before are restored on exit, so the caller's own random
        stream is not advanced by the stage's draws.
        """
        s = derive_seed(self.seed, step, stage, mb)
        saved_cpu = torch.get_rng_state()
        mod = None if self._acc is None else torch.get_device_module(self.device.type)
        saved_acc = None if mod is None else mod.get_rng_state(self.device)
        torch.set_rng_state(self._cpu.manual_seed(s).get_state())
        if mod is not None:
            assert self._acc is not None
            mod.set_rng_state(self._acc.manual_seed(s).get_state(), self.device)
        try:
            yield
        finally:
            torch.set_rng_state(saved_cpu)
            if mod is not None:
                mod.set_rng_state(saved_acc, self.device)
