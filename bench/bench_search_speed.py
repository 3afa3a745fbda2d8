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

Every kind runs at equal costs (F=B=W=1, comm=0) and at the unequal mix of issue 46
(``F=1,B=2,W=1,comm=0.1``, per device), where zero bubble is out of reach and every
placement's passes and seeds run until they cannot win (goals for ``auto`` there as at
equal costs: 10 s and 30 s of CPU); ``--costs`` picks one mix. Each row prints the cost
found beside the time, so a faster search that finds a dearer schedule shows.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_search_speed.py [--p 32 --m 256 --repeat 3]
[--costs equal|uneven]`` (and ``--p 64 --m 512 --repeat 1`` for the large goal).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from zerobubble.schedule.costs import CostSpec, parse_costs
from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate

#: (kind, chunks option, goal in seconds or None at P=32, M=256)
KINDS = (("zb-auto", None, 2.0), ("zbv-auto", None, None), ("auto", 2, 10.0), ("auto", None, 10.0))

#: CPU-second goals of ``auto`` with its default chunks by (P, M), from issue 27 (equal
#: costs) and issue 46 (the unequal mix).
AUTO_GOALS = {(32, 256): 10.0, (64, 512): 30.0}

#: The cost mixes, per-device totals (None: the default, F=B=W=1 and comm=0).
COSTS = {"equal": None, "uneven": "F=1,B=2,W=1,comm=0.1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=32)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--costs", choices=sorted(COSTS), action="append")
    args = ap.parse_args()
    rows = []
    for mix, (kind, chunks, goal) in (
        (mix, row) for mix in args.costs or list(COSTS) for row in KINDS
    ):
        if (args.p, args.m) != (32, 256):
            goal = AUTO_GOALS.get((args.p, args.m)) if (kind, chunks) == ("auto", None) else None
        text = COSTS[mix]
        spec = CostSpec() if text is None else parse_costs(text)
        times, cpu = [], []
        for _ in range(args.repeat):
            t0, c0 = time.perf_counter(), time.process_time()
            sched = generate(kind, args.p, args.m, chunks=chunks, costs=spec)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        res = simulate(sched, spec.resolve(sched.placement))
        median = statistics.median(times)
        rows.append(
            {
                "kind": kind,
                "chunks": chunks,
                "costs": text or "F=1,B=1,W=1,comm=0",
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
