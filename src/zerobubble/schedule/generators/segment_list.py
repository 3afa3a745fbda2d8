"""A list scheduler over sequence segments, on any placement.

A segment schedule (:attr:`~zerobubble.schedule.ir.Schedule.segments`, k) runs each
microbatch as k units, and the dependency rule adds two same-stage needs inside a
microbatch (:data:`~zerobubble.schedule.deps.RULES`): F of segment i reads segment i-1's
keys and values, the backward of segment i needs segment i+1's. :class:`SegmentPass` is a
list scheduler that is also its simulator (devices decide in time order; an action starts
once its device is free and its inputs have arrived, ``CostModel.hop`` after a producer
on another device), over units. ``seq-zbv`` runs its cool-down through it, and the
segment search (:mod:`zerobubble.schedule.search.segmented`) its grid of passes.

A free device picks, as the searches' pass does (the ZB paper's heuristic):

1. a B whose inputs have arrived (``SegPolicy.f_first`` puts a ready F first);
2. an F whose inputs have arrived and that memory admits (``f_hold``: not one that would
   still run when the device's next B arrives);
3. a W (pending since its B) when memory blocks the ready F, when it ends before the next
   known arrival, or in any gap with ``SegPolicy.w_fill``;

else it waits for the next arrival. F run in unit order on each stage (a microbatch's
segments from the sequence's start), B in backward order (microbatch by microbatch, each
from its end), W in the order of their B. A ``prefix`` of given per-device orders runs
first, each action as soon as its inputs allow; the heuristic takes over where it ends.

Memory: an F must leave room on its device for the rest of the oldest microbatch whose
forward has not reached the loss (its units still to run on the device's stages). That
microbatch can then always finish its forward, its backward needs no memory, and freeing
it makes room for the next one; so any limit of one microbatch on every stage of the
busiest device is schedulable. Torch-free and deterministic.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.deps import PRODUCERS, needs
from zerobubble.schedule.ir import Action, Op, Schedule

_INF = float("inf")
_OPS = (Op.F, Op.B, Op.W)
_F, _B, _W = 0, 1, 2


@dataclass(frozen=True)
class SegPolicy:
    """The list scheduler's choices (the segment searches run a small grid of them)."""

    f_first: bool = False
    """Run a ready F before a ready B."""
    later_first: bool = True
    """Among ready B of several stages on a device, the later stage first."""
    f_later: bool = True
    """Among ready F of several stages on a device, the later stage first."""
    w_fill: bool = True
    """Start a pending W in any gap, even one shorter than the W."""
    f_hold: bool = False
    """Hold back an F that would still run when the device's next B arrives."""


def forward_units(num_microbatches: int, segments: int) -> list[int]:
    """Units in forward order: microbatch by microbatch, each sequence from its start."""
    return list(range(num_microbatches * segments))


def backward_units(num_microbatches: int, segments: int) -> list[int]:
    """Units in backward order: microbatch by microbatch, each sequence from its end."""
    k = segments
    return [mb * k + (k - 1 - r) for mb in range(num_microbatches) for r in range(k)]


def _segment_costs(
    costs: CostModel, S: int, k: int
) -> tuple[list[list[list[float]]], list[list[float]], list[list[list[float]]]]:
    """Per (op, stage, segment): duration (host tail whole, compute scaled); per (stage,
    segment) what an F holds; per (op, stage, segment) the memory change.

    Under recompute B may allocate (M_W > M_B), and the last segment's B allocates the
    earlier segments' key and value gradient sums: an F then reserves what its B will
    hold, so that admitting F at the limit never lets a later B exceed it."""
    scale_t, _ = costs.segment_scales(k)
    dur = [
        [
            [
                float(costs.host_time(op, s))
                + float(costs.duration(op, s) - costs.host_time(op, s)) * float(scale_t[g])
                for g in range(k)
            ]
            for s in range(S)
        ]
        for op in _OPS
    ]
    # the last segment's B also starts the earlier segments' key and value gradient sums
    before_last = sum(costs.segment_factors("segment_tokens", k)[:-1])
    sums = [float(costs.kv_grad[s] * before_last) for s in range(S)]
    mem_f = [
        [
            float(max(costs.mem_f[s], costs.mem_w[s]) * costs.segment_memory_factor(s, g, k))
            + (sums[s] if g == k - 1 else 0.0)
            for g in range(k)
        ]
        for s in range(S)
    ]
    delta = [
        [[float(costs.unit_memory_delta(op, s, g, k)) for g in range(k)] for s in range(S)]
        for op in _OPS
    ]
    return dur, mem_f, delta


def _segment_needs(
    placement: tuple[int, ...], k: int
) -> list[list[list[tuple[tuple[int, int, int, bool], ...]]]]:
    """Producers of each (op, stage, segment): (op index, stage, unit offset, crosses)."""
    S = len(placement)
    return [
        [
            [
                tuple(
                    (
                        _OPS.index(next(p for p in PRODUCERS[key.kind] if p in _OPS)),
                        key.stage,
                        key.mb - g,
                        placement[key.stage] != placement[s],
                    )
                    for key in needs(op, s, g, S, k)
                )
                for g in range(k)
            ]
            for s in range(S)
        ]
        for op in _OPS
    ]


class SegmentPass:
    """One pass of the list scheduler: per-device orders of F/B/W actions over units."""

    def __init__(
        self,
        placement: tuple[int, ...],
        num_microbatches: int,
        segments: int,
        costs: CostModel,
        mem_limit: float,
        policy: SegPolicy,
        prefix: Sequence[Sequence[Action]] = (),
    ) -> None:
        S = len(placement)
        P = max(placement) + 1
        k = segments
        U = num_microbatches * k
        self.placement, self.S, self.P, self.k, self.U = placement, S, P, k, U
        self.m = num_microbatches
        self.policy = policy
        self.dur, self.mem_f, self.delta = _segment_costs(costs, S, k)
        self.hop = [[float(costs.hop(op, s)) for s in range(S)] for op in _OPS]
        self.limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
        self.stages: list[list[int]] = [[] for _ in range(P)]
        for s, d in enumerate(placement):
            self.stages[d].append(s)
        self.order = (forward_units(num_microbatches, k), backward_units(num_microbatches, k))
        self.need = _segment_needs(placement, k)
        self.consumers = [
            [
                sorted({placement[t] for t in (s - 1, s + 1) if 0 <= t < S} - {placement[s]})
                for s in range(S)
            ]
            for _ in _OPS
        ]
        self.end = [[[-1.0] * U for _ in range(S)] for _ in _OPS]
        self.n = [[0] * S for _ in _OPS]  # F and B run so far per stage (in their order)
        self.free = [0.0] * P
        self.mem = [0.0] * P
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(P)]
        self.out: list[list[Action]] = [[] for _ in range(P)]
        self.left = [3 * U * len(h) for h in self.stages]
        self.heap: list[tuple[float, int]] = [(0.0, d) for d in range(P)]
        self.queued: list[set[float]] = [{0.0} for _ in range(P)]
        self.prefix = [tuple(prefix[d]) if d < len(prefix) else () for d in range(P)]

    # ---- arrivals ------------------------------------------------------------------------

    def _next_unit(self, k: int, s: int) -> int:
        """The next unit of F (k = 0) or B (k = 1) on stage ``s``; -1 when all ran."""
        i = self.n[k][s]
        return self.order[k][i] if i < self.U else -1

    def _ready(self, k: int, s: int, u: int) -> float:
        """When (k, s, u) can start as far as its inputs go (inf: some is not scheduled)."""
        t = 0.0
        for p, st, off, cross in self.need[k][s][u % self.k]:
            e = self.end[p][st][u + off]
            if e < 0:
                return _INF
            if cross:
                e += self.hop[p][st]
            if e > t:
                t = e
        return t

    def _fits(self, d: int, s: int, u: int) -> bool:
        """Whether memory admits F(s, u) on device ``d``: it must leave room for the rest of
        the oldest microbatch whose forward has not reached the loss (its units still to run
        on ``d``'s stages), so that microbatch can always finish and free its memory."""
        k = self.k
        oldest = self.n[_F][self.S - 1] // k
        need = 0.0 if u // k == oldest else self.mem_f[s][u % k]
        if oldest < self.m:
            for t in self.stages[d]:
                for v in range(max(self.n[_F][t], oldest * k), (oldest + 1) * k):
                    need += self.mem_f[t][v % k]
        return need <= self.limit - self.mem[d]

    # ---- the pass ------------------------------------------------------------------------

    def run(self) -> list[list[Action]] | None:
        """The per-device orders; None if the pass stalled (a limit it cannot honour)."""
        heap, queued, left, free = self.heap, self.queued, self.left, self.free
        while heap:
            t, d = heapq.heappop(heap)
            queued[d].discard(t)
            if left[d]:
                self._decide(d, t if t > free[d] else free[d])
        if any(left):
            return None
        return self.out

    def _wake(self, d: int, t: float) -> None:
        q = self.queued[d]
        if t not in q:
            q.add(t)
            heapq.heappush(self.heap, (t, d))

    def _decide(self, d: int, now: float) -> None:
        pol = self.policy
        free = self.free[d]
        done = len(self.out[d])
        if done < len(self.prefix[d]):  # the given order first, as soon as its inputs allow
            a = self.prefix[d][done]
            k = _OPS.index(a.op)
            r = self._ready(k, a.stage, a.mb)
            if r <= now:
                self._put(d, k, a.stage, a.mb, max(r, free))
            elif r < _INF:
                self._wake(d, r)
            return
        held = self.stages[d][::-1] if pol.later_first else self.stages[d]
        held_f = self.stages[d][::-1] if pol.f_later else self.stages[d]
        soon = _INF
        best_b, b_at, b_u = -1, _INF, -1
        for s in held:
            u = self._next_unit(_B, s)
            if u < 0:
                continue
            r = self._ready(_B, s, u)
            if r <= now:
                if best_b < 0 or (r < b_at and not pol.later_first):
                    best_b, b_at, b_u = s, r, u
            elif r < soon:
                soon = r
        next_b = soon
        best_f, f_at, f_u = -1, _INF, -1
        blocked = False
        for s in held_f:
            u = self._next_unit(_F, s)
            if u < 0:
                continue
            fits = self._fits(d, s, u)
            r = self._ready(_F, s, u)
            if r <= now:
                if not fits:
                    blocked = True
                elif best_f < 0 or (r < f_at and not pol.f_later):
                    best_f, f_at, f_u = s, r, u
            elif fits and r < soon:
                soon = r
        if best_b >= 0 and not (pol.f_first and best_f >= 0):
            self._put(d, _B, best_b, b_u, max(b_at, free))
            return
        if best_f >= 0:
            start = max(f_at, free)
            if (
                best_b >= 0
                or not pol.f_hold
                or start + self.dur[_F][best_f][f_u % self.k] <= next_b
            ):
                self._put(d, _F, best_f, f_u, start)
                return
        if self.pending_w[d]:
            s, u = self.pending_w[d][0]
            start = max(self.end[_B][s][u], free)
            gap_end = next_b if best_f >= 0 else soon
            if blocked or pol.w_fill or start + self.dur[_W][s][u % self.k] <= gap_end:
                self._put(d, _W, s, u, start)
                return
        if soon < _INF:
            self._wake(d, soon)

    def _put(self, d: int, k: int, s: int, u: int, start: float) -> None:
        g = u % self.k
        end = start + self.dur[k][s][g]
        self.end[k][s][u] = end
        self.mem[d] += self.delta[k][s][g]
        if k == _W:
            pending = self.pending_w[d]
            if pending[0] == (s, u):
                pending.popleft()
            else:
                pending.remove((s, u))
        else:
            self.n[k][s] += 1
        if k == _B:
            self.pending_w[d].append((s, u))
        for e in self.consumers[k][s]:
            self._wake(e, self.free[e])
        self.out[d].append(Action(_OPS[k], s, u))
        self.free[d] = end
        self.left[d] -= 1
        self._wake(d, end)


def segment_pass(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    segments: int,
    costs: CostModel,
    mem_limit: float,
    policy: SegPolicy = SegPolicy(),
) -> Schedule | None:
    """One list-scheduling pass as a :class:`~zerobubble.schedule.ir.Schedule` of
    ``segments`` units per microbatch; None if it stalled under ``mem_limit``."""
    orders = SegmentPass(placement, num_microbatches, segments, costs, mem_limit, policy).run()
    if orders is None:
        return None
    p = max(placement) + 1
    rows = tuple(map(tuple, orders))
    return Schedule(name, p, len(placement), num_microbatches, placement, rows, segments)
