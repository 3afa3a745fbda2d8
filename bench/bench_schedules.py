"""Generate + validate + simulate every registered kind at P=64, M=512 (goal: < 2 s each).

Every handcrafted kind is a target. Kinds that take a memory limit are
searches (``auto``, ``zb-auto``, ``zbv-auto``): they are timed once and reported
with ``target: false`` (their own goal is in ``bench_search_speed.py``).
``optimal`` and ``optimal-v`` are exact MILPs for small instances only and are
skipped.

Times are medians over ``--repeat`` runs: wall clock (the goal) and CPU time
of this process (steadier on a shared machine). Prints one JSON object; run
with ``PYTHONPATH=src .venv/bin/python bench/bench_schedules.py [--p 64 --m 512
--repeat 3] [--kinds v-half,zbv]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.validate import validate

GOAL_S = 2.0
SKIP = {kind: "exact MILP, small instances only" for kind in ("optimal", "optimal-v")}
OPTIONS = {"interleaved-1f1b": {"chunks": 2}}


def is_search(kind: str) -> bool:
    return "mem_limit" in GENERATORS[kind].options


def time_kind(kind: str, p: int, m: int, repeat: int) -> dict[str, object]:
    wall: dict[str, list[float]] = {"generate": [], "validate": []}
    cpu: list[float] = []
    for _ in range(1 if is_search(kind) else repeat):
        c0, t0 = time.process_time(), time.perf_counter()
        sched = generate(kind, p, m, **OPTIONS.get(kind, {}))
        t1 = time.perf_counter()
        result = validate(sched)
        t2, c2 = time.perf_counter(), time.process_time()
        wall["generate"].append(t1 - t0)
        wall["validate"].append(t2 - t1)
        cpu.append(c2 - c0)
    total = statistics.median(g + v for g, v in zip(*wall.values(), strict=True))
    target = not is_search(kind)
    return {
        "kind": kind,
        "P": p,
        "M": m,
        "actions": len(sched),
        "generate_s": round(statistics.median(wall["generate"]), 4),
        "validate_and_simulate_s": round(statistics.median(wall["validate"]), 4),
        "total_s": round(total, 4),
        "cpu_total_s": round(statistics.median(cpu), 4),
        "bubble_rate": round(result.bubble_rate, 5),
        "max_peak_memory": float(max(result.peak_memory)),
        "target": target,
        "goal_met": total < GOAL_S if target else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--kinds", default=None, help="comma-separated subset (default: all)")
    args = ap.parse_args()
    kinds = args.kinds.split(",") if args.kinds else [k for k in GENERATORS if k not in SKIP]
    rows = [time_kind(k, args.p, args.m, args.repeat) for k in kinds]
    targets = [r for r in rows if r["target"]]
    print(
        json.dumps(
            {
                "benchmark": "schedule_core_speed",
                "goal_s": GOAL_S,
                "skipped": {k: why for k, why in SKIP.items() if k in GENERATORS},
                "all_targets_met": all(r["goal_met"] for r in targets),
                "rows": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
