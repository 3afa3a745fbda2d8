"""Wall time of the automatic schedulers, whole search included.

Goals: zb-auto < 2 s and the placement search ``auto`` with up to 2 chunks per
device (looped v=1, v=2 and V) < 10 s at P=32, M=256; ``auto`` with its default
chunks (up to 4 per device, six placements) at most 10 s CPU at P=32, M=256 and
30 s CPU at P=64, M=512 (issue 27; before: 11 s and about 60 s on the 2-core machine).

At these sizes the local search is skipped (its budget would not cover enough
full simulations), so the time is the grid's passes, which prune each other,
the handcrafted candidates (simulated only while they can still win) and
building the Schedule. The machine is
shared, so the load average (1 minute) is printed beside the figures, and the
CPU time (process time, the steadier figure under load) beside the wall time.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search_speed.py [--p 32 --m 256 --repeat 3]``
(and ``--p 64 --m 512 --repeat 1`` for the large goal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate

#: (kind, chunks option, goal in seconds or None at P=32, M=256)
KINDS = (("zb-auto", None, 2.0), ("zbv-auto", None, None), ("auto", 2, 10.0), ("auto", None, 10.0))

#: CPU-second goals of ``auto`` with its default chunks by (P, M), from issue 27.
AUTO_GOALS = {(32, 256): 10.0, (64, 512): 30.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=32)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for kind, chunks, goal in KINDS:
        if (args.p, args.m) != (32, 256):
            goal = AUTO_GOALS.get((args.p, args.m)) if (kind, chunks) == ("auto", None) else None
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
