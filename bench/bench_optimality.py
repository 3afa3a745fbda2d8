"""Certify zb-auto against the exact MILP on the full small grid.

Grid: P in 1..4, M in 1..6, memory limits P (ZB-1p) and 2P (ZB-2p), ``--seeds``
seeds of random uneven per-stage costs per (P, M). Costs are drawn as in
tests/test_search.py (``realistic``): F in [0.8, 1.2], B in [0.9, 1.4], W in
[0.4, 0.9], first stage +[0, 0.3] on F and B, last stage +[0.2, 0.6], comm in
[0, 0.1]. ``--harsh`` draws F, B in [0.5, 2], W in [0.3, 1.5], comm in [0, 0.3]
instead (stages up to 4x apart), a stress test.

For each instance: zb-auto's cost over the MILP's proven lower bound, and
whether zb-auto is above zb-h1 (limit P) or zb-h2 (limit 2P). Prints JSON with
the worst ratio, how many instances are within 1%, and the time both took.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_optimality.py [--seeds 10] [--harsh]``.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import zb_h1, zb_h2
from zerobubble.schedule.search import solve_optimal, zb_auto
from zerobubble.schedule.simulate import simulate


def realistic(rng: random.Random, p: int) -> CostModel:
    f = [rng.uniform(0.8, 1.2) for _ in range(p)]
    b = [rng.uniform(0.9, 1.4) for _ in range(p)]
    w = [rng.uniform(0.4, 0.9) for _ in range(p)]
    f[0] += rng.uniform(0, 0.3)
    b[0] += rng.uniform(0, 0.3)
    f[-1] += rng.uniform(0.2, 0.6)
    b[-1] += rng.uniform(0.2, 0.6)
    return CostModel.per_stage(f, b, w, comm=rng.uniform(0, 0.1))


def harsh(rng: random.Random, p: int) -> CostModel:
    return CostModel.per_stage(
        [rng.uniform(0.5, 2) for _ in range(p)],
        [rng.uniform(0.5, 2) for _ in range(p)],
        [rng.uniform(0.3, 1.5) for _ in range(p)],
        comm=rng.uniform(0, 0.3),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--harsh", action="store_true")
    args = ap.parse_args()
    draw = harsh if args.harsh else realistic
    rows = []
    t_auto = t_milp = 0.0
    for seed in range(args.seeds):
        for p in range(1, 5):
            for m in range(1, 7):
                costs = draw(random.Random(1000 * p + 10 * m + seed), p)
                spec = CostSpec(stage_costs=costs)
                for limit, hand in ((p, zb_h1(p, m)), (2 * p, zb_h2(p, m))):
                    t0 = time.perf_counter()
                    sched = zb_auto(p, m, costs=spec, mem_limit=limit)
                    t1 = time.perf_counter()
                    opt = solve_optimal(sched, costs, limit, time_limit=120)
                    t2 = time.perf_counter()
                    t_auto += t1 - t0
                    t_milp += t2 - t1
                    cost = float(simulate(sched, costs).cost)
                    rows.append(
                        {
                            "seed": seed,
                            "P": p,
                            "M": m,
                            "limit": limit,
                            "zb_auto": cost,
                            "optimum": opt.cost,
                            "lower_bound": opt.lower_bound,
                            "proven": opt.proven,
                            "ratio": cost / opt.lower_bound,
                            "above_handcrafted": cost > float(simulate(hand, costs).cost) + 1e-9,
                        }
                    )
    worst = max(rows, key=lambda r: r["ratio"])
    summary = {
        "costs": "harsh" if args.harsh else "realistic",
        "instances": len(rows),
        "all_proven": all(r["proven"] for r in rows),
        "worst_ratio": round(worst["ratio"], 6),
        "worst_instance": {k: worst[k] for k in ("seed", "P", "M", "limit")},
        "within_1pct": sum(r["ratio"] <= 1.01 for r in rows),
        "equal_to_milp_best": sum(r["zb_auto"] <= r["optimum"] * (1 + 1e-9) for r in rows),
        "above_handcrafted": sum(r["above_handcrafted"] for r in rows),
        "zb_auto_seconds": round(t_auto, 2),
        "milp_seconds": round(t_milp, 2),
    }
    bad = [r for r in rows if r["ratio"] > 1.01]
    print(
        json.dumps({"benchmark": "zb_auto_vs_milp", "summary": summary, "over_1pct": bad}, indent=1)
    )


if __name__ == "__main__":
    main()
