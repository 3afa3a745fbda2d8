"""Schedule-to-schedule passes that keep a schedule's meaning and timing.

Pure functions on the torch-free IR; the runtime applies them before lowering.
"""

from __future__ import annotations

import math

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.deps import backward_ops, dependencies, pair_conflict, produces
from zerobubble.schedule.errors import ScheduleError
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.simulate import simulate

__all__ = ["fuse_local_backward", "fusible_backward", "overlap_where_it_pays"]


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


def overlap_where_it_pays(
    schedule: Schedule, costs: CostModel | None = None, mem_limit: float | None = None
) -> Schedule:
    """``schedule`` with overlapped F&B pairs (:attr:`Schedule.overlaps`) added where they pay
    under ``costs`` (uniform without all-to-all by default: then none does).

    A pair is an F and a backward (B or BW) of *another stage* on its device
    (:func:`~zerobubble.schedule.deps.pair_conflict`: two actions of one stage would share
    its module and store across threads), the backward right after the F. For each F, in
    device order, two candidates: the nearest backward of another stage after it, moved up
    to follow it, and the nearest before it, which the F is moved up to precede; only W
    actions may lie in between (moving a backward ahead of W, or an F ahead of one
    backward and W, changes no data a third action waits for). A candidate is kept when
    it hides some all-to-all (``CostModel.a2a``), the schedule still runs (a pair waits
    for both inputs, which can close a cycle), the simulated makespan does not grow and
    the peak memory stays within ``mem_limit`` (None: any; an F moved up holds its
    activation earlier, e.g. zbv's peak grows by half a microbatch's, to dualpipev's); of
    the two, the shorter. The
    schedule's own pairs stay. One simulation per candidate: quadratic in the actions,
    meant for schedules of a few thousand.
    """
    first = simulate(schedule, costs)
    model, best = first.costs, first.makespan
    limit = math.inf if mem_limit is None else mem_limit
    ops = backward_ops(schedule)
    kept = list(schedule.overlaps)
    used = {a for pair in kept for a in pair}
    rows = [list(acts) for acts in schedule.actions]
    for d in range(schedule.num_devices):
        for f in [a for a in rows[d] if a.op is Op.F and a not in used]:
            trials = []
            for order, b in _pair_moves(rows[d], rows[d].index(f), used):
                if not model.a2a_time(Op.F, f.stage) + model.a2a_time(b.op, b.stage):
                    continue
                if f in dependencies(b, schedule.num_stages, ops, schedule.segments):
                    continue
                moved = [*rows[:d], order, *rows[d + 1 :]]
                trial = schedule.with_actions(moved, overlaps=(*kept, (f, b)))
                try:
                    result = simulate(trial, model)
                except ScheduleError:  # the pair's wait closes a cycle
                    continue
                if result.makespan <= best and max(result.peak_memory) <= limit:
                    trials.append((result.makespan, order, b))
            if trials:
                best, order, b = min(trials, key=lambda t: t[0])
                rows[d] = order
                kept.append((f, b))
                used.update((f, b))
    return schedule.with_actions(rows, overlaps=kept)


def _pair_moves(acts: list[Action], i: int, used: set[Action]) -> list[tuple[list[Action], Action]]:
    """The device order with F ``acts[i]`` directly followed by a backward of another stage
    (:func:`overlap_where_it_pays`'s two candidates), and that backward."""
    f = acts[i]
    out: list[tuple[list[Action], Action]] = []
    j = i + 1
    while j < len(acts) and acts[j].op is Op.W:
        j += 1
    if (
        j < len(acts)
        and acts[j].op.is_backward
        and acts[j] not in used
        and pair_conflict(f, acts[j]) is None
    ):
        out.append(([*acts[: i + 1], acts[j], *acts[i + 1 : j], *acts[j + 1 :]], acts[j]))
    j = i - 1
    while j >= 0 and acts[j].op is Op.W:
        j -= 1
    if (
        j >= 0
        and acts[j].op.is_backward
        and acts[j] not in used
        and pair_conflict(f, acts[j]) is None
    ):
        out.append(([*acts[:j], f, *acts[j:i], *acts[i + 1 :]], acts[j]))
    return out
