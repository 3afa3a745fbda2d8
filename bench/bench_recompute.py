"""Activation checkpointing with the B/W split: memory held after F and step time (prints JSON).

Memory (one process, one microbatch per stage of a GPT cut into three stages): the bytes
each stage holds after F (``StageChunk.held_bytes``, distinct storages) with
``recompute`` none, stage and layers, against the checkpointed inputs (the stage's input,
and on the last stage its target, for "stage"; every layer's input for "layers", whose
last stage also keeps what its loss saves, as the loss is outside the layers); and what
it holds after B (W's operands: the same with or without checkpointing). The issue's
goal: with checkpointing at most 1.2 times the checkpointed inputs.

Time (P = 2 ranks, one thread each, M = 8): the median wall time of a step of 1f1b,
zb-h1 and zbv with recompute off and on (whole stages), configurations taking turns
step by step. The point (torchtitan measured interleaved zero-bubble at 13 tokens/s
against 128 for interleaved 1F1B with checkpointing): with recompute, zero-bubble
schedules should keep their standing against 1F1B, every B one forward longer on all
of them. On a shared 2-core machine wall time counts waiting for a core: compare the
ratios, on a quiet machine.

    PYTHONPATH=src python bench/bench_recompute.py [--steps 8] [--seq-len 128] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.stage import StageChunk, storage_bytes
from zerobubble.schedule.generators import generate

P, M = 2, 8
KINDS = ("1f1b", "zb-h1", "zbv")
MODES = ("none", "stage", "layers")


def _collect(into: list[Tensor]) -> Callable[[nn.Module, tuple], None]:
    """A forward pre-hook appending the layer's tensor inputs to ``into``."""

    def hook(_module: nn.Module, args: tuple) -> None:
        into.extend(a for a in args if isinstance(a, Tensor))

    return hook


def memory(cfg: GPTConfig, mb: int) -> dict[str, object]:
    """Held bytes after F and after B of one microbatch, per stage and recompute mode."""
    layers = list(build_gpt(cfg))
    n = len(layers)
    cut = [0, 1 + (n - 3) // 2, n - 2, n]  # embedding + blocks | blocks | norm + head
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (mb, cfg.max_seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (mb, cfg.max_seq_len), generator=gen)
    out: dict[str, object] = {"stages": [f"layers {a}-{b - 1}" for a, b in itertools.pairwise(cut)]}
    for mode in MODES:
        fresh = [nn.Sequential(*build_gpt(cfg)[a:b]) for a, b in itertools.pairwise(cut)]
        chunks = [
            StageChunk(m, s, 3, loss_fn=gpt_loss if s == 2 else None, recompute=mode)
            for s, m in enumerate(fresh)
        ]
        seen: list[list[Tensor]] = [[] for _ in chunks]
        for c, got in zip(chunks, seen, strict=True):
            for name in c.recomputed_layers:
                c.module.get_submodule(name).register_forward_pre_hook(_collect(got))
        h: object = x
        after_f, inputs = [], []
        for s, c in enumerate(chunks):
            kept = [h] if mode == "stage" else seen[s]
            kw = {"target": y} if s == 2 else {}
            if mode == "stage" and s == 2:
                kept = [h, y]
            assert isinstance(h, Tensor)
            h = c.forward(0, h, **kw)
            after_f.append(c.held_bytes())
            inputs.append(storage_bytes(kept) if mode != "none" else None)
        g = None
        for c in reversed(chunks):
            g = c.backward_input(0, g)
        out[mode] = {
            "held_after_F_bytes": after_f,
            "checkpointed_input_bytes": inputs,
            "ratio_to_inputs": [
                None if i is None else round(f / i, 4) for f, i in zip(after_f, inputs, strict=True)
            ],
            "held_after_B_bytes": [c.held_bytes() for c in chunks],
        }
    return out


def timing(cfg: GPTConfig, mb: int, steps: int, warmup: int) -> dict[str, object] | None:
    """Median step wall time per (kind, recompute) on this rank; the report on rank 0."""
    info = init_distributed(timeout_s=300)
    layers = list(build_gpt(cfg))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (mb * M, cfg.max_seq_len), generator=gen)
    y = torch.randint(0, cfg.vocab_size, (mb * M, cfg.max_seq_len), generator=gen)
    runs = {}
    for kind in KINDS:
        sched = generate(kind, P, M)
        for mode in ("none", "stage"):
            stages = build_stage_modules(layers, sched, info.rank)
            opts = ExecutorOptions(trace=False, recompute=mode)
            runs[kind, mode] = PipelineExecutor(sched, stages, loss_fn=gpt_loss, options=opts)
    times: dict[tuple[str, str], list[float]] = {k: [] for k in runs}
    for i in range(warmup + steps):
        for key, pipe in runs.items():
            for chunk in pipe.chunks.values():
                for p in chunk.module.parameters():
                    p.grad = None
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            dist.barrier()
            if i >= warmup:
                times[key].append((time.perf_counter() - t0) * 1e3)
    dist.destroy_process_group()
    if info.rank != 0:
        return None
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = mb * M * cfg.max_seq_len
    return {
        "step_ms": {f"{k}/{m}": round(v, 2) for (k, m), v in med.items()},
        "tokens_per_s": {f"{k}/{m}": round(tokens / v * 1e3) for (k, m), v in med.items()},
        "recompute_slowdown": {k: round(med[k, "stage"] / med[k, "none"], 3) for k in KINDS},
        "vs_1f1b_with_recompute": {
            k: round(med[k, "stage"] / med["1f1b", "stage"], 3) for k in KINDS
        },
        "vs_1f1b_without": {k: round(med[k, "none"] / med["1f1b", "none"], 3) for k in KINDS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample")
    parser.add_argument("--microbatch", type=int, default=4, help="samples per microbatch")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 steps (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup, args.seq_len, args.microbatch = 2, 1, 16, 2
    d = 32 if args.quick else 128
    cfg = GPTConfig(vocab_size=256, max_seq_len=args.seq_len, d_model=d, n_heads=4, n_layers=4)
    torch.set_num_threads(1)
    report: dict[str, object] = {
        "config": {
            "d_model": d,
            "n_layers": cfg.n_layers,
            "seq_len": args.seq_len,
            "microbatch": args.microbatch,
            "P": P,
            "M": M,
            "steps": args.steps,
        },
        "memory": memory(cfg, args.microbatch),
    }
    results = launch(timing, P, cfg, args.microbatch, args.steps, args.warmup, timeout=3600)
    report["time"] = results[0]
    report["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
