"""Overlapped F&B pairs as a decision of the search: orders that say which actions pair.

A pair (:attr:`~zerobubble.schedule.ir.Schedule.overlaps`) is an F and, right after it on
its device, a backward of *another stage* (:func:`~zerobubble.schedule.deps.pair_conflict`),
run as one block of ``max(compute, all-to-all)`` of the two
(:meth:`~zerobubble.schedule.costs.CostModel.overlapped`). The searches keep per-device
orders of :class:`~.graph.ActionGraph` indices (0..N-1); here an index ``x + N`` says
"action ``x`` runs in the block of the F before it". A block is the F, its B, and
optionally that B's own W (``[f, b + N, w + N]``: the schedule's BW, whose weight-gradient
compute hides all-to-all too). Everything else is as in the plain search, so an order
without such codes means what it means there.

:class:`PairEvaluator` times such orders exactly as
:func:`~zerobubble.schedule.simulate.simulate` times the schedule :func:`decode` makes of
them; :func:`refine_pairs` and :func:`perturb_pairs` are the local search's moves with a
block moving as one, plus the moves that form and undo pairs.
"""

from __future__ import annotations

import random
import time
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from itertools import chain

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.search.graph import OPS, ActionGraph
from zerobubble.schedule.search.refine import Evaluator, Timing, _better, _key

_EPS = 1e-9


def unit_end(order: Sequence[int], i: int, n: int) -> int:
    """The position after the unit that starts at ``i`` (an action alone, or a block)."""
    j = i + 1
    while j < len(order) and order[j] >= n:
        j += 1
    return j


def can_pair(placement: Sequence[int], costs: CostModel) -> bool:
    """Whether a pair can hide anything here: a device holds two stages and some all-to-all
    cost is positive (otherwise a block only waits for both inputs)."""
    return len(set(placement)) < len(placement) and any(costs.a2a)


class PairEvaluator(Evaluator):
    """:class:`~.refine.Evaluator` of orders with pair codes (see the module docstring).

    ``start`` and ``end`` have 2N entries: a block's members get its start and end under
    their index and under their code, so a caller reading them by order position or by
    dependency finds the same times (a lone action's under its index, which is its code).
    """

    def __init__(self, graph: ActionGraph, costs: CostModel) -> None:
        super().__init__(graph, costs)
        self.n = n = len(graph)
        M = graph.num_microbatches
        self.a2a = [
            x
            for op in OPS
            for s in range(graph.num_stages)
            for x in [float(costs.a2a_time(op, s))] * M
        ]
        self.comp = [d - x for d, x in zip(self.dur, self.a2a, strict=True)]
        self.delta = self.delta + self.delta  # a member's code carries its memory change
        self.stage = [a.stage for a in graph.actions]
        self.op = [a.op for a in graph.actions]
        assert len(self.delta) == 2 * n

    def floor(self) -> float:
        """A bound no order beats: per device, every unit takes at least its compute and at
        least its all-to-all (a block the larger of their sums), so a device's span covers
        the larger of its total compute and its total all-to-all."""
        return max(
            (
                max(sum(self.comp[a] for a in held), sum(self.a2a[a] for a in held))
                for held in self.graph.by_device
            ),
            default=0.0,
        )

    def block(self, members: Sequence[int]) -> float:
        """The duration of a block of these actions (indices): ``max(compute, all-to-all)``."""
        c = sum(self.comp[x] for x in members)
        x = sum(self.a2a[x] for x in members)
        return c if c > x else x

    def work(self, order: Sequence[int], lo: int = 0, hi: int | None = None) -> float:
        """The busy time of ``order[lo:hi]`` (whole units): lone durations plus blocks."""
        n, dur = self.n, self.dur
        hi = len(order) if hi is None else hi
        total = 0.0
        i = lo
        while i < hi:
            j = unit_end(order, i, n)
            total += dur[order[i]] if j == i + 1 else self.block([x % n for x in order[i:j]])
            i = j
        return total

    def pairable(self, f: int, b: int) -> bool:
        """Whether F ``f`` may pair with backward ``b`` (indices): two stages, some all-to-all."""
        return (
            self.op[f] is Op.F
            and self.op[b] is Op.B
            and self.stage[f] != self.stage[b]
            and self.a2a[f] + self.a2a[b] > 0
        )

    def timing(
        self, orders: list[list[int]], base: Timing | None = None, changed: int = 0, at: int = 0
    ) -> Timing | None:
        """As :meth:`Evaluator.timing`; ``at`` steps back to the start of a block that
        either the new or the base order has there."""
        n, P = self.n, self.num_devices
        if base is not None and at:
            new, old = orders[changed], base.orders[changed]
            while at > 0 and ((at < len(new) and new[at] >= n) or (at < len(old) and old[at] >= n)):
                at -= 1
        if base is None or at == 0:
            end = [-1.0] * (2 * n)
            start = [0.0] * (2 * n)
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
                    if a >= n:
                        end[a - n] = -1.0
        work = sum(len(o) - k for o, k in zip(orders, pos, strict=True))
        if not self._advance(orders, pos, free, first, end, start, work):
            return None
        spans = [free[d] - first[d] if orders[d] else 0.0 for d in range(P)]
        return Timing(list(orders), start, end, first, spans, work)

    def cost_within(self, orders: Sequence[Sequence[int]], cutoff: float) -> float | None:
        """As :meth:`Evaluator.cost_within`, each device's work counted by its units."""
        P, n = self.num_devices, self.n
        free, first = [0.0] * P, [0.0] * P
        end, start = [-1.0] * (2 * n), [0.0] * (2 * n)
        rem = [self.work(o) for o in orders]
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
        """:meth:`Evaluator._advance` where a block starts once the device is free and every
        member's inputs have arrived (inputs inside the block excepted), and all its members
        end together."""
        deps, dur, n = self.deps, self.dur, self.n
        while todo:
            progressed = False
            for d, lst in enumerate(orders):
                i = start_i = pos[d]
                t_free = free[d]
                size = len(lst)
                while i < size:
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
                        j = i + 1
                        if j < size and lst[j] >= n:  # a block: F, B (and B's W)
                            timed = self._time_block(lst, i, t, end, start)
                            if timed is None:
                                break
                            j, e = timed
                        else:
                            e = t + dur[a]
                            start[a] = t
                            end[a] = e
                        if i == 0:
                            first[d] = t
                        t_free = e
                        i = j
                        continue
                    break
                if i != start_i:
                    todo -= i - start_i
                    pos[d] = i
                    free[d] = t_free
                    progressed = True
                    if bar is not None:
                        cutoff, rem = bar
                        rem[d] -= self.work(lst, start_i, i)
                        if t_free - first[d] + rem[d] > cutoff:
                            return False
            if not progressed:
                return False
        return True

    def _time_block(
        self, lst: Sequence[int], i: int, t: float, end: list[float], start: list[float]
    ) -> tuple[int, float] | None:
        """Time the block whose F is ``lst[i]``, that F's inputs in by ``t``: it starts once
        its B's inputs (and its W's, but the B) are in too. Records every member's start and
        end under its index and its code; returns the position after the block and its end,
        or None while some input has not arrived."""
        deps, n, comp, a2a = self.deps, self.n, self.comp, self.a2a
        size = len(lst)
        a = lst[i]
        b = lst[i + 1] - n
        for dep, lat in deps[b]:
            ready = end[dep]
            if ready < 0:
                return None
            ready += lat
            if ready > t:
                t = ready
        c, x = comp[a] + comp[b], a2a[a] + a2a[b]
        j = i + 2
        w = -1
        if j < size and lst[j] >= n:
            w = lst[j] - n
            for dep, lat in deps[w]:
                if dep == b:
                    continue
                ready = end[dep]
                if ready < 0:
                    return None
                ready += lat
                if ready > t:
                    t = ready
            c += comp[w]
            x += a2a[w]
            j += 1
        e = t + (c if c > x else x)
        start[a] = start[b] = start[b + n] = t
        end[a] = end[b] = end[b + n] = e
        if w >= 0:
            start[w] = start[w + n] = t
            end[w] = end[w + n] = e
        return j, e


# ---- orders <-> schedules -------------------------------------------------------------------


def encode(graph: ActionGraph, sched: Schedule) -> tuple[tuple[int, ...], ...]:
    """``sched``'s per-device orders with pair codes: each BW as B then W, a paired
    backward (and a paired BW's W) coded ``+ N``."""
    n = len(graph)
    paired = {b for _, b in sched.overlaps}
    out = []
    for row in sched.actions:
        codes: list[int] = []
        for a in row:
            shift = n if a in paired else 0
            if a.op is Op.BW:
                codes.append(graph.index(Op.B, a.stage, a.mb) + shift)
                codes.append(graph.index(Op.W, a.stage, a.mb) + shift)
            else:
                codes.append(graph.index(a.op, a.stage, a.mb) + shift)
        out.append(tuple(codes))
    return tuple(out)


def decode(name: str, graph: ActionGraph, orders: Sequence[Sequence[int]]) -> Schedule:
    """The schedule of orders with pair codes: a block ``[f, b + N]`` is the pair
    ``(F, B)``, ``[f, b + N, w + N]`` the pair ``(F, BW)``."""
    n, acts = len(graph), graph.actions
    rows: list[tuple[Action, ...]] = []
    pairs: list[tuple[Action, Action]] = []
    for order in orders:
        row: list[Action] = []
        i = 0
        while i < len(order):
            j = unit_end(order, i, n)
            f = acts[order[i]]
            row.append(f)
            if j > i + 1:
                b = acts[order[i + 1] - n]
                if j == i + 3:
                    b = Action(Op.BW, b.stage, b.mb)
                row.append(b)
                pairs.append((f, b))
            i = j
        rows.append(tuple(row))
    return Schedule(
        name,
        graph.num_devices,
        graph.num_stages,
        graph.num_microbatches,
        graph.placement,
        tuple(rows),
        overlaps=tuple(pairs),
    )


# ---- the local search's moves ---------------------------------------------------------------


def _units(order: Sequence[int], n: int) -> list[int]:
    """Start positions of the units of ``order``."""
    out = []
    i = 0
    while i < len(order):
        out.append(i)
        i = unit_end(order, i, n)
    return out


def _toggles(ev: PairEvaluator, lst: list[int], i: int) -> Iterator[tuple[list[int], int]]:
    """Moves that form or undo a pair at the unit starting at ``i``: (new order, first
    changed position). Only an F starts a block, so a B or W coded below N is alone."""
    n = ev.n
    j = unit_end(lst, i, n)
    a = lst[i]
    if j > i + 1:  # a block: undo it, or grow (F, B) into (F, BW) when B's W comes next
        yield [*lst[:i], *(x % n for x in lst[i:j]), *lst[j:]], i
        if j == i + 3:
            yield [*lst[: i + 2], lst[i + 2] - n, *lst[j:]], i
        elif j < len(lst):
            b, w = lst[i + 1] - n, lst[j]
            if w < n and ev.op[w] is Op.W and ev.stage[w] == ev.stage[b] and _same_mb(ev, w, b):
                yield [*lst[:j], w + n, *lst[j + 1 :]], i
        return
    if ev.op[a] is not Op.F:
        return
    # The nearest B after the F (only lone Ws between) moved up to follow it.
    k = j
    while k < len(lst) and lst[k] < n and ev.op[lst[k]] is Op.W:
        k += 1
    if k < len(lst) and lst[k] < n and ev.pairable(a, lst[k]):
        b = lst[k]
        if ev.local_pred[b].isdisjoint(lst[j:k]):
            yield [*lst[:j], b + n, *lst[j:k], *lst[k + 1 :]], i
    # The F moved up to precede the nearest B before it (only lone Ws between).
    k = i - 1
    while k >= 0 and lst[k] < n and ev.op[lst[k]] is Op.W:
        k -= 1
    if k >= 0 and lst[k] < n and ev.pairable(a, lst[k]) and ev.local_pred[a].isdisjoint(lst[k:i]):
        yield [*lst[:k], a, lst[k] + n, *lst[k + 1 : i], *lst[i + 1 :]], k


def _same_mb(ev: PairEvaluator, w: int, b: int) -> bool:
    """Whether actions ``w`` and ``b`` (indices) are of one microbatch."""
    m = ev.graph.num_microbatches
    return w % m == b % m


def _shifts(
    ev: PairEvaluator, lst: list[int], i: int, window: int
) -> Iterator[tuple[list[int], int]]:
    """The unit at ``i`` moved up to ``window`` units earlier or later (never past a
    same-device predecessor or successor of any of its members)."""
    n = ev.n
    starts = _units(lst, n)
    u = starts.index(i)
    j = unit_end(lst, i, n)
    unit = lst[i:j]
    members = [x % n for x in unit]
    for k in range(1, window + 1):
        for sign in (-1, 1):
            v = u + sign * k
            if not 0 <= v < len(starts):
                continue
            if sign < 0:
                lo = starts[v]
                crossed = {x % n for x in lst[lo:i]}
                if any(not ev.local_pred[x].isdisjoint(crossed) for x in members):
                    continue
                yield [*lst[:lo], *unit, *lst[lo:i], *lst[j:]], lo
            else:
                hi = unit_end(lst, starts[v], n)
                crossed = {x % n for x in lst[j:hi]}
                if any(not ev.local_succ[x].isdisjoint(crossed) for x in members):
                    continue
                yield [*lst[:i], *lst[j:hi], *unit, *lst[hi:]], i


def refine_pairs(
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
    """:func:`~.refine.refine` on orders with pair codes: each unit (an action, or a block)
    in turn, first the moves that form or undo a pair there, then moved as one by up to
    ``window`` units; the first move that lowers the key is kept."""
    ev = PairEvaluator(graph, costs)
    n = ev.n
    orders = [list(o) for o in orders]
    timing = ev.timing(orders)
    if timing is None:
        raise ValueError("refine_pairs() needs orders that run; these deadlock")
    sm = graph.num_stages * graph.num_microbatches
    backward = range(sm, 2 * sm) if plateau else None
    best = _key(timing, backward)
    limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
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
                if lst[i] >= n:
                    i -= 1
                    continue
                moved = False
                for new, at in chain(_toggles(ev, lst, i), _shifts(ev, lst, i, window)):
                    if not ev.fits(new, limit):
                        continue
                    orders[d] = new
                    trial = ev.timing(orders, timing, d, at)
                    spent += len(graph) if trial is None else trial.work
                    if trial is not None and _better(key := _key(trial, backward), best):
                        timing, best, lst = trial, key, new
                        improved = moved = True
                        break
                    orders[d] = lst
                    if spent >= max_steps:
                        break
                if moved:
                    i = min(i, len(lst) - 1)
                else:
                    i -= 1
    return orders, best[0], spent


def perturb_pairs(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    orders: list[list[int]],
    rng: random.Random,
    moves: int,
) -> list[list[int]] | None:
    """:func:`~.refine.perturb` with units: random unit moves of one to three units and,
    one time in four, a random move that forms or undoes a pair."""
    ev = PairEvaluator(graph, costs)
    n = ev.n
    limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
    out = [list(o) for o in orders]
    done = 0
    for _ in range(moves * 20):
        if done == moves:
            break
        d = rng.randrange(ev.num_devices)
        lst = out[d]
        starts = _units(lst, n)
        if len(starts) < 2:
            continue
        i = starts[rng.randrange(len(starts))]
        if rng.randrange(4) == 0:
            options = list(_toggles(ev, lst, i))
        else:
            options = list(_shifts(ev, lst, i, 3))
        if not options:
            continue
        new, _ = options[rng.randrange(len(options))]
        if not ev.fits(new, limit):
            continue
        out[d] = new
        if ev.spans(out) is None:
            out[d] = lst
            continue
        done += 1
    return out if done else None
