"""Overlapped F&B pairs inside the search (``overlap=True`` on auto, zb-auto, zbv-auto)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

import zerobubble.schedule.search.auto as search_auto
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import GENERATORS, NoPairWarning, generate
from zerobubble.schedule.ir import Op, looped_placement, v_placement
from zerobubble.schedule.search import zbv_auto
from zerobubble.schedule.search.auto import GRID_V, round_grid
from zerobubble.schedule.search.graph import ActionGraph, min_feasible_limit
from zerobubble.schedule.search.greedy import run_pass
from zerobubble.schedule.search.pairs import (
    PairEvaluator,
    decode,
    encode,
    perturb_pairs,
    refine_pairs,
)
from zerobubble.schedule.search.placement import zigzag_placement
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate


def _eighths(rng: random.Random, lo: int, hi: int) -> float:
    """A duration in eighths: sums of these are exact in floats, so times compare with ==."""
    return rng.randint(lo, hi) / 8


def test_the_search_times_pairs_as_the_simulator_does():
    """Random placements (V, looped v = 2, 3, zig-zag v = 4), uneven costs with all-to-all,
    comm and limits from the smallest feasible up: every pairing pass of the grid, the
    local search and a kick give orders that decode into valid schedules within the limit,
    whose simulated cost is exactly the search's own, and encode back to the same orders.
    A block that is an F with a B and its W is a pair (F, BW)."""
    rng = random.Random(5)
    checked, with_bw = 0, 0
    for _ in range(20):
        p, m = rng.choice([2, 3, 4]), rng.choice([2, 3, 5])
        placement = rng.choice(
            [v_placement(p), looped_placement(p, 2), looped_placement(p, 3), zigzag_placement(p, 4)]
        )
        n = len(placement)
        costs = CostModel.per_stage(
            [_eighths(rng, 2, 12) for _ in range(n)],
            [_eighths(rng, 2, 16) for _ in range(n)],
            [_eighths(rng, 1, 8) for _ in range(n)],
            comm=rng.choice([0, 0.125]),
            a2a=[_eighths(rng, 0, 12) for _ in range(n)],
        )
        limit = float(min_feasible_limit(placement, costs)) * rng.choice([1, 1.5, 3])
        graph = ActionGraph(placement, m)
        ev = PairEvaluator(graph, costs)
        found = []
        for pol in GRID_V[:2] + round_grid(p)[:1]:
            for then_w in (False, True):
                pairing = replace(pol, pair=True, pair_then_w=then_w)
                got = run_pass(placement, m, costs, limit, pairing)
                if got is not None:
                    found.append((got.orders, got.cost))
        orders = [list(o) for o in min(found, key=lambda f: f[1])[0]]
        polished, cost, _ = refine_pairs(graph, costs, limit, orders, max_steps=20_000)
        found.append((tuple(map(tuple, polished)), cost))
        kicked = perturb_pairs(graph, costs, limit, polished, rng, 3)
        if kicked is not None:
            found.append((tuple(map(tuple, kicked)), max(ev.spans(kicked) or [0.0])))
        for orders, cost in found:
            sched = decode("x", graph, orders)
            res = validate(sched, mem_limit=limit * (1 + 1e-12), costs=costs)
            assert float(res.cost) == cost == ev.cost_within(orders, cost)
            assert encode(graph, sched) == tuple(map(tuple, orders))
            assert all(f.op is Op.F and f.stage != b.stage for f, b in sched.overlaps)
            with_bw += sum(b.op is Op.BW for _, b in sched.overlaps)
            checked += bool(sched.overlaps)
    assert checked >= 20 and with_bw > 0  # pairs were formed, some with a W inside


def test_zbv_auto_pairs_where_dualpipev_and_zbv_pair():
    """The issue's mix, at M = 2P: all-to-all as long as compute (a2a = F = B = W = 1 per
    device) and dualpipev's peak as the limit. DualPipeV with its pairs takes 37.5, zbv with
    the pass's 37; zbv-auto without pairs 42.5 (the all-to-all in every F and B), with them
    35.0 (the floor, every F paired and each W between blocks, is 24)."""
    spec = CostSpec(a2a=1)
    model = spec.resolve(v_placement(4))
    costs = {
        (kind, overlap): simulate(
            generate(kind, 4, 8, overlap=overlap, costs=spec, mem_limit=4.5), model
        ).cost
        for kind, overlap in (("dualpipev", True), ("zbv", True), ("zbv-auto", False))
    }
    assert costs == {
        ("dualpipev", True): 37.5,
        ("zbv", True): 37,
        ("zbv-auto", False): 42.5,
    }
    paired = zbv_auto(4, 8, costs=spec, mem_limit=4.5, overlap=True)
    res = validate(paired, mem_limit=4.5, costs=model)
    assert res.cost == 35.0 and max(res.peak_memory) <= 4.5
    assert len(paired.overlaps) == 26 and all(f.stage != b.stage for f, b in paired.overlaps)
    assert PairEvaluator(ActionGraph(v_placement(4), 8), model).floor() == 24.0


def _candidates(max_chunks: int) -> list[tuple[str, int | None, bool]]:
    """Every kind auto could choose (name, chunks, overlap): the ones that pair, with and
    without their pairs; the MILP kinds and segment kinds are not among its choices."""
    out: list[tuple[str, int | None, bool]] = []
    for name, gen in GENERATORS.items():
        if name in ("auto", "optimal", "optimal-v") or gen.segmented:
            continue
        for v in range(1, max_chunks + 1) if "chunks" in gen.options else (None,):
            out.append((name, v, False))
            if name not in ("gpipe", "1f1b", "zb-h1", "zb-h2") and v != 1:
                out.append((name, v, True))
    return out


#: (P, cost mix, limit) rows: every P with every mix or limit, in 8 rows instead of 24.
ROWS = (
    (2, 0, "tight"),
    (2, 2, "loose"),
    (3, 1, "tight"),
    (3, 2, "loose"),
    (4, 0, "loose"),
    (4, 1, "tight"),
    (8, 1, "loose"),
    (8, 2, "tight"),
)
MIXES = (
    CostSpec(F=1, B=2, W=1, comm=0.1),  # no all-to-all
    CostSpec(F=1, B=1.5, W=0.7, a2a=0.5),
    CostSpec(F=1, B=2, W=1, comm=0.1, a2a=1.5),
)


@pytest.mark.filterwarnings("ignore::zerobubble.schedule.generators.NoPairWarning")
def test_auto_with_pairs_is_never_worse_than_a_kind_it_could_have_chosen(monkeypatch):
    """auto --overlap (two chunks at most) costs no more than any kind it could have chosen,
    with or without pairs, that fits the limit (tight: V's smallest feasible limit plus half
    a microbatch; loose: 2P), exactly, at P = 2, 3, 4, 8 and M = 2P. It holds by
    construction, not by the polish: the local search's budgets are cut to 20,000 simulated
    actions here (the fixed paired kinds are compared as generate makes them)."""
    for name in ("REFINE_STEPS", "KICK_STEPS", "PLATEAU_STEPS", "PAIR_STEPS"):
        monkeypatch.setattr(search_auto, name, 20_000)
    paired_wins = 0
    for p, mix, tight in ROWS:
        spec, m = MIXES[mix], 2 * p
        limit = (p + 1) / 2 if tight == "tight" else 2 * p
        sched = generate("auto", p, m, chunks=2, costs=spec, mem_limit=limit, overlap=True)
        ours = validate(sched, mem_limit=limit, costs=spec.resolve(sched.placement))
        best_other = float("inf")
        for name, chunks, overlap in _candidates(2):
            searches = "mem_limit" in GENERATORS[name].options
            try:
                other = generate(
                    name,
                    p,
                    m,
                    chunks=chunks,
                    costs=spec,
                    mem_limit=limit if searches or overlap else None,
                    overlap=overlap,
                )
                res = validate(other, mem_limit=limit, costs=spec.resolve(other.placement))
            except ValueError:  # refuses this P, M, chunks or pairs, or breaks the limit
                continue
            assert ours.cost <= res.cost, (p, mix, limit, name, chunks, overlap)
            if not (searches and overlap):  # zb-auto and zbv-auto pair as auto does
                best_other = min(best_other, float(res.cost))
        if mix == 0:
            assert not sched.overlaps  # no all-to-all: no pair pays
        paired_wins += bool(sched.overlaps) and ours.cost < best_other
    assert paired_wins >= 3  # the search's own pairs beat every fixed kind and plain search


def test_no_all_to_all_changes_nothing_and_one_stage_cannot_pair(monkeypatch):
    """Without an all-to-all cost, overlap=True returns the very schedule of overlap=False
    (and says no pair paid); a search held to one stage per device refuses pairs. (Budgets
    cut as above: the claims hold at any budget.)"""
    for name in ("REFINE_STEPS", "KICK_STEPS", "PLATEAU_STEPS", "PAIR_STEPS"):
        monkeypatch.setattr(search_auto, name, 20_000)
    spec = CostSpec(F=1, B=2, W=1, comm=0.1)
    for kind, opts in (("zbv-auto", {}), ("zb-auto", {"chunks": 2})):
        plain = generate(kind, 3, 6, costs=spec, **opts)
        with pytest.warns(NoPairWarning, match="no all-to-all cost was given"):
            assert generate(kind, 3, 6, costs=spec, overlap=True, **opts) == plain
    for kind, opts in (("zb-auto", {}), ("auto", {"chunks": 1})):
        with pytest.raises(ValueError, match=f"schedule kind '{kind}' places one stage per"):
            generate(kind, 3, 6, costs=CostSpec(a2a=1), overlap=True, **opts)
