"""The one exception type every schedule check raises."""

from __future__ import annotations

import enum

from zerobubble.schedule.ir import Action


class Reason(enum.StrEnum):
    """Why a schedule was rejected. Stable strings: tests and tools match on them."""

    OUT_OF_RANGE = "out_of_range"
    """A stage or microbatch index outside [0, S) or [0, M)."""
    WRONG_DEVICE = "wrong_device"
    """An action on a device that does not hold its stage."""
    DUPLICATE = "duplicate"
    """The same action appears twice."""
    CONFLICT = "conflict"
    """A (stage, microbatch) uses both BW and the split B/W."""
    MISSING = "missing"
    """A (stage, microbatch) lacks its F, its backward, or its W."""
    LOCAL_ORDER = "local_order"
    """An action precedes, on the same device, an action it depends on."""
    DEADLOCK = "deadlock"
    """Devices wait on each other in a cycle; no execution order exists."""
    MEMORY = "memory"
    """Activation memory on a device exceeds the limit."""
    COMM_ORDER = "comm_order"
    """Lowered programs disagree on the order of messages between two devices."""
    OVERLAP = "overlap"
    """An overlapped F&B pair of one stage, or whose backward needs its forward's result."""


class ScheduleError(ValueError):
    """A schedule that cannot be executed as written.

    Attributes:
        reason: Machine-readable category.
        device: Device of the first offending action (None if not tied to one).
        position: Index of that action in the device's list.
        action: The first offending action.
    """

    def __init__(
        self,
        reason: Reason,
        message: str,
        *,
        device: int | None = None,
        position: int | None = None,
        action: Action | None = None,
    ) -> None:
        where = ""
        if device is not None and position is not None:
            what = f"{action} " if action is not None else ""
            where = f"{what}at device {device} position {position}: "
        super().__init__(f"[{reason}] {where}{message}")
        self.reason = reason
        self.device = device
        self.position = position
        self.action = action
