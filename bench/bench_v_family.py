"""V-shaped schedules against 1F1B and ZB-V: simulated figures, then generation speed.

Figures are exact simulations at per-device totals F = B = W = 1 (M_W = M_B/2):
cost (longest device span), bubble rate and peak activation memory (1F1B's is
P). Speed is generate + validate at a large P, M. Prints one JSON object;
run with ``.venv/bin/python bench/bench_v_family.py [--speed-p 64 --speed-m 512]``.
"""

from __future__ import annotations

import argparse
import json
import time
from fractions import Fraction

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.validate import validate

KINDS = ("1f1b", "zbv", "v-half", "v-min", "1f1b-v", "dualpipev")
CASES = ((4, 8), (8, 16))


def figures(kind: str, p: int, m: int) -> dict[str, object]:
    sched = generate(kind, p, m)
    costs = CostModel.from_device_totals(
        sched.placement, Fraction(1), Fraction(1), Fraction(1), mem_w=Fraction(1, 2)
    )
    r = validate(sched, costs=costs)
    return {
        "kind": kind,
        "P": p,
        "M": m,
        "cost": str(r.cost),
        "bubble": str(r.bubble_time),
        "bubble_rate": round(r.bubble_rate, 4),
        "peak_memory": str(Fraction(max(r.peak_memory))),
        "peak_vs_1f1b": round(float(max(r.peak_memory)) / p, 4),
    }


def speed(kind: str, p: int, m: int) -> dict[str, object]:
    t0 = time.perf_counter()
    sched = generate(kind, p, m)
    t1 = time.perf_counter()
    validate(sched)
    t2 = time.perf_counter()
    return {
        "kind": kind,
        "P": p,
        "M": m,
        "actions": len(sched),
        "generate_s": round(t1 - t0, 3),
        "validate_s": round(t2 - t1, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--speed-p", type=int, default=64)
    ap.add_argument("--speed-m", type=int, default=512)
    args = ap.parse_args()
    table = [figures(k, p, m) for p, m in CASES for k in KINDS]
    timing = [speed(k, args.speed_p, args.speed_m) for k in KINDS]
    print(json.dumps({"benchmark": "v_family", "figures": table, "speed": timing}, indent=2))


if __name__ == "__main__":
    main()
