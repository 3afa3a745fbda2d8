"""Fault injection for the optimizer protocol, passed explicitly to the trainer.

The faults the protocol must survive: a non-finite gradient on some stage and
microbatch, a gradient norm that crosses the clip threshold only once the last
stage adds its part, several bad iterations in a row, a rank dying or stalling
before the optimizer's messages, between its provisional step and the validation,
or in the middle of a checkpoint.
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
        """Corrupt ``params``' gradients (the stage's, in model order)."""
        with torch.no_grad():
            grads = [p.grad for p in params if p.grad is not None]
            if not grads:
                raise RuntimeError(f"fault {self}: stage {self.stage} has no gradient yet")
            if self.kind is GradFaultKind.SCALE:
                for g in grads:
                    g.mul_(self.factor)
            else:
                grads[0].view(-1)[0] = (
                    float("nan") if self.kind is GradFaultKind.NAN else float("inf")
                )


class CrashPoint(enum.StrEnum):
    AT_TAIL = "at_tail"
    """After the iteration's compute, before the optimizer's first message or collective."""
    AFTER_PROVISIONAL = "after_provisional"
    """After the rank's provisional step (and its prefix message), before validation."""
    DURING_SAVE = "during_save"
    """After the rank wrote its checkpoint shard, before it confirmed the save."""


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


@dataclass(frozen=True)
class Stall:
    """Make one rank sleep at the tail of one iteration, before the optimizer's messages.

    Attributes:
        rank: The rank that stalls.
        iteration: Trainer iteration.
        seconds: How long it sleeps (longer than the comm timeout to test it).
    """

    rank: int
    iteration: int
    seconds: float


@dataclass(frozen=True)
class FaultPlan:
    """Everything to inject into one run (empty by default)."""

    grads: tuple[GradFault, ...] = ()
    crashes: tuple[Crash, ...] = ()
    stalls: tuple[Stall, ...] = ()

    def after_compute(
        self, iteration: int, action: Action, stage_params: Mapping[int, Sequence[Tensor]]
    ) -> None:
        """Microbatch-level gradient faults, right after a W (or BW)."""
        if action.op not in (Op.W, Op.BW):
            return
        for f in self.grads:
            if (f.iteration, f.stage, f.mb) == (iteration, action.stage, action.mb):
                f.apply(stage_params[f.stage])

    def at_tail(self, iteration: int, stage_params: Mapping[int, Sequence[Tensor]]) -> None:
        """Tail-level gradient faults of this rank's stages, after every W."""
        for f in self.grads:
            if f.iteration == iteration and f.mb is None and f.stage in stage_params:
                f.apply(stage_params[f.stage])

    def crash(self, rank: int, iteration: int, point: CrashPoint) -> None:
        """Die here if the plan says so."""
        if Crash(rank, iteration, point) in self.crashes:
            os.kill(os.getpid(), signal.SIGKILL)

    def stall(self, rank: int, iteration: int) -> None:
        """Sleep here if the plan says so (at the iteration tail)."""
        for s in self.stalls:
            if (s.rank, s.iteration) == (rank, iteration):
                time.sleep(s.seconds)
