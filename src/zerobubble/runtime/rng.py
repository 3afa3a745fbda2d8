"""Per-microbatch randomness: the generator state of each (step, stage, microbatch).

A schedule runs the forwards of a step in its own order, so random ops (dropout)
drawing from one running generator would see different numbers under different
schedules. Instead every forward of stage ``s`` on microbatch ``j`` in step ``k``
starts from a generator state derived from ``(seed, k, s, j)`` alone, and the
state the caller had is put back afterwards. The same derivation seeds
:func:`~zerobubble.reference.step.reference_step`, which therefore draws
exactly what any pipelined run draws; a replayed forward draws the same again.

Backward ops draw nothing new: autograd keeps dropout's mask from the forward; the
split layers (:mod:`~zerobubble.runtime.split`) recompute nothing; and a forward that
is recomputed (activation checkpointing's B, :mod:`~zerobubble.runtime.recompute`, or
the graph-level split's W, :mod:`~zerobubble.runtime.split.fallback`) runs from the
generator state its F started from, so it draws F's numbers again.

Under tensor parallelism the ``tp`` ranks of a stage start from the same state (the tuple
has no tp rank), which is the *shared* stream: a random op on activations that every tp
rank holds whole (replicated) draws the same numbers on each, so the replicas stay equal.
A random op on activations that are sharded over the tp ranks (sequence shards, local
attention heads) runs inside :func:`rank_stream`: one value is drawn from the shared stream
(the same count on every rank, so the shared stream stays in step), and the tp rank's own
stream is seeded from that value and the rank (:func:`derive_rank_seed`), a function of
``(seed, step, stage, microbatch, tp rank)`` and the op's place in the forward. A replayed
or recomputed forward starts from the same shared state, so it draws the same again. The
tensor-parallel plan says which region is which (:class:`~zerobubble.parallel.tp.TPRandom`).

The default generators are the process's, and an overlapped F&B pair runs a forward beside
a backward that may replay one: whoever uses them holds the rank's :class:`GeneratorLock`.
A holder that blocks on its peers (an ep all-to-all) gives it up meanwhile
(:func:`yield_generators`), with its generator states put aside and back, so the other
half may run and what the holder draws next is what it would have drawn without the wait.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

__all__ = [
    "GeneratorLock",
    "StageRng",
    "derive_rank_seed",
    "derive_seed",
    "rank_stream",
    "yield_generators",
]

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


def derive_rank_seed(shared: int, rank: int) -> int:
    """A 63-bit seed for tp rank ``rank``'s stream, from a value ``shared`` that every tp rank
    drew alike from the shared stream; distinct pairs give unrelated seeds."""
    if rank < 0:
        raise ValueError(f"rank must be >= 0 to derive a seed, got {rank}")
    packed = struct.pack("<qq", shared, rank)
    digest = hashlib.blake2b(packed, digest_size=8, person=b"zerobubble-tprk").digest()
    return int.from_bytes(digest, "little") & _MASK63


@contextmanager
def _seeded(
    seed: int, device: torch.device, cpu: torch.Generator, acc: torch.Generator | None
) -> Iterator[None]:
    """Inside: the CPU's and ``device``'s default generators start at ``seed``'s state (set
    through the scratch generators ``cpu`` and ``acc``, the latter on ``device`` unless it is
    the CPU); their states before are restored on exit."""
    saved_cpu = torch.get_rng_state()
    mod = None if acc is None else torch.get_device_module(device.type)
    saved_acc = None if mod is None else mod.get_rng_state(device)
    torch.set_rng_state(cpu.manual_seed(seed).get_state())
    if mod is not None:
        assert acc is not None
        mod.set_rng_state(acc.manual_seed(seed).get_state(), device)
    try:
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        if mod is not None:
            mod.set_rng_state(saved_acc, device)


@contextmanager
def rank_stream(rank: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Inside: the default generators (the CPU's and ``device``'s) draw from tp rank
    ``rank``'s own stream; on exit the shared stream continues as on every other tp rank.

    On entry one int64 is drawn from the CPU's default generator (the shared stream, the
    same value on every tp rank), and the rank's stream is seeded with
    :func:`derive_rank_seed` of it and ``rank``.
    """
    shared = int(torch.empty((), dtype=torch.int64).random_())
    dev = torch.device(device)
    acc = None if dev.type == "cpu" else torch.Generator(dev)
    with _seeded(derive_rank_seed(shared, rank), dev, torch.Generator(), acc):
        yield


States: TypeAlias = tuple[torch.Tensor, torch.Tensor | None]
"""The CPU's and a device's default generator states (None: the device is the CPU)."""


def generator_states(device: torch.device) -> States:
    """The CPU's and ``device``'s default generator states."""
    mod = None if device.type == "cpu" else torch.get_device_module(device.type)
    return torch.get_rng_state(), None if mod is None else mod.get_rng_state(device)


def set_generator_states(states: States, device: torch.device) -> None:
    """Set the CPU's and ``device``'s default generators to ``states``."""
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.get_device_module(device.type).set_rng_state(states[1], device)


@dataclass
class _Hold:
    """A thread's hold on a :class:`GeneratorLock`: how deep, and the generator states it
    found when it took the lock (what they hold whenever nobody holds it)."""

    lock: GeneratorLock
    depth: int
    found: States


class _Holds(threading.local):
    """The generator locks this thread holds, outermost first (per thread: a thread
    blocking on its peers gives up only its own)."""

    def __init__(self) -> None:
        self.holds: list[_Hold] = []


_HOLDS = _Holds()


class GeneratorLock:
    """The rank's hold on the process's default generators (the CPU's and ``device``'s): a
    re-entrant lock that its holder may give up while it blocks (:func:`yield_generators`).

    Whoever sets or draws from them holds it: every forward (:meth:`StageRng.scope`), and a
    replay of a forward that drew (activation recompute's B, the graph-level split's W). A
    holder that waits on its peers while another thread of the rank waits for the lock would
    close a cycle across ranks (an ep peer's forward holding its own lock waiting for this
    rank's forward), so a holder gives the lock up for its waits.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self._lock = threading.RLock()

    def _hold(self) -> _Hold | None:
        return next((h for h in _HOLDS.holds if h.lock is self), None)

    def __enter__(self) -> None:
        self._lock.acquire()
        hold = self._hold()
        if hold is None:
            _HOLDS.holds.append(_Hold(self, 1, generator_states(self.device)))
        else:
            hold.depth += 1

    def __exit__(self, *exc: Any) -> None:
        hold = self._hold()
        assert hold is not None, "GeneratorLock released by a thread that does not hold it"
        hold.depth -= 1
        if hold.depth == 0:
            _HOLDS.holds.remove(hold)
        self._lock.release()


@contextmanager
def yield_generators() -> Iterator[None]:
    """Inside: this thread holds no :class:`GeneratorLock` (wrap a blocking wait in it).

    Each lock it held is given up wholly (however deep), its generators first set back to
    the states the thread found when it took the lock, so another thread takes them as if
    the lock had been free all along; on exit the thread holds each again, as deep, with the
    generator states it had (whatever another thread drew or set meanwhile). A thread that
    holds none: a no-op.
    """
    holds = list(_HOLDS.holds)
    if not holds:
        yield
        return
    own = []
    for hold in reversed(holds):  # innermost first
        own.append(generator_states(hold.lock.device))
        set_generator_states(hold.found, hold.lock.device)
        for _ in range(hold.depth):
            hold.lock._lock.release()
    _HOLDS.holds = []
    try:
        yield
    finally:
        for hold, states in zip(holds, reversed(own), strict=True):  # outermost first
            for _ in range(hold.depth):
                hold.lock._lock.acquire()
            hold.found = generator_states(hold.lock.device)
            set_generator_states(states, hold.lock.device)
        _HOLDS.holds = holds


class StageRng:
    """Seeds the default generators of the CPU and of ``device`` for one stage's forward.

    Args:
        seed: The run's seed (:attr:`~zerobubble.executor.ExecutorOptions.seed`).
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
        self.lock = GeneratorLock(self.device)
        """Held for a whole forward (:meth:`scope`), but for its waits on its peers
        (:func:`yield_generators`): the default generators are the process's, and an
        overlapped pair runs a forward beside a backward whose recomputation (activation
        checkpointing) or W may replay a forward's draws (``WeightGradStore.rng_lock``)."""

    @contextmanager
    def scope(self, step: int, stage: int, mb: int) -> Iterator[None]:
        """Inside: the default generators start at ``(seed, step, stage, mb)``'s state.

        The states they had before are restored on exit, so the caller's own random
        stream is not advanced by the stage's draws.
        """
        seed = derive_seed(self.seed, step, stage, mb)
        with self.lock, _seeded(seed, self.device, self._cpu, self._acc):
            yield
