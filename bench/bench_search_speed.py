"""Wall time of the automatic schedulers, whole search included.

Goals: zb-auto < 2 s and the placement search ``auto`` with up to 2 chunks per
device (looped v=1, v=2 and V) < 10 s at P=32, M=256.

At this size the local search is skipped (its budget would not cover enough
full simulations), so the time is the grid's passes, which prune each other,
plus the handcrafted candidates and building the Schedule. The machine is
shared, so the load average (1 minute) is printed beside the figures, and the
CPU time (process time, the steadier figure under load) beside the wall time.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search_speed.py [--p 32 --m 256 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate

#: (kind, chunks option, goal in seconds or None)
KINDS = (("zb-auto", None, 2.0), ("zbv-auto", None, None), ("auto", 2, 10.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=32)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for kind, chunks, goal in KINDS:
        times, cpu = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            sched = generate(kind, args.p, args.m, chunks=chunks)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        res = simulate(sched)
        median = statistics.median(times)
        rows.append(
            {
                "kind": kind,
                "chunks": chunks,
                "P": args.p,
                "M": args.m,
                "placement_chunks": sched.num_stages // sched.num_devices,
                "actions": len(sched),
                "median_s": round(median, 3),
                "min_s": round(min(times), 3),
                "median_cpu_s": round(statistics.median(cpu), 3),
                "cost": float(res.cost),
                "bubble_rate": round(res.bubble_rate, 5),
                "goal_s": goal,
                "goal_met": None if goal is None else median < goal,
                "cpu_goal_met": None if goal is None else statistics.median(cpu) < goal,
            }
        )
    load = os.getloadavg()[0]
    print(json.dumps({"benchmark": "search_speed", "load_1min": load, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
