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

Memory is in units of one microbatch's activations on a device (M_B). Each segment
saves its own keys and values once (the earlier segments' are read from theirs, see
docs/long-context.md), so the pair term is the only one that grows with the position.

``--measure`` also runs 1f1b, zb-h1 and seq1f1b at each of ``--measure-ks`` on
``--measure-p`` CPU ranks (gloo, one thread each) at ``--measure-seq`` tokens with our
GPT (``--width``, 4 heads, two blocks per rank, batch 1 per microbatch, ``--m``
microbatches): per kind the median step (wall ms on rank 0, between barriers, kinds
taking turns step by step) and each rank's peak of the activation bytes its stages hold
(the executor's trace, ``mem_after``), relative to 1F1B's beside the closed form
``(P + k - 1) / (k P)``, and the planner's prediction of that peak (zb-h1's measured M_B
and M_W, split over the segments by the fitted segment memory,
:func:`~zerobubble.schedule.segments.segment_model`) over the trace's. Segment kinds run
at balanced cuts.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_long_context.py [--seq 4096] [--p 4]
[--measure --measure-seq 2048 --measure-ks 2,4,8 --steps 3]``.
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
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.profile.segments import profile_segment_memory
from zerobubble.profile.stages import stage_profile
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.segments import (
    SegmentCost,
    SegmentMemory,
    balanced_cuts,
    equal_token_cuts,
    imbalance,
    segment_model,
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
    ap.add_argument("--measure-ks", default="2,4,8", help="segment counts to measure")
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
    """Run 1f1b, zb-h1 and seq1f1b at each of ``--measure-ks`` on CPU ranks; print each
    kind's step and held bytes, each segment count's held bytes relative to 1F1B beside
    the closed form ``(P + k - 1) / (k P)``, and the planner's predicted peak (the
    segment model of zb-h1's measured M_B and M_W with the fitted segment memory) against
    the trace's."""
    p, t = args.measure_p, args.measure_seq
    flops = SegmentCost.transformer(args.width, kernel="dense")
    ks = [int(k) for k in args.measure_ks.split(",")]
    cuts = {k: balanced_cuts(t, k, flops, args.granularity) for k in ks}
    kinds = [("1f1b", 1), ("zb-h1", 1), *(("seq1f1b", k) for k in ks)]
    rows = launch(_ranks, p, kinds, cuts, t, args.width, args.m, args.steps, timeout=3600)
    layers = list(build_gpt(_config(t, args.width, p)))
    batch = torch.randint(0, 64, (1, t), generator=torch.Generator().manual_seed(1))
    per_layer = profile_segment_memory(layers, batch, kernel="dense")
    memory = [SegmentMemory.total(per_layer[i] for i in r) for r in stage_bounds(len(layers), p)]
    prof = stage_profile([e for r in rows for e in r[1]["events"]], p, skip_iterations=0)
    costs = CostModel.per_stage(
        [1.0] * p, [1.0] * p, [1.0] * p, mem_f=prof.mem_b, mem_w=[w or 0 for w in prof.mem_w]
    )
    base = [r[0]["peak"] for r in rows]
    for i, (kind, k) in enumerate(kinds):
        held = [r[i]["peak"] for r in rows]
        row: dict[str, object] = {
            "measured": kind,
            "segments": k,
            "cuts": list(cuts[k]) if k > 1 else None,
            "seq": t,
            "p": p,
            "m": args.m,
            "step_ms": rows[0][i]["step_ms"],
            "held_mib_per_rank": [round(h / 2**20, 2) for h in held],
            "held_vs_1f1b_per_rank": [round(h / b, 4) for h, b in zip(held, base, strict=True)],
        }
        if k > 1:
            model = segment_model(costs, cuts[k], flops, memory)
            predicted = simulate(generate(kind, p, args.m, segments=k), model).peak_memory
            row["closed_form_vs_1f1b"] = round((p + k - 1) / (k * p), 4)
            row["predicted_mib_per_rank"] = [round(float(x) / 2**20, 2) for x in predicted]
            row["predicted_vs_held_per_rank"] = [
                round(float(x) / h, 4) for x, h in zip(predicted, held, strict=True)
            ]
        print(json.dumps(row))


def _config(t: int, width: int, p: int) -> GPTConfig:
    return GPTConfig(vocab_size=64, max_seq_len=t, d_model=width, n_heads=4, n_layers=2 * p)


def _ranks(
    kinds: list[tuple[str, int]],
    cuts: dict[int, tuple[int, ...]],
    t: int,
    width: int,
    m: int,
    steps: int,
) -> list[dict[str, object]]:
    """Every kind on this rank, taking turns step by step; one warm-up step each."""
    info = init_distributed()
    torch.set_num_threads(1)
    cfg = _config(t, width, info.world_size)
    pipes = []
    for kind, segs in kinds:
        opts = {"segments": segs} if segs > 1 else {}
        sched = generate(kind, info.world_size, m, **opts)
        stages = build_stage_modules(list(build_gpt(cfg)), sched, info.rank)
        options = ExecutorOptions(cuts=cuts[segs] if segs > 1 else None)
        pipes.append(
            PipelineExecutor(sched, stages, loss_fn=_token_loss, count_fn=_count, options=options)
        )
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (m, t), generator=gen)
    y = torch.randint(0, 64, (m, t), generator=gen)
    times: list[list[float]] = [[] for _ in pipes]
    peaks = [0] * len(pipes)
    last: list[list[object]] = [[] for _ in pipes]
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
            last[i] = list(pipe.trace.events)
            for chunk in pipe.chunks.values():
                chunk.module.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return [
        {
            "step_ms": round(statistics.median(ts), 1),
            "peak": pk,
            "events": events if kind == "zb-h1" else [],
        }
        for ts, pk, events, (kind, _) in zip(times, peaks, last, kinds, strict=True)
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
