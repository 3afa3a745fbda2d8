"""How the automatic schedulers' grids (search.auto.GRID_1 / GRID_V) were chosen.

Every combination of the heuristic's choices is run (one pass each, no local
search) on seeded instances: P in {2, 3, 4, 6, 8}, M in {2, 4, 6, 8, 12, 16},
limits P and 2P (1.5P too for V), equal and uneven costs. Then policies are
picked greedily, each time the one that most lowers the mean ratio of the
best-of-picked cost to the best-of-all cost. Prints JSON: the pick order with
the mean and worst ratio after each pick, and how the shipped grid does.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_grid.py [--seeds 4]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import looped_placement, v_placement
from zerobubble.schedule.search.auto import GRID_1, GRID_V
from zerobubble.schedule.search.greedy import Policy, run_pass

BOOL = (False, True)


def uneven(rng: random.Random, stages: int, scale: float) -> CostModel:
    f = [rng.uniform(0.8, 1.2) * scale for _ in range(stages)]
    b = [rng.uniform(0.9, 1.4) * scale for _ in range(stages)]
    w = [rng.uniform(0.4, 0.9) * scale for _ in range(stages)]
    f[0] += 0.3 * scale
    b[-1] += 0.4 * scale
    f[-1] += 0.4 * scale
    mem = [scale] * stages
    return CostModel.per_stage(f, b, w, rng.uniform(0, 0.1) * scale, mem, [x / 2 for x in mem])


def study(v_shape: bool, seeds: int) -> dict[str, object]:
    if v_shape:
        combos = [
            Policy(f_first=a, f_overrun=b, w_overrun=c, later_first=d, inflight=e)
            for a, b, c, d, e in itertools.product(BOOL, BOOL, BOOL, BOOL, (0, 1))
        ]
        shipped, factors = GRID_V, (1.0, 1.5, 2.0)
    else:
        combos = [
            Policy(f_first=a, f_overrun=b, w_overrun=c, inflight=e)
            for a, b, c, e in itertools.product(BOOL, BOOL, BOOL, (0, 1, 2))
        ]
        shipped, factors = GRID_1, (1.0, 2.0)
    ratios: dict[Policy, list[float]] = {c: [] for c in combos}
    for seed in range(seeds):
        rng = random.Random(seed)
        for p in (2, 3, 4, 6, 8):
            placement = v_placement(p) if v_shape else looped_placement(p, 1)
            scale = 0.5 if v_shape else 1.0
            for m in (2, 4, 6, 8, 12, 16):
                for costs in (
                    CostModel.from_device_totals(placement),
                    uneven(rng, len(placement), scale),
                ):
                    for k in factors:
                        costs_by = {c: run_pass(placement, m, costs, k * p, c).cost for c in combos}
                        best = min(costs_by.values())
                        for c, x in costs_by.items():
                            ratios[c].append(x / best)
    n = len(next(iter(ratios.values())))

    def cover(picked: list[Policy]) -> tuple[float, float]:
        per = [min(ratios[c][i] for c in picked) for i in range(n)]
        return sum(per) / n, max(per)

    picked: list[Policy] = []
    order = []
    while len(picked) < len(shipped) + 2:
        best_c = min((c for c in combos if c not in picked), key=lambda c: cover([*picked, c])[0])
        picked.append(best_c)
        mean, worst = cover(picked)
        order.append(
            {"policy": repr(best_c), "mean_ratio": round(mean, 5), "worst": round(worst, 4)}
        )
    mean, worst = cover(list(shipped))
    return {
        "instances": n,
        "pick_order": order,
        "shipped_grid": {
            "size": len(shipped),
            "mean_ratio": round(mean, 5),
            "worst": round(worst, 4),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    out = {"one_stage": study(False, args.seeds), "v_shape": study(True, args.seeds)}
    print(json.dumps({"benchmark": "policy_grid", **out}, indent=1))


if __name__ == "__main__":
    main()
