"""Step time of our runtime against PyTorch's own pipelining runtime (prints JSON).

Same small GPT, 2 CPU ranks with one thread each, M = 8 microbatches. Ours:
1f1b, zb-h1, zb-h2, zbv through :class:`PipelineExecutor` (tracing off).
PyTorch's: ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` and
``ScheduleZBVZeroBubble`` over ``PipelineStage`` objects built from the very
same layers and the same cut (equal transformer blocks per stage). Each entry is
the median wall time of the timed steps after warm-up, measured on rank 0
between two barriers; configurations take turns step by step.

    PYTHONPATH=src python bench/bench_runtime.py [--steps 8] [--warmup 2]

Figures on a shared or loaded machine are noisy; compare on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.runtime.executor import ExecutorOptions, PipelineExecutor
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.partition import build_stage_modules
from zerobubble.schedule.generators import generate

P, M = 2, 8
CFG = GPTConfig(vocab_size=128, max_seq_len=32, d_model=128, n_heads=4, n_layers=4)
BATCH = 32
StepFn = Callable[[torch.Tensor, torch.Tensor], object]
OURS = ("1f1b", "zb-h1", "zb-h2", "zbv")
# PyTorch class -> our kind with the same placement (for the layer cut).
THEIRS = {
    "Schedule1F1B": "1f1b",
    "ScheduleInterleavedZeroBubble": "interleaved-1f1b",
    "ScheduleZBVZeroBubble": "zbv",
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)
    return x, torch.randint(0, CFG.vocab_size, (BATCH, CFG.max_seq_len), generator=gen)


def _cut(num_stages: int) -> list[int]:
    """Equal transformer blocks per stage (the embedding rides on the first stage, the
    final norm and head on the last), so no stage dominates and bubbles matter."""
    k = CFG.n_layers // num_stages
    return [0, *(1 + k * s for s in range(1, num_stages)), CFG.n_layers + 3]


def _ours(kind: str, rank: int) -> tuple[StepFn, list[torch.nn.Parameter]]:
    sched = generate(kind, P, M)
    stages = build_stage_modules(build_gpt(CFG), sched, rank, boundaries=_cut(sched.num_stages))
    pipe = PipelineExecutor(sched, stages, loss_fn=gpt_loss, options=ExecutorOptions(trace=False))
    params = [p for c in pipe.chunks.values() for p in c.module.parameters()]
    return (lambda x, y: pipe.step(x, target=y)), params


def _theirs(name: str, rank: int) -> tuple[StepFn, list[torch.nn.Parameter]]:
    from torch.distributed import pipelining

    kind = THEIRS[name]
    sched = generate(kind, P, M, **({"chunks": 2} if kind == "interleaved-1f1b" else {}))
    mods = build_stage_modules(build_gpt(CFG), sched, rank, boundaries=_cut(sched.num_stages))
    stages = [
        pipelining.PipelineStage(m, s, sched.num_stages, torch.device("cpu"))
        for s, m in sorted(mods.items())
    ]
    cls = getattr(pipelining, name)
    runner = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=M, loss_fn=gpt_loss)
    params = [p for m in mods.values() for p in m.parameters()]
    return (lambda x, y: runner.step(x, target=y)), params


def bench(steps: int, warmup: int) -> list[dict]:
    """Round-robin over the configurations, one step each per round, so that load
    changes on the machine hit every configuration alike."""
    info = init_distributed()
    runners = {("zerobubble", k): _ours(k, info.rank) for k in OURS}
    runners |= {("torch", n): _theirs(n, info.rank) for n in THEIRS}
    times: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for i in range(warmup + steps):
        x, y = _batch(i)
        for key, (step, params) in runners.items():
            for p in params:
                p.grad = None
            dist.barrier()
            start = time.perf_counter()
            step(x, y)
            dist.barrier()
            if i >= warmup:
                times[key].append((time.perf_counter() - start) * 1000)
    dist.destroy_process_group()
    return [{"runtime": r, "schedule": s, **_summary(t)} for (r, s), t in times.items()]


def _summary(times: list[float]) -> dict:
    return {
        "median_ms": round(statistics.median(times), 2),
        "steps_ms": [round(t, 2) for t in times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="runtime step time: ours vs torch.distributed.pipelining"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    args = parser.parse_args()
    rows = launch(bench, P, args.steps, args.warmup, timeout=900)[0]
    med = {r["schedule"]: r["median_ms"] for r in rows}
    ours_zb = [med[k] for k in ("zb-h1", "zb-h2", "zbv")]
    torch_zb = [med["ScheduleInterleavedZeroBubble"], med["ScheduleZBVZeroBubble"]]
    report = {
        "config": {
            "ranks": P,
            "threads_per_rank": 1,
            "microbatches": M,
            "batch": BATCH,
            "model": {"d_model": CFG.d_model, "n_layers": CFG.n_layers, "seq_len": CFG.max_seq_len},
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
        },
        "results": rows,
        "goals": {
            "our_zb_faster_than_torch_zb": max(ours_zb) < min(torch_zb),
            "our_zb_not_slower_than_our_1f1b": max(ours_zb) <= med["1f1b"],
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
