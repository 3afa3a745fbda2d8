"""Discrete-event simulation of a schedule under a cost model.

Each device runs its actions in list order, one at a time, never pre-empted.
An action starts when its device is free and every dependency has finished
(plus ``comm`` when the dependency ran on another device). An action's
duration includes its host tail (``CostModel.host_*``: recording it, sending
its output, posting receives), which keeps its device busy; its message leaves
when its compute ends, so a consumer on another device may start ``comm``
after the end minus the host tail. The graph of
"previous action on my device" and dependency edges is processed in
topological order, so the simulation is O(actions) and also proves the
schedule is realizable: a cycle is reported as a deadlock.

Definitions (the Zero Bubble paper's):

* span of a device: end of its last action minus start of its first;
* cost: the longest span; makespan: the last end over all devices;
* bubble rate: (cost - ideal) / cost, with ideal the largest per-device busy
  time (M(F+B+W) for uniform costs).

Data-parallel gradient reduction (``CostModel.reduce``, 0 by default): the
all-reduce of stage s's gradients starts when its device finished the stage's
last W or BW of the step and the device's previous reduction (one comm lane per
device, reductions in launch order), and takes ``reduce[s]``; it occupies no
compute, so it overlaps with the device's remaining actions. Its *exposed* part
is what outlasts the device's last action: the step's optimizer tail waits for
it (:attr:`SimResult.exposed_reduce`, :attr:`SimResult.step_time`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from operator import itemgetter, sub

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.graph import Graph, build_graph
from zerobubble.schedule.ir import Action, Op, Schedule

_op_stage = itemgetter(0, 1)  # (op, stage) of an Action


@dataclass(frozen=True)
class SimResult:
    """Timing and memory of every action of a simulated schedule.

    ``start[d][i]`` / ``end[d][i]`` belong to ``schedule.actions[d][i]``;
    ``memory[d][i]`` is device d's activation memory right after that action.
    """

    schedule: Schedule
    costs: CostModel
    start: tuple[tuple[Number, ...], ...]
    end: tuple[tuple[Number, ...], ...]
    memory: tuple[tuple[Number, ...], ...]

    @cached_property
    def busy(self) -> tuple[Number, ...]:
        """Compute time of each device."""
        return tuple(sum(map(sub, en, st), 0) for st, en in zip(self.start, self.end, strict=True))

    @cached_property
    def host(self) -> tuple[Number, ...]:
        """Per device: the host part of its actions' durations (``CostModel.host_*``):
        what a measured trace shows as idle "overhead", not as compute."""
        c = self.costs
        return tuple(
            sum((c.host_time(a.op, a.stage) for a in acts), 0) for acts in self.schedule.actions
        )

    @cached_property
    def overhead(self) -> tuple[Number, ...]:
        """Per device: the host time that delayed its actions, as a measured trace's
        idle breakdown counts "overhead" (:mod:`zerobubble.profile.bubbles`): of the
        previous action's host tail, the part after the next action's inputs were ready.
        Host time spent while an input was still on its way is dependency or comm there."""
        g = build_graph(self.schedule)
        c = self.costs
        start = [t for row in self.start for t in row]
        end = [t for row in self.end for t in row]
        out = []
        for d in range(len(g.offsets) - 1):
            total: Number = 0
            for i in range(g.offsets[d] + 1, g.offsets[d + 1]):
                ready: Number = 0
                for x in g.preds[i]:
                    r = (
                        end[x] + c.hop(g.flat[x].op, g.flat[x].stage)
                        if g.device[x] != d
                        else end[x]
                    )
                    ready = max(ready, r)
                prev = g.flat[i - 1]
                tail = c.host_time(prev.op, prev.stage)
                total += min(max(end[i - 1] - ready, 0), tail) if start[i] >= ready else 0
            out.append(total)
        return tuple(out)

    @cached_property
    def exposed_a2a(self) -> tuple[Number, ...]:
        """Per device: the all-to-all time its actions wait for (``CostModel.a2a``): all of
        a lone F's or backward's, and of an overlapped pair what outlasts its compute."""
        c, sched = self.costs, self.schedule

        def exposed(a: Action, b: Action | None) -> Number:
            return _a2a(c, sched, a) if b is None else _block(c, sched, a, b)[1]

        return tuple(
            sum((exposed(a, b) for a, b in sched.blocks(d)), 0) for d in range(sched.num_devices)
        )

    @cached_property
    def span(self) -> tuple[Number, ...]:
        """Per device: last end minus first start (0 for an idle device)."""
        return tuple(
            (en[-1] - st[0]) if st else 0 for st, en in zip(self.start, self.end, strict=True)
        )

    @property
    def cost(self) -> Number:
        """The longest per-device span (the ZB paper's schedule cost)."""
        return max(self.span)

    @property
    def makespan(self) -> Number:
        return max((en[-1] for en in self.end if en), default=0)

    @property
    def ideal(self) -> Number:
        """Largest per-device compute time: the cost of a bubble-free schedule."""
        return max(self.busy)

    @property
    def bubble_time(self) -> Number:
        return self.cost - self.ideal

    @property
    def bubble_rate(self) -> float:
        return float(self.bubble_time / self.cost) if self.cost else 0.0

    @property
    def bubble_rate_makespan(self) -> float:
        return float((self.makespan - self.ideal) / self.makespan) if self.makespan else 0.0

    @cached_property
    def reductions(self) -> tuple[tuple[tuple[int, Number, Number], ...], ...]:
        """Per device, its stages' gradient reductions as ``(stage, start, end)``, in launch
        order (see the module docstring); empty where every ``reduce`` cost is 0."""
        if not any(self.costs.reduce):
            return tuple(() for _ in self.schedule.actions)
        out = []
        for acts, en in zip(self.schedule.actions, self.end, strict=True):
            last: dict[int, Number] = {}
            for a, t in zip(acts, en, strict=True):
                if a.op.adds_weight_grad:
                    last[a.stage] = t
            lane: Number = 0
            row = []
            for stage, t in sorted(last.items(), key=lambda kv: (kv[1], kv[0])):
                begin = max(t, lane)
                lane = begin + self.costs.reduce[stage]
                row.append((stage, begin, lane))
            out.append(tuple(row))
        return tuple(out)

    @cached_property
    def exposed_reduce(self) -> tuple[Number, ...]:
        """Per device: how long its last reduction outlasts its last action (0 if not)."""
        return tuple(
            max(0, red[-1][2] - en[-1]) if red and en else 0
            for red, en in zip(self.reductions, self.end, strict=True)
        )

    @property
    def step_time(self) -> Number:
        """The makespan including the reductions' exposed part (the optimizer waits for it)."""
        return max(
            (
                max(en[-1], red[-1][2] if red else 0)
                for en, red in zip(self.end, self.reductions, strict=True)
                if en
            ),
            default=0,
        )

    @cached_property
    def peak_memory(self) -> tuple[Number, ...]:
        return tuple(max(m, default=0) if m else 0 for m in self.memory)

    @cached_property
    def idle(self) -> tuple[tuple[tuple[Number, Number], ...], ...]:
        """Gaps between consecutive actions of each device (inside its span)."""
        gaps = []
        for st, en in zip(self.start, self.end, strict=True):
            gaps.append(tuple((en[i], st[i + 1]) for i in range(len(st) - 1) if st[i + 1] > en[i]))
        return tuple(gaps)

    def summary(self) -> dict[str, object]:
        """JSON-friendly figures."""
        return {
            "name": self.schedule.name,
            "num_devices": self.schedule.num_devices,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "cost": float(self.cost),
            "makespan": float(self.makespan),
            "ideal": float(self.ideal),
            "bubble_time": float(self.bubble_time),
            "bubble_rate": self.bubble_rate,
            "bubble_rate_makespan": self.bubble_rate_makespan,
            "span": [float(x) for x in self.span],
            "peak_memory": [float(x) for x in self.peak_memory],
            "max_peak_memory": float(max(self.peak_memory)),
            **(
                {
                    "exposed_reduce": [float(x) for x in self.exposed_reduce],
                    "step_time": float(self.step_time),
                }
                if any(self.costs.reduce)
                else {}
            ),
        }


def simulate(
    schedule: Schedule, costs: CostModel | None = None, *, graph: Graph | None = None
) -> SimResult:
    """Simulate ``schedule``; raises :class:`ScheduleError` if it deadlocks.

    The schedule is assumed structurally valid (see ``validate``); missing
    dependencies are treated as satisfied so that partial schedules can be
    timed while they are being built. ``graph`` lets a caller that already
    indexed the schedule skip that work.
    """
    if costs is None:
        costs = CostModel.from_device_totals(schedule.placement, segments=schedule.segments)
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"cost model has {costs.num_stages} stages, schedule has {schedule.num_stages}"
        )
    graph = graph if graph is not None else build_graph(schedule)
    start, end = _times(schedule, costs, graph)
    memory = _memory(schedule, costs)
    return SimResult(schedule, costs, start, end, memory)


def _times(
    schedule: Schedule, costs: CostModel, graph: Graph
) -> tuple[tuple[tuple[Number, ...], ...], tuple[tuple[Number, ...], ...]]:
    """Run every device as far as its dependencies allow; a blocked device waits on one action.

    Each action is timed once and each block parks its device on the awaited
    action, so this is O(actions) without building a successor list.
    """
    flat, device, offsets = graph.flat, graph.device, graph.offsets
    dep1, dep2, dep3 = graph.deps
    n = len(flat)
    table = {(op, st): costs.duration(op, st) for op in Op for st in range(costs.num_stages)}
    dur = list(map(table.__getitem__, map(_op_stage, flat)))
    if schedule.segments > 1:
        k, (scale, _) = schedule.segments, costs.segment_scales(schedule.segments)
        tail = {key: costs.host_time(*key) for key in table}
        dur = [
            tail[key] + (t - tail[key]) * scale[a.mb % k]  # the host tail is per action
            for t, a, key in zip(dur, flat, map(_op_stage, flat), strict=True)
        ]
    hops = {(op, st): costs.hop(op, st) for op, st in table}
    leave = list(map(hops.__getitem__, map(_op_stage, flat)))
    deps: list[tuple[int, ...]] = list(zip(dep1, dep2, dep3, strict=True))
    for g, h in _pairs(schedule, graph):  # an overlapped pair is one block, timed on its F:
        dur[g], _ = _block(costs, schedule, flat[g], flat[h])
        dur[h] = 0  # its backward ends with it
        deps[g] = tuple(x for x in (*deps[g], *deps[h]) if x != g)  # both inputs first

    start: list[Number] = [0] * n
    end: list[Number] = [0] * n
    done = bytearray(n)
    num_devices = len(offsets) - 1
    head = list(offsets[:-1])  # first action not yet timed
    clock: list[Number] = [0] * num_devices  # end of the last timed action
    parked: dict[int, list[int]] = {}  # action -> devices waiting for it
    runnable = list(range(num_devices - 1, -1, -1))
    while runnable:
        d = runnable.pop()
        g, stop, t_dev = head[d], offsets[d + 1], clock[d]
        while g < stop:
            t, waiting = t_dev, -1
            for x in deps[g]:
                if x < 0:
                    continue
                if not done[x]:
                    waiting = x
                    break
                r = end[x] + leave[x] if device[x] != d else end[x]
                if r > t:
                    t = r
            if waiting >= 0:
                parked.setdefault(waiting, []).append(d)
                break
            start[g] = t
            t_dev = end[g] = t + dur[g]
            done[g] = 1
            if g in parked:
                runnable.extend(parked.pop(g))
            g += 1
        head[d], clock[d] = g, t_dev
    stuck = {d: head[d] - offsets[d] for d in range(num_devices) if head[d] < offsets[d + 1]}
    if stuck:
        raise _deadlock_error(schedule, graph, stuck, deps)
    per_dev_start = tuple(tuple(start[offsets[d] : offsets[d + 1]]) for d in range(num_devices))
    per_dev_end = tuple(tuple(end[offsets[d] : offsets[d + 1]]) for d in range(num_devices))
    return per_dev_start, per_dev_end


def _scale(costs: CostModel, schedule: Schedule, a: Action) -> Number | None:
    """The time factor of ``a``'s segment (:attr:`CostModel.segment_time`); None without
    segments (the durations are the model's own)."""
    k = schedule.segments
    return None if k == 1 else costs.segment_scales(k)[0][a.mb % k]


def _a2a(costs: CostModel, schedule: Schedule, a: Action) -> Number:
    """The all-to-all time of unit ``a`` (scaled by its segment, as its compute is)."""
    x, scale = costs.a2a_time(a.op, a.stage), _scale(costs, schedule, a)
    return x if scale is None else x * scale


def _block(costs: CostModel, schedule: Schedule, f: Action, b: Action) -> tuple[Number, Number]:
    """An overlapped pair's duration and exposed all-to-all
    (:meth:`CostModel.overlapped`), each half's compute and all-to-all scaled by its
    segment (the halves may be units of different segments)."""
    if schedule.segments == 1:
        return costs.overlapped(f.stage, b.op, b.stage)

    def duration(a: Action) -> Number:  # as _times scales a lone unit
        t, tail = costs.duration(a.op, a.stage), costs.host_time(a.op, a.stage)
        return tail + (t - tail) * costs.segment_scales(schedule.segments)[0][a.mb % k]

    k = schedule.segments
    comm = _a2a(costs, schedule, f) + _a2a(costs, schedule, b)
    compute = duration(f) + duration(b) - comm
    return max(compute, comm), max(comm - compute, 0)


def _pairs(schedule: Schedule, graph: Graph) -> list[tuple[int, int]]:
    """The flat indices ``(F, its partner)`` of the schedule's overlapped pairs."""
    return [(graph.index[f], graph.index[b]) for f, b in schedule.overlaps]


def _deadlock_error(
    schedule: Schedule, graph: Graph, head: dict[int, int], deps: list[tuple[int, ...]]
) -> ScheduleError:
    """Describe the wait-for cycle among the stuck device heads.

    ``head[d]`` is the first position device d could not run (everything before it ran);
    ``deps[g]`` what action ``g`` waited for (an overlapped pair's F: both its inputs).
    """
    acts = schedule.actions
    partner = schedule.overlap_partner()

    def blocker(d: int) -> tuple[int, int]:
        for x in deps[graph.offsets[d] + head[d]]:
            if x < 0:
                continue
            dd, ii = graph.location(x)
            if ii >= head.get(dd, len(acts[dd])):
                return dd, ii
        raise AssertionError("stuck head without a stuck dependency")  # pragma: no cover

    d = min(head)
    seen: list[int] = []
    while d not in seen:
        seen.append(d)
        d = blocker(d)[0]
    cycle = seen[seen.index(d) :]
    steps = []
    for c in cycle:
        bd, bi = blocker(c)
        a = acts[c][head[c]]
        block = f"{a}, overlapped with {partner[a]}" if a in partner else str(a)
        steps.append(
            f"device {c} at position {head[c]} ({block}) waits for "
            f"{acts[bd][bi]} at device {bd} position {bi}"
        )
    first = min(cycle)
    return ScheduleError(
        Reason.DEADLOCK,
        "no execution order exists: " + "; ".join(steps) + ". Reorder one of these devices "
        "so that the awaited action comes first"
        + (" (or run the overlapped pair in sequence)." if "overlapped" in "".join(steps) else "."),
        device=first,
        position=head[first],
        action=acts[first][head[first]],
    )


def _memory(schedule: Schedule, costs: CostModel) -> tuple[tuple[Number, ...], ...]:
    if schedule.segments > 1:
        k = schedule.segments
        units = {
            (op, s, g): costs.unit_memory_delta(op, s, g, k)
            for op in Op
            for s in range(costs.num_stages)
            for g in range(k)
        }
        return tuple(
            tuple(accumulate((units[a.op, a.stage, a.mb % k] for a in lst), initial=0))[1:]
            for lst in schedule.actions
        )
    table = {(op, s): costs.memory_delta(op, s) for op in Op for s in range(costs.num_stages)}
    get = table.__getitem__
    return tuple(
        tuple(accumulate(map(get, map(_op_stage, lst)), initial=0))[1:] for lst in schedule.actions
    )
