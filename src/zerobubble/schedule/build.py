"""One builder for every rank's program: the passes, in one ordered list, then one check.

``build_programs(schedule, plan)`` is the only place programs are made:

1. the compute schedule is validated
   (:func:`~zerobubble.schedule.validate.validate`);
2. ``fuse``: B immediately followed by its own W becomes BW where no one waits
   for the B (:func:`~zerobubble.schedule.passes.fuse_local_backward`);
3. ``lower``: cross-device dependencies become sends and receives
   (:func:`~zerobubble.schedule.lowering.lower`);
4. then the program passes of :data:`PASSES`, each a function from programs to
   programs: the gradient reduction over data-parallel replicas, or FSDP's
   unshard and reduce-scatter; the optimizer's protocol (version checks, the
   replay gate); last, each overlapped F&B pair becomes one instruction
   (:func:`~zerobubble.schedule.overlap.insert_overlaps`);
5. the finished programs are validated as they will run, every kind included
   (:func:`~zerobubble.schedule.program_check.validate_program`).

Nothing is inserted anywhere else: the executor runs what this returns. This
module is pure and torch-free.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from zerobubble.schedule.dp import insert_grad_reduce
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.lowering import lower
from zerobubble.schedule.overlap import insert_overlaps
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.program import LoweredSchedule, Program
from zerobubble.schedule.program_check import validate_program
from zerobubble.schedule.replay import insert_protocol
from zerobubble.schedule.sharding import shard_programs
from zerobubble.schedule.validate import validate

__all__ = [
    "PASSES",
    "GradSync",
    "ProgramPlan",
    "Protocol",
    "build_program",
    "build_programs",
    "format_programs",
]


class GradSync(enum.StrEnum):
    """How a stage's gradients meet the other data-parallel replicas' ones."""

    NONE = "none"
    """One replica: nothing to reduce."""
    REDUCE = "reduce"
    """Each replica holds whole parameters; each stage's gradients are summed over the
    replicas right after its last W or BW (:func:`~zerobubble.schedule.dp.insert_grad_reduce`)."""
    FSDP = "fsdp"
    """Parameters are sharded (FSDP2): gathered before the stage's first F, gradients
    reduce-scattered after its last W or BW (:mod:`~zerobubble.schedule.sharding`)."""

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


def _grad_sync(lowered: LoweredSchedule, plan: ProgramPlan) -> LoweredSchedule:
    if plan.grad_sync.reduces:
        return insert_grad_reduce(lowered)
    if plan.grad_sync.shards:
        return shard_programs(lowered)
    return lowered


def _protocol(lowered: LoweredSchedule, plan: ProgramPlan) -> LoweredSchedule:
    if not plan.protocol.checks:
        return lowered
    return insert_protocol(lowered, speculative=plan.protocol.gates)


Pass = Callable[[LoweredSchedule, ProgramPlan], LoweredSchedule]


def _overlaps(lowered: LoweredSchedule, plan: ProgramPlan) -> LoweredSchedule:
    return insert_overlaps(lowered)


PASSES: tuple[tuple[str, Pass], ...] = (
    ("gradient sync", _grad_sync),
    ("optimizer protocol", _protocol),
    ("overlapped pairs", _overlaps),
)
"""The program passes after lowering, in order. Gradient sync comes first: the gate plan
of the protocol must see every instruction (and the reductions come after the gate).
The pairs come last: they gather what the other passes put around each pair's computes."""


def build_programs(schedule: Schedule, plan: ProgramPlan | None = None) -> LoweredSchedule:
    """Every rank's finished program for ``schedule`` under ``plan``, validated.

    ``result.schedule`` is the schedule the programs run (after fusion). Raises
    ``ScheduleError`` (a ``ValueError``) when the schedule or a finished program is
    invalid.
    """
    plan = plan or ProgramPlan()
    validate(schedule)
    schedule = plan.compute_schedule(schedule)
    lowered = lower(schedule, recv_lookahead=plan.recv_lookahead)
    for _, run in PASSES:
        lowered = run(lowered, plan)
    validate_program(lowered, plan)
    return lowered


def build_program(schedule: Schedule, rank: int, plan: ProgramPlan | None = None) -> Program:
    """Rank ``rank``'s finished program (the passes need every rank's, so all are built)."""
    if not 0 <= rank < schedule.num_devices:
        raise ValueError(f"rank {rank} is not in [0, {schedule.num_devices})")
    return build_programs(schedule, plan).programs[rank]


def format_programs(lowered: LoweredSchedule, rank: int | None = None) -> str:
    """The programs as text: a header per rank, one numbered instruction per line."""
    ranks = range(len(lowered.programs)) if rank is None else (rank,)
    lines = []
    for d in ranks:
        prog = lowered.programs[d]
        stages = ", ".join(map(str, lowered.schedule.stages_of_device[d]))
        lines.append(f"rank {d} (stages {stages}): {len(prog)} instructions")
        width = len(str(len(prog) - 1))
        lines += [f"  {i:>{width}}  {ins}" for i, ins in enumerate(prog)]
    return "\n".join(lines)
