"""Optimizer semantics for pipeline runs: synchronous step, post-validation with rollback,
versioned parameters, drain-point checkpoints (see docs/optim.md)."""
