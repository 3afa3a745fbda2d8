"""Generate + validate + simulate every handcrafted kind at P=64, M=512 (goal: < 2 s each).

Prints one JSON object per kind and a summary; run with
``.venv/bin/python bench/bench_schedules.py [--p 64 --m 512 --repeat 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from zerobubble.schedule.generators import generate
from zerobubble.schedule.validate import validate

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv")


def time_kind(kind: str, p: int, m: int, repeat: int) -> dict[str, object]:
    gen, val = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        sched = generate(kind, p, m, chunks=2 if kind == "interleaved-1f1b" else None)
        t1 = time.perf_counter()
        result = validate(sched)
        t2 = time.perf_counter()
        gen.append(t1 - t0)
        val.append(t2 - t1)
    total = [g + v for g, v in zip(gen, val, strict=True)]
    return {
        "kind": kind,
        "P": p,
        "M": m,
        "actions": len(sched),
        "generate_s": round(statistics.median(gen), 4),
        "validate_and_simulate_s": round(statistics.median(val), 4),
        "total_s": round(statistics.median(total), 4),
        "bubble_rate": round(result.bubble_rate, 5),
        "goal_met": statistics.median(total) < 2.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--p", type=int, default=64)
    ap.add_argument("--m", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = [time_kind(k, args.p, args.m, args.repeat) for k in KINDS]
    print(json.dumps({"benchmark": "schedule_core_speed", "goal_s": 2.0, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
