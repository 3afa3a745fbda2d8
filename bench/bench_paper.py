"""Bubble rates in the Zero Bubble paper's profiled setting, beside the paper's.

The paper (arXiv 2401.10241) profiles its 1.5B model on P=8 stages with M=24
microbatches: T_F=18.522, T_B=18.086, T_W=9.337, T_comm=0.601 per stage (Table 9),
and reports bubble rates (Table 5). We simulate every schedule with those costs
(memory in M_B units, M_W = M_B / 2) and print ours beside theirs as JSON. ZB-1p
and ZB-2p are zb-auto (the paper's placement, one stage per device) at memory
limits P and 2P. The ``auto-1p`` / ``auto-2p`` rows are the placement search
under the same limits, with the per-stage costs as per-device totals split over
each placement's chunks (comm per hop unchanged); the paper has no such row.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_paper.py``.
"""

from __future__ import annotations

import json
import time

from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.validate import validate

#: (model, P, M, F, B, W, comm, paper bubble rates by our kind name)
SETTINGS = [
    (
        "1.5B",
        8,
        24,
        18.522,
        18.086,
        9.337,
        0.601,
        {"1f1b": 0.2431, "zb-h1": 0.1585, "zb-h2": 0.1083, "zb-1p": 0.1585, "zb-2p": 0.0433},
    ),
]


def row(
    kind: str, sched: Schedule, costs: CostModel, limit: float | None, paper: float | None, secs
):
    res = validate(sched, limit, costs)
    return {
        "kind": kind,
        "bubble_rate": round(res.bubble_rate, 4),
        "paper_bubble_rate": paper,
        "cost": round(float(res.cost), 3),
        "peak_memory_in_M_B": round(float(max(res.peak_memory)), 3),
        "mem_limit_in_M_B": limit,
        "generate_s": round(secs, 3),
    }


def main() -> None:
    out = []
    for model, p, m, f, b, w, comm, paper in SETTINGS:
        costs = CostModel.per_stage([f] * p, [b] * p, [w] * p, comm)
        spec = CostSpec(stage_costs=costs)
        totals = CostSpec(F=f, B=b, W=w, comm=comm)
        rows = []
        for kind, gen_kind, limit, opts in (
            ("1f1b", "1f1b", None, {}),  # combined backward, as the paper's baseline
            ("zb-h1", "zb-h1", None, {}),
            ("zb-h2", "zb-h2", None, {}),
            ("zb-1p", "zb-auto", float(p), {"costs": spec, "mem_limit": p}),
            ("zb-2p", "zb-auto", float(2 * p), {"costs": spec, "mem_limit": 2 * p}),
            ("auto-1p", "auto", float(p), {"costs": totals, "mem_limit": p}),
            ("auto-2p", "auto", float(2 * p), {"costs": totals, "mem_limit": 2 * p}),
        ):
            t0 = time.perf_counter()
            sched = generate(gen_kind, p, m, **opts)
            secs = time.perf_counter() - t0
            used = totals.resolve(sched.placement) if gen_kind == "auto" else costs
            r = row(kind, sched, used, limit, paper.get(kind), secs)
            r["chunks"] = sched.num_stages // p
            rows.append(r)
        out.append(
            {"model": model, "P": p, "M": m, "F": f, "B": b, "W": w, "comm": comm, "rows": rows}
        )
    print(json.dumps({"benchmark": "paper_bubble_rates", "settings": out}, indent=2))


if __name__ == "__main__":
    main()
