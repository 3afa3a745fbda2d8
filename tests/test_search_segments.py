"""Segment schedules inside the search: ``auto`` with ``segments=K`` and its parts.

``auto(segments=K)`` is the better of the plain placement search (k = 1) and
:func:`search_segments` (k = 2..K); the plain search is tested in test_placement_search, so
most checks here call :func:`search_segments` itself (the plain search alone takes ~20 s at
P = 8, M = 8).
"""

from __future__ import annotations

import pytest

from zerobubble.cli import main
from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.generators.segment_list import SegPolicy, segment_pass
from zerobubble.schedule.ir import v_placement
from zerobubble.schedule.search.refine import Evaluator
from zerobubble.schedule.search.segmented import (
    GRID,
    SegmentGraph,
    candidates,
    search_segments,
    segment_placements,
)
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate

SEGMENT_KINDS = tuple(k for k, g in GENERATORS.items() if g.segmented)
TOL = 1e-9


def test_the_segment_kinds_are_the_three_seq_kinds():
    assert SEGMENT_KINDS == ("seq1f1b", "seq-zb", "seq-zbv")
    assert "segments" in GENERATORS["auto"].options and not GENERATORS["auto"].segmented


def test_auto_with_segments_reaches_the_floor_where_seq_zb_does_not():
    """P = 8, k = 2, M = 8 at seq-zb's peak 4.5: the V reaches the work floor, 24 against
    seq-zb's 27.5 (the outside check's figure); seq-zbv's own order is among the candidates."""
    (cost, peak, k, chunks), sched = search_segments(8, 8, 2, CostSpec(), 4.5)
    assert (cost, peak, k, chunks) == (24.0, 4.5, 2, 2)
    assert sched.name == "auto" and sched.placement == v_placement(8)
    validate(sched, mem_limit=4.5, costs=CostSpec().resolve(sched.placement, 2))


#: (P, M, K, costs): uniform, F/B/W uneven with comm, and a third mix; small enough to run
#: the whole segment search (polish included) in about a second each.
NEVER_WORSE = [
    (2, 3, 3, CostSpec()),
    (3, 2, 2, CostSpec(F=1, B=2, W=0.6, comm=0.1)),
    (3, 4, 2, CostSpec(F=1, B=1.5, W=0.5, comm=0.05)),
]


@pytest.mark.parametrize(("p", "m", "K", "spec"), NEVER_WORSE)
def test_search_segments_is_never_worse_than_a_segment_kind_it_could_have_chosen(p, m, K, spec):
    """Under each segment kind's peak as the limit (every k <= K), the search's schedule
    costs no more and holds no more."""
    kinds: dict[float, list[tuple[float, float]]] = {}  # peak -> (peak, cost) of the kinds
    for k in range(2, K + 1):
        for kind in SEGMENT_KINDS:
            sched = generate(kind, p, m, segments=k)
            res = simulate(sched, spec.resolve(sched.placement, k))
            peak = float(max(res.peak_memory))  # equal peaks in floats may differ by rounding
            kinds.setdefault(round(peak, 9), []).append((peak, float(res.cost)))
    for group in kinds.values():
        limit, costs = max(x for x, _ in group), [c for _, c in group]
        got = search_segments(p, m, K, spec, limit)
        assert got is not None
        (cost, peak, k, _), sched = got
        assert cost <= min(costs) + TOL and peak <= limit + TOL, (limit, cost, costs)
        res = validate(sched, mem_limit=limit + TOL, costs=spec.resolve(sched.placement, k))
        assert float(res.cost) == cost


def test_auto_with_segments_is_never_worse_than_auto_and_cuts_where_that_pays():
    p, m = 2, 2
    plain = generate("auto", p, m, chunks=1)
    assert generate("auto", p, m, chunks=1, segments=1) == plain
    seg = generate("auto", p, m, chunks=1, segments=2)
    a = simulate(plain, CostSpec().resolve(plain.placement))
    b = simulate(seg, CostSpec().resolve(seg.placement, seg.segments))
    # One stage per device at P = 2, M = 2, limit P: 7 against 6 (the floor) with k = 2.
    assert (float(a.cost), seg.segments, float(b.cost)) == (7.0, 2, 6.0)
    assert max(b.peak_memory) <= 2
    with pytest.raises(ValueError, match="overlapped F&B pairs with sequence segments"):
        generate("auto", p, m, segments=2, overlap=True)
    with pytest.raises(ValueError, match="segments must be an integer >= 1"):
        generate("auto", p, m, segments=0)


def test_cli_auto_segments(capsys):
    assert main(["schedule", "auto", "-p", "2", "-m", "2", "--chunks", "1", "--segments", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("auto: P=2 S=2 M=2 segments=2 cost=6 "), first


def test_the_list_scheduler_never_stalls_at_the_smallest_feasible_limit():
    """One microbatch on every stage of a device is the least any schedule needs; every
    policy of the grid schedules within it (the rule: room for the oldest microbatch)."""
    spec = CostSpec(F=1, B=2, W=0.5, comm=0.2)
    for p in (2, 3):
        for k in (2, 3):
            for m in (1, 3):
                for cand in segment_placements(p, 2):
                    costs = spec.resolve(cand.placement, k)
                    for policy in (*GRID, SegPolicy()):
                        sched = segment_pass("t", cand.placement, m, k, costs, 1.0, policy)
                        assert sched is not None, (p, k, m, cand.label, policy)
                        validate(sched, mem_limit=1.0 + TOL, costs=costs)


def test_the_search_graph_over_units_times_like_the_simulator():
    """SegmentGraph's edges are the rule's with segments: the searches' evaluator (which
    the local search runs on) gives every candidate the simulator's spans."""
    spec = CostSpec(F=1, B=2, W=0.6, comm=0.1)
    p, m, k = 3, 2, 3
    for cand in segment_placements(p, 2):
        costs = spec.resolve(cand.placement, k)
        graph = SegmentGraph(cand.placement, m * k, k)
        ev = Evaluator(graph, costs)
        for sched in candidates(p, m, k, cand, costs, 2.0):
            spans = ev.spans([list(o) for o in graph.orders_of(sched.actions)])
            assert spans is not None
            assert spans == pytest.approx([float(x) for x in simulate(sched, costs).span])


def test_the_polish_pays_where_no_candidate_reaches_the_floor():
    spec = CostSpec(F=1, B=2, W=1, comm=0.2)
    unpolished = search_segments(3, 6, 2, spec, 1.5, steps=0)
    polished = search_segments(3, 6, 2, spec, 1.5)
    assert unpolished is not None and polished is not None
    assert unpolished[0][:2] == pytest.approx((34.1, 1.5))
    assert polished[0][:2] == pytest.approx((33.85, 1.5))
