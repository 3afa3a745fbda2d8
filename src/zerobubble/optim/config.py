"""How the optimizer step of a pipeline run is coordinated across stages."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from zerobubble.schedule.step_sim import StepMode

__all__ = ["OptimConfig", "Rollback", "StepMode"]


class Rollback(enum.StrEnum):
    """How a provisional step that validation rejects is undone."""

    SNAPSHOT = "snapshot"
    """Copy parameters and optimizer state before each provisional step and restore the
    copy: exact, works for every optimizer, costs one copy of both per iteration."""
    INVERSE = "inverse"
    """Invert the update algebraically in place (Adam, AdamW, SGD): no copy, but the
    restored values carry rounding error (see docs/optim.md for the measured size)."""


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer-step semantics of a :class:`~zerobubble.optim.trainer.PipelineTrainer`.

    Every mode computes the same result as single-process training with
    ``torch.nn.utils.clip_grad_norm_`` over all parameters followed by
    ``optimizer.step()`` (skipped when the norm is not finite); they differ only
    in when ranks wait for one another.
    """

    mode: StepMode = StepMode.SYNC
    """``sync`` (default), ``conservative`` or ``speculative`` post-validation; see
    :class:`~zerobubble.schedule.step_sim.StepMode`. Speculative refuses (at the trainer's
    construction) a schedule whose ranks cannot reach their replay gates."""

    max_norm: float | None = None
    """Clip the global gradient norm to this value, exactly as
    ``clip_grad_norm_(params, max_norm, norm_type)`` does (coefficient
    ``max_norm / (norm + 1e-6)`` clamped to 1). None: no clipping."""

    norm_type: float = 2.0
    """Order of the gradient norm (``inf`` allowed), as in ``clip_grad_norm_``."""

    skip_nonfinite: bool = True
    """Skip the step on every rank when the global gradient norm is NaN or infinite (a
    NaN/Inf gradient anywhere). A skipped step leaves parameters and optimizer state
    untouched, step counters included. False: step anyway, as plain PyTorch would."""

    rollback: Rollback = Rollback.SNAPSHOT
    """Post-validation only: how a rejected provisional step is undone; see :class:`Rollback`."""

    replica_check_every: int | None = None
    """Every this many committed steps, compare a checksum of every stage's parameters over
    the data-parallel replicas (dense parameters over ``dp``, experts over the replicas
    holding the same experts) and raise :class:`~zerobubble.optim.replicas.ReplicaDivergence`
    naming the replica that differs. Cost: one read of the rank's parameters and an
    all-gather of two integers per stage (docs/reliability.md has the measured figure).
    None (the default): off, as replicas that run the library's reduction and agree on every
    step cannot drift apart on their own; turn it on to catch what bypasses it (a fault in
    memory, a parameter written by hand on one rank). Ignored without dp replicas and under
    FSDP (whose replicas hold different shards)."""

    def __post_init__(self) -> None:
        if self.mode == "post_validation":
            raise ValueError(
                "mode='post_validation' is now mode='conservative' or mode='speculative' "
                "(the speculative flag is gone)"
            )
        object.__setattr__(self, "mode", StepMode(self.mode))
        object.__setattr__(self, "rollback", Rollback(self.rollback))
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None for no clipping), got {self.max_norm}")
        if not (self.norm_type > 0 or math.isinf(self.norm_type)):
            raise ValueError(f"norm_type must be > 0 or inf, got {self.norm_type}")
        every = self.replica_check_every
        if every is not None and (type(every) is not int or every < 1):
            raise ValueError(
                f"replica_check_every must be an integer >= 1 (or None: off), got {every!r}"
            )

    @property
    def post_validation(self) -> bool:
        """Conservative or speculative: the step is validated after the fact."""
        return self.mode.post_validation

    @property
    def speculative(self) -> bool:
        return self.mode is StepMode.SPECULATIVE
