"""Small helpers shared by the generators."""

from __future__ import annotations

from zerobubble.schedule.ir import Action, Op


def check_counts(num_devices: int, num_microbatches: int) -> tuple[int, int]:
    """Validate P and M (every generator needs P >= 1 and M >= 1)."""
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"number of devices P must be an integer >= 1, got {num_devices!r}")
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(
            f"number of microbatches M must be an integer >= 1, got {num_microbatches!r}"
        )
    return num_devices, num_microbatches


def emit_backward(stage: int, mb: int, split: bool) -> list[Action]:
    """BW, or B immediately followed by W when ``split``."""
    if split:
        return [Action(Op.B, stage, mb), Action(Op.W, stage, mb)]
    return [Action(Op.BW, stage, mb)]
