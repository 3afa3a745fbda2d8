"""Running schedules on torch: B/W split, per-stage compute, lowering, executor."""
