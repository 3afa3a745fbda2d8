"""Context parallelism: per-rank activation memory and step time at pp2 against pp2 x cp2.

A tiny HF Llama (``--width`` hidden, 4 heads, 2 kv heads, MLP 2x, ``--layers`` blocks) at
``--seq`` tokens, ``--m`` microbatches of one row, zb-h1 on 2 pipeline ranks: once on a
``pp=2`` mesh (2 CPU ranks, gloo, one thread each) and once on ``pp=2 x cp=2`` (4 ranks:
each holds chunks ``r`` and ``3 - r`` of every sequence). Per configuration: the median
step (wall ms on global rank 0, between barriers, after one warm-up step) and each
rank's peak of the activation bytes its stages hold (the executor's trace,
``mem_after``). Expected: the cp ranks hold about ``1 / cp`` of the pp-only ranks' peak:
the decoder blocks run the cp ring (every tensor they save is of the rank's own tokens; no
mask, no other rank's keys and values), whose extra is per token too (the keys and values
repeated to the query heads, the output and its log-sum-exp). The step time on a shared
CPU machine is indicative only.

``--model gpt``: our GPT instead (``--width``, 4 heads, MLP 4x, no dropout), whose attention
runs the ring under cp (it holds no other rank's keys and values) and, whole, scores every
query against every key (eager).

``--segments k`` (with ``--model gpt``): seq-zb with ``k`` equal segments instead of zb-h1,
both configurations (under cp each segment sharded over the cp ranks; the ring carries the
earlier segments' keys and values and holds none of them after the layer's forward), so
the ratio is cp's over segments alone.

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_cp.py [--seq 2048] [--m 4] [--attn sdpa]
[--model gpt] [--segments 4]``;
prints one JSON line per configuration, then the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.interop import hf
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.schedule.generators import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--m", type=int, default=4)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--model", default="hf-llama", choices=["hf-llama", "gpt"])
    parser.add_argument("--segments", type=int, default=1)
    args = parser.parse_args()
    if args.segments > 1 and args.model != "gpt":
        parser.error("--segments takes --model gpt (HF blocks are refused under cp x segments)")
    rows = {}
    for cp in (1, 2):
        per_rank = launch(
            _ranks, 2 * cp, cp, args.seq, args.m, args.width, args.layers, args.steps,
            args.attn, args.model, args.segments, timeout=3600,
        )  # fmt: skip
        row = {
            "config": "pp2" if cp == 1 else "pp2 x cp2",
            "kind": "zb-h1" if args.segments == 1 else f"seq-zb, {args.segments} segments",
            "model": f"{args.model}{' ' + args.attn if args.model == 'hf-llama' else ''}, "
            f"width {args.width}, {args.layers} layers",
            "seq": args.seq,
            "m": args.m,
            "step_ms": per_rank[0]["step_ms"],
            "peak_mib_per_rank": [r["peak_mib"] for r in per_rank],
            "pp_rank_of_each": [r["pp"] for r in per_rank],
        }
        rows[cp] = row
        print(json.dumps(row))
    for pp in (0, 1):
        whole = max(p for p, d in zip(rows[1]["peak_mib_per_rank"], rows[1]["pp_rank_of_each"],
                                      strict=True) if d == pp)  # fmt: skip
        shard = max(p for p, d in zip(rows[2]["peak_mib_per_rank"], rows[2]["pp_rank_of_each"],
                                      strict=True) if d == pp)  # fmt: skip
        print(json.dumps({"pp_rank": pp, "peak_cp2_over_pp2": round(shard / whole, 4)}))


def _token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum")
    return ce / num_items


def _count(labels: torch.Tensor) -> int:
    return labels.numel()


def _ranks(
    cp: int, t: int, m: int, width: int, layers: int, steps: int, attn: str, which: str,
    segments: int,
) -> dict[str, object]:  # fmt: skip
    init_distributed()
    torch.set_num_threads(1)
    mesh = build_mesh(2, cp=cp)
    if which == "gpt":
        cfg = GPTConfig(vocab_size=256, max_seq_len=t, d_model=width, n_heads=4, n_layers=layers)
        model_layers = list(build_gpt(cfg))
    else:
        model = hf.tiny_model(
            "hf-llama",
            attn_implementation=attn,
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=layers,
            max_position_embeddings=t,
            tie_word_embeddings=False,
        ).train()
        model_layers = hf.causal_lm_layers(model, check=False)
    sched = (
        generate("zb-h1", 2, m) if segments == 1 else generate("seq-zb", 2, m, segments=segments)
    )
    cuts = None if segments == 1 else tuple(i * t // segments for i in range(segments + 1))
    stages = build_stage_modules(model_layers, sched, mesh.pp_rank)
    pipe = PipelineExecutor(
        sched, stages, loss_fn=_token_loss, count_fn=_count, mesh=mesh,
        options=ExecutorOptions(trace=True, cuts=cuts),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (m, t), generator=gen)
    y = torch.randint(0, 256, (m, t), generator=gen)
    batch = ids if which == "gpt" else {"input_ids": ids}
    times: list[float] = []
    peak = 0
    for step in range(steps + 1):
        pipe.trace.clear()
        dist.barrier()
        start = time.perf_counter()
        pipe.step(batch, target=y)
        dist.barrier()
        if step:
            times.append((time.perf_counter() - start) * 1e3)
        peak = max(peak, max(e.mem_after for e in pipe.trace.events))
        for chunk in pipe.chunks.values():
            chunk.module.zero_grad(set_to_none=True)
    dist.destroy_process_group()
    return {
        "step_ms": round(statistics.median(times), 1),
        "peak_mib": round(peak / 2**20, 2),
        "pp": mesh.pp_rank,
    }


if __name__ == "__main__":
    main()
