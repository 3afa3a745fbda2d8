"""Module state that a training step's forwards feed and its applied optimizer step updates.

A layer whose state moves once per optimizer step, from what the step's forwards saw
(DeepSeek-V3's expert-bias balancing:
:class:`~zerobubble.interop.hf_layers.BiasBalancedBlock`), implements :class:`StepState`. The
:class:`~zerobubble.optim.trainer.PipelineTrainer` finds such modules in its stages (by
this protocol: the optim layer imports no model or interop module) and calls, every step:

1. :meth:`StepState.begin_step` before the step's first forward: forget what forwards
   outside a training step saw;
2. :meth:`StepState.end_step` at the step's tail, before the optimizer decides: combine
   what the step's forwards saw over the data-parallel replicas with ``reduce`` (a sum over
   the dp group, collective: every rank holding the module calls it in the same order);
3. :meth:`StepState.commit_step` when the optimizer's final action of that step is applied
   on this rank: ``applied`` is False for a skipped step (NaN/Inf gradients), which must
   not move the state.

Under post-validation (``conservative``) the commit of step k comes at its validation,
before the first forward of step k + 1, so every forward sees the state a synchronous step
would have left. ``speculative`` runs step k + 1's first forwards before step k is
validated, with the state of before its update: the trainer refuses it with such modules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from torch import Tensor

__all__ = ["StepState"]


@runtime_checkable
class StepState(Protocol):
    """What :class:`~zerobubble.optim.trainer.PipelineTrainer` calls on a stage's module
    every step (see the module docstring)."""

    def begin_step(self) -> None:
        """The step's forwards are about to run."""

    def end_step(self, reduce: Callable[[Tensor], Tensor]) -> None:
        """The step's forwards and backwards ran; ``reduce(t)`` returns ``t`` summed over
        the dp replicas (collective)."""

    def commit_step(self, applied: bool) -> None:
        """The optimizer's final action of the step: applied (True) or skipped (False)."""
