"""What the passes build into every rank's program: :class:`ProgramPlan` and its choices.

Its own module so that the final-program check (:mod:`~zerobubble.program.check`) reads the
plan without depending on the builder that applies it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import fuse_local_backward

__all__ = ["GradSync", "ProgramPlan", "Protocol"]


class GradSync(enum.StrEnum):
    """How a stage's gradients meet the other data-parallel replicas' ones."""

    NONE = "none"
    """One replica: nothing to reduce."""
    REDUCE = "reduce"
    """Each replica holds whole parameters; each stage's gradients are summed over the
    replicas right after its last W or BW
    (:func:`~zerobubble.program.passes.grad_sync.insert_grad_reduce`)."""
    FSDP = "fsdp"
    """Parameters are sharded (FSDP2): gathered before the stage's first F, gradients
    reduce-scattered after its last W or BW (:mod:`~zerobubble.program.passes.sharding`)."""

    __hash__ = str.__hash__

    @property
    def reduces(self) -> bool:
        return self is GradSync.REDUCE

    @property
    def shards(self) -> bool:
        return self is GradSync.FSDP


class Protocol(enum.StrEnum):
    """The optimizer protocol's instructions (:mod:`~zerobubble.optim.speculation`)."""

    NONE = "none"
    """A bare executor: the caller steps the optimizer (or not) between steps."""
    CHECKED = "checked"
    """A version check before every compute (synchronous and conservative steps)."""
    SPECULATIVE = "speculative"
    """Version checks and the replay gate of speculative post-validation."""

    __hash__ = str.__hash__

    @property
    def checks(self) -> bool:
        return self is not Protocol.NONE

    @property
    def gates(self) -> bool:
        return self is Protocol.SPECULATIVE


@dataclass(frozen=True)
class ProgramPlan:
    """What the passes build into every rank's program."""

    fuse_local_backward: bool = True
    """Fuse a B immediately followed by its W into one BW where no other device waits for
    that B (see :func:`~zerobubble.schedule.passes.fuse_local_backward`)."""
    recv_lookahead: int = 2
    """How many compute actions before its consumer a receive is posted."""
    grad_sync: GradSync = GradSync.NONE
    """Gradient reduction over data-parallel replicas (:class:`GradSync`)."""
    protocol: Protocol = Protocol.NONE
    """The optimizer protocol's instructions (:class:`Protocol`)."""

    def __post_init__(self) -> None:
        if self.recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be >= 0, got {self.recv_lookahead}")
        # Plain strings ("reduce", "speculative") are accepted and stored as the enums.
        object.__setattr__(self, "grad_sync", GradSync(self.grad_sync))
        object.__setattr__(self, "protocol", Protocol(self.protocol))
        if self.grad_sync.shards and self.protocol.gates:
            raise ValueError(
                "speculative post-validation with FSDP-sharded stages is not supported (a "
                "rollback would leave the gathered parameters stale); use the synchronous step"
            )

    def compute_schedule(self, schedule: Schedule) -> Schedule:
        """The compute schedule the programs run: ``schedule`` after the B/W fusion, if
        asked for (which stages split their backward is read from it)."""
        return fuse_local_backward(schedule) if self.fuse_local_backward else schedule

    def __str__(self) -> str:
        fuse = "fused" if self.fuse_local_backward else "unfused"
        return (
            f"{fuse}, lookahead {self.recv_lookahead}, grad sync {self.grad_sync.value}, "
            f"protocol {self.protocol.value}"
        )
