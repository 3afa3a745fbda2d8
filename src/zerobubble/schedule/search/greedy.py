"""One pass of the automatic scheduler: a cost- and memory-aware list scheduler.

Devices decide in time order while the pass tracks when every action ends,
so the pass is its own simulator: its times are exactly what ``simulate``
computes for the order it emits (an action starts once its device is free and
its inputs have arrived: across devices, ``CostModel.hop`` after its producer ends).

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
k = 0, 1, 2 for F, B, W. What each action waits for and which devices hear of
it come from the dependency rule (:mod:`zerobubble.schedule.deps`), tabled per
(op, stage) once; the roles the heuristic gives F, B and W are its own.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.deps import LOCAL_PRODUCER
from zerobubble.schedule.ir import Op
from zerobubble.schedule.search.graph import OPS, consumer_stages, direct_predecessors

_INF = float("inf")
_F, _B, _W = range(len(OPS))
"""Indices into ``OPS``: the heuristic's three roles (forward, critical backward, filler)."""


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
    pair: bool = False
    """Run a ready F and a ready B of another stage of the device as one overlapped block
    (:mod:`.pairs`) whenever that is shorter than the two in turn (an all-to-all cost),
    with the B's W inside it when the block does not grow; the orders then hold pair
    codes. Only for devices with several stages."""
    pair_then_w: bool = False
    """With :attr:`pair`: after a block whose B left its W pending, run the device's next
    pending W before the next choice when it is of that B's stage (the steady state then
    alternates a block and a W, as DualPipe's does, instead of deferring every W to the
    end)."""


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
    kind = _PairBuilder if policy.pair else _Builder
    builder = kind(placement, num_microbatches, costs, float(mem_limit), policy, cutoff)
    try:
        return builder.run()
    except _Cutoff:
        return None


def _memory_deltas(costs: CostModel) -> tuple[list[float], list[float], list[float]]:
    """What an F, a B and a W of each stage add to its device's memory, as the pass counts.

    Under recompute B may allocate (M_W > M_B): an F then reserves what its B will hold,
    so that admitting F at the limit never lets a later B exceed it."""
    pairs = list(zip(costs.mem_f, costs.mem_w, strict=True))
    mem_f = [float(max(f, w)) for f, w in pairs]
    mem_b = [
        float(costs.memory_delta(Op.B, s)) if w <= f else float(w) - mem_f[s]
        for s, (f, w) in enumerate(pairs)
    ]
    mem_w = [float(costs.memory_delta(Op.W, s)) for s in range(len(pairs))]
    return mem_f, mem_b, mem_w


def _reserves(stages: list[list[int]], mem_f: list[float]) -> list[float]:
    """Room an F of stage s leaves for one F of each later stage on its device."""
    reserve = [0.0] * len(mem_f)
    for held in stages:
        for k, s in enumerate(held):
            reserve[s] = sum(mem_f[t] for t in held[k + 1 :])
    return reserve


_Need = tuple[int, list[int], int, list[float], float]
"""One input of an action: (its producer's op, that op's counts, its stage, its end times
there, the latency)."""


def _dependency_tables(
    placement: tuple[int, ...],
    costs: CostModel,
    dur: list[list[float]],
    counts: list[list[int]],
    ends: list[list[list[float]]],
) -> tuple[
    list[list[tuple[_Need, ...]]],
    list[list[tuple[int, ...]]],
    list[list[_Need | None]],
    list[list[tuple[float, int, float, int]]],
]:
    """The dependency rule tabled per (op k, stage s), once per pass: each need of (k, s, j)
    (its producer runs microbatch j too), reading the pass's live ``counts`` and ``ends``;
    the other devices its outputs reach; its need if it has exactly one (else None); and
    (the latency of that need, its device, its duration, its key k * S + s) for walking
    chains of them."""
    S = len(placement)
    preds = direct_predecessors(S)
    need = [
        [
            tuple(
                (p, counts[p], t, ends[p][t], hop if placement[t] != placement[s] else 0.0)
                for p, t, hop in (
                    (OPS.index(op_p), t, float(costs.hop(op_p, t))) for op_p, t in preds[op, s]
                )
            )
            for s in range(S)
        ]
        for op in OPS
    ]
    tell = [
        [
            tuple(
                dict.fromkeys(
                    placement[t] for t in consumer_stages(op, s, S) if placement[t] != placement[s]
                )
            )
            for s in range(S)
        ]
        for op in OPS
    ]
    one = [[nd[0] if len(nd) == 1 else None for nd in row] for row in need]
    step = [
        [
            (nd[0][4] if len(nd) == 1 else 0.0, placement[s], dur[k][s], k * S + s)
            for s, nd in enumerate(row)
        ]
        for k, row in enumerate(need)
    ]
    return need, tell, one, step


def _round_order(held: list[int], m: int, group: int) -> list[int]:
    """Stages in interleaved order: ``group`` microbatches of each stage in turn (whole
    rounds repeat one pattern; the last, shorter one has what is left)."""
    whole, rest = divmod(m, group)
    return [s for s in held for _ in range(group)] * whole + [s for s in held for _ in range(rest)]


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
        self.dur = [[float(costs.duration(op, s)) for s in range(S)] for op in OPS]
        self.f, self.b, self.w = self.dur
        self.mem_f, self.mem_b, self.mem_w = _memory_deltas(costs)
        self.mem_delta = (self.mem_f, self.mem_b, self.mem_w)
        self.limit = limit + 1e-10 * max(1.0, abs(limit))
        self.stages = [[s for s, e in enumerate(placement) if e == d] for d in range(P)]
        self.rev_stages = [h[::-1] for h in self.stages]
        self.reserve = _reserves(self.stages, self.mem_f)
        self.cap = [policy.inflight * (S - s) if policy.inflight > 0 else m for s in range(S)]
        self.n = [[0] * S for _ in OPS]  # actions of (k, s) run so far (in microbatch order)
        self.nf, self.nb = self.n[_F], self.n[_B]
        self.end = [[[0.0] * m for _ in range(S)] for _ in OPS]
        self.need, self.tell, self.one, self.step = _dependency_tables(
            placement, costs, self.dur, self.n, self.end
        )
        # The op whose action on the same stage and microbatch must run first (None: F),
        # and so how far each (k, s) may go: its local producer's count, else M.
        self.local = [None if (p := LOCAL_PRODUCER[op]) is None else OPS.index(p) for op in OPS]
        self.upto = [[m] * S if p is None else self.n[p] for p in self.local]
        # Per (k, s): (j, a lower bound on when action j of (k, s) can start) from an earlier
        # ``_bound``; still a lower bound while j is unscheduled (see ``_none_before``).
        self.seen = [[(-1, 0.0)] * S for _ in OPS]
        self.reuse_bounds = True
        self._init_devices()

    def _init_devices(self) -> None:
        """Each device's state: free time, first start, memory, work left, the W it owes,
        its order so far, where it stands in its rounds, and the wake-up queue."""
        P, m, policy = self.P, self.m, self.policy
        self.free = [0.0] * P
        self.first = [-1.0] * P
        self.mem = [0.0] * P
        self.peak = [0.0] * P
        self.rem = [sum(self.f[s] + self.b[s] + self.w[s] for s in h) * m for h in self.stages]
        self.pending_w: list[deque[int]] = [deque() for _ in range(P)]
        self.out: list[list[int]] = [[] for _ in range(P)]
        self.left = [len(OPS) * m * len(h) for h in self.stages]
        # With rounds: the fixed F and B stage sequence of each device, and where it stands
        # (built only for passes in rounds: no other reads them).
        group = policy.rounds or P
        rounds = policy.rounds > 0
        self.seq_f = [_round_order(held, m, group) if rounds else [] for held in self.stages]
        self.seq_b = [_round_order(held[::-1], m, group) if rounds else [] for held in self.stages]
        self.pos_f = [0] * P
        self.pos_b = [0] * P
        self.heap: list[tuple[float, int]] = [(0.0, d) for d in range(P)]
        self.queued: list[set[float]] = [{0.0} for _ in range(P)]

    # ---- arrivals ------------------------------------------------------------------------

    def _ready(self, k: int, s: int) -> float:
        """When the next action of (k, s) can start (inf if some input is not scheduled yet)."""
        j = self.n[k][s]
        t = 0.0
        for _, n, u, end, lat in self.need[k][s]:
            if n[u] <= j:
                return _INF
            r = end[j] + lat
            if r > t:
                t = r
        return t

    def _bound(self, k: int, s: int) -> float:
        """Lower bound on when the next action of (k, s) can start, where ``_ready`` says inf."""
        j = self.n[k][s]
        need = self.need[k][s]
        seen: dict[int, float] | None = {} if len(need) > 1 else None
        t = 0.0
        for p, n, u, end, lat in need:
            r = (end[j] if n[u] > j else self._end_bound(p, u, j, seen)) + lat
            if r > t:
                t = r
        return t

    def _end_bound(self, k: int, s: int, j: int, seen: dict[int, float] | None) -> float:
        """Lower bound on the end of the unscheduled action j of (k, s): its unscheduled
        ancestors run uncontended, each after its inputs and once its device is free.

        Actions with one need are walked up as a chain, without a call per action (this
        is the pass's hottest path); several needs recurse, sharing ``seen`` (the bounds
        found so far in this query, by ``k * S + s``) so that no ancestor is visited twice.
        """
        one, step, free = self.one, self.step, self.free
        chain = []  # the walked actions' steps, from (k, s) up
        while True:
            single = one[k][s]
            if single is None:  # no need or several: the top of the chain
                nd = self.need[k][s]
                if nd and seen is None:
                    seen = {}
                t = 0.0
                for p, n, u, end, lat in nd:
                    if n[u] > j:
                        r = end[j]
                    else:
                        assert seen is not None
                        hit = seen.get(p * self.S + u)
                        r = self._end_bound(p, u, j, seen) if hit is None else hit
                    r += lat
                    if r > t:
                        t = r
                chain.append((0.0, *step[k][s][1:]))
                break
            chain.append(step[k][s])
            p, n, u, end, _ = single
            if n[u] > j:
                t = end[j]
                break
            if seen is not None and (hit := seen.get(p * self.S + u)) is not None:
                t = hit
                break
            k, s = p, u
        for lat, d, dur, key in reversed(chain):
            t += lat
            f = free[d]
            t = (t if t > f else f) + dur
            if seen is not None:
                seen[key] = t
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
        """Place the action the heuristic picks for free device ``d`` at ``now``, or queue
        a wake-up for the next known arrival (unknown ones send news when scheduled)."""
        pol = self.policy
        held = self.rev_stages[d]
        whole = not (pol.rounds and len(held) > 1)  # both scans see every stage held here
        held_b, held_f = (held, held) if whole else self._round_heads(d)
        best_b, b_at, next_b, unknown_b = self._scan_b(held_b, now)
        best_f, f_at, next_f, soon_f, unknown_f, blocked = self._scan_f(d, held_f, now)
        free = self.free[d]
        if best_b >= 0 and not (pol.f_first and best_f >= 0):
            self._put(d, _B, best_b, b_at if b_at > free else free)
            return
        if best_f >= 0:
            start = f_at if f_at > free else free
            if (
                best_b >= 0
                or pol.f_overrun
                or self._none_before(start + self.f[best_f], next_b, _B, unknown_b)
            ):
                self._put(d, _F, best_f, start)
                return
        if self.pending_w[d]:
            s = self.pending_w[d][0]
            r = self._ready(_W, s)
            start = r if r > free else free
            # The gap lasts until the next B (if a ready F is held back for it) or until
            # the next F or B arrives; with nothing (admissible) to come it stays open.
            if r < _INF and (
                blocked
                or pol.w_overrun
                or (
                    self._none_before(start + self.w[s], next_b, _B, unknown_b)
                    and (best_f >= 0 or self._none_before(start + self.w[s], next_f, _F, unknown_f))
                )
            ):
                self._put(d, _W, s, start)
                return
        soon = (soon_f if soon_f < next_b else next_b) if whole else self._next_arrival(d, now)
        if soon < _INF:
            self._wake(d, soon)

    def _round_heads(self, d: int) -> tuple[Sequence[int], Sequence[int]]:
        """In rounds: the stage whose turn it is for B and for F on ``d`` (every stage held
        there once its sequence is done)."""
        held = self.rev_stages[d]
        held_b: Sequence[int] = held
        held_f: Sequence[int] = held
        if self.pos_b[d] < len(self.seq_b[d]):
            held_b = (self.seq_b[d][self.pos_b[d]],)
        if self.pos_f[d] < len(self.seq_f[d]):
            held_f = (self.seq_f[d][self.pos_f[d]],)
        return held_b, held_f

    def _scan_b(self, held_b: Sequence[int], now: float) -> tuple[int, float, float, list[int]]:
        """The next B of each stage held here: ready now, or when it will arrive (``_ready``,
        written out: this is the pass's hottest loop). Returns the B to run (its stage, -1 if
        none is ready, and its arrival), ``next_b``, the earliest of the known arrivals, and
        ``unknown_b``, the stages whose next B is not scheduled yet: a choice that needs them
        bounds them below (``_bound``, a walk up their unscheduled ancestors)."""
        later = self.policy.later_first
        nb, upto_b, need = self.nb, self.upto[_B], self.need[_B]
        best_b, b_at, next_b = -1, _INF, _INF
        unknown_b: list[int] = []
        for s in held_b:
            j = nb[s]
            if j < upto_b[s]:
                r = 0.0
                for _, n, u, end, lat in need[s]:
                    if n[u] <= j:
                        r = _INF
                        break
                    x = end[j] + lat
                    if x > r:
                        r = x
                if r <= now:
                    if r < b_at and not (later and best_b >= 0):
                        best_b, b_at = s, r
                elif r == _INF:
                    unknown_b.append(s)
                elif r < next_b:
                    next_b = r
        return best_b, b_at, next_b, unknown_b

    def _scan_f(
        self, d: int, held_f: Sequence[int], now: float
    ) -> tuple[int, float, float, float, list[int], bool]:
        """As ``_scan_b`` for F, counting only the F that memory (and ``inflight``) admit,
        plus ``soon_f``, the earliest arrival of every F, admitted or not, and whether memory
        blocks a ready one."""
        later = self.policy.later_first
        nf, nb, upto_f, need = self.nf, self.nb, self.upto[_F], self.need[_F]
        best_f, f_at, next_f, soon_f = -1, _INF, _INF, _INF
        unknown_f: list[int] = []
        blocked = False
        room = self.limit - self.mem[d]
        mem_f, reserve, cap = self.mem_f, self.reserve, self.cap
        for s in held_f:
            j = nf[s]
            if j < upto_f[s]:
                fits = mem_f[s] + reserve[s] <= room and j - nb[s] < cap[s]
                r = 0.0
                for _, n, u, end, lat in need[s]:
                    if n[u] <= j:
                        r = _INF
                        break
                    x = end[j] + lat
                    if x > r:
                        r = x
                if r <= now:
                    if not fits:
                        blocked = True
                    elif r < f_at and not (later and best_f >= 0):
                        best_f, f_at = s, r
                else:
                    if r < soon_f:
                        soon_f = r
                    if fits:
                        if r == _INF:
                            unknown_f.append(s)
                        elif r < next_f:
                            next_f = r
        return best_f, f_at, next_f, soon_f, unknown_f, blocked

    def _next_arrival(self, d: int, now: float) -> float:
        """In rounds: the earliest known arrival after ``now`` of any next F or B on ``d``."""
        soon = _INF
        for s in self.rev_stages[d]:
            for k in (_F, _B):
                if self.n[k][s] < self.upto[k][s]:
                    r = self._ready(k, s)
                    if now < r < soon:
                        soon = r
        return soon

    def _none_before(self, t: float, known: float, k: int, unknown: list[int]) -> bool:
        """Whether no next action of ``k`` arrives before ``t``: ``known`` is the earliest
        scheduled arrival, ``unknown`` the stages whose next one is not scheduled yet
        (bounded one by one, only until one comes sooner).

        A bound found earlier for the same action is still a lower bound of today's: free
        times only grow, and every action scheduled since ends no sooner than the bound
        the walk gave it then (the same operations on larger inputs, so in floating point
        too). So where the old bound already clears ``t`` the walk is skipped: the answer
        is the one the walk would give. (Not in the pass with pairs, whose blocks may end
        before their F alone would: there every query walks.)"""
        if t > known:
            return False
        n, seen, reuse = self.n[k], self.seen[k], self.reuse_bounds
        for s in unknown:
            j, low = seen[s]
            if reuse and j == n[s] and t <= low:
                continue
            low = self._bound(k, s)
            seen[s] = n[s], low
            if t > low:
                return False
        return True

    def _put(self, d: int, k: int, s: int, start: float) -> None:
        m, n = self.m, self.n[k]
        j = n[s]
        end = start + self.dur[k][s]
        self.end[k][s][j] = end
        n[s] = j + 1
        self.mem[d] += self.mem_delta[k][s]
        if k == _F:
            self.pos_f[d] += 1
            if self.mem[d] > self.peak[d]:
                self.peak[d] = self.mem[d]
        elif k == _B:
            self.pos_b[d] += 1
        else:
            self.pending_w[d].popleft()
        if k == self.local[_W]:  # W runs from the queue once its own stage's input exists
            self.pending_w[d].append(s)
        free, queued, heap = self.free, self.queued, self.heap
        for e in self.tell[k][s]:  # _wake(e, free[e]), written out
            t = free[e]
            if t not in (q := queued[e]):
                q.add(t)
                heapq.heappush(heap, (t, e))
        if self.first[d] < 0:
            self.first[d] = start
        self.out[d].append((k * self.S + s) * m + j)
        self.free[d] = end
        self.left[d] -= 1
        self.rem[d] -= end - start
        if end - self.first[d] + self.rem[d] >= self.cutoff:
            raise _Cutoff
        self._wake(d, end)


class _PairBuilder(_Builder):
    """The pass with :attr:`Policy.pair`: before the usual choice, a free device runs a
    ready F and a ready B of another of its stages as one block when that is shorter than
    the two in turn (the F as admitted by memory as alone; the B chosen as alone, the F
    among the other stages). The block starts once both inputs are in, so both are taken
    ready now; it ends both, and its B's W joins it when that does not lengthen it and no
    earlier W of that stage is pending. A block's members are emitted as the F's index and
    the others' plus N (:mod:`.pairs`). The span pruning charges what remains on a device
    the larger of its compute and its all-to-all (a block may hide the smaller), so it
    stays a bound."""

    def __init__(
        self,
        placement: tuple[int, ...],
        m: int,
        costs: CostModel,
        limit: float,
        policy: Policy,
        cutoff: float,
    ) -> None:
        super().__init__(placement, m, costs, limit, policy, cutoff)
        S = self.S
        self.code_n = len(OPS) * S * m
        self.a2a = [[float(costs.a2a_time(op, s)) for s in range(S)] for op in OPS]
        self.comp = [
            [d - x for d, x in zip(row, xs, strict=True)]
            for row, xs in zip(self.dur, self.a2a, strict=True)
        ]
        # What remains on a device takes at least its compute and at least its all-to-all.
        self.rem_c = [sum(c[s] for c in self.comp for s in h) * m for h in self.stages]
        self.rem_a = [sum(x[s] for x in self.a2a for s in h) * m for h in self.stages]
        self.rem = [max(c, x) for c, x in zip(self.rem_c, self.rem_a, strict=True)]
        self.w_next = [False] * self.P  # pair_then_w: the block just run left its W
        self.reuse_bounds = False  # a block may end before its F alone would

    def _put(self, d: int, k: int, s: int, start: float) -> None:
        self.rem_c[d] -= self.comp[k][s]
        self.rem_a[d] -= self.a2a[k][s]
        # The plain put takes the action's whole duration off what remains: add it first.
        self.rem[d] = max(self.rem_c[d], self.rem_a[d]) + self.dur[k][s]
        super()._put(d, k, s, start)

    def _decide(self, d: int, now: float) -> None:
        if self.w_next[d]:
            self.w_next[d] = False
            s = self.pending_w[d][-1]
            if self.pending_w[d][0] == s:  # the block's W is the next one of the queue
                r = self._ready(_W, s)
                self._put(d, _W, s, r if r > self.free[d] else self.free[d])
                return
        if not self._pair(d, now):
            super()._decide(d, now)

    def _pair(self, d: int, now: float) -> bool:
        """Run a block on ``d`` at ``now`` if a pair that pays is ready; whether it did."""
        pol = self.policy
        held = self.rev_stages[d]
        if len(held) < 2:
            return False
        held_b, held_f = self._round_heads(d) if pol.rounds else (held, held)
        nf, nb = self.nf, self.nb
        upto_f, upto_b = self.upto[_F], self.upto[_B]
        ready = self._ready
        bs = []
        for s in held_b:
            if nb[s] < upto_b[s] and (r := ready(_B, s)) <= now:
                bs.append((r, s))
        if not bs:
            return False
        room = self.limit - self.mem[d]
        fs = []
        for s in held_f:
            if (
                nf[s] < upto_f[s]
                and self.mem_f[s] + self.reserve[s] <= room
                and nf[s] - nb[s] < self.cap[s]
                and (r := ready(_F, s)) <= now
            ):
                fs.append((r, s))
        if not fs:
            return False
        if not pol.later_first:  # first come first (held lists the later stages first)
            bs.sort()
            fs.sort()
        comp, a2a = self.comp, self.a2a
        for rb, sb in bs:
            for rf, sf in fs:
                if sf == sb:
                    continue
                c = comp[_F][sf] + comp[_B][sb]
                x = a2a[_F][sf] + a2a[_B][sb]
                took = c if c > x else x
                if took >= self.f[sf] + self.b[sb]:
                    continue  # hides nothing
                free = self.free[d]
                start = max(free, rf, rb)
                w = sb not in self.pending_w[d] and c + comp[_W][sb] <= took
                self._put_block(d, sf, sb, w, start, took)
                return True
        return False

    def _put_block(self, d: int, sf: int, sb: int, with_w: bool, start: float, took: float) -> None:
        m, S, n = self.m, self.S, self.code_n
        end = start + took
        if self.first[d] < 0:
            self.first[d] = start
        members = [(_F, sf), (_B, sb)] + ([(_W, sb)] if with_w else [])
        for pos, (k, s) in enumerate(members):
            count = self.n[k]
            j = count[s]
            self.end[k][s][j] = end
            count[s] = j + 1
            self.mem[d] += self.mem_delta[k][s]
            if self.mem[d] > self.peak[d]:
                self.peak[d] = self.mem[d]
            for e in self.tell[k][s]:
                self._wake(e, self.free[e])
            self.out[d].append((k * S + s) * m + j + (n if pos else 0))
        self.pos_f[d] += 1
        self.pos_b[d] += 1
        if not with_w:
            self.pending_w[d].append(sb)
            self.w_next[d] = self.policy.pair_then_w
        self.free[d] = end
        self.left[d] -= len(members)
        self.rem_c[d] -= sum(self.comp[k][s] for k, s in members)
        self.rem_a[d] -= sum(self.a2a[k][s] for k, s in members)
        self.rem[d] = max(self.rem_c[d], self.rem_a[d])
        if end - self.first[d] + self.rem[d] >= self.cutoff:
            raise _Cutoff
        self._wake(d, end)
