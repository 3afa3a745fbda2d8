"""Wall time of the automatic schedulers, whole search included (goal: zb-auto < 2 s at
P=32, M=256).

At this size the local search is skipped (its budget would not cover enough
full simulations), so the time is the grid's passes, which prune each other,
plus the handcrafted candidates and building the Schedule.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search_speed.py [--p 32 --m 256 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=32)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for kind in ("zb-auto", "zbv-auto"):
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            sched = generate(kind, args.p, args.m)
            times.append(time.perf_counter() - t0)
        res = simulate(sched)
        rows.append(
            {
                "kind": kind,
                "P": args.p,
                "M": args.m,
                "actions": len(sched),
                "median_s": round(statistics.median(times), 3),
                "min_s": round(min(times), 3),
                "cost": float(res.cost),
                "bubble_rate": round(res.bubble_rate, 5),
                "goal_met": statistics.median(times) < 2.0 if kind == "zb-auto" else None,
            }
        )
    print(json.dumps({"benchmark": "search_speed", "goal_s": 2.0, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
