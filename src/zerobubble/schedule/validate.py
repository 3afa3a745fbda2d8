"""Static validation of a schedule.

Checks run from the cheapest and most specific to the most global, so the
error names the most precise cause: ranges, placement, duplicates, B/BW
conflicts, completeness, same-device order, cross-device deadlock, memory.
"""

from __future__ import annotations

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action, Op, Schedule, backward_ops, dependencies
from zerobubble.schedule.simulate import SimResult, simulate


def validate(
    schedule: Schedule,
    mem_limit: Number | None = None,
    costs: CostModel | None = None,
) -> SimResult:
    """Raise :class:`ScheduleError` if ``schedule`` cannot run; else return its simulation.

    Args:
        schedule: The schedule to check.
        mem_limit: Optional per-device activation-memory limit, in the units of
            ``costs`` (M_B of a whole device with the default costs).
        costs: Cost model for timing and memory (uniform F=B=W=1 by default).
    """
    check_structure(schedule)
    result = simulate(schedule, costs)  # raises DEADLOCK
    if mem_limit is not None:
        check_memory(result, mem_limit)
    return result


def check_structure(schedule: Schedule) -> None:
    """Every check that needs no timing: ranges, placement, completeness, local order."""
    S, M = schedule.num_stages, schedule.num_microbatches
    seen: dict[Action, tuple[int, int]] = {}
    for d, i, a in schedule:
        if not isinstance(a, Action) or not isinstance(a.op, Op):
            raise ScheduleError(
                Reason.OUT_OF_RANGE, f"{a!r} is not an Action", device=d, position=i
            )
        if not 0 <= a.stage < S:
            raise ScheduleError(
                Reason.OUT_OF_RANGE,
                f"stage {a.stage} is outside [0, {S})",
                device=d,
                position=i,
                action=a,
            )
        if not 0 <= a.mb < M:
            raise ScheduleError(
                Reason.OUT_OF_RANGE,
                f"microbatch {a.mb} is outside [0, {M})",
                device=d,
                position=i,
                action=a,
            )
        if schedule.placement[a.stage] != d:
            raise ScheduleError(
                Reason.WRONG_DEVICE,
                f"stage {a.stage} is placed on device {schedule.placement[a.stage]}, not {d}",
                device=d,
                position=i,
                action=a,
            )
        if a in seen:
            fd, fi = seen[a]
            raise ScheduleError(
                Reason.DUPLICATE,
                f"already scheduled at device {fd} position {fi}",
                device=d,
                position=i,
                action=a,
            )
        seen[a] = (d, i)

    # B/BW conflicts and the W that needs a B.
    for d, i, a in schedule:
        s, j = a.stage, a.mb
        if a.op is Op.BW and Action(Op.B, s, j) in seen:
            fd, fi = seen[Action(Op.B, s, j)]
            raise ScheduleError(
                Reason.CONFLICT,
                f"stage {s} microbatch {j} also has a split B at device {fd} position {fi}; "
                "use either BW or B+W",
                device=d,
                position=i,
                action=a,
            )
        if a.op is Op.W and Action(Op.B, s, j) not in seen:
            raise ScheduleError(
                Reason.MISSING,
                f"W without its B: stage {s} microbatch {j} has no B"
                + (
                    " (it uses BW, which already computes the weight gradient)"
                    if Action(Op.BW, s, j) in seen
                    else ""
                ),
                device=d,
                position=i,
                action=a,
            )
        if a.op is Op.B and Action(Op.W, s, j) not in seen:
            raise ScheduleError(
                Reason.MISSING,
                f"B without its W: stage {s} microbatch {j} never computes its weight gradient",
                device=d,
                position=i,
                action=a,
            )

    for s in range(S):
        for j in range(M):
            if Action(Op.F, s, j) not in seen:
                raise ScheduleError(
                    Reason.MISSING,
                    f"stage {s} microbatch {j} has no F (expected on device "
                    f"{schedule.placement[s]})",
                )
            if Action(Op.B, s, j) not in seen and Action(Op.BW, s, j) not in seen:
                raise ScheduleError(
                    Reason.MISSING,
                    f"stage {s} microbatch {j} has no backward (B+W or BW) (expected on device "
                    f"{schedule.placement[s]})",
                )

    bw = backward_ops(schedule)
    for d, i, a in schedule:
        for dep in dependencies(a, S, bw):
            dd, di = seen[dep]
            if dd == d and di > i:
                raise ScheduleError(
                    Reason.LOCAL_ORDER,
                    f"it depends on {dep}, which comes later on the same device "
                    f"(position {di}); move it after position {di}",
                    device=d,
                    position=i,
                    action=a,
                )


def check_memory(result: SimResult, mem_limit: Number) -> None:
    """Raise if any device's activation memory exceeds ``mem_limit``."""
    eps = 1e-9 * max(1.0, abs(float(mem_limit)))
    for d, curve in enumerate(result.memory):
        for i, level in enumerate(curve):
            if level > mem_limit + eps:
                raise ScheduleError(
                    Reason.MEMORY,
                    f"activation memory reaches {float(level):g} > limit {float(mem_limit):g} "
                    f"(device peak {float(result.peak_memory[d]):g}); raise the limit or pick a "
                    "schedule with fewer microbatches in flight",
                    device=d,
                    position=i,
                    action=result.schedule.actions[d][i],
                )
