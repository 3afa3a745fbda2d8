"""Step time of our runtime against PyTorch's own pipelining runtime (prints JSON).

Same small GPT, 2 CPU ranks with one thread each, M = 8 microbatches. Ours:
1f1b, 1f1b-v, zb-h1, zb-h2, zbv through :class:`PipelineExecutor` (tracing off).
PyTorch's: ``Schedule1F1B``, ``ScheduleInterleavedZeroBubble`` and
``ScheduleZBVZeroBubble`` over ``PipelineStage`` objects built from the very
same layers and the same cut (equal transformer blocks per stage). Each entry is
the median wall time of the timed steps after warm-up, measured on rank 0
between two barriers; configurations take turns step by step. ``cpu_ms`` is
each rank's median process CPU time per step (compute plus communication
threads): on a machine whose cores are shared, wall time also counts waiting
for a core, and only a quiet machine shows the schedules' bubbles.

``cpu_ratio`` divides per-rank CPU medians: each zero-bubble kind by the kind
without B/W split on the same placement and cut (zb-h1, zb-h2 by 1f1b; zbv by
``1f1b-v``, 1F1B on zbv's V placement), which is the split's cost, and 1f1b-v by
1f1b, which is the V cut's: four stages of one block each instead of two of two,
run interleaved, cost more on the same machine with no split at all (each stage's
ops start on colder caches, and there are twice as many ops and messages).

Ours run with the executor's defaults: a B immediately followed by its own W
where no other device waits for it runs as one BW (stage 0 of zb-h1/zb-h2, the
local hand-over of zbv), and CPU executors keep freed host memory, which
process-wide also serves PyTorch's runs here. Before those two, zb-h1, zb-h2
and zbv were 1.5-7% slower than our 1f1b: each step page-faulted thousands of
activation pages back in, and stage 0 paid for a split it did not need.

Model size: at P = 2 and M = 8 the 1F1B bubble is 1/9 of the step, and the
simulator (bench_stage_ops, ``plain``) gives zero-bubble schedules only 5-8%
(zb-h1, zb-h2) to 8-12% (zbv) over 1F1B even with a free B/W split. The split
must therefore cost about what a fused backward does, i.e. each op must be
large against the runtime's fixed cost per op (Python between kernels,
autograd bookkeeping, W re-reading its operands from memory). The default
``--seq-len 128`` (512 tokens per microbatch, ops of 5-25 ms on one core) is
where that roughly holds here: split F and B + W cost 2-5% and 6-11% more
than plain autograd, and the simulator puts zb-h1/zb-h2/zbv 1-3% below 1F1B.
At 32 (128 tokens, ops of 2-8 ms) they cost 4-15% and 15-18% more, and zb-h1
comes out ~2% slower than 1F1B (see bench_stage_ops at both sizes).

    PYTHONPATH=src python bench/bench_runtime.py [--steps 32] [--warmup 2] [--seq-len 128]

Figures on a shared or loaded machine are noisy; compare on a quiet one. Even
on a quiet one single steps here spread by 6-13% (``quartiles_ms``), so the
median of 16 steps moves by about 3% from run to run: as much as the gain
the simulator predicts for zero-bubble schedules at this size (2-5%). Hence 32
steps by default, and several runs before concluding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.schedule.generators import generate

P, M = 2, 8
BATCH = 32
SEQ_LEN = 128
StepFn = Callable[[torch.Tensor, torch.Tensor], object]
OURS = ("1f1b", "1f1b-v", "zb-h1", "zb-h2", "zbv")
# Each zero-bubble kind -> the kind without B/W split on the same placement and cut.
SAME_PLACEMENT = {"zb-h1": "1f1b", "zb-h2": "1f1b", "zbv": "1f1b-v"}
# PyTorch class -> our kind with the same placement (for the layer cut).
THEIRS = {
    "Schedule1F1B": "1f1b",
    "ScheduleInterleavedZeroBubble": "interleaved-1f1b",
    "ScheduleZBVZeroBubble": "zbv",
}


def gpt_config(seq_len: int = SEQ_LEN) -> GPTConfig:
    """The benchmarked GPT: 4 blocks of width 128, 4 heads, vocabulary 128."""
    return GPTConfig(vocab_size=128, max_seq_len=seq_len, d_model=128, n_heads=4, n_layers=4)


def _batch(cfg: GPTConfig, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen)
    return x, torch.randint(0, cfg.vocab_size, (BATCH, cfg.max_seq_len), generator=gen)


def cut(cfg: GPTConfig, num_stages: int) -> list[int]:
    """Equal transformer blocks per stage (the embedding rides on the first stage, the
    final norm and head on the last), so no stage dominates and bubbles matter."""
    k = cfg.n_layers // num_stages
    return [0, *(1 + k * s for s in range(1, num_stages)), cfg.n_layers + 3]


def _ours(cfg: GPTConfig, kind: str, rank: int) -> tuple[StepFn, list[torch.nn.Parameter]]:
    sched = generate(kind, P, M)
    stages = build_stage_modules(build_gpt(cfg), sched, rank, boundaries=cut(cfg, sched.num_stages))
    pipe = PipelineExecutor(sched, stages, loss_fn=gpt_loss, options=ExecutorOptions(trace=False))
    params = [p for c in pipe.chunks.values() for p in c.module.parameters()]
    return (lambda x, y: pipe.step(x, target=y)), params


def _theirs(cfg: GPTConfig, name: str, rank: int) -> tuple[StepFn, list[torch.nn.Parameter]]:
    from torch.distributed import pipelining

    kind = THEIRS[name]
    sched = generate(kind, P, M, **({"chunks": 2} if kind == "interleaved-1f1b" else {}))
    mods = build_stage_modules(build_gpt(cfg), sched, rank, boundaries=cut(cfg, sched.num_stages))
    stages = [
        pipelining.PipelineStage(m, s, sched.num_stages, torch.device("cpu"))
        for s, m in sorted(mods.items())
    ]
    cls = getattr(pipelining, name)
    runner = cls(stages[0] if len(stages) == 1 else stages, n_microbatches=M, loss_fn=gpt_loss)
    params = [p for m in mods.values() for p in m.parameters()]
    return (lambda x, y: runner.step(x, target=y)), params


def bench(seq_len: int, steps: int, warmup: int) -> list[dict]:
    """Round-robin over the configurations, one step each per round, so that load
    changes on the machine hit every configuration alike. Every rank returns its
    rows (wall time is rank 0's; CPU time is per rank)."""
    info = init_distributed()
    cfg = gpt_config(seq_len)
    runners = {("zerobubble", k): _ours(cfg, k, info.rank) for k in OURS}
    runners |= {("torch", n): _theirs(cfg, n, info.rank) for n in THEIRS}
    walls: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    cpus: dict[tuple[str, str], list[float]] = {key: [] for key in runners}
    for i in range(warmup + steps):
        x, y = _batch(cfg, i)
        for key, (step, params) in runners.items():
            for p in params:
                p.grad = None
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            step(x, y)
            cpu = time.process_time() - cpu
            dist.barrier()
            if i >= warmup:
                walls[key].append((time.perf_counter() - start) * 1000)
                cpus[key].append(cpu * 1000)
    dist.destroy_process_group()
    return [
        {"runtime": r, "schedule": s, **_summary(walls[r, s]), "cpu_ms": _median(cpus[r, s])}
        for r, s in runners
    ]


def _median(times: list[float]) -> float:
    return round(statistics.median(times), 2)


def _summary(times: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {
        "median_ms": _median(times),
        "quartiles_ms": [round(q1, 2), round(q3, 2)],
        "steps_ms": [round(t, 2) for t in times],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description="runtime step time: ours vs torch.distributed.pipelining"
    )
    parser.add_argument("--steps", type=int, default=32, help="timed steps per schedule")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--seq-len", type=int, default=SEQ_LEN, help="tokens per sequence (see the docstring)"
    )
    args = parser.parse_args()
    per_rank = launch(bench, P, args.seq_len, args.steps, args.warmup, timeout=1800)
    rows = per_rank[0]
    for row, *others in zip(rows, *per_rank[1:], strict=True):
        row["cpu_ms"] = [row["cpu_ms"], *(o["cpu_ms"] for o in others)]
    med = {r["schedule"]: r["median_ms"] for r in rows}
    cpu = {r["schedule"]: r["cpu_ms"] for r in rows if r["runtime"] == "zerobubble"}
    ours_zb = [med[k] for k in ("zb-h1", "zb-h2", "zbv")]
    torch_zb = [med["ScheduleInterleavedZeroBubble"], med["ScheduleZBVZeroBubble"]]
    cfg = gpt_config(args.seq_len)
    report = {
        "config": {
            "ranks": P,
            "threads_per_rank": 1,
            "microbatches": M,
            "batch": BATCH,
            "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "seq_len": cfg.max_seq_len},
            "timed_steps": args.steps,
            "warmup_steps": args.warmup,
        },
        "results": rows,
        "cpu_ratio": {
            f"{k}/{base}": [round(a / b, 3) for a, b in zip(cpu[k], cpu[base], strict=True)]
            for k, base in (("1f1b-v", "1f1b"), *SAME_PLACEMENT.items())
        },
        "goals": {
            "our_zb_faster_than_torch_zb": max(ours_zb) < min(torch_zb),
            "our_zb_not_slower_than_our_1f1b": max(ours_zb) <= med["1f1b"],
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
