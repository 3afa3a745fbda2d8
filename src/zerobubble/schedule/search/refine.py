"""Local search that polishes a schedule's per-device orders.

The heuristic applies one policy to every device and every moment; on small
instances the best order often differs from it in a few places. This pass
moves one action at a time to a nearby position on its device (up to
``window`` places), keeps a move if it lowers the cost (ties broken by the sum
of device spans, which rewards progress off the critical device), and stops
when no move helps or after ``max_steps`` simulated actions over all trials
(a count, not a clock, so the result is deterministic). Moves never cross an action's
same-device predecessors or successors, never exceed the memory limit, and a
move that deadlocks is rejected by the simulation.
"""

from __future__ import annotations

import random
import time
from bisect import bisect_left
from collections.abc import Sequence
from functools import cached_property
from itertools import accumulate

import numpy as np
import numpy.typing as npt

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.search.graph import ActionGraph, durations, memory_deltas

_EPS = 1e-9
#: Orders at least this long are checked against the memory limit with numpy.
FITS_BY_ARRAY = 512


class Timing:
    """Start and end of every action of one set of orders (indexed by action)."""

    def __init__(
        self,
        orders: list[list[int]],
        start: list[float],
        end: list[float],
        first: list[float],
        spans: list[float],
        work: int,
    ) -> None:
        self.orders = orders  # the inner lists are never modified in place
        self.start = start
        self.end = end
        self.first = first
        self.spans = spans
        self.work = work  # actions simulated to get here (incremental runs: the suffix)
        self._starts: dict[int, list[float]] = {}

    def starts(self, device: int) -> list[float]:
        """Start times of ``device``'s actions in its order (non-decreasing)."""
        if device not in self._starts:
            self._starts[device] = [self.start[a] for a in self.orders[device]]
        return self._starts[device]


class Evaluator:
    """Fast simulation of per-device orders of ActionGraph indices."""

    def __init__(self, graph: ActionGraph, costs: CostModel) -> None:
        self.graph = graph
        self.num_devices = graph.num_devices
        self.dur = durations(graph, costs)
        self.delta = memory_deltas(graph, costs)
        self.deps = graph.dependencies(costs)

    @cached_property
    def local_pred(self) -> list[set[int]]:
        """Each action's same-device direct predecessors (moves must not cross them)."""
        out: list[set[int]] = [set() for _ in range(len(self.graph))]
        for a, b, cross in self.graph.edges:
            if not cross:
                out[b].add(a)
        return out

    @cached_property
    def local_succ(self) -> list[set[int]]:
        """Each action's same-device direct successors."""
        out: list[set[int]] = [set() for _ in range(len(self.graph))]
        for a, b, cross in self.graph.edges:
            if not cross:
                out[a].add(b)
        return out

    def spans(self, orders: list[list[int]]) -> list[float] | None:
        """Per-device spans of the as-soon-as-possible execution, None on deadlock."""
        timing = self.timing(orders)
        return None if timing is None else timing.spans

    def timing(
        self, orders: list[list[int]], base: Timing | None = None, changed: int = 0, at: int = 0
    ) -> Timing | None:
        """Simulate ``orders``; None on deadlock.

        With ``base`` (the timing of orders that differ only on device ``changed`` from
        position ``at`` on), everything that started before the first changed action
        could start is kept: it cannot depend on the change.
        """
        dur = self.dur
        P = self.num_devices
        if base is None or at == 0:
            end = [-1.0] * len(dur)
            start = [0.0] * len(dur)
            pos = [0] * P
            free = [0.0] * P
            first = [0.0] * P
        else:
            end = base.end.copy()
            start = base.start.copy()
            first = list(base.first)
            horizon = base.end[orders[changed][at - 1]]
            pos = [at if e == changed else bisect_left(base.starts(e), horizon) for e in range(P)]
            free = [end[orders[e][pos[e] - 1]] if pos[e] else 0.0 for e in range(P)]
            for e in range(P):
                for a in orders[e][pos[e] :]:
                    end[a] = -1.0
        work = sum(len(o) - k for o, k in zip(orders, pos, strict=True))
        if not self._advance(orders, pos, free, first, end, start, work):
            return None
        spans = [free[d] - first[d] if orders[d] else 0.0 for d in range(P)]
        return Timing(list(orders), start, end, first, spans, work)

    def cost_within(self, orders: Sequence[Sequence[int]], cutoff: float) -> float | None:
        """The cost of ``orders`` (the largest span), or None on deadlock or as soon as
        some device's span so far plus its work still to run exceeds ``cutoff`` by more
        than rounding could explain: a caller that keeps only what can win skips the
        rest of a hopeless order's simulation (a cost at ``cutoff`` is still returned).
        """
        dur, P = self.dur, self.num_devices
        free, first = [0.0] * P, [0.0] * P
        end, start = [-1.0] * len(dur), [0.0] * len(dur)
        rem = [sum(map(dur.__getitem__, o)) for o in orders]
        bar = (cutoff + _EPS * max(1.0, abs(cutoff)), rem)
        todo = sum(map(len, orders))
        if not self._advance(orders, [0] * P, free, first, end, start, todo, bar=bar):
            return None
        return max(free[d] - first[d] if orders[d] else 0.0 for d in range(P))

    def _advance(
        self,
        orders: Sequence[Sequence[int]],
        pos: list[int],
        free: list[float],
        first: list[float],
        end: list[float],
        start: list[float],
        todo: int,
        *,
        bar: tuple[float, list[float]] | None = None,
    ) -> bool:
        """Run every device from ``pos`` as far as its dependencies allow, until ``todo``
        actions ran (``end`` is -1 for an action not run yet); False on deadlock, or, with
        ``bar = (cutoff, work left per device)``, once a device's span so far plus its
        work left exceeds the cutoff."""
        deps, dur = self.deps, self.dur
        while todo:
            progressed = False
            for d, lst in enumerate(orders):
                i = start_i = pos[d]
                t_free = free[d]
                n = len(lst)
                while i < n:
                    a = lst[i]
                    t = t_free
                    for dep, lat in deps[a]:
                        ready = end[dep]
                        if ready < 0:
                            break
                        ready += lat
                        if ready > t:
                            t = ready
                    else:
                        if i == 0:
                            first[d] = t
                        start[a] = t
                        t_free = end[a] = t + dur[a]
                        i += 1
                        continue
                    break
                if i != start_i:
                    todo -= i - start_i
                    pos[d] = i
                    free[d] = t_free
                    progressed = True
                    if bar is not None:
                        cutoff, rem = bar
                        rem[d] -= sum(map(dur.__getitem__, lst[start_i:i]))
                        if t_free - first[d] + rem[d] > cutoff:
                            return False
            if not progressed:
                return False
        return True

    def fits(self, order: Sequence[int], limit: float) -> bool:
        """Whether the memory level stays within ``limit`` after every action of ``order``.

        A long order (a seed of a large instance holds thousands of actions per device) is
        summed by numpy, in half the time: ``cumsum`` adds one after another in the same
        order, so the levels are the very floats of the plain sum."""
        if len(order) < FITS_BY_ARRAY:
            return not order or max(accumulate(map(self.delta.__getitem__, order))) <= limit
        levels = np.cumsum(self._delta_array[np.fromiter(order, np.intp, len(order))])
        return bool(levels.max() <= limit)

    @cached_property
    def _delta_array(self) -> npt.NDArray[np.float64]:
        return np.array(self.delta, dtype=np.float64)


def _key(timing: Timing, backward: range | None) -> tuple[float, ...]:
    """Cost, then the sum of spans; with ``backward``, the sum of every B's end before
    the sum of spans.

    That order lets the search walk across plateaus: a B moved ahead of the W that
    delayed it changes no cost by itself (the next device's W still blocks the
    chain, and the W moved behind lengthens its device), but such moves on each
    device of the chain in turn shorten the critical backward chain.
    """
    if backward is None:
        return max(timing.spans), sum(timing.spans)
    end = timing.end
    return max(timing.spans), sum(end[i] for i in backward), sum(timing.spans)


def _better(x: tuple[float, ...], y: tuple[float, ...]) -> bool:
    """Lexicographically smaller, each key with a relative tolerance."""
    for a, b in zip(x, y, strict=True):
        tol = _EPS * max(1.0, abs(b))
        if a < b - tol:
            return True
        if a > b + tol:
            return False
    return False


def refine(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    orders: list[list[int]],
    *,
    max_steps: int,
    window: int = 6,
    plateau: bool = False,
    deadline: float | None = None,
) -> tuple[list[list[int]], float, int]:
    """Improve ``orders`` (a valid schedule within ``mem_limit``).

    ``plateau`` also accepts moves that keep cost and spans but end the Bs sooner
    in sum (see ``_key``); past ``deadline`` (a :func:`time.monotonic` time) it stops
    with what it has. Returns the orders, their cost and the simulation steps spent.
    """
    ev = Evaluator(graph, costs)
    orders = [list(o) for o in orders]
    timing = ev.timing(orders)
    if timing is None:
        raise ValueError("refine() needs a schedule that runs; this one deadlocks")
    sm = graph.num_stages * graph.num_microbatches
    backward = range(sm, 2 * sm) if plateau else None
    best = _key(timing, backward)
    limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
    offsets = [s for k in range(1, window + 1) for s in (-k, k)]
    spent = 0
    improved = True
    while improved and spent < max_steps:
        improved = False
        for d in range(ev.num_devices):
            lst = orders[d]
            i = len(lst) - 1
            while i >= 0 and spent < max_steps:
                if deadline is not None and time.monotonic() > deadline:
                    return orders, best[0], spent
                a = lst[i]
                for step in offsets:
                    k = i + step
                    if not 0 <= k < len(lst):
                        continue
                    if step < 0:
                        if not ev.local_pred[a].isdisjoint(lst[k:i]):
                            continue
                        new = [*lst[:k], a, *lst[k:i], *lst[i + 1 :]]
                    else:
                        if not ev.local_succ[a].isdisjoint(lst[i + 1 : k + 1]):
                            continue
                        new = [*lst[:i], *lst[i + 1 : k + 1], a, *lst[k + 1 :]]
                    if not ev.fits(new, limit):
                        continue
                    orders[d] = new
                    trial = ev.timing(orders, timing, d, min(i, k))
                    spent += len(graph) if trial is None else trial.work
                    if trial is not None and _better(key := _key(trial, backward), best):
                        timing, best = trial, key
                        lst = new
                        improved = True
                        break
                    orders[d] = lst
                else:
                    i -= 1
    return orders, best[0], spent


def perturb(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    orders: list[list[int]],
    rng: random.Random,
    moves: int,
    translate: float = 0.0,
) -> list[list[int]] | None:
    """``moves`` random legal single-action moves (a kick out of a local optimum).

    With ``translate`` > 0, that share of the moves are *translated*: the same move made
    for every microbatch of the action's op and stage (each of those actions moved by the
    same number of places, where it can be; a single move where fewer than two can), the
    one change to every period of a steady state at once. Two schedules whose steady
    states differ on every device are many single moves apart, each of which may cost
    more by itself (P=3, M=6, F=1, B=2, W=1, comm=1, limit 1.5 on the V: 66.5 and the
    optimum 64.5 differ so); a translated move changes all periods of a device at once.

    Returns None when no runnable perturbation was found; the caller's ``rng``
    makes the sequence deterministic (``translate`` = 0 draws what it always drew).
    """
    ev = Evaluator(graph, costs)
    limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
    out = [list(o) for o in orders]
    done = 0
    for _ in range(moves * 20):
        if done == moves:
            break
        d = rng.randrange(ev.num_devices)
        lst = out[d]
        if len(lst) < 2:
            continue
        i = rng.randrange(len(lst))
        k = min(max(i + rng.choice((-3, -2, -1, 1, 2, 3)), 0), len(lst) - 1)
        new = None
        if translate > 0 and rng.random() < translate:
            new = _translated(ev, lst, lst[i], k - i)
        if new is None:  # (also a chain too short to translate: one microbatch)
            new = _moved(ev, lst, i, k)
        if new is None or not ev.fits(new, limit):
            continue
        out[d] = new
        if ev.spans(out) is None:
            out[d] = lst
            continue
        done += 1
    return out if done else None


def _moved(ev: Evaluator, lst: list[int], i: int, k: int) -> list[int] | None:
    """``lst`` with its action at ``i`` moved to ``k``; None where that crosses one of the
    action's same-device predecessors or successors (or ``k == i``)."""
    a = lst[i]
    if k < i and ev.local_pred[a].isdisjoint(lst[k:i]):
        return [*lst[:k], a, *lst[k:i], *lst[i + 1 :]]
    if k > i and ev.local_succ[a].isdisjoint(lst[i + 1 : k + 1]):
        return [*lst[:i], *lst[i + 1 : k + 1], a, *lst[k + 1 :]]
    return None


def _translated(ev: Evaluator, lst: list[int], a: int, step: int) -> list[int] | None:
    """``lst`` with every action of ``a``'s op and stage (its microbatches: indices
    ``(k * S + s) * M + j`` for every j) moved ``step`` places, the earliest first when
    moving up (the latest first when moving down, so none crosses another of the chain);
    one that cannot move stays. None unless two of them moved."""
    if step == 0:
        return None
    m = ev.graph.num_microbatches
    base = a - a % m
    where = {x: pos for pos, x in enumerate(lst) if base <= x < base + m}
    members = sorted(where, key=where.__getitem__, reverse=step > 0)
    cur, moved = lst, 0
    for x in members:
        i = cur.index(x)
        k = i + step
        if 0 <= k < len(cur) and (new := _moved(ev, cur, i, k)) is not None:
            cur, moved = new, moved + 1
    return cur if moved > 1 else None
