"""One pass of the automatic scheduler: a cost- and memory-aware list scheduler.

Devices decide in time order while the pass tracks when every action ends,
so the pass is its own simulator: its times are exactly what ``simulate``
computes for the order it emits (an action starts once its device is free and
its inputs have arrived, plus ``comm`` across devices).

A free device picks, in this order (the ZB paper's heuristic):

1. a B whose input has arrived: B is on the critical path and frees memory
   (``Policy.f_first`` puts a ready F first instead);
2. an F whose input has arrived and that memory admits. In warm-up this runs
   as many F as the limit allows before the first B arrives; with
   ``f_overrun`` off, an F that would still be running when the next B
   arrives is held back and the gap goes to a W or stays idle;
3. a W: when memory blocks the ready F (a W frees M_W), when it fits in the
   gap before the next F or B arrives, when ``w_overrun`` fills a gap even
   though the W outlasts it, and at the end to drain.

Otherwise it waits. A waiting device decides again whenever news arrives (an
input of its next F or B is scheduled) and may still place an action at the
moment it became free, so decisions use the latest knowledge and start times
stay as-soon-as-possible. Arrivals not known yet are bounded below by the
uncontended chain that produces them.

Memory: an F of a stage with later stages on the same device (the first leg
of a V) also leaves room for one F of each of them, so a device never fills
up with first-leg forwards and leaves no room to turn the V around. With that,
any limit of at least one microbatch's M_B per device (summed over its
stages) is schedulable.

Actions are encoded as ``ActionGraph`` indices: ``(k * S + s) * M + j`` with
k = 0, 1, 2 for F, B, W.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.ir import Op

_INF = float("inf")


@dataclass(frozen=True)
class Policy:
    """The heuristic's binary choices; the automatic schedulers grid-search them."""

    f_first: bool = False
    """Run a ready F before a ready B (more microbatches in flight sooner)."""
    f_overrun: bool = True
    """Start an F even if a B arrives before it ends (fills gaps, may delay that B)."""
    w_overrun: bool = False
    """Start a W in a gap shorter than the W (no idling, may delay what arrives)."""
    later_first: bool = False
    """Among ready F (or ready B) of several stages on a device, run the later stage
    (for F: nearer the loss; for B: the longer backward still to go) rather than the
    one that arrived first. Only matters for devices with several stages."""
    inflight: int = 0
    """If > 0, stage s keeps at most ``inflight * (S - s)`` microbatches between its F
    and its B (1 is 1F1B's shape); 0 leaves the count to the memory limit."""
    rounds: int = 0
    """If > 0, on devices with several stages, run F (and B) in rounds of this many
    microbatches per stage, stage by stage (the interleaved 1F1B order with rounds of
    P: F of the first stage held for microbatches 0..P-1, then of the next stage, ...;
    B the same with the stages reversed), waiting for the next one in that order
    rather than taking whichever arrived first. Keeps every stage of a device fed
    evenly, which first-come order does not when comm delays the later stages'
    inputs; smaller rounds need less memory to fill the pipeline."""


@dataclass(frozen=True)
class Pass:
    """One pass's per-device orders (ActionGraph indices), spans, cost and peaks."""

    orders: tuple[tuple[int, ...], ...]
    span: tuple[float, ...]
    peak: tuple[float, ...]

    @property
    def cost(self) -> float:
        return max(self.span)


class _Cutoff(Exception):
    """The pass cannot beat the cost it was told to beat (or, in rounds, cannot finish)."""


def run_pass(
    placement: tuple[int, ...],
    num_microbatches: int,
    costs: CostModel,
    mem_limit: Number,
    policy: Policy,
    cutoff: float = _INF,
) -> Pass | None:
    """Schedule every F/B/W of ``placement`` x M within ``mem_limit`` using ``policy``.

    Returns None as soon as some device's span is bound to reach ``cutoff``
    (its span so far plus its remaining work), which prunes the grid search.
    The limit must be at least ``min_feasible_limit``; with ``policy.rounds`` a
    pass whose fixed order the limit cannot honour also returns None.
    """
    builder = _Builder(placement, num_microbatches, costs, float(mem_limit), policy, cutoff)
    try:
        return builder.run()
    except _Cutoff:
        return None


class _Builder:
    def __init__(
        self,
        placement: tuple[int, ...],
        m: int,
        costs: CostModel,
        limit: float,
        policy: Policy,
        cutoff: float,
    ) -> None:
        S = len(placement)
        P = max(placement) + 1
        self.placement, self.m, self.S, self.P, self.policy = placement, m, S, P, policy
        self.cutoff = cutoff * (1 - 1e-12)
        self.f = [float(x) for x in costs.f]
        self.b = [float(x) for x in costs.b]
        self.w = [float(x) for x in costs.w]
        comm = float(costs.comm)
        # Under recompute B may allocate (M_W > M_B): an F then reserves what its B will
        # hold, so that admitting F at the limit never lets a later B exceed it.
        self.mem_f = [float(max(f, w)) for f, w in zip(costs.mem_f, costs.mem_w, strict=True)]
        self.mem_b = [
            float(costs.memory_delta(Op.B, s)) if w <= f else float(w) - self.mem_f[s]
            for s, (f, w) in enumerate(zip(costs.mem_f, costs.mem_w, strict=True))
        ]
        self.mem_w = [float(costs.memory_delta(Op.W, s)) for s in range(S)]
        self.limit = limit + 1e-10 * max(1.0, abs(limit))
        self.stages: list[list[int]] = [[] for _ in range(P)]
        for s, d in enumerate(placement):
            self.stages[d].append(s)
        self.rev_stages = [h[::-1] for h in self.stages]
        # Room an F of stage s leaves for one F of each later stage on its device.
        self.reserve = [0.0] * S
        for held in self.stages:
            for k, s in enumerate(held):
                self.reserve[s] = sum(self.mem_f[t] for t in held[k + 1 :])
        self.cap = [policy.inflight * (S - s) if policy.inflight > 0 else m for s in range(S)]
        # Latency into stage s from the stage before (F) and after (B) it.
        self.lat_prev = [
            comm if s > 0 and placement[s - 1] != placement[s] else 0.0 for s in range(S)
        ]
        self.lat_next = [
            comm if s + 1 < S and placement[s + 1] != placement[s] else 0.0 for s in range(S)
        ]
        self.nf = [0] * S
        self.nb = [0] * S
        self.nw = [0] * S
        self.end_f = [[0.0] * m for _ in range(S)]
        self.end_b = [[0.0] * m for _ in range(S)]
        self.free = [0.0] * P
        self.first = [-1.0] * P
        self.mem = [0.0] * P
        self.peak = [0.0] * P
        self.rem = [sum(self.f[s] + self.b[s] + self.w[s] for s in h) * m for h in self.stages]
        self.pending_w: list[deque[int]] = [deque() for _ in range(P)]
        self.out: list[list[int]] = [[] for _ in range(P)]
        self.left = [3 * m * len(h) for h in self.stages]
        # With rounds: the fixed F and B stage sequence of each device, and where it stands.
        group = policy.rounds or P
        self.seq_f = [self._rounds(held, m, group) for held in self.stages]
        self.seq_b = [self._rounds(held[::-1], m, group) for held in self.stages]
        self.pos_f = [0] * P
        self.pos_b = [0] * P
        self.heap: list[tuple[float, int]] = [(0.0, d) for d in range(P)]
        self.queued: list[set[float]] = [{0.0} for _ in range(P)]

    @staticmethod
    def _rounds(held: list[int], m: int, group: int) -> list[int]:
        """Stages in interleaved order: ``group`` microbatches of each stage in turn."""
        out: list[int] = []
        for g in range(0, m, group):
            for s in held:
                out.extend([s] * (min(m, g + group) - g))
        return out

    # ---- arrivals ------------------------------------------------------------------------

    def _f_ready(self, s: int) -> float:
        """When the next F of stage s can start (inf if its input is not scheduled yet)."""
        if s == 0:
            return 0.0
        j = self.nf[s]
        if self.nf[s - 1] <= j:
            return _INF
        return self.end_f[s - 1][j] + self.lat_prev[s]

    def _b_ready(self, s: int) -> float:
        j = self.nb[s]
        if s == self.S - 1:
            return self.end_f[s][j]
        if self.nb[s + 1] <= j:
            return _INF
        return self.end_b[s + 1][j] + self.lat_next[s]

    def _f_bound(self, s: int) -> float:
        """Lower bound on when the next F of stage s can start."""
        r = self._f_ready(s)
        if r < _INF:
            return r
        return self._f_end_bound(s - 1, self.nf[s]) + self.lat_prev[s]

    def _b_bound(self, s: int) -> float:
        r = self._b_ready(s)
        if r < _INF:
            return r
        return self._b_end_bound(s + 1, self.nb[s]) + self.lat_next[s]

    def _f_end_bound(self, s: int, j: int) -> float:
        """Lower bound on the end of F(s, j): its unscheduled forward chain, uncontended."""
        nf = self.nf
        if nf[s] > j:
            return self.end_f[s][j]
        top = s
        while top > 0 and nf[top - 1] <= j:
            top -= 1
        t = 0.0 if top == 0 else self.end_f[top - 1][j] + self.lat_prev[top]
        for u in range(top, s + 1):
            if u > top:
                t += self.lat_prev[u]
            t = max(t, self.free[self.placement[u]]) + self.f[u]
        return t

    def _b_end_bound(self, s: int, j: int) -> float:
        """Lower bound on the end of B(s, j): the rest of its forward and backward chain."""
        nb = self.nb
        if nb[s] > j:
            return self.end_b[s][j]
        last = self.S - 1
        top = s
        while top < last and nb[top + 1] <= j:
            top += 1
        if top == last:
            t = self._f_end_bound(last, j)
        else:
            t = self.end_b[top + 1][j] + self.lat_next[top]
        for u in range(top, s - 1, -1):
            if u < top:
                t += self.lat_next[u]
            t = max(t, self.free[self.placement[u]]) + self.b[u]
        return t

    # ---- the pass ------------------------------------------------------------------------

    def run(self) -> Pass:
        heap, queued, left, free = self.heap, self.queued, self.left, self.free
        while heap:
            t, d = heapq.heappop(heap)
            queued[d].discard(t)
            if left[d]:
                self._decide(d, t if t > free[d] else free[d])
        if any(left):
            if self.policy.rounds:  # the fixed order needed memory the limit does not give
                raise _Cutoff
            # The reservation rule makes this unreachable.
            raise RuntimeError(
                f"automatic scheduler stalled with work left on {left}"
            )  # pragma: no cover
        span = tuple(self.free[d] - self.first[d] if self.out[d] else 0.0 for d in range(self.P))
        return Pass(tuple(map(tuple, self.out)), span, tuple(self.peak))

    def _wake(self, d: int, t: float) -> None:
        q = self.queued[d]
        if t not in q:
            q.add(t)
            heapq.heappush(self.heap, (t, d))

    def _decide(self, d: int, now: float) -> None:
        pol = self.policy
        later = pol.later_first
        free = self.free[d]
        nf, nb, m = self.nf, self.nb, self.m
        held = self.rev_stages[d]
        held_b: Sequence[int] = held
        held_f: Sequence[int] = held
        if pol.rounds and len(held) > 1:
            if self.pos_b[d] < len(self.seq_b[d]):
                held_b = (self.seq_b[d][self.pos_b[d]],)
            if self.pos_f[d] < len(self.seq_f[d]):
                held_f = (self.seq_f[d][self.pos_f[d]],)
        # The next B and F of each stage held here: ready now, or when they will arrive.
        best_b, b_at, next_b = -1, _INF, _INF
        for s in held_b:
            if nb[s] < nf[s]:
                r = self._b_ready(s)
                if r <= now:
                    if r < b_at and not (later and best_b >= 0):
                        best_b, b_at = s, r
                else:
                    r = self._b_bound(s)
                    if r < next_b:
                        next_b = r
        best_f, f_at, next_f = -1, _INF, _INF
        blocked = False
        room = self.limit - self.mem[d]
        for s in held_f:
            if nf[s] < m:
                fits = self.mem_f[s] + self.reserve[s] <= room and nf[s] - nb[s] < self.cap[s]
                r = self._f_ready(s)
                if r <= now:
                    if not fits:
                        blocked = True
                    elif r < f_at and not (later and best_f >= 0):
                        best_f, f_at = s, r
                elif fits:
                    r = self._f_bound(s)
                    if r < next_f:
                        next_f = r

        if best_b >= 0 and not (pol.f_first and best_f >= 0):
            self._put(d, 1, best_b, b_at if b_at > free else free)
            return
        if best_f >= 0:
            start = f_at if f_at > free else free
            if best_b >= 0 or pol.f_overrun or start + self.f[best_f] <= next_b:
                self._put(d, 0, best_f, start)
                return
        if self.pending_w[d]:
            s = self.pending_w[d][0]
            # The gap lasts until the next B (if a ready F is held back for it) or until
            # the next F or B arrives; with nothing (admissible) to come it stays open.
            gap_end = next_b if best_f >= 0 else min(next_b, next_f)
            if blocked or pol.w_overrun or free + self.w[s] <= gap_end:
                self._put(d, 2, s, free)
                return
        # Wait for the next known arrival; unknown ones send news when scheduled.
        soon = _INF
        for s in held:
            if nf[s] < m:
                r = self._f_ready(s)
                if now < r < soon:
                    soon = r
            if nb[s] < nf[s]:
                r = self._b_ready(s)
                if now < r < soon:
                    soon = r
        if soon < _INF:
            self._wake(d, soon)

    def _put(self, d: int, k: int, s: int, start: float) -> None:
        m = self.m
        if k == 0:
            j = self.nf[s]
            end = start + self.f[s]
            self.end_f[s][j] = end
            self.nf[s] = j + 1
            self.pos_f[d] += 1
            self.mem[d] += self.mem_f[s]
            if self.mem[d] > self.peak[d]:
                self.peak[d] = self.mem[d]
            if s + 1 < self.S and self.placement[s + 1] != d:
                nxt = self.placement[s + 1]
                self._wake(nxt, self.free[nxt])
        elif k == 1:
            j = self.nb[s]
            end = start + self.b[s]
            self.end_b[s][j] = end
            self.nb[s] = j + 1
            self.pos_b[d] += 1
            self.mem[d] += self.mem_b[s]
            self.pending_w[d].append(s)
            if s > 0 and self.placement[s - 1] != d:
                prv = self.placement[s - 1]
                self._wake(prv, self.free[prv])
        else:
            self.pending_w[d].popleft()
            j = self.nw[s]
            self.nw[s] = j + 1
            end = start + self.w[s]
            self.mem[d] += self.mem_w[s]
        if self.first[d] < 0:
            self.first[d] = start
        self.out[d].append((k * self.S + s) * m + j)
        self.free[d] = end
        self.left[d] -= 1
        self.rem[d] -= end - start
        if end - self.first[d] + self.rem[d] >= self.cutoff:
            raise _Cutoff
        self._wake(d, end)
