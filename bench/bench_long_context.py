"""Sequence segments at a long sequence: simulated step and activation memory, and what
balanced cuts buy over equal token counts.

A decoder of ``--width`` (4 heads, MLP 4x) at ``--seq`` tokens on P pipeline ranks with
M microbatches. Each kind is simulated with the same per-microbatch work (one device's
F = B = W = 1 per microbatch, split evenly over its segments' mean), so steps compare
at equal M:

* 1f1b and zb-h1 run whole sequences;
* seq1f1b and seq-zb run k segments per microbatch, once cut at equal token counts
  and once at :func:`~zerobubble.schedule.segments.balanced_cuts`. A segment's time is
  its share of the layer's flops (:meth:`SegmentCost.transformer`); its activation
  memory its share of what a layer saves: ``16 * width`` floats per token and, with
  eager attention (``--kernel dense``, what our GPT runs), the scores and probabilities
  of every head, 2 floats per query-key pair.

Memory is in units of one microbatch's activations on a device (M_B), the keys and
values that later segments read included in the pair term's concatenations only
approximately (they are ``2 * width`` floats per cached token; see docs/long-context.md).

Measured (runtime) figures need the segment runtime, which is not built yet: this
script prints the simulated ones only and says so.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_long_context.py [--seq 4096] [--p 4]``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.segments import (
    SegmentCost,
    balanced_cuts,
    equal_token_cuts,
    imbalance,
    time_factors,
)
from zerobubble.schedule.simulate import SimResult, simulate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--kernel", choices=("dense", "causal"), default="dense")
    ap.add_argument("--granularity", type=int, default=64)
    args = ap.parse_args()
    heads = 4
    flops = SegmentCost.transformer(args.width, kernel=args.kernel)
    saved = SegmentCost(linear=16 * args.width, attention=2 * heads, kernel=args.kernel)
    p, m = args.p, args.m
    rows = []
    for kind in ("1f1b", "zb-h1"):
        res = simulate(generate(kind, p, m), CostModel.from_device_totals(range(p)))
        rows.append(_row(kind, 1, None, res))
    for k in (2, 4, 8):
        for cut_name, cuts in (
            ("equal", equal_token_cuts(args.seq, k, args.granularity)),
            ("balanced", balanced_cuts(args.seq, k, flops, args.granularity)),
        ):
            costs = replace(
                CostModel.from_device_totals(range(p), segments=k),
                segment_time=time_factors(cuts, flops),
                segment_memory=time_factors(cuts, saved),
            )
            for kind in ("seq1f1b", "seq-zb"):
                res = simulate(generate(kind, p, m, segments=k), costs)
                row = _row(kind, k, cut_name, res)
                row["cuts"] = list(cuts)
                row["imbalance"] = round(imbalance(cuts, flops), 4)
                rows.append(row)
    step, peak = float(rows[0]["step"]), float(rows[0]["peak_memory"])
    for r in rows:
        r["step_vs_1f1b"] = round(float(r["step"]) / step, 4)
        r["peak_vs_1f1b"] = round(float(r["peak_memory"]) / peak, 4)
        print(json.dumps(r))
    print(
        json.dumps(
            {
                "summary": "simulated",
                "seq": args.seq,
                "width": args.width,
                "kernel": args.kernel,
                "p": p,
                "m": m,
                "measured": "not run: the segment runtime is not built yet",
            }
        )
    )


def _row(kind: str, k: int, cuts: str | None, res: SimResult) -> dict[str, object]:
    return {
        "kind": kind,
        "segments": k,
        "cuts_by": cuts,
        "step": round(float(res.makespan), 4),
        "bubble_rate": round(res.bubble_rate, 4),
        "peak_memory": round(float(max(res.peak_memory)), 4),
    }


if __name__ == "__main__":
    main()
