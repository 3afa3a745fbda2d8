"""Segment schedules inside the search: ``auto`` with ``segments=K``.

``auto(..., segments=K)`` (``zerobubble schedule auto --segments K``) also considers
cutting each microbatch's sequence into k = 2..K segments
(:attr:`~zerobubble.schedule.ir.Schedule.segments`), on one stage per device and on the V
placement. For each k and placement it builds candidates within the memory limit:

* the segment kinds of the placement: ``seq1f1b`` (each BW written as B then W, no
  slower), ``seq-zb`` (one stage per device) and ``seq-zbv`` (the V), as generated;
* ``seq-zbv``'s warm-up and steady state with its cool-down list-scheduled under the
  given costs (:func:`~zerobubble.schedule.generators.sequence.retail`);
* one pass of the segment list scheduler
  (:class:`~zerobubble.schedule.generators.segment_list.SegmentPass`) per point of
  :data:`GRID`, under the limit;

and keeps the cheapest that fits. Those of every k and placement, cheapest first, are then
polished with the searches' local search and seeded restarts (:func:`.refine.refine`,
:func:`.refine.perturb`, unchanged) on :class:`SegmentGraph`, the searches' graph over
units, within one budget of simulated actions, each only while its work floor is below the
best cost so far (no order beats the floor). The cheapest over every k (the
plain search's schedule is k = 1) wins; ties go to the lower peak memory, then to fewer
segments (fewer actions, less host work), then to fewer chunks. So ``auto`` with
``segments=K`` is never worse than a segment kind it could have chosen at k <= K under the
same limit, nor than ``auto`` without segments.

Torch-free and deterministic (unless given a deadline).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import cached_property

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.deps import PRODUCERS, needs
from zerobubble.schedule.errors import ScheduleError
from zerobubble.schedule.generators.segment_list import (
    SegPolicy,
    backward_units,
    forward_units,
    segment_pass,
)
from zerobubble.schedule.generators.sequence import (
    retail,
    seq1f1b,
    seq_zb,
    seq_zbv,
    zbv_warm_steady,
)
from zerobubble.schedule.ir import Op, Schedule, looped_placement, v_placement
from zerobubble.schedule.search.auto import (
    at_floor,
    expired,
    resolve_costs,
    split_backward,
)
from zerobubble.schedule.search.auto import work_floor as evaluator_floor
from zerobubble.schedule.search.graph import ActionGraph, Deps
from zerobubble.schedule.search.refine import Evaluator, perturb, refine
from zerobubble.schedule.simulate import simulate

_OPS = (Op.F, Op.B, Op.W)

#: Simulated actions the polish of one segment count may spend (local search and restarts).
SEGMENT_STEPS = 500_000
#: Restarts of the segment polish from kicked orders.
KICKS = 60

#: The list scheduler's grid: of all 32 combinations of SegPolicy's choices, the smallest set
#: that keeps the best pass on 661 of the 664 instances (of 864: P in {2, 3, 4, 6}, k in
#: {2, 3, 4}, M in {2, P, 2P}, four cost mixes, three limits, both placements) where a pass
#: is at least as good as the fixed candidates; in the other 3 it is second.
GRID: tuple[SegPolicy, ...] = (
    SegPolicy(later_first=False, w_fill=True),
    SegPolicy(later_first=False, w_fill=False),
    SegPolicy(f_first=True, later_first=False, w_fill=True),
    SegPolicy(f_first=True, later_first=False, w_fill=False),
    SegPolicy(later_first=False, w_fill=False, f_hold=True),
)


@dataclass(frozen=True)
class SegmentGraph(ActionGraph):
    """The searches' action graph over units: ``num_microbatches`` counts units (M * k),
    indices are :class:`.graph.ActionGraph`'s, and the edges are the rule's with segments
    (:func:`~zerobubble.schedule.deps.needs`) plus each (op, stage) chain in its own order:
    F by unit, B and W in backward order (last segment first). So the local search
    (:func:`.refine.refine`) polishes segment orders unchanged."""

    segments: int = 1

    def _chain(self, op: Op) -> list[int]:
        m, k = self.num_microbatches // self.segments, self.segments
        return forward_units(m, k) if op is Op.F else backward_units(m, k)

    def _needs(self, op: Op, s: int, u: int) -> list[tuple[int, bool]]:
        pl, S = self.placement, self.num_stages
        return [
            (
                self.index(next(p for p in PRODUCERS[key.kind] if p in _OPS), key.stage, key.mb),
                pl[key.stage] != pl[s],
            )
            for key in needs(op, s, u, S, self.segments)
        ]

    @cached_property
    def edges(self) -> tuple[tuple[int, int, bool], ...]:
        out: list[tuple[int, int, bool]] = []
        for op in _OPS:
            chain = self._chain(op)
            for s in range(self.num_stages):
                for i, u in enumerate(chain):
                    b = self.index(op, s, u)
                    out.extend((a, b, cross) for a, cross in self._needs(op, s, u))
                    if i:
                        out.append((self.index(op, s, chain[i - 1]), b, False))
        return tuple(out)

    def dependencies(self, costs: CostModel) -> list[Deps]:
        deps: list[list[tuple[int, float]]] = [[] for _ in range(len(self))]
        hop = {(op, s): float(costs.hop(op, s)) for op in _OPS for s in range(self.num_stages)}
        acts = self.actions
        for a, b, cross in self.edges:
            x = acts[a]
            deps[b].append((a, hop[x.op, x.stage] if cross else 0.0))
        return [tuple(d) for d in deps]


def uniform(costs: CostModel) -> bool:
    """Whether every segment of ``costs`` is alike (no per-segment factors but 1): the
    searches' evaluator then times and counts the units right."""
    rows = [x for row in costs.stage_segment_memory for x in row]
    factors = (*costs.segment_time, *costs.segment_memory, *costs.segment_tokens, *rows)
    return all(x == 1 for x in factors) and not any(costs.kv_grad)


def work_floor(schedule: Schedule, costs: CostModel) -> float:
    """The busiest device's actions back to back: no order of them is cheaper."""
    k = schedule.segments
    scale, _ = costs.segment_scales(k)
    return max(
        sum(
            float(costs.host_time(a.op, a.stage))
            + float(costs.duration(a.op, a.stage) - costs.host_time(a.op, a.stage))
            * float(scale[a.mb % k])
            for a in row
        )
        for row in schedule.actions
    )


def polish(
    schedule: Schedule,
    costs: CostModel,
    mem_limit: float,
    *,
    steps: int = SEGMENT_STEPS,
    deadline: float | None = None,
) -> tuple[Schedule, int]:
    """``schedule`` improved by the searches' local search and seeded restarts
    (:func:`.refine.refine`, :func:`.refine.perturb`) within ``steps`` simulated actions,
    stopping at the work floor, and the steps spent; unchanged when its costs have unequal
    segments (the searches' evaluator times every unit alike)."""
    if not uniform(costs):
        return schedule, 0
    graph = SegmentGraph(schedule.placement, schedule.num_units, schedule.segments)
    ev = Evaluator(graph, costs)
    floor = evaluator_floor(ev)
    orders = [list(o) for o in graph.orders_of(schedule.actions)]
    spans = ev.spans(orders)
    if spans is None:
        raise ValueError(f"{schedule.name}: the orders to polish deadlock")
    cost = max(spans)
    budget = steps
    if not at_floor(cost, floor) and steps > 0:
        orders, cost, spent = refine(
            graph, costs, mem_limit, orders, max_steps=steps, deadline=deadline
        )
        steps -= spent
    rng = random.Random(0)
    kicks = 0
    while not at_floor(cost, floor) and steps > 0 and kicks < KICKS and not expired(deadline):
        kicks += 1
        start = perturb(graph, costs, mem_limit, orders, rng, moves=1 + kicks % 4)
        if start is None:
            break
        got, c, spent = refine(graph, costs, mem_limit, start, max_steps=steps, deadline=deadline)
        steps -= spent
        if c < cost - 1e-12:
            orders, cost = got, c
    rows = tuple(tuple(graph.actions[i] for i in o) for o in orders)
    return schedule.with_actions(rows), budget - steps


@dataclass(frozen=True)
class SegmentPlacement:
    """A placement the segment search tries: one stage per device, or the V."""

    label: str
    chunks: int
    placement: tuple[int, ...]


def segment_placements(num_devices: int, max_chunks: int) -> list[SegmentPlacement]:
    """One stage per device, and the V where ``max_chunks`` >= 2 and P > 1 (as ``auto``)."""
    out = [SegmentPlacement("looped-v1", 1, looped_placement(num_devices, 1))]
    if max_chunks >= 2 and num_devices > 1:
        out.append(SegmentPlacement("v", 2, v_placement(num_devices)))
    return out


#: A candidate's key: cost, peak memory, segments, chunks (smaller is better).
Key = tuple[float, float, int, int]


def key_of(schedule: Schedule, costs: CostModel) -> Key:
    """``schedule``'s :data:`Key` under ``costs`` (of its placement and segment count)."""
    res = simulate(schedule, costs)
    return (
        float(res.cost),
        float(max(res.peak_memory)),
        schedule.segments,
        schedule.num_stages // schedule.num_devices,
    )


def candidates(
    p: int, m: int, k: int, cand: SegmentPlacement, costs: CostModel, limit: float
) -> list[Schedule]:
    """The schedules of ``k`` segments on ``cand``'s placement that the search starts
    from (:mod:`this module's docstring <.segmented>`), within ``limit`` or not."""
    if cand.chunks == 1:
        fixed = [split_backward(seq1f1b(p, m, segments=k)), seq_zb(p, m, segments=k)]
    else:
        prefix = zbv_warm_steady(p, m, k)
        fixed = [seq_zbv(p, m, segments=k)] + [
            retail("auto", cand.placement, m, k, prefix, costs, SegPolicy(later_first=b))
            for b in (True, False)
        ]
    passes = [segment_pass("auto", cand.placement, m, k, costs, limit, pol) for pol in GRID]
    return [s.with_actions(s.actions, name="auto") for s in fixed + passes if s is not None]


def search_segments(
    num_devices: int,
    num_microbatches: int,
    max_segments: int,
    spec: CostSpec,
    mem_limit: Number | None,
    *,
    max_chunks: int = 2,
    stages: int | None = None,
    max_stages: int | None = None,
    deadline: float | None = None,
    beat: Key | None = None,
    steps: int = SEGMENT_STEPS,
) -> tuple[Key, Schedule] | None:
    """The best schedule of k = 2..``max_segments`` segments per microbatch (and its
    key) that beats ``beat`` (the plain search's key), or None.

    Every (k, placement) gets its candidates (:func:`candidates`); then their best ones,
    cheapest first, are polished (:func:`polish`) within ``steps`` simulated actions in
    all, each only while the best so far is above its work floor (which no polish can pass).
    ``stages`` keeps only placements of that many stages (a per-stage costs file),
    ``max_stages`` those with at most that many; past ``deadline`` (a
    :func:`time.monotonic` time) it returns the best so far.
    """
    p, m = num_devices, num_microbatches
    best: tuple[Key, Schedule] | None = None
    found: list[tuple[Key, Schedule, CostModel, float]] = []
    for k in range(2, max_segments + 1):
        for cand in segment_placements(p, max_chunks):
            if expired(deadline) and found:
                break
            if stages is not None and stages != len(cand.placement):
                continue
            if max_stages is not None and len(cand.placement) > max_stages:
                continue
            try:
                _, limit = resolve_costs(cand.placement, spec, mem_limit, default=p)
            except ScheduleError:
                continue  # the plain search names why: the same limit binds every k
            costs = spec.resolve(cand.placement, k)
            tol = 1e-10 * max(1.0, abs(limit))
            fits = [
                (key, sched)
                for sched in candidates(p, m, k, cand, costs, limit)
                if (key := key_of(sched, costs))[1] <= limit + tol
            ]
            if fits:  # the first of the cheapest: the fixed kinds come first
                key, sched = min(fits, key=lambda item: item[0])
                found.append((key, sched, costs, limit))
    found.sort(key=lambda item: item[0])
    if found and (beat is None or found[0][0] < beat):
        best = found[0][0], found[0][1]
    bar = found[0][0][0] if found else math.inf  # the cheapest so far
    if beat is not None:
        bar = min(bar, beat[0])
    for key, sched, costs, limit in found:
        if steps <= 0 or expired(deadline):
            break
        if work_floor(sched, costs) >= bar * (1 - 1e-12):
            continue  # no order of it is cheaper than the best so far
        polished, spent = polish(sched, costs, limit, steps=steps, deadline=deadline)
        steps -= spent
        got = key_of(polished, costs)
        if got < key and (best is None or got < best[0]) and (beat is None or got < beat):
            best = got, polished
            bar = min(bar, got[0])
    return best


__all__ = [
    "GRID",
    "SegmentGraph",
    "candidates",
    "key_of",
    "polish",
    "search_segments",
    "work_floor",
]
