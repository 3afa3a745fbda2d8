"""Discrete-event simulation of a schedule under a cost model.

Each device runs its actions in list order, one at a time, never pre-empted.
An action starts when its device is free and every dependency has finished
(plus ``comm`` when the dependency ran on another device). The graph of
"previous action on my device" and dependency edges is processed in
topological order, so the simulation is O(actions) and also proves the
schedule is realizable: a cycle is reported as a deadlock.

Definitions (the Zero Bubble paper's):

* span of a device: end of its last action minus start of its first;
* cost: the longest span; makespan: the last end over all devices;
* bubble rate: (cost - ideal) / cost, with ideal the largest per-device busy
  time (M(F+B+W) for uniform costs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action, Schedule, backward_ops, dependencies


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
        return tuple(
            sum((e - s for s, e in zip(st, en, strict=True)), 0)
            for st, en in zip(self.start, self.end, strict=True)
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
        }


def simulate(schedule: Schedule, costs: CostModel | None = None) -> SimResult:
    """Simulate ``schedule``; raises :class:`ScheduleError` if it deadlocks.

    The schedule is assumed structurally valid (see ``validate``); missing
    dependencies are treated as satisfied so that partial schedules can be
    timed while they are being built.
    """
    if costs is None:
        costs = CostModel.from_device_totals(schedule.placement)
    if costs.num_stages != schedule.num_stages:
        raise ValueError(
            f"cost model has {costs.num_stages} stages, schedule has {schedule.num_stages}"
        )
    start, end = _times(schedule, costs)
    memory = _memory(schedule, costs)
    return SimResult(schedule, costs, start, end, memory)


def _times(
    schedule: Schedule, costs: CostModel
) -> tuple[tuple[tuple[Number, ...], ...], tuple[tuple[Number, ...], ...]]:
    acts = schedule.actions
    where: dict[Action, tuple[int, int]] = {}
    for d, lst in enumerate(acts):
        for i, a in enumerate(lst):
            where.setdefault(a, (d, i))
    bw = backward_ops(schedule)
    nstages = schedule.num_stages
    comm = costs.comm
    dur = costs.duration

    # waiting[d][i]: unfinished predecessors (device order + dependencies present in schedule).
    deps_of: list[list[tuple[tuple[int, int], ...]]] = []
    waiting: list[list[int]] = []
    dependents: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for d, lst in enumerate(acts):
        dl, wl = [], []
        for i, a in enumerate(lst):
            locs = tuple(where[x] for x in dependencies(a, nstages, bw) if x in where)
            dl.append(locs)
            wl.append(len(locs) + (1 if i else 0))
            for loc in locs:
                dependents.setdefault(loc, []).append((d, i))
        deps_of.append(dl)
        waiting.append(wl)

    start: list[list[Number]] = [[0] * len(lst) for lst in acts]
    end: list[list[Number]] = [[0] * len(lst) for lst in acts]
    done = 0
    ready = [(d, 0) for d, lst in enumerate(acts) if lst and waiting[d][0] == 0]
    while ready:
        d, i = ready.pop()
        a = acts[d][i]
        t = end[d][i - 1] if i else 0
        for dd, ii in deps_of[d][i]:
            ready_at = end[dd][ii] + (comm if dd != d else 0)
            if ready_at > t:
                t = ready_at
        start[d][i] = t
        end[d][i] = t + dur(a.op, a.stage)
        done += 1
        for nd, ni in dependents.get((d, i), ()):
            waiting[nd][ni] -= 1
            if waiting[nd][ni] == 0:
                ready.append((nd, ni))
        if i + 1 < len(acts[d]):
            waiting[d][i + 1] -= 1
            if waiting[d][i + 1] == 0:
                ready.append((d, i + 1))
    if done != len(schedule):
        raise _deadlock_error(schedule, waiting, deps_of)
    return tuple(map(tuple, start)), tuple(map(tuple, end))


def _deadlock_error(
    schedule: Schedule,
    waiting: list[list[int]],
    deps_of: list[list[tuple[tuple[int, int], ...]]],
) -> ScheduleError:
    """Describe the wait-for cycle among the stuck device heads."""
    acts = schedule.actions
    # The first unfinished position of each device: everything before it ran.
    head: dict[int, int] = {}
    for d, wl in enumerate(waiting):
        for i, n in enumerate(wl):
            if n > 0:
                head[d] = i
                break

    def blocker(d: int) -> tuple[int, int]:
        i = head[d]
        for dd, ii in deps_of[d][i]:
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
        steps.append(
            f"device {c} at position {head[c]} ({acts[c][head[c]]}) waits for "
            f"{acts[bd][bi]} at device {bd} position {bi}"
        )
    first = min(cycle)
    return ScheduleError(
        Reason.DEADLOCK,
        "no execution order exists: " + "; ".join(steps) + ". Reorder one of these devices "
        "so that the awaited action comes first.",
        device=first,
        position=head[first],
        action=acts[first][head[first]],
    )


def _memory(schedule: Schedule, costs: CostModel) -> tuple[tuple[Number, ...], ...]:
    out = []
    delta = costs.memory_delta
    for lst in schedule.actions:
        level: Number = 0
        curve = []
        for a in lst:
            level = level + delta(a.op, a.stage)
            curve.append(level)
        out.append(tuple(curve))
    return tuple(out)


def device_peak(schedule: Schedule, costs: CostModel) -> Sequence[Number]:
    """Peak activation memory per device (no timing needed: it is order-only)."""
    return tuple(max(c, default=0) for c in _memory(schedule, costs))
