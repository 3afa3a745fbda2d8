"""One builder for every rank's program: the passes, in one ordered list, then one check.

``build_programs(schedule, plan)`` is the only place programs are made:

1. the compute schedule is validated
   (:func:`~zerobubble.schedule.validate.validate`);
2. ``fuse``: B immediately followed by its own W becomes BW where no one waits
   for the B (:func:`~zerobubble.schedule.passes.fuse_local_backward`);
3. ``lower``: cross-device dependencies become sends and receives
   (:func:`~zerobubble.program.lowering.lower`);
4. then the program passes of :data:`PASSES`, each a function from programs to
   programs: the gradient reduction over data-parallel replicas, or FSDP's
   unshard and reduce-scatter; the optimizer's protocol (version checks, the
   replay gate); last, each overlapped F&B pair becomes one instruction
   (:func:`~zerobubble.program.passes.overlap.insert_overlaps`);
5. the finished programs are validated as they will run, every kind included
   (:func:`~zerobubble.program.check.validate_program`).

Nothing is inserted anywhere else: the executor runs what this returns. This
module is pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Callable

from zerobubble.program.check import validate_program
from zerobubble.program.instructions import LoweredSchedule, Program
from zerobubble.program.lowering import lower
from zerobubble.program.passes.grad_sync import insert_grad_reduce
from zerobubble.program.passes.overlap import insert_overlaps
from zerobubble.program.passes.protocol import insert_protocol
from zerobubble.program.passes.sharding import shard_programs
from zerobubble.program.plan import ProgramPlan
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.validate import validate

__all__ = ["PASSES", "build_program", "build_programs", "format_programs"]


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
