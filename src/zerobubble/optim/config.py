"""How the optimizer step of a pipeline run is coordinated across stages."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class StepMode(enum.StrEnum):
    """When the global gradient state is known relative to the optimizer step."""

    SYNC = "sync"
    """Reduce the global gradient norm across all ranks, then every rank clips, skips or
    steps together. A barrier at the end of every iteration; simplest to audit."""
    POST_VALIDATION = "post_validation"
    """Step provisionally on the prefix of the global state that reaches a rank along the
    pipeline, validate once the full state has travelled back, and roll back if needed."""


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
    """``sync`` (default) or ``post_validation``; see :class:`StepMode`."""

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

    speculative: bool = False
    """Post-validation only. False (conservative): a rank validates iteration k before
    its first forward of k+1. True: forwards of k+1 may run on provisional parameters
    until the rank's replay gate (before its first backward); on rollback every rank
    discards that work and replays it. Needs an executor built with
    ``ExecutorOptions(replay_gate=True)``."""

    rollback: Rollback = Rollback.SNAPSHOT
    """Post-validation only: how a rejected provisional step is undone; see :class:`Rollback`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", StepMode(self.mode))
        object.__setattr__(self, "rollback", Rollback(self.rollback))
        if self.max_norm is not None and not self.max_norm > 0:
            raise ValueError(f"max_norm must be > 0 (or None for no clipping), got {self.max_norm}")
        if not (self.norm_type > 0 or math.isinf(self.norm_type)):
            raise ValueError(f"norm_type must be > 0 or inf, got {self.norm_type}")
        if self.speculative and self.mode is not StepMode.POST_VALIDATION:
            raise ValueError(
                "speculative=True only applies to mode='post_validation'; drop it for sync steps"
            )
