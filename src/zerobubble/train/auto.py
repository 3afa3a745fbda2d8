"""``pipeline_parallel_schedule = "auto"`` in the trainer: profile briefly, plan, then measure
the plan against 1F1B and the fixed kinds on the real model, and train with the fastest.

The pieces are the benchmark's (:mod:`zerobubble.train.job`, :mod:`zerobubble.train.trials`):
ZB-H1 and 1F1B take turns for a few steps with the backward split, their traces are the
stage profile (:func:`~zerobubble.profile.stages.stage_profile`), the planner
(:func:`~zerobubble.train.job.plan_schedule`) plans under ``mem_ratio`` x 1F1B's predicted
peak, and :func:`~zerobubble.train.trials.plan_candidates` adds the fixed kinds that fit
(ZB-H1, ZB-H2, ...). 1F1B joins them, and ZBV and interleaved 1F1B where the model has
layers for two stages per device. Each candidate then runs ``TRIAL_WARMUP + TRIAL_STEPS``
steps (those of one placement taking turns) and the fastest median step wins
(:func:`~zerobubble.train.trials.fastest`).

Every trial step is a forward and backward **without an optimizer step**, on pipelines
that are dropped afterwards: gradients accumulate into ``.grad`` of their own stage
modules, which the trainer never sees, and the pipeline it trains is built afresh with the
chosen schedule. So ``auto`` trains bitwise as the chosen kind named in the recipe would.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from zerobubble.executor import ExecutorOptions
from zerobubble.pipeline import Pipeline
from zerobubble.profile.costs_file import Profile
from zerobubble.profile.stages import boundary_pairs, message_latency, stage_profile
from zerobubble.runtime.recorder import gather_traces
from zerobubble.schedule.generators import generate, one_f_one_b
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.search.graph import min_feasible_limit
from zerobubble.schedule.simulate import simulate
from zerobubble.trace.format import TraceEvent
from zerobubble.train.trials import Candidate, TrialResult, fastest, plan_candidates, predict_ms

__all__ = ["MEM_RATIO", "TRIAL_STEPS", "TRIAL_WARMUP", "AutoChoice", "choose_schedule"]

TRIAL_WARMUP = 1
"""Steps of each pipeline not measured (the first builds caches and buffers)."""
TRIAL_STEPS = 2
"""Measured steps of each profiled schedule and of each candidate."""
MEM_RATIO = 1.5
"""The plan's activation-memory limit per device: this x 1F1B's predicted peak (the
benchmark's default, ``schedule.mem_ratio``)."""
V_KINDS = ("zbv", "interleaved-1f1b")
"""Fixed kinds of two stages per device, tried where the model has 2 x P layers; the
one-stage profile does not price them (their prediction is unknown)."""

BuildFn = Callable[[Schedule, ExecutorOptions], Pipeline]
"""``build(schedule, options) -> this rank's Pipeline`` of the model (collective)."""
StepFn = Callable[[Pipeline], None]
"""One forward and backward of the trial batch on a pipeline without an optimizer."""


@dataclass(frozen=True)
class AutoChoice:
    """What ``auto`` measured and chose (the same on every rank)."""

    schedule: Schedule
    kind: str
    """The chosen candidate's name (``auto`` for the plan)."""
    trials: tuple[TrialResult, ...]
    """Every candidate tried, in the order tried; ``chosen`` marks the winner."""
    warning: str
    """Non-empty when the plan lost to a fixed kind: both names and median steps."""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able record (the trainer writes it to ``dump_folder/schedule.json``)."""
        return {
            "chosen": self.kind,
            "warning": self.warning or None,
            "trials": [
                {
                    "kind": r.kind,
                    "predicted_ms": r.predicted_ms if math.isfinite(r.predicted_ms) else None,
                    "step_ms": [round(s * 1e3, 3) for s in r.step_s],
                    "median_ms": round(r.step_time * 1e3, 3),
                    "chosen": r.chosen,
                }
                for r in self.trials
            ],
        }


def choose_schedule(
    build: BuildFn,
    step: StepFn,
    *,
    num_devices: int,
    microbatches: int,
    num_layers: int,
    options: ExecutorOptions,
    device: torch.device,
    mem_ratio: float = MEM_RATIO,
) -> AutoChoice:
    """Profile, plan and measure (see the module); collective over the job's ranks.

    ``build`` makes the model's pipeline for a schedule (called several times: each
    pipeline is dropped after its steps), ``step`` runs one step of the trial batch on
    it. ``options`` are the training run's (seed, recompute); the profile runs them
    unfused, the trials as given.
    """
    from zerobubble.train.job import PLANNER

    P, M = num_devices, microbatches
    rc = options.recompute != "none"
    unfused = replace(options, fuse_local_backward=False, trace=True)
    zbh1, f1b = generate("zb-h1", P, M), one_f_one_b(P, M)
    base: Pipeline | None = build(zbh1, unfused)
    assert base is not None
    if base.executor.sharding is None:  # 1F1B on the same stages, the two taking turns
        other = base.with_schedule(f1b, options=unfused)
        _rotate([base, other], step, device)
        traces = [_gather(base), _gather(other)]
        del other
    else:  # FSDP wraps the stages in place: one schedule per pipeline, one at a time
        _rotate([base], step, device)
        traces = [_gather(base)]
        base = None
        gc.collect()  # its memory free before the next is built
        other = build(f1b, unfused)
        _rotate([other], step, device)
        traces.append(_gather(other))
        del other

    box: list[Any] = [None]
    if dist.get_rank() == 0:  # rank 0 holds the traces
        box[0] = _plan(traces, f1b, M, num_layers, recompute=rc, mem_ratio=mem_ratio)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], ValueError):  # refused alike on every rank
        raise box[0]
    candidates: list[Candidate] = list(box[0])
    if num_layers >= 2 * P:
        candidates += [Candidate(k, generate(k, P, M), math.inf) for k in V_KINDS]
    step_s = _trials(build, step, base, candidates, options, device)
    del base
    gc.collect()
    tried = [(c, s) for c, s in zip(candidates, step_s, strict=True) if s is not None]
    best = fastest([(statistics.median(s), c.predicted_ms) for c, s in tried])
    results = tuple(
        TrialResult(c.kind, c.predicted_ms, tuple(s), tuple(s), i == best)
        for i, (c, s) in enumerate(tried)
    )
    won = tried[best][0]
    return AutoChoice(won.schedule, won.kind, results, _warning(results, PLANNER))


def _plan(
    traces: list[list[TraceEvent] | None],
    f1b: Schedule,
    M: int,
    num_layers: int,
    *,
    recompute: bool,
    mem_ratio: float,
) -> tuple[Candidate, ...] | ValueError:
    """The trial's candidates from the ZB-H1 and 1F1B traces: the profile, the plan within
    ``mem_ratio`` x 1F1B's activation peak, its best predictions and 1F1B; a ValueError to
    raise on every rank when the planner finds nothing."""
    from zerobubble.train.job import plan_schedule

    P, rc = f1b.num_devices, recompute
    zb, full_run = traces[0] or [], traces[1] or []
    split = stage_profile(zb, P, skip_iterations=TRIAL_WARMUP, recompute=rc)
    full = stage_profile(full_run, P, skip_iterations=TRIAL_WARMUP, recompute=rc)
    paid = message_latency(full_run, zb, skip_iterations=TRIAL_WARMUP)
    pairs = boundary_pairs(f1b.placement)
    lat = tuple((s, paid[s]) for s, _, _ in pairs if s in paid and paid[s].median >= 0)
    prof = Profile(split, f1b.placement, lat, warmup=TRIAL_WARMUP, fused=full)
    costs = prof.cost_model()
    peak = max(float(m) for m in simulate(f1b, prof.cost_model(fused=True)).peak_memory)
    if rc:  # 1F1B's B rebuilds one M_W at least
        peak = max(peak, float(min_feasible_limit(f1b.placement, costs)))
    limit = int(mem_ratio * peak)
    try:
        planned, kind = plan_schedule(P, M, costs, limit, num_layers=num_layers)
    except ValueError as exc:  # ScheduleError too
        return ValueError(
            f"pipeline_parallel_schedule auto: the planner found no schedule within "
            f"{mem_ratio} x 1F1B's activation peak ({exc}); name a schedule kind instead"
        )
    found = list(plan_candidates(prof, (kind, planned), M, limit, top=8, pairs=False))
    ran = fuse_local_backward(f1b)
    if all(fuse_local_backward(c.schedule).actions != ran.actions for c in found):
        found.append(Candidate("1f1b", f1b, predict_ms(prof, ran)))
    return tuple(found)


def _gather(pipe: Pipeline) -> list[TraceEvent] | None:
    """``pipe``'s events of every pipeline rank on its pipeline rank 0 (one replica's ranks:
    one clock); the job's rank 0 is one of those."""
    return gather_traces(pipe.executor.trace, group=pipe.executor.group)


def _warning(results: Sequence[TrialResult], planner: str) -> str:
    """Non-empty where the plan measured slower than the fastest fixed kind."""
    plan = next((r for r in results if r.kind == planner), None)
    won = next(r for r in results if r.chosen)
    if plan is None or plan.chosen:
        return ""
    return (
        f"the plan ({planner}) lost to {won.kind} in the trial: median step "
        f"{plan.step_time * 1e3:.1f} ms against {won.step_time * 1e3:.1f} ms; training with "
        f"{won.kind}"
    )


def _trials(
    build: BuildFn,
    step: StepFn,
    base: Pipeline | None,
    candidates: Sequence[Candidate],
    options: ExecutorOptions,
    device: torch.device,
) -> list[list[float] | None]:
    """Each candidate's measured step times (None: a kind this model cannot be built for,
    refused alike on every rank). Candidates on ``base``'s placement share its stages and
    take turns; each other one is built, measured and dropped."""
    out: list[list[float] | None] = [None] * len(candidates)
    same = [
        i
        for i, c in enumerate(candidates)
        if base is not None and c.schedule.placement == base.schedule.placement
    ]
    if base is not None and same:
        pipes = [base.with_schedule(candidates[i].schedule, options=options) for i in same]
        for i, times in zip(same, _rotate(pipes, step, device), strict=True):
            out[i] = times
        del pipes
    for i, c in enumerate(candidates):
        if i in same:
            continue
        gc.collect()
        try:
            pipe = build(c.schedule, options)
        except ValueError:  # e.g. ties this mesh refuses at this placement: on every rank
            continue
        out[i] = _rotate([pipe], step, device)[0]
        del pipe
    return out


def _rotate(pipes: Sequence[Pipeline], step: StepFn, device: torch.device) -> list[list[float]]:
    """``TRIAL_WARMUP + TRIAL_STEPS`` steps of every pipeline, taking turns; the measured
    steps' wall times, slowest rank (every rank gets them)."""
    times: list[list[float]] = [[] for _ in pipes]
    for r in range(TRIAL_WARMUP + TRIAL_STEPS):
        for i, pipe in enumerate(pipes):
            dist.barrier()
            began = time.perf_counter()
            step(pipe)
            took = torch.tensor([time.perf_counter() - began], dtype=torch.float64, device=device)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r >= TRIAL_WARMUP:
                times[i].append(float(took))
    return times
