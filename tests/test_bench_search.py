"""bench/bench_search.py --a2a (issue 46's table) at its smallest: P=2, M=4, a2a = F/2."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import zerobubble.schedule.search.auto as search_auto
from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.schedule.simulate import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench_search


def test_a2a_rows_price_every_peer_by_one_simulator_and_auto_is_never_worse(monkeypatch):
    """Every peer of the --a2a table is simulated with the all-to-all in its F and backward
    (PyTorch's DualPipeV keeps its own pairs, our kinds pair where it pays), and auto with
    pairs, under each peer's peak, costs no more (budgets cut to 20,000 simulated actions:
    it holds by construction, not by the polish)."""
    for name in ("REFINE_STEPS", "KICK_STEPS", "PLATEAU_STEPS", "PAIR_STEPS"):
        monkeypatch.setattr(search_auto, name, 20_000)
    args = argparse.Namespace(
        p=[2], m_per_p=[2], mix=["fbw"], comm=[0.0], a2a=[0.5], peer=list(bench_search.A2A_PEERS)
    )
    rows = bench_search.peer_rows(args)
    assert [r["peer"] for r in rows] == [
        "torch:InterleavedZeroBubble",
        "torch:ZBVZeroBubble",
        "torch:DualPipeV",
        "dualpipev --overlap",
        "zbv --overlap",
    ]
    a2a = rows[0]["_a2a"]
    assert abs(a2a - 0.5) < 1e-9  # half a device's F (fbw: F = 1)
    # PyTorch's DualPipeV with its pairs: cheaper than the same order with every action alone.
    theirs = torch_schedule("DualPipeV", 2, 4)
    assert theirs.overlaps
    model = bench_search.stage_costs(theirs.placement, bench_search.layer_costs(2, "fbw"), 0, a2a)
    alone = simulate(theirs.with_actions(theirs.actions, overlaps=()), model)
    assert rows[2]["peer_cost"] == round(float(simulate(theirs, model).cost), 4)
    assert rows[2]["peer_cost"] < float(alone.cost)
    for r in rows:
        mine = bench_search.ours(2, 4, "fbw", 0.0, r["peer_peak"], False, a2a)["auto"]
        assert mine["cost"] <= r["peer_cost"] and mine["peak"] <= r["peer_peak"] + 1e-9, r
