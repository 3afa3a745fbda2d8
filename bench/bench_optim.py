"""Post-validation against the synchronous optimizer step: measured and predicted (prints JSON).

Two CPU ranks (one thread each), an MLP wide enough that AdamW's step costs about
as much as a few microbatches of compute, M = 8. For each schedule kind (zb-h2
and zb-auto, or zb-h1 where zb-auto is not registered) and each step mode:

* ``sync``: all-reduce of the gradient norms, then every rank steps;
* ``conservative`` / ``speculative``: post-validation, inverse rollback;
* ``speculative+snapshot``: post-validation with snapshot rollback (one copy of
  parameters and optimizer state per iteration).

``measured_s`` is the wall time per iteration on rank 0 over ``--steps``
back-to-back iterations (no barrier between them; drained at the end), median
over ``--rounds`` rounds in which the configurations take turns. ``predicted_s``
comes from :func:`zerobubble.schedule.step_sim.simulate_steps` with durations
profiled from a traced synchronous run: per-stage mean F/B/W, the optimizer
step (plus the snapshot copy where used), the all-reduce latency (the shortest
reduction seen: the last rank to arrive waits only for the latency) and the
neighbour latency (half a ping-pong of the state vector).

    PYTHONPATH=src python bench/bench_optim.py [--steps 6] [--rounds 3]

Figures on a shared or loaded machine are noisy; compare on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.rollback import Snapshot
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.recorder import gather_traces
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.step_sim import StepCosts, simulate_steps

P, M = 2, 8
WIDTH, LAYERS, BATCH = 384, 6, 32
MODES = {
    "sync": OptimConfig(max_norm=1.0),
    "conservative": OptimConfig(mode="conservative", max_norm=1.0, rollback="inverse"),
    "speculative": OptimConfig(mode="speculative", max_norm=1.0, rollback="inverse"),
    "speculative+snapshot": OptimConfig(mode="speculative", max_norm=1.0, rollback="snapshot"),
}


def kinds() -> tuple[list[str], str | None]:
    if "zb-auto" in GENERATORS:
        return ["zb-h2", "zb-auto"], None
    return ["zb-h2", "zb-h1"], "zb-auto is not registered yet; zb-h1 measured instead"


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


def build(kind: str, mode: str, rank: int, trace: bool = False) -> PipelineTrainer:
    cfg = MODES[mode]
    sched = generate(kind, P, M)
    layers = build_mlp([WIDTH] * (LAYERS + 1), seed=0)
    # Unfused: the profile needs B and W of every stage, and the prediction
    # simulates the schedule as generated.
    options = ExecutorOptions(trace=trace, fuse_local_backward=False)
    pipe = PipelineExecutor(
        sched, build_stage_modules(layers, sched, rank), loss_fn=mlp_loss, options=options
    )
    params = [p for c in pipe.chunks.values() for p in c.module.parameters()]
    return PipelineTrainer(pipe, torch.optim.AdamW(params, lr=1e-3), cfg)


def timed_block(trainer: PipelineTrainer, start: int, steps: int) -> float:
    """Seconds per iteration over ``steps`` back-to-back iterations (rank 0's clock)."""
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(start, start + steps):
        trainer.step(*batch(i)[:1], target=batch(i)[1])
    trainer.drain()
    dist.barrier()
    return (time.perf_counter() - t0) / steps


def profile(kind: str, rank: int, steps: int) -> dict:
    """Durations for the model, from a traced synchronous run and a ping-pong."""
    trainer = build(kind, "sync", rank, trace=True)
    for i in range(steps + 1):
        if i == 1:
            trainer.pipe.trace.clear()  # drop the first (warm-up) iteration
        trainer.step(*batch(i)[:1], target=batch(i)[1])
    snap = Snapshot(trainer.optimizer)
    t0 = time.perf_counter()
    for _ in range(3):
        snap.prepare()
    snapshot_s = (time.perf_counter() - t0) / 3
    vec = trainer.layout.new_vector()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(20):
        for turn in range(2):
            if rank == turn:
                trainer.pipe.p2p.wait(trainer.pipe.p2p.isend(vec, 1 - rank, "ping"), 1 - rank, "")
            else:
                trainer.pipe.p2p.wait(trainer.pipe.p2p.irecv(vec, 1 - rank, "pong"), 1 - rank, "")
    hop = (time.perf_counter() - t0) / 40
    snaps = [None] * P
    dist.all_gather_object(snaps, snapshot_s)
    events = gather_traces(trainer.pipe.trace)
    if rank != 0:
        return {}
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    opt, reduce = [], []
    for e in events:
        secs = (e.end_ns - e.start_ns) / 1e9
        if e.op in ("F", "B", "W"):
            durations[e.op, e.stage].append(secs)
        elif e.op == "opt_step":
            opt.append(secs)
        elif e.op == "opt_reduce":
            reduce.append(secs)
    S = trainer.pipe.schedule.num_stages
    mean = {k: statistics.fmean(v) for k, v in durations.items()}
    return {
        "F": [mean["F", s] for s in range(S)],
        "B": [mean["B", s] for s in range(S)],
        "W": [mean["W", s] for s in range(S)],
        "opt_step": statistics.fmean(opt),
        "snapshot": max(snaps),
        "allreduce": min(reduce),
        "hop": hop,
    }


def job(steps: int, rounds: int) -> dict | None:
    info = init_distributed(timeout_s=120)
    names, note = kinds()
    out: dict = {"P": P, "M": M, "width": WIDTH, "layers": LAYERS, "batch": BATCH, "runs": []}
    if note:
        out["note"] = note
    for kind in names:
        prof = profile(kind, info.rank, steps)
        trainers = {mode: build(kind, mode, info.rank) for mode in MODES}
        for tr in trainers.values():  # warm-up (shape handshake, allocator)
            timed_block(tr, 0, 2)
        times: dict[str, list[float]] = defaultdict(list)
        for r in range(rounds):
            for mode, tr in trainers.items():
                times[mode].append(timed_block(tr, 2 + r * steps, steps))
        if info.rank != 0:
            continue
        sched = generate(kind, P, M)
        costs = CostModel.per_stage(prof["F"], prof["B"], prof["W"], comm=prof["hop"])
        measured = {m: statistics.median(ts) for m, ts in times.items()}
        for mode in MODES:
            opt = prof["opt_step"] + (prof["snapshot"] if "snapshot" in mode else 0.0)
            sc = StepCosts(opt_step=opt, allreduce=prof["allreduce"], hop=prof["hop"])
            pred = simulate_steps(sched, costs, sc, mode=MODES[mode].mode, iterations=6).step_time
            out["runs"].append(
                {
                    "kind": kind,
                    "mode": mode,
                    "measured_s": measured[mode],
                    "predicted_s": pred,
                    "measured_gain_vs_sync": measured["sync"] / measured[mode],
                    "replays": trainers[mode].pipe.replays,
                }
            )
        sync_pred = next(
            r["predicted_s"] for r in out["runs"] if r["kind"] == kind and r["mode"] == "sync"
        )
        for r in out["runs"]:
            if r["kind"] == kind:
                r["predicted_gain_vs_sync"] = sync_pred / r["predicted_s"]
        out.setdefault("profile", {})[kind] = prof
    dist.destroy_process_group()
    return out if info.rank == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="iterations per timed block")
    ap.add_argument("--rounds", type=int, default=3, help="timed blocks per configuration")
    args = ap.parse_args()
    result = launch(job, P, args.steps, args.rounds, timeout=1800)[0]
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
