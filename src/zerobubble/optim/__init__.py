"""Optimizer semantics for pipeline runs: synchronous step, post-validation with rollback,
versioned parameters, drain-point checkpoints (see docs/optim.md)."""

from zerobubble.optim.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from zerobubble.optim.config import OptimConfig, Rollback, StepMode
from zerobubble.optim.faults import Crash, FaultPlan, GradFault, Stall
from zerobubble.optim.trainer import PipelineTrainer

__all__ = [
    "Crash",
    "FaultPlan",
    "GradFault",
    "OptimConfig",
    "PipelineTrainer",
    "Rollback",
    "Stall",
    "StepMode",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]
