"""zb-auto / zbv-auto against PyTorch's schedules at the same (or lower) peak memory.

Ours: zb-auto (one stage per device), zb-auto with chunks=2 (interleaved
placement, InterleavedZeroBubble's) and zbv-auto (V placement).

For P in {4, 8, 16} and M in {P, 2P, 4P}, under equal and uneven costs, each
peer schedule is simulated, and ours are generated with ``mem_limit`` = the
peer's simulated peak, so every comparison is at equal or lower memory. Peers:
PyTorch pipelining's InterleavedZeroBubble, ZBVZeroBubble and DualPipeV
(imported from ``get_schedule_ops``), and 1F1B (ours: PyTorch's listing names
microbatch M on the last rank, so it cannot be imported; ours is the same
schedule).

Costs come from a model of 2P layers, so every placement is costed
consistently: with one stage per device stage d holds layers 2d and 2d+1, with
two chunks stage s holds layer s. Equal: every layer F=B=W=1/2. Uneven (seeded):
per-layer F in [0.4, 0.6], B in [0.45, 0.7], W in [0.2, 0.45], the first layer
heavier (embedding) and the last heavier still (head and loss), comm 0.02.
Memory: one microbatch's activations on all of a device's layers is 1 (M_B).

Prints JSON; ``--quick`` runs only P=4 (and is what CI-sized machines should use).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule, looped_placement, v_placement
from zerobubble.schedule.simulate import simulate

PEERS = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "1F1B")
#: Our kinds: (label, kind, chunks, placement).
OURS = (
    ("zb-auto", "zb-auto", None, lambda p: looped_placement(p, 1)),
    ("zb-auto-chunks2", "zb-auto", 2, lambda p: looped_placement(p, 2)),
    ("zbv-auto", "zbv-auto", None, v_placement),
)


def layer_costs(
    p: int, uneven: bool, seed: int = 0
) -> tuple[list[float], list[float], list[float]]:
    n = 2 * p
    if not uneven:
        return [0.5] * n, [0.5] * n, [0.5] * n
    rng = random.Random(seed * 1000 + p)
    f = [rng.uniform(0.4, 0.6) for _ in range(n)]
    b = [rng.uniform(0.45, 0.7) for _ in range(n)]
    w = [rng.uniform(0.2, 0.45) for _ in range(n)]
    f[0] += 0.15
    b[0] += 0.1
    f[-1] += 0.3
    b[-1] += 0.3
    return f, b, w


def stage_costs(placement: tuple[int, ...], layers, comm: float) -> CostModel:
    """Per-stage costs of ``placement`` from per-layer costs (2P layers in model order)."""
    f, b, w = layers
    per = len(f) // len(placement)
    group = [range(s * per, (s + 1) * per) for s in range(len(placement))]
    mem = [per / 2 for _ in placement]  # 2 layers = one device's M_B
    return CostModel.per_stage(
        [sum(f[i] for i in g) for g in group],
        [sum(b[i] for i in g) for g in group],
        [sum(w[i] for i in g) for g in group],
        comm,
        mem_f=mem,
        mem_w=[x / 2 for x in mem],
    )


def peer(name: str, p: int, m: int) -> Schedule:
    if name == "1F1B":
        return generate("1f1b", p, m)
    return torch_schedule(name, p, m)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="P=4 only")
    args = ap.parse_args()
    rows = []
    for p in (4,) if args.quick else (4, 8, 16):
        for m in (p, 2 * p, 4 * p):
            for uneven in (False, True):
                layers = layer_costs(p, uneven)
                comm = 0.02 if uneven else 0.0
                ours_cache: dict[tuple[str, float], tuple[float, float, float]] = {}
                for name in PEERS:
                    try:
                        theirs = peer(name, p, m)
                    except Exception as exc:  # a peer that cannot build this (P, M)
                        rows.append(
                            {"P": p, "M": m, "uneven": uneven, "peer": name, "error": str(exc)}
                        )
                        continue
                    costs = stage_costs(theirs.placement, layers, comm)
                    ref = simulate(theirs, costs)
                    limit = float(max(ref.peak_memory))
                    row = {
                        "P": p,
                        "M": m,
                        "uneven": uneven,
                        "peer": name,
                        "peer_cost": round(float(ref.cost), 4),
                        "peer_peak": limit,
                    }
                    for label, kind, chunks, placement in OURS:
                        key = (label, limit)
                        if key not in ours_cache:
                            mine = stage_costs(placement(p), layers, comm)
                            t0 = time.perf_counter()
                            spec = CostSpec(stage_costs=mine)
                            ours = generate(kind, p, m, chunks=chunks, costs=spec, mem_limit=limit)
                            secs = time.perf_counter() - t0
                            res = simulate(ours, mine)
                            ours_cache[key] = (float(res.cost), float(max(res.peak_memory)), secs)
                        cost, peak, secs = ours_cache[key]
                        row[label] = {
                            "cost": round(cost, 4),
                            "peak": peak,
                            "seconds": round(secs, 3),
                        }
                    best = min(row[label]["cost"] for label, *_ in OURS)
                    row["best_ours_vs_peer"] = round(best / row["peer_cost"], 4)
                    rows.append(row)
    ok = [r for r in rows if "error" not in r]
    summary = {
        "comparisons": len(ok),
        "never_worse": all(r["best_ours_vs_peer"] <= 1 + 1e-9 for r in ok),
        "strictly_better_uneven": sum(1 for r in ok if r["uneven"] and r["best_ours_vs_peer"] < 1),
        "uneven_comparisons": sum(1 for r in ok if r["uneven"]),
        "worst_ratio": max((r["best_ours_vs_peer"] for r in ok), default=None),
    }
    print(json.dumps({"benchmark": "search_vs_torch", "summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
