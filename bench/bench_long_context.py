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

``--measure`` also runs the kinds on ``--measure-p`` CPU ranks (gloo, one thread each)
at ``--measure-seq`` tokens with our GPT (``--width``, 4 heads, two blocks per rank,
batch 1 per microbatch, ``--m`` microbatches): per kind the median step (wall ms on
rank 0, between barriers, kinds taking turns step by step) and each rank's peak of the
activation bytes its stages hold (the executor's trace, ``mem_after``). Segment kinds run
at balanced cuts.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_long_context.py [--seq 4096] [--p 4]
[--measure --measure-seq 2048 --steps 3]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
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
    ap.add_argument("--measure", action="store_true", help="also run the kinds on CPU ranks")
    ap.add_argument("--measure-seq", type=int, default=2048)
    ap.add_argument("--measure-p", type=int, default=2)
    ap.add_argument("--measure-k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
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
            }
        )
    )
    if args.measure:
        _measure(args)


def _token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")
    return ce / num_items


def _count(labels: torch.Tensor) -> int:
    return labels.numel()


def _measure(args: argparse.Namespace) -> None:
    p, t, k = args.measure_p, args.measure_seq, args.measure_k
    flops = SegmentCost.transformer(args.width, kernel="dense")
    cuts = balanced_cuts(t, k, flops, args.granularity)
    kinds = [("1f1b", 1), ("zb-h1", 1), ("seq1f1b", k), ("seq-zb", k)]
    rows = launch(_ranks, p, kinds, cuts, t, args.width, args.m, args.steps, timeout=3600)
    for i, (kind, segs) in enumerate(kinds):
        print(
            json.dumps(
                {
                    "measured": kind,
                    "segments": segs,
                    "cuts": list(cuts) if segs > 1 else None,
                    "seq": t,
                    "p": p,
                    "m": args.m,
                    "step_ms": rows[0][i]["step_ms"],
                    "peak_mib_per_rank": [r[i]["peak_mib"] for r in rows],
                }
            )
        )


def _ranks(
    kinds: list[tuple[str, int]], cuts: tuple[int, ...], t: int, width: int, m: int, steps: int
) -> list[dict[str, object]]:
    """Every kind on this rank, taking turns step by step; one warm-up step each."""
    info = init_distributed()
    torch.set_num_threads(1)
    cfg = GPTConfig(
        vocab_size=64, max_seq_len=t, d_model=width, n_heads=4, n_layers=2 * info.world_size
    )
    pipes = []
    for kind, segs in kinds:
        opts = {"segments": segs} if segs > 1 else {}
        sched = generate(kind, info.world_size, m, **opts)
        stages = build_stage_modules(list(build_gpt(cfg)), sched, info.rank)
        options = ExecutorOptions(cuts=cuts if segs > 1 else None)
        pipes.append(
            PipelineExecutor(sched, stages, loss_fn=_token_loss, count_fn=_count, options=options)
        )
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (m, t), generator=gen)
    y = torch.randint(0, 64, (m, t), generator=gen)
    times: list[list[float]] = [[] for _ in pipes]
    peaks = [0] * len(pipes)
    for step in range(steps + 1):
        for i, pipe in enumerate(pipes):
            pipe.trace.clear()
            dist.barrier()
            start = time.perf_counter()
            pipe.step(x, target=y)
            dist.barrier()
            if step:
                times[i].append((time.perf_counter() - start) * 1e3)
            peaks[i] = max(peaks[i], max(e.mem_after for e in pipe.trace.events))
            for chunk in pipe.chunks.values():
                chunk.module.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return [
        {"step_ms": round(statistics.median(ts), 1), "peak_mib": round(pk / 2**20, 1)}
        for ts, pk in zip(times, peaks, strict=True)
    ]


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
