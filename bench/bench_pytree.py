"""Cost of pytree boundaries and of variable shapes (prints JSON).

Three runs of one model (token-wise blocks ``h + tanh(W h)`` of width 256, 2 CPU
ranks with one thread each, zb-h1, M = 8, tracing off), taking turns step by step:

* ``tensor``: the blocks pass the hidden states ``[B, T, D]`` alone, fixed shape;
* ``pytree``: they pass ``{"hidden", "mask" (bool), "pos" (int64)}``, the mask and
  the position ids forwarded untouched: the same compute, two more tensors per
  message (forward only: they carry no gradient);
* ``variable``: like ``tensor``, but the batch alternates between 32 x 128 and
  64 x 64 tokens, so every message of every step has a new layout; the blocks
  work token by token, so the compute is the same as ``tensor``'s.

Each row gives the median wall time of rank 0 between two barriers, its quartiles,
and each rank's median process CPU time per step (``cpu_ms``: on a shared machine
wall time also counts waiting for a core, so CPU time is the steadier figure);
``vs_tensor`` and ``cpu_vs_tensor`` are ratios of medians (CPU: summed over the
ranks, step by step). The whole run is launched ``--repeats`` times; the top-level
``median_vs_tensor`` / ``median_cpu_vs_tensor`` are the medians over the repeats.
``message_us`` is the host CPU time of one boundary message's round trip in one
process (flatten, layout lookup, pack into a frame, read its header, unpack, unflatten;
no transport), one microbatch of the ``tensor`` and of the ``pytree`` run, the two
taking turns: the part of the step the pytree path adds, free of the machine's load.

    PYTHONPATH=src python bench/bench_pytree.py [--steps 24] [--warmup 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.p2p.wire import FRAME_HEADER, frame_header, pack_frame, unpack_frame
from zerobubble.runtime.shapes import Layout, flatten, unflatten
from zerobubble.schedule.generators import generate

P, M, D, LAYERS = 2, 8, 256, 6
SHAPES = {"fixed": [(32, 128)], "variable": [(32, 128), (64, 64)]}


class Block(nn.Module):
    def __init__(self, pytree: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.pytree = pytree

    def forward(self, x):
        h = x["hidden"] if self.pytree else x
        h = h + torch.tanh(self.lin(h))
        return {**x, "hidden": h} if self.pytree else h


class Embed(nn.Module):
    """Stage 0's input: the features (and for the pytree run the mask and positions)."""

    def __init__(self, pytree: bool) -> None:
        super().__init__()
        self.pytree = pytree

    def forward(self, x: torch.Tensor):
        if not self.pytree:
            return x
        b, t, _ = x.shape
        pos = torch.arange(t).expand(b, t)
        return {"hidden": x, "mask": torch.ones(b, t, dtype=torch.bool), "pos": pos}


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:
    h = out["hidden"] if isinstance(out, dict) else out
    return ((h - target) ** 2).mean()


def _runner(name: str, rank: int) -> tuple[PipelineExecutor, list[tuple[int, int]]]:
    pytree = name == "pytree"
    torch.manual_seed(0)
    layers = [Embed(pytree), *(Block(pytree) for _ in range(LAYERS))]
    sched = generate("zb-h1", P, M)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(sched, stages, loss_fn=loss_fn, options=ExecutorOptions(trace=False))
    return pipe, SHAPES["variable" if name == "variable" else "fixed"]


def bench(steps: int, warmup: int) -> list[dict]:
    info = init_distributed()
    runners = {name: _runner(name, info.rank) for name in ("tensor", "pytree", "variable")}
    walls: dict[str, list[float]] = {k: [] for k in runners}
    cpus: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(warmup + steps):
        for name, (pipe, shapes) in runners.items():
            b, t = shapes[i % len(shapes)]
            gen = torch.Generator().manual_seed(i)
            x, y = torch.randn(b, t, D, generator=gen), torch.randn(b, t, D, generator=gen)
            for c in pipe.chunks.values():
                for p in c.module.parameters():
                    p.grad = None
            dist.barrier()
            start, cpu = time.perf_counter(), time.process_time()
            pipe.step(x, target=y)
            cpu = time.process_time() - cpu
            dist.barrier()
            if i >= warmup:
                walls[name].append((time.perf_counter() - start) * 1000)
                cpus[name].append(cpu * 1000)
    dist.destroy_process_group()
    return [{"run": k, "wall": walls[k], "cpu": cpus[k]} for k in runners]


def message_us(reps: int = 11, iters: int = 500) -> dict[str, float]:
    """CPU microseconds of one message's round trip, tensor vs pytree (see the module)."""
    torch.set_num_threads(1)
    b, t = SHAPES["fixed"][0][0] // M, SHAPES["fixed"][0][1]
    h = torch.randn(b, t, D, requires_grad=True)
    values = {"tensor": h, "pytree": Embed(True)(h)}
    layouts: dict[tuple[int, ...], Layout] = {}
    cpu = torch.device("cpu")

    def round_trip(x: object) -> object:
        codes, tensors = flatten(x, "stage 0 output")
        layout = layouts.get(codes) or layouts.setdefault(codes, Layout.of(codes, FRAME_HEADER))
        frame = pack_frame(layout, tensors, cpu)
        frame_header(frame)
        return unflatten(layout.codes, unpack_frame(frame, layout))

    spent: dict[str, list[float]] = {k: [] for k in values}
    for _ in range(reps):
        for name, x in values.items():
            start = time.process_time()
            for _ in range(iters):
                round_trip(x)
            spent[name].append((time.process_time() - start) / iters * 1e6)
    return {k: _median(v) for k, v in spent.items()}


def _median(times: list[float]) -> float:
    return round(statistics.median(times), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    repeats = [_rows(launch(bench, P, args.steps, args.warmup, timeout=1800))]
    for _ in range(args.repeats - 1):
        repeats.append(_rows(launch(bench, P, args.steps, args.warmup, timeout=1800)))
    summary = {
        key: {
            row["run"]: round(statistics.median(r[i][key] for r in repeats), 4)
            for i, row in enumerate(repeats[0])
        }
        for key in ("vs_tensor", "cpu_vs_tensor")
    }
    out = {"P": P, "M": M, "schedule": "zb-h1", "steps": args.steps, "repeats": args.repeats}
    out |= {f"median_{k}": v for k, v in summary.items()}
    out["message_us"] = message_us()
    print(json.dumps({**out, "runs": repeats}))


def _rows(per_rank: list[list[dict]]) -> list[dict]:
    """One launch's rows: rank 0's wall times, every rank's CPU time, ratios to tensor."""
    base = statistics.median(per_rank[0][0]["wall"])
    cpu_sum = [[sum(c) for c in zip(*(r[i]["cpu"] for r in per_rank), strict=True)]
               for i in range(len(per_rank[0]))]  # fmt: skip
    cpu_base = statistics.median(cpu_sum[0])
    rows = []
    for i, row in enumerate(per_rank[0]):
        wall = row["wall"]
        q1, _, q3 = statistics.quantiles(wall, n=4) if len(wall) > 1 else (wall[0],) * 3
        rows.append(
            {
                "run": row["run"],
                "median_ms": _median(wall),
                "quartiles_ms": [round(q1, 2), round(q3, 2)],
                "vs_tensor": round(statistics.median(wall) / base, 4),
                "cpu_ms_per_rank": [_median(r[i]["cpu"]) for r in per_rank],
                "cpu_vs_tensor": round(statistics.median(cpu_sum[i]) / cpu_base, 4),
            }
        )
    return rows


if __name__ == "__main__":
    main()
