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


class DeviceOrder:
    """Builds one device's action list, numbering microbatches per (op, stage) in order.

    Generators that describe a device as "do the next F of stage s, then the
    next B of stage t, ..." use this instead of tracking counters by hand.
    """

    def __init__(self) -> None:
        self.actions: list[Action] = []
        self._next: dict[tuple[Op, int], int] = {}

    def add(self, op: Op, stage: int) -> Action:
        """Append the next microbatch of ``op`` on ``stage``."""
        j = self._next.get((op, stage), 0)
        self._next[op, stage] = j + 1
        action = Action(op, stage, j)
        self.actions.append(action)
        return action

    def count(self, op: Op, stage: int) -> int:
        """How many ``op`` of ``stage`` were added so far."""
        return self._next.get((op, stage), 0)
