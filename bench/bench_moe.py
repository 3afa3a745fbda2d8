"""Overlapped F&B pairs against a mixture of experts' all-to-all, simulated (prints JSON lines).

DualPipe pairs one microbatch's forward with another's backward so that each one's
dispatch and combine all-to-all travels while the other computes. Here every F and every
backward of a stage also waits ``a2a`` (per device, like F: ``CostSpec(a2a=...)``) for its
all-to-all unless it is in an overlapped pair, whose block takes ``max(compute,
all-to-all)`` of the two (``Schedule.overlaps``, ``CostModel.a2a``). Compared: ``dualpipev``
with its pairs overlapped and run in sequence, and ``zbv`` (same V placement) with the pairs
that pay under the costs (``passes.overlap_where_it_pays``) and without,
at F = B = W = 1 per device and all-to-all from none to 1.5x F; ``a2a=1`` is a
DeepSeek-V3-like mix (the all-to-all about as long as the compute it pairs with).

    PYTHONPATH=src python bench/bench_moe.py [--p 4 8] [--m-per-p 4]

Each row: the kind, P, M, the all-to-all per device, the step (makespan), its ratio to
dualpipev in sequence, the exposed all-to-all summed over devices (what no compute hid)
and the bubble rate. The measured side (exposed all-to-all ms per step on CPU ranks with
expert parallelism) needs the mixture-of-experts runtime, which is not built yet.
"""

from __future__ import annotations

import argparse
import json

from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate

A2A = (0.0, 0.5, 1.0, 1.5)
KINDS = (("dualpipev", True), ("dualpipev", False), ("zbv", True), ("zbv", False))


def rows(p: int, m: int) -> list[dict[str, object]]:
    """One row per (all-to-all, kind) at ``p`` devices and ``m`` microbatches."""
    out: list[dict[str, object]] = []
    for a2a in A2A:
        spec = CostSpec(a2a=a2a)
        steps = {}
        for kind, overlap in KINDS:
            sched = generate(kind, p, m, overlap=overlap, costs=spec)
            res = simulate(sched, spec.resolve(sched.placement))
            steps[kind, overlap] = res
        base = float(steps["dualpipev", False].makespan)
        for (kind, overlap), res in steps.items():
            out.append(
                {
                    "kind": kind,
                    "overlap": overlap,
                    "p": p,
                    "m": m,
                    "a2a": a2a,
                    "step": round(float(res.makespan), 4),
                    "step_vs_dualpipev": round(float(res.makespan) / base, 4),
                    "exposed_a2a": round(float(sum(res.exposed_a2a)), 4),
                    "bubble_rate": round(res.bubble_rate, 4),
                }
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8], help="device counts")
    parser.add_argument("--m-per-p", type=int, default=4, help="microbatches per device")
    args = parser.parse_args()
    for p in args.p:
        for row in rows(p, args.m_per_p * p):
            print(json.dumps(row))


if __name__ == "__main__":
    main()
