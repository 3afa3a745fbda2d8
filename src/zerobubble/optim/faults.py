"""Fault injection for the optimizer protocol, passed explicitly to the trainer.

The faults the protocol must survive: a non-finite gradient on some stage and
microbatch, a gradient norm that crosses the clip threshold only once the last
stage adds its part, several bad iterations in a row, a rank dying or stalling
before the optimizer's messages, between its provisional step and the validation,
or in the middle of a checkpoint; and, for the kill/stall matrix, a rank killed
or stalled in the forward, the backward or the optimizer step.
Tests pass the same plan to a synchronous run to get the expected result.
"""

from __future__ import annotations

import enum
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from zerobubble.schedule.ir import Action, Op


class GradFaultKind(enum.StrEnum):
    NAN = "nan"
    """Set one gradient element to NaN."""
    INF = "inf"
    """Set one gradient element to +inf."""
    SCALE = "scale"
    """Multiply all gradients of the stage by ``factor`` (at the iteration tail)."""


@dataclass(frozen=True)
class GradFault:
    """Corrupt the gradients of one stage in one iteration.

    Attributes:
        iteration: Trainer iteration (0-based).
        stage: Virtual stage whose gradients are corrupted.
        mb: For NaN/Inf: right after the weight gradient of this microbatch is
            accumulated (its W or BW). None: at the iteration tail, after all W.
        kind: See :class:`GradFaultKind`.
        factor: Multiplier for ``scale``.
    """

    iteration: int
    stage: int
    mb: int | None = None
    kind: GradFaultKind = GradFaultKind.NAN
    factor: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", GradFaultKind(self.kind))
        if self.kind is GradFaultKind.SCALE and self.mb is not None:
            raise ValueError("a scale fault applies at the iteration tail: leave mb=None")

    def apply(self, params: Sequence[Tensor]) -> None:
        """Corrupt ``params``' gradients (the stage's, in model order); a DTensor gradient
        in this rank's shard (or partial sum) only, as a fault on one tp rank would."""
        with torch.no_grad():
            grads = [_local(p.grad) for p in params if p.grad is not None]
            if not grads:
                raise RuntimeError(f"fault {self}: stage {self.stage} has no gradient yet")
            if self.kind is GradFaultKind.SCALE:
                for g in grads:
                    g.mul_(self.factor)
            else:
                grads[0].view(-1)[0] = (
                    float("nan") if self.kind is GradFaultKind.NAN else float("inf")
                )


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (sharing its storage); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class CrashPoint(enum.StrEnum):
    AT_TAIL = "at_tail"
    """After the iteration's compute, before the optimizer's first message or collective."""
    AFTER_PROVISIONAL = "after_provisional"
    """After the rank's provisional step (and its prefix message), before validation."""
    DURING_SAVE = "during_save"
    """After the rank wrote its checkpoint shard, before it confirmed the save."""
    IN_WRITE = "in_write"
    """Inside ``torch.distributed.checkpoint``'s save, where this rank writes its shards:
    its peers wait for it in DCP's own collectives."""


@dataclass(frozen=True)
class Crash:
    """Kill one rank (SIGKILL, no cleanup) at a protocol point of one iteration.

    Attributes:
        rank: The rank that dies.
        iteration: Trainer iteration (for a save: the validated step being saved).
        point: See :class:`CrashPoint`.
    """

    rank: int
    iteration: int
    point: CrashPoint

    def __post_init__(self) -> None:
        object.__setattr__(self, "point", CrashPoint(self.point))


class Phase(enum.StrEnum):
    FORWARD = "forward"
    """Right after the rank's F of the given stage and microbatch (its output not yet sent)."""
    BACKWARD = "backward"
    """Right after the rank's B or BW of the given stage and microbatch."""
    OPTIMIZER_STEP = "optimizer_step"
    """At the start of the optimizer step: every W done, before the norm is reduced."""


class RankFaultKind(enum.StrEnum):
    KILL = "kill"
    """SIGKILL, no cleanup: the peers see a closed connection."""
    STALL = "stall"
    """Sleep ``stall_s`` seconds: the peers see no message (only their timeouts end it)."""


@dataclass(frozen=True)
class RankFault:
    """Kill or stall the rank that holds ``stage`` in one phase of one iteration.

    Attributes:
        iteration: Trainer iteration (0-based).
        stage: A virtual stage of the rank that fails (any of them for the optimizer step).
        phase: See :class:`Phase`.
        mb: The microbatch of the F or backward (ignored for the optimizer step).
        kind: See :class:`RankFaultKind`.
        stall_s: How long a stall lasts; longer than any timeout, so the launcher ends it.
    """

    iteration: int
    stage: int
    phase: Phase
    mb: int = 0
    kind: RankFaultKind = RankFaultKind.KILL
    stall_s: float = 3600.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase(self.phase))
        object.__setattr__(self, "kind", RankFaultKind(self.kind))

    def happen(self) -> None:
        if self.kind is RankFaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(self.stall_s)


_PHASE_OPS = {Op.F: Phase.FORWARD, Op.B: Phase.BACKWARD, Op.BW: Phase.BACKWARD}


@dataclass(frozen=True)
class Stall:
    """Make one rank sleep at a protocol point of one iteration: by default the tail,
    before the optimizer's messages; ``during_save``: after writing its checkpoint shard;
    ``in_write``: inside DCP's save, before writing it.

    Attributes:
        rank: The rank that stalls.
        iteration: Trainer iteration (for a save: the validated step being saved).
        seconds: How long it sleeps (longer than the comm timeout to test it).
        point: See :class:`CrashPoint` (``after_provisional`` is not a stall point).
    """

    rank: int
    iteration: int
    seconds: float
    point: CrashPoint = CrashPoint.AT_TAIL

    def __post_init__(self) -> None:
        object.__setattr__(self, "point", CrashPoint(self.point))
        if self.point is CrashPoint.AFTER_PROVISIONAL:
            raise ValueError("a stall happens at_tail or during_save, not after_provisional")


@dataclass(frozen=True)
class FaultPlan:
    """Everything to inject into one run (empty by default)."""

    grads: tuple[GradFault, ...] = ()
    crashes: tuple[Crash, ...] = ()
    stalls: tuple[Stall, ...] = ()
    ranks: tuple[RankFault, ...] = ()

    def after_compute(
        self, iteration: int, action: Action, stage_params: Mapping[int, Sequence[Tensor]]
    ) -> None:
        """Microbatch-level gradient faults, right after a W (or BW); rank faults in the
        forward or backward, right after that F, B or BW."""
        phase = _PHASE_OPS.get(action.op)
        for r in self.ranks:
            if (r.iteration, r.stage, r.mb, r.phase) == (iteration, action.stage, action.mb, phase):
                r.happen()
        if not action.op.adds_weight_grad:
            return
        for f in self.grads:
            if (f.iteration, f.stage, f.mb) == (iteration, action.stage, action.mb):
                f.apply(stage_params[f.stage])

    def at_tail(self, iteration: int, stage_params: Mapping[int, Sequence[Tensor]]) -> None:
        """Tail-level gradient faults of this rank's stages, after every W; then rank faults
        at the start of the optimizer step."""
        for f in self.grads:
            if f.iteration == iteration and f.mb is None and f.stage in stage_params:
                f.apply(stage_params[f.stage])
        for r in self.ranks:
            step = (r.iteration, r.phase) == (iteration, Phase.OPTIMIZER_STEP)
            if step and r.stage in stage_params:
                r.happen()

    def crash(self, rank: int, iteration: int, point: CrashPoint) -> None:
        """Die here if the plan says so."""
        if Crash(rank, iteration, point) in self.crashes:
            os.kill(os.getpid(), signal.SIGKILL)

    def stall(self, rank: int, iteration: int, point: CrashPoint = CrashPoint.AT_TAIL) -> None:
        """Sleep here if the plan says so (by default: at the iteration tail)."""
        for s in self.stalls:
            if (s.rank, s.iteration, s.point) == (rank, iteration, point):
                time.sleep(s.seconds)
