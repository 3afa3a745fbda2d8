"""Schedule-to-schedule passes that keep a schedule's meaning and timing.

Pure functions on the torch-free IR; the runtime applies them before lowering.
"""

from __future__ import annotations

from zerobubble.schedule.deps import produces
from zerobubble.schedule.ir import Action, Op, Schedule

__all__ = ["fuse_local_backward", "fusible_backward"]


def fusible_backward(schedule: Schedule, device: int, index: int) -> bool:
    """Whether action ``index`` of ``device`` is a B that :func:`fuse_local_backward` merges.

    That is a B(s, j) directly followed on its device by W(s, j), where nobody on
    another device waits for B's result: every stage that consumes what B
    produces (:func:`~zerobubble.schedule.deps.produces`) lives on this device.
    For B that is s itself (what W reads) and s - 1 (the input gradient; none on
    the first stage).
    """
    acts = schedule.actions[device]
    a = acts[index]
    if a.op is not Op.B or index + 1 >= len(acts):
        return False
    if acts[index + 1] != Action(Op.W, a.stage, a.mb):
        return False
    made = produces(a.op, a.stage, a.mb, schedule.num_stages)
    return all(schedule.placement[k.consumer_stage] == device for k in made)


def fuse_local_backward(schedule: Schedule) -> Schedule:
    """Merge every B immediately followed by its own W into one BW where that delays no one.

    Splitting a backward pays off only when W can wait: B's input gradient is
    then sent upstream at once and W fills a gap later. Where W comes right
    after B anyway and the input gradient has no consumer on another device
    (see :func:`fusible_backward`), the split buys nothing: every device's
    order and every cross-device dependency stay the same, and a runtime runs
    one ordinary backward instead of B, which keeps W's operands alive, and
    W, which reads them back. ZB-H1 and ZB-H2 fuse all of stage 0; the V
    shapes fuse stage 0 and the stage that hands over to it on the same
    device. Returns ``schedule`` itself when nothing is fusible.
    """
    out: list[tuple[Action, ...]] = []
    merged: dict[Action, Action] = {}  # B -> its BW
    for d, acts in enumerate(schedule.actions):
        fused: list[Action] = []
        skip = False
        for i, a in enumerate(acts):
            if skip:
                skip = False
                continue
            if fusible_backward(schedule, d, i):
                merged[a] = Action(Op.BW, a.stage, a.mb)
                fused.append(merged[a])
                skip = True
            else:
                fused.append(a)
        out.append(tuple(fused))
    if not merged:
        return schedule
    pairs = tuple((f, merged.get(b, b)) for f, b in schedule.overlaps)  # an F&B keeps its B
    return schedule.with_actions(out, overlaps=pairs)
