"""The overlap pass: each overlapped F&B pair of the schedule becomes one instruction.

A schedule's :attr:`~zerobubble.schedule.ir.Schedule.overlaps` pair an F with the
backward that follows it on the same device (DualPipe's ``OVERLAP_F_B``). Lowered,
the two computes lie a few instructions apart: the F's sends, receives for the
backward, the backward's version check. For the two to run at once, the backward's
input must be in hand before the F starts and the F's output leaves after both. So
this pass, the last one, rewrites each pair's stretch of the program as

    receives (posts and waits) between the two, in their order
    Overlap(version check of F, F, version check of B, B)
    the F's sends

Anything else between the two (a replay gate, a gradient reduction, FSDP's
collectives) would have to run in the middle of the pair: that is refused with the
pair and the instruction named. Moving a receive's wait earlier can make a device
wait on a peer that waits on it; the program check that follows the passes
(:func:`~zerobubble.program.check.validate_program`) finds such a cycle.

Pure and torch-free.
"""

from __future__ import annotations

from zerobubble.program.instructions import (
    Compute,
    Instruction,
    LoweredSchedule,
    Overlap,
    PostRecv,
    Send,
    VersionCheck,
    WaitRecv,
)
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action

__all__ = ["insert_overlaps"]


def insert_overlaps(lowered: LoweredSchedule) -> LoweredSchedule:
    """Every rank's program with its schedule's pairs as :class:`Overlap` instructions."""
    pairs = dict(lowered.schedule.overlaps)
    if not pairs:
        return lowered
    return lowered.with_programs(
        _overlap(list(prog), pairs, lowered.schedule.name, d)
        for d, prog in enumerate(lowered.programs)
    )


def _overlap(
    prog: list[Instruction], pairs: dict[Action, Action], name: str, d: int
) -> list[Instruction]:
    out: list[Instruction] = []
    i = 0
    while i < len(prog):
        ins = prog[i]
        if not (isinstance(ins, Compute) and ins.action in pairs):
            out.append(ins)
            i += 1
            continue
        f, b = ins.action, pairs[ins.action]
        parts: list[VersionCheck | Compute] = [ins]
        check = out[-1] if out else None
        if isinstance(check, VersionCheck) and check.action == f:
            parts.insert(0, check)
            out.pop()
        before: list[Instruction] = []
        after: list[Instruction] = []
        j = i + 1
        while not (isinstance(prog[j], Compute) and prog[j].action == b):  # type: ignore[union-attr]
            mid = prog[j]
            if isinstance(mid, PostRecv | WaitRecv):
                before.append(mid)
            elif isinstance(mid, Send):
                after.append(mid)
            elif isinstance(mid, VersionCheck) and mid.action == b:
                parts.append(mid)
            else:
                raise ScheduleError(
                    Reason.OVERLAP,
                    f"schedule {name!r}: the overlapped pair {f} & {b} on device {d} has "
                    f"'{mid}' between its two halves, which cannot run inside the pair; "
                    "drop this pair from the schedule's overlaps (or the option that "
                    "inserts that instruction)",
                    device=d,
                    action=f,
                )
            j += 1
        parts.append(prog[j])  # type: ignore[arg-type]  # the backward's Compute
        out += [*before, Overlap(tuple(parts)), *after]
        i = j + 1
    return out
