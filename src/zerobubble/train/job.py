"""The end-to-end job every rank runs: profile -> plan -> train -> measure.

Phases, in lock step on all ranks (rank 0 analyses and reports):

1. **Layers.** Rank 0 times every layer alone (:mod:`zerobubble.profile.layers`)
   and sends the costs to all ranks; the balanced cut minimises the slowest
   stage. A few ZB-H1 steps on a copy cut into equal layer counts measure
   the stage times *before* balancing.
2. **Profile.** 1F1B and ZB-H1 take turns training the model (balanced cut) on
   batches of the longest length the job can draw, so the memory planned from
   them holds on every later step, whatever its length. Their traces are the
   stage profile (ZB-H1: F, B, W and memory; 1F1B: F and BW without split); a
   boundary's latency is what its messages took in those steps (from the end of
   the producing op's compute to the return of a receiver that was waiting), or a
   ping-pong's where no receiver waited.
3. **Plan.** Rank 0 plans with :data:`PLANNER` under the memory limit from
   the profile and sends the schedule to all ranks, with the other candidates
   (:mod:`zerobubble.train.trials`: the fixed kinds that fit, best prediction
   first). Unless ``job.trials`` is 1, the candidates train a few steps each,
   taking turns, and the fastest by measurement becomes the plan.
4. **Train.** 1F1B, ZB-H1 and the plan take turns, step by step, so that a
   drifting machine load hits all three alike; these steps are the figures
   compared. They run as the executor does by default, with B/W pairs that
   delay no one fused into BW (profiling runs every B and W split). The
   plan's trace is saved and checked.

Every step trains the same model (:mod:`zerobubble.train.models`: our GPT, or a
tiny Hugging Face causal LM on padded rows of varying length) with one AdamW
optimizer behind :mod:`zerobubble.optim`'s synchronous step (global grad-norm
clipping, non-finite steps skipped); gradients are bitwise the same whatever the
schedule, so schedules only change the speed. A parameter the layers share across
stages (a tied embedding and LM head) is a tied group
(:class:`~zerobubble.parallel.tied.TiedGroups`): its replicas' gradients are summed
in stage order before clipping, and the replicas are compared (a checksum each)
after every step. Each phase's executor seeds its stages' random ops (dropout) per
(step, stage, microbatch) from its own seed; ``losses.json`` records, per step,
the phase, the executor's step number, that seed and the exact loss, which is what
a single-process reference needs to reproduce the run.
Warm-up steps are excluded from every figure. Python's cyclic garbage collector runs
between steps, never inside one (:mod:`zerobubble.train.collect`).
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.executor import ExecutorOptions
from zerobubble.models.corpus import CharCorpus, stdlib_corpus
from zerobubble.optim.config import OptimConfig
from zerobubble.parallel.ep import ExpertGroup, expert_groups, timing_waits
from zerobubble.parallel.partition import stage_bounds
from zerobubble.pipeline import Pipeline
from zerobubble.profile.balance import balanced_boundaries, boundaries_of, stage_costs
from zerobubble.profile.bubbles import IterationBubbles, analyze_iteration
from zerobubble.profile.calibrate import fit_latency
from zerobubble.profile.costs_file import Profile
from zerobubble.profile.layers import LayerProfile, profile_layers
from zerobubble.profile.segments import profile_segment_cost, profile_segment_memory
from zerobubble.profile.stages import (
    StageProfile,
    all_to_all_ms,
    boundary_pairs,
    message_latency,
    p2p_latency,
    stage_profile,
)
from zerobubble.profile.stats import OpStats
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.recorder import gather_traces
from zerobubble.runtime.rng import derive_seed
from zerobubble.runtime.sequence.check import check_segments
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import NoPairWarning, generate, one_f_one_b
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.search.graph import min_feasible_limit
from zerobubble.schedule.segments import SegmentCost, SegmentMemory, balanced_cuts
from zerobubble.schedule.simulate import SimResult, simulate
from zerobubble.schedule.validate import validate
from zerobubble.trace.check import TraceReport, check_trace
from zerobubble.trace.format import TraceEvent, write_chrome_trace, write_jsonl
from zerobubble.train.collect import StepCollector
from zerobubble.train.config import TORCH_PROFILE_ACTIVE, TORCH_PROFILE_WARMUP, TrainConfig
from zerobubble.train.models import JobModel, build_job_model
from zerobubble.train.trials import (
    Candidate,
    MeasuredSteps,
    TrialResult,
    executed_costs,
    fastest,
    overlapping,
    plan_candidates,
    predict_ms,
)

T = TypeVar("T")

PLANNER = "auto"
"""The schedule kind that plans from the measured costs under the memory limit: the
placement search, which with the profile's per-stage costs tries only placements of
the profiled stage count (here one stage per device, the profiled placement)."""


class PlanError(ValueError):
    """The job cannot plan under its settings (e.g. a memory limit no schedule fits); raised
    on every rank alike, with a message naming the setting and the fix."""


class Reporter(Protocol):
    """Live progress of rank 0 (the CLI prints it; tests pass None)."""

    def info(self, text: str) -> None: ...
    def start(self, total_steps: int) -> None: ...
    def extend(self, more_steps: int) -> None: ...
    def step(self, phase: str, step: int, loss: float, seconds: float, note: str) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class Balance:
    """Stage balancing: the equal-count cut against the balanced one.

    Times are per-stage medians of F + B + W in ms: ``predicted_*`` summed from the
    layer profile, ``measured_*`` from pipeline runs (None when both cuts agree).
    """

    equal: tuple[int, ...]
    balanced: tuple[int, ...]
    predicted_equal: tuple[float, ...]
    predicted_balanced: tuple[float, ...]
    measured_equal: tuple[float, ...] | None
    measured_balanced: tuple[float, ...]


@dataclass(frozen=True)
class PhaseResult(MeasuredSteps):
    """One schedule's training steps, measured (warm-up excluded) and predicted."""

    name: str
    schedule: Schedule
    planned: bool
    """True for the schedule the job planned from the profile."""
    step_s: tuple[float, ...]
    """Wall time of each measured step (pipeline + optimizer), slowest rank."""
    pipe_s: tuple[float, ...]
    """Wall time of each measured pipeline step alone, slowest rank."""
    losses: tuple[float, ...]
    """Mean loss of every step, warm-up included."""
    bubbles: tuple[IterationBubbles, ...]
    """Idle-time breakdown of each measured iteration."""
    predicted: SimResult
    """The schedule simulated with the measured profile (times in ms)."""
    fixed_ms: float = 0.0
    """The step's measured time outside its compute window, added to the prediction."""
    replayed: SimResult | None = None
    """The schedule simulated with the op times of these very steps
    (:meth:`~zerobubble.profile.costs_file.Profile.replay_model`); None for a schedule of
    sequence segments or overlapped pairs, whose ops the stage profile does not separate."""

    @property
    def bubble_rate(self) -> float:
        return statistics.median(b.bubble_rate for b in self.bubbles)

    @property
    def peak_memory(self) -> int:
        return max(b.peak_memory for b in self.bubbles)

    @property
    def predicted_ms(self) -> float:
        """The predicted pipeline step: the simulated makespan plus the profile's
        :attr:`~zerobubble.profile.costs_file.Profile.step_fixed_ms`."""
        return float(self.predicted.makespan) + self.fixed_ms

    @property
    def predicted_bubble_rate(self) -> float:
        """Σ idle / (P · makespan) of the simulation: the measured rate's definition, so
        the ops' host tails count as idle (a trace's "overhead"), not as compute."""
        r = self.predicted
        busy = sum(float(x) - float(h) for x, h in zip(r.busy, r.host, strict=True))
        return 1 - busy / (len(r.busy) * float(r.makespan)) if r.makespan else 0.0

    @property
    def predicted_overhead_ms(self) -> float:
        """The host time that delayed the simulated actions, summed over devices (ms per
        iteration): the measured "overhead"'s definition (see ``SimResult.overhead``)."""
        return sum(float(h) for h in self.predicted.overhead)

    @property
    def replayed_ms(self) -> float | None:
        """The replayed pipeline step: what the prediction would have been at the pace these
        steps ran (same fixed time per step); None where there is no replay."""
        if self.replayed is None:
            return None
        return float(self.replayed.makespan) + self.fixed_ms

    def idle_ms(self) -> dict[str, float]:
        """Idle time by cause, summed over devices, median over measured iterations."""
        keys = self.bubbles[0].totals().keys()
        return {k: statistics.median(b.totals()[k] for b in self.bubbles) / 1e6 for k in keys}


@dataclass(frozen=True)
class StepRecord:
    """One training step as it ran (``losses.json``): enough to reproduce it alone."""

    step: int
    """Position in the job (every phase's steps, in the order they ran)."""
    phase: str
    iteration: int
    """The phase executor's step number (the ``k`` of its random ops' seed)."""
    seed: int
    """The phase executor's :attr:`~zerobubble.executor.ExecutorOptions.seed`."""
    loss: float
    """The batch loss: the microbatches' losses summed (token-normalised loss) or
    averaged (per-sample mean), as float32 computes it."""
    seq_len: int = 0
    """The batch's length (``job.seq_len`` in the profiling steps, which draw the longest
    batch; see :func:`~zerobubble.train.models.padded_batch`)."""
    cuts: tuple[int, ...] | None = None
    """A segment schedule's token boundaries (see
    :func:`~zerobubble.reference.step.segment_reference_step`); None without segments."""


@dataclass(frozen=True)
class JobResult:
    """What rank 0 hands back: every figure the CLI prints and the bench reports."""

    config: TrainConfig
    layers: LayerProfile
    balance: Balance
    profile: Profile
    mem_limit: int
    plan_kind: str
    plan: Schedule
    phases: tuple[PhaseResult, ...]
    trace_report: TraceReport | None
    files: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    steps: tuple[StepRecord, ...] = ()
    tied: tuple[str, ...] = ()
    """Parameters tied across stages (the model's first name of each), checked equal after
    every step."""
    trials: tuple[TrialResult, ...] = ()
    """The candidates tried before training, best prediction first (empty: the plan was
    taken on its prediction)."""
    collections: int = 0
    """Garbage collections rank 0 made between steps: one before every step it ran,
    the layer cut's measuring steps included (none inside a step)."""


def plan_schedule(
    num_devices: int,
    num_microbatches: int,
    costs: CostModel,
    mem_limit: int,
    *,
    num_layers: int,
    overlap: bool = False,
) -> tuple[Schedule, str]:
    """The :data:`PLANNER` schedule for ``costs`` within ``mem_limit`` and at most one
    stage per layer of ``num_layers``, validated, and its kind. ``overlap``: the planner may
    pair F&B where that pays (none pays without an all-to-all cost; a placement of one stage
    per device, the job's profile, has none: then it says nothing)."""
    spec = CostSpec(stage_costs=costs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoPairWarning)
        sched = generate(
            PLANNER,
            num_devices,
            num_microbatches,
            costs=spec,
            mem_limit=mem_limit,
            max_stages=num_layers,
            overlap=overlap,
        )
    validate(sched, mem_limit=mem_limit, costs=costs)
    return sched, PLANNER


# ---- the job --------------------------------------------------------------------------------


@dataclass
class _Ctx:
    """State shared by the phases on one rank."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    corpus: CharCorpus
    data: torch.Generator
    reporter: Reporter | None
    model: JobModel | None = None
    tied_names: tuple[str, ...] = ()
    """The model's first name of every parameter tied across stages."""
    step_index: int = 0
    phases_made: int = 0
    steps: list[StepRecord] = field(default_factory=list)
    collector: StepCollector = field(default_factory=StepCollector)
    """Collects Python's garbage before each step (see :mod:`zerobubble.train.collect`)."""

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def say(self, text: str) -> None:
        if self.lead and self.reporter is not None:
            self.reporter.info(text)

    @property
    def job_model(self) -> JobModel:
        assert self.model is not None  # set first thing in _run
        return self.model

    def batch(self, longest: bool = False) -> tuple[tuple[Any, ...], torch.Tensor]:
        """The next step's batch (step arguments, target) from the job's data stream;
        ``longest``: of the longest length the job can draw (``seq_len``)."""
        return self.job_model.batch(self.cfg.batch_size, self.data, longest)

    def next_seed(self) -> int:
        """The seed of the next phase executor: the n-th made gets (seed, 0, 0, n)'s."""
        self.phases_made += 1
        return derive_seed(self.cfg.job.seed, 0, 0, self.phases_made - 1)


def run_job(cfg: TrainConfig, reporter: Reporter | None = None) -> JobResult | None:
    """Run the whole job on this rank (start it with one process per device).

    Returns the :class:`JobResult` on rank 0 and None elsewhere.
    """
    began = time.perf_counter()
    info = init_distributed(timeout_s=cfg.executor.comm_timeout_s)
    if info.world_size != cfg.schedule.devices:
        raise ValueError(
            f"the job was configured for {cfg.schedule.devices} devices but runs on "
            f"{info.world_size} ranks; pass -p with the number of processes"
        )
    ctx = _Ctx(
        cfg,
        info.rank,
        info.world_size,
        info.device,
        stdlib_corpus(max_chars=cfg.job.corpus_chars),
        torch.Generator().manual_seed(cfg.job.seed),
        reporter,
    )
    try:
        with ctx.collector:
            return _run(ctx, began)
    finally:
        if ctx.lead and reporter is not None:
            reporter.close()
        dist.destroy_process_group()


def _run(ctx: _Ctx, began: float) -> JobResult | None:
    cfg, P = ctx.cfg, ctx.world
    model = ctx.model = build_job_model(cfg, ctx.corpus)
    layers = model.layers
    _say_job(ctx, model)
    # 1. Per-layer costs on rank 0, the same cut everywhere.
    lp, seg_cost, seg_memory = _profile_layers(ctx)
    equal = tuple(boundaries_of(stage_bounds(len(layers), P)))
    balanced = tuple(balanced_boundaries(lp.costs(), P))
    ctx.say(f"layer cut: equal counts {list(equal)} -> balanced {list(balanced)}")
    measured_equal = None
    if equal != balanced:
        measured_equal = _measure_cut(ctx, layers, equal)
    # 2. Profile: 1F1B and ZB-H1 take turns step by step on the balanced cut (and train).
    base = one_f_one_b(P, cfg.schedule.microbatches)
    zbh1 = generate("zb-h1", P, cfg.schedule.microbatches)
    root, phases, opt = _profile_phases(ctx, balanced, base, zbh1)
    profiled, a2a = _profile_steps(ctx, root, phases)
    boundary = cfg.job.microbatch_size * cfg.job.seq_len * model.hidden * 4  # float32
    pairs = [(a, b) for _, a, b in boundary_pairs(base.placement)]
    latency = p2p_latency(pairs, boundary, device=ctx.device)

    # 3. Plan on rank 0; a refusal reaches every rank, so that all of them stop alike.
    def plan_or_refusal() -> _Plan | PlanError:
        try:
            fixed = [x for ph in phases for x in ph.fixed_s]
            steps = [(ph.pipe.schedule, statistics.median(ph.settled_s) * 1e3) for ph in phases]
            segment = (seg_cost, seg_memory)
            return _plan(ctx, profiled, lp, balanced, latency, base, fixed, segment, steps, a2a)
        except PlanError as exc:
            return exc

    plan = _from_lead(ctx, plan_or_refusal)
    if isinstance(plan, PlanError):
        raise plan
    ctx.say(_a2a_line(a2a, plan.profile.stages))
    paired = len(plan.schedule.overlaps)
    ctx.say(
        f"planned with {plan.kind}{f' ({paired} overlapped pairs)' if paired else ''} under a "
        f"memory limit of {plan.mem_limit / 2**20:.2f} MiB per device"
    )
    trials: tuple[TrialResult, ...] = ()
    # 4. Train: the three schedules take turns (first the plan's candidates, if several).
    if not cfg.job.profile_only:
        phases, plan, trials = _train(ctx, root, zbh1, opt, phases, plan)
    root.tied.check(root.executor.iteration)  # the replicas after the last step too
    if not ctx.lead:
        return None
    cut = _Cut(lp, equal, balanced, measured_equal)
    return _report(ctx, phases, cut, plan, trials, began=began)


def _say_job(ctx: _Ctx, model: JobModel) -> None:
    """The job's opening lines: the model, the corpus, the pipeline and recompute."""
    cfg = ctx.cfg
    n_params = sum(p.numel() for p in nn.Sequential(*model.layers).parameters())
    mb, L = cfg.job.microbatch_size, cfg.job.seq_len
    shape = f"{mb} padded rows of up to {L}" if model.count_fn is not None else f"{mb}x{L}"
    ctx.say(
        f"{model.summary}, {n_params / 1e6:.2f}M parameters; {ctx.corpus.sources} stdlib "
        f"files, {len(ctx.corpus.tokens):,} characters; P={ctx.world} ranks, "
        f"M={cfg.schedule.microbatches} microbatches of {shape} tokens"
    )
    if cfg.executor.recompute != "none":
        ctx.say(
            f"activation checkpointing: {cfg.executor.recompute} (F keeps the checkpointed "
            "inputs, B recomputes the forward; profiled and planned with it)"
        )


def _profile_layers(
    ctx: _Ctx,
) -> tuple[LayerProfile, SegmentCost | None, tuple[SegmentMemory, ...] | None]:
    """Per-layer costs, measured on rank 0 and sent to every rank; with segments, the cost
    and the memory of a segment of the sequence too, from the layers' forward on spans of a
    longest batch, and the check that every layer computes on segments what it does on the
    whole (a refusal raises on every rank)."""
    cfg, model = ctx.cfg, ctx.job_model
    layers = model.layers

    def layer_profile() -> (
        tuple[LayerProfile, SegmentCost | None, tuple[SegmentMemory, ...] | None] | PlanError
    ):
        gen = torch.Generator().manual_seed(cfg.job.seed + 1)
        (x,), y = model.batch(cfg.job.microbatch_size, gen, False)
        lp = profile_layers(layers, model.profile_loss, x, y, warmup=1, iters=cfg.job.layer_iters)
        k, L = cfg.schedule.segments, cfg.job.seq_len
        if k == 1:
            return lp, None, None
        (x,), _ = model.batch(cfg.job.microbatch_size, gen, True)
        cost = profile_segment_cost(layers, x, kernel="dense", iters=cfg.job.layer_iters)
        try:
            check_segments(layers, x, balanced_cuts(L, k, cost))
        except ValueError as exc:
            return PlanError(f"cannot run --segments {k}: {exc}")
        return lp, cost, profile_segment_memory(layers, x, kernel="dense")

    profiled_layers = _from_lead(ctx, layer_profile)
    if isinstance(profiled_layers, PlanError):
        raise profiled_layers
    lp, seg_cost, seg_memory = profiled_layers
    if seg_cost is not None:
        k, L = cfg.schedule.segments, cfg.job.seq_len
        ctx.say(
            f"segment cost (whole model's forward): {seg_cost.linear * 1e3:.3g} us a token, "
            f"{seg_cost.attention * 1e6:.3g} ns a query-key pair; {k} segments of equal work: "
            f"cuts {list(balanced_cuts(L, k, seg_cost))} of {L} tokens (each layer checked "
            "to compute on segments what it computes on the whole sequence)"
        )
    return lp, seg_cost, seg_memory


def _profile_phases(
    ctx: _Ctx, balanced: tuple[int, ...], base: Schedule, zbh1: Schedule
) -> tuple[Pipeline, list[_Phase], torch.optim.Optimizer]:
    """The profile's phases, ``base`` (1F1B, the root pipeline) and ZB-H1 on the balanced
    cut, and the optimizer they share. Every phase is a Pipeline of the first one's family:
    one model, one set of tied groups."""
    cfg, model = ctx.cfg, ctx.job_model
    root = Pipeline(
        model.layers,
        model.loss_fn,
        base,
        boundaries=balanced,
        device=ctx.device,
        options=_options(cfg, seed=ctx.next_seed()),
        count_fn=model.count_fn,
        tied_check_every=1,
    )
    _say_ties(ctx, root)
    pipes = [root, root.with_schedule(zbh1, options=_options(cfg, seed=ctx.next_seed()))]
    # After every chunk exists (B/W splitting swaps layers in place); a rank holding two
    # replicas of a tie steps its memory once.
    opt = torch.optim.AdamW(root.parameters(), lr=cfg.optimizer.lr)
    return root, [_phase(ctx, pipe, opt) for pipe in pipes], opt


def _profile_steps(
    ctx: _Ctx, root: Pipeline, phases: list[_Phase]
) -> tuple[list[list[TraceEvent]], _ExpertWaits]:
    """The profile's steps, the phases taking turns on batches of the longest length the
    job can draw (the plan's memory is taken there, so it holds on every step: activations
    grow with the length); returns every phase's events and the expert all-to-all waits."""
    cfg = ctx.cfg
    total = 2 * (cfg.job.warmup + cfg.job.baseline_steps)
    total += 0 if cfg.job.profile_only else 3 * (cfg.job.warmup + cfg.job.steps)
    if ctx.lead and ctx.reporter is not None:
        ctx.reporter.start(total)  # the trials' steps are added once their count is known
    rounds = cfg.job.warmup + cfg.job.baseline_steps
    groups = [g for c in root.executor.chunks.values() for g in expert_groups(c.module)]
    with (
        _torch_profile(ctx, rounds if cfg.job.profile_only else 0) as prof,
        timing_waits(groups) as waited,
    ):
        _rotate(ctx, phases, rounds, measure=False, longest=True, profiler=prof)
    profiled = [gather_traces(ph.pipe.executor.trace) or [] for ph in phases]
    a2a = _expert_waits(ctx, groups, waited, phases[1].pipe.executor.trace.epoch_ns)
    return profiled, a2a


def _train(
    ctx: _Ctx,
    root: Pipeline,
    zbh1: Schedule,
    opt: torch.optim.Optimizer,
    phases: list[_Phase],
    plan: _Plan,
) -> tuple[list[_Phase], _Plan, tuple[TrialResult, ...]]:
    """The measured steps: 1F1B, ZB-H1 and the plan take turns, so that load drifts hit
    them alike, now with the executor's B/W fusion; first the plan's candidates, if more
    than one. Returns the three phases, the plan as chosen and the trials."""
    cfg = ctx.cfg
    fused = root.with_schedule(zbh1, options=_options(cfg, fuse=True, seed=ctx.next_seed()))
    plan_ph, trials, chosen = _verify(ctx, root, opt, plan.candidates)
    plan = plan._replace(schedule=chosen.schedule, kind=chosen.kind)
    phases = [phases[0], _phase(ctx, fused, opt), plan_ph]
    rounds = cfg.job.warmup + cfg.job.steps
    with _torch_profile(ctx, rounds) as prof:
        _rotate(ctx, phases, rounds, measure=True, profiler=prof)
    for ph in phases:
        ph.events = gather_traces(ph.pipe.executor.trace) or []
    return phases, plan, trials


class _ExpertWaits(NamedTuple):
    """What the profiling steps saw of expert all-to-alls, on every rank."""

    groups: int
    """Expert layers' ep groups over all ranks (0: no stage holds expert layers)."""
    exchanging: int
    """Of them, those over more than one rank (the others run every expert locally)."""
    waits: dict[int, list[tuple[int, int]]]
    """Per rank, its waits for all-to-alls, on the ZB-H1 phase's trace clock."""


def _expert_waits(
    ctx: _Ctx, groups: Sequence[ExpertGroup], waited: list[tuple[int, int]], epoch_ns: int
) -> _ExpertWaits:
    """Every rank's recorded all-to-all waits, on the clock of the traces they are charged
    to (a collective)."""
    mine = (
        len(groups),
        sum(g.size > 1 for g in groups),
        [(a - epoch_ns, b - epoch_ns) for a, b in waited],
    )
    every: list[Any] = [None] * ctx.world
    dist.all_gather_object(every, mine)
    return _ExpertWaits(
        sum(x[0] for x in every),
        sum(x[1] for x in every),
        {rank: x[2] for rank, x in enumerate(every)},
    )


def _a2a_line(seen: _ExpertWaits, stages: StageProfile) -> str:
    """The job's line on the all-to-all its plan prices."""
    if not seen.groups:
        return "all-to-all: none (no stage holds expert layers); the plan prices none"
    if not seen.exchanging:
        return (
            "all-to-all: none (every stage's experts run on its own process, ep=1); the plan "
            "prices none"
        )
    per = ", ".join(
        f"s{s} {f:.3g}/{b:.3g}"
        for s, (f, b) in enumerate(zip(stages.a2a_f, stages.a2a_b, strict=True))
    )
    return (
        f"all-to-all waits per F/backward (median ms): {per}; the plan prices "
        f"{[round(x, 3) for x in stages.a2a]} ms each, beside compute"
    )


def _verify(
    ctx: _Ctx, root: Pipeline, opt: torch.optim.Optimizer, candidates: tuple[Candidate, ...]
) -> tuple[_Phase, tuple[TrialResult, ...], Candidate]:
    """The plan's phase and the candidate it runs: the fastest by measurement after
    ``job.trial_steps`` steps of each, taking turns (see :mod:`zerobubble.train.trials`),
    or the best prediction alone when there is one candidate."""
    cfg = ctx.cfg

    def pipe(c: Candidate) -> Pipeline:
        opts = _options(cfg, fuse=True, seed=ctx.next_seed(), cuts=c.cuts)
        return root.with_schedule(c.schedule, options=opts)

    if len(candidates) == 1:
        only = candidates[0]
        return _phase(ctx, pipe(only), opt, name=only.kind, planned=True), (), only
    ctx.say(
        "trying the plan's candidates, best prediction first: "
        + ", ".join(
            f"{c.kind} ({c.predicted_ms:.0f} ms{f', {c.pairs} pairs' if c.pairs else ''})"
            for c in candidates
        )
    )
    if ctx.lead and ctx.reporter is not None:
        ctx.reporter.extend(len(candidates) * (cfg.job.warmup + cfg.job.trial_steps))
    tried = [_phase(ctx, pipe(c), opt, name=f"try:{c.kind}") for c in candidates]
    _rotate(ctx, tried, cfg.job.warmup + cfg.job.trial_steps, measure=True)

    def measured() -> tuple[TrialResult, ...]:  # rank 0 holds the step times
        best = fastest(
            [
                (statistics.median(t.step_s), c.predicted_ms)
                for t, c in zip(tried, candidates, strict=True)
            ]
        )
        return tuple(
            TrialResult(
                c.kind, c.predicted_ms, tuple(t.step_s), tuple(t.pipe_s), i == best, c.pairs
            )
            for i, (t, c) in enumerate(zip(tried, candidates, strict=True))
        )

    results = _from_lead(ctx, measured)
    best = next(i for i, r in enumerate(results) if r.chosen)
    won = candidates[best]
    ctx.say(
        f"chose {won.kind}{f' ({won.pairs} overlapped pairs)' if won.pairs else ''} by "
        "measurement (median step: "
        + ", ".join(f"{r.kind} {r.step_time * 1e3:.0f} ms" for r in results)
        + ")"
        + _within_noise(overlapping(results), cfg.job.trial_steps)
    )
    winner = tried[best]
    return _Phase(candidates[best].kind, True, winner.pipe), results, candidates[best]


def _within_noise(close: Sequence[str], steps: int) -> str:
    """The "chose" line's note on the candidates the trial could not tell from the winner
    (:func:`~zerobubble.train.trials.overlapping`); empty without any."""
    if not close:
        return ""
    names = " and ".join([", ".join(close[:-1]), close[-1]] if len(close) > 1 else close)
    ranges = "ranges" if len(close) > 1 else "range"
    verb = "overlap" if len(close) > 1 else "overlaps"
    return (
        f"; the step {ranges} of {names} {verb} its: within the trial's noise at {steps} "
        "steps each (more job.trial_steps would separate them)"
    )


def _from_lead(ctx: _Ctx, make: Callable[[], T]) -> T:
    """``make()`` run on rank 0 alone and sent to every rank, so all ranks agree on it."""
    box: list[Any] = [make() if ctx.lead else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _options(
    cfg: TrainConfig, *, fuse: bool = False, seed: int = 0, cuts: tuple[int, ...] | None = None
) -> ExecutorOptions:
    # Unfused unless asked: a profile needs B and W of every stage.
    ex = cfg.executor
    return ExecutorOptions(
        comm_timeout_s=ex.comm_timeout_s,
        recv_lookahead=ex.recv_lookahead,
        fuse_local_backward=fuse,
        seed=seed,
        recompute=ex.recompute,  # type: ignore[arg-type]  # checked by ExecutorSection
        cuts=cuts,
        term_weight=ex.term_weight,  # type: ignore[arg-type]  # checked by ExecutorSection
    )


def _say_ties(ctx: _Ctx, pipe: Pipeline) -> None:
    """Name the parameters tied across stages (kept for the report) on rank 0."""
    for tp in pipe.shared:
        if tp.tied:
            ctx.tied_names += (tp.source_names[0],)
            ctx.say(
                f"tied across stages {list(tp.stages)}: {', '.join(tp.source_names)} (one "
                "replica per stage, gradients summed in stage order, replicas compared after "
                "every step)"
            )


def _measure_cut(ctx: _Ctx, layers: list[nn.Module], cut: tuple[int, ...]) -> tuple[float, ...]:
    """Per-stage F + B + W (ms) of a few ZB-H1 steps on a copy of the model cut at ``cut``."""
    cfg, model = ctx.cfg, ctx.job_model
    sched = generate("zb-h1", ctx.world, cfg.schedule.microbatches)
    pipe = Pipeline(
        layers,
        model.loss_fn,
        sched,
        boundaries=cut,
        device=ctx.device,
        options=_options(cfg),
        count_fn=model.count_fn,
    )
    gen = torch.Generator().manual_seed(cfg.job.seed + 2)
    for _ in range(cfg.job.warmup + 2):
        args, y = model.batch(cfg.batch_size, gen, False)
        ctx.collector.boundary()
        pipe.step(*args, target=y)  # no optimizer: gradients accumulate on the copy
    events = gather_traces(pipe.executor.trace)
    if events is None:
        return ()
    prof = stage_profile(events, sched.num_stages, skip_iterations=cfg.job.warmup)
    return tuple(prof.stage_time(s) for s in range(sched.num_stages))


@dataclass
class _Phase:
    """One schedule's pipeline and, on rank 0, its measurements."""

    name: str
    planned: bool
    pipe: Pipeline
    measure_from: int = 0
    """First executor iteration whose figures count."""
    step_s: list[float] = field(default_factory=list)
    pipe_s: list[float] = field(default_factory=list)
    fixed_s: list[float] = field(default_factory=list)
    """Per step after the warm-up, measured or not: the pipeline step's time outside its
    compute window (splitting the batch, the first posts, the last waits), slowest rank."""
    settled_s: list[float] = field(default_factory=list)
    """Per step after the warm-up, measured or not: the pipeline step's time, slowest rank
    (the profiled steps' are what the latency fit matches)."""
    losses: list[float] = field(default_factory=list)
    events: list[TraceEvent] = field(default_factory=list)


def _phase(
    ctx: _Ctx, pipe: Pipeline, opt: torch.optim.Optimizer, *, name: str = "", planned: bool = False
) -> _Phase:
    """``pipe`` trained by ``opt`` under the synchronous optimizer step (global grad-norm
    clipping, non-finite steps skipped); named ``name`` or after its schedule."""
    pipe.set_optimizer(opt, OptimConfig(max_norm=ctx.cfg.optimizer.grad_clip))
    return _Phase(name or pipe.schedule.name, planned, pipe)


def _rotate(
    ctx: _Ctx,
    phases: list[_Phase],
    rounds: int,
    *,
    measure: bool,
    longest: bool = False,
    profiler: torch.profiler.profile | None = None,
) -> None:
    """``rounds`` steps of every phase, taking turns; the first ``warmup`` rounds are not
    measured (nor, without ``measure``, any: they only feed the profile). ``longest``: every
    batch of the longest length (see :meth:`_Ctx.batch`). ``profiler`` steps once a round."""
    for ph in phases:
        ph.measure_from = ph.pipe.executor.iteration + ctx.cfg.job.warmup
    for r in range(rounds):
        for ph in phases:
            warm = r < ctx.cfg.job.warmup
            note = "warm-up, not measured" if warm else ("" if measure else "profiling")
            _step(ctx, ph, record=measure and not warm, note=note, longest=longest)
        if profiler is not None:
            profiler.step()


def _torch_profile(
    ctx: _Ctx, rounds: int
) -> contextlib.AbstractContextManager[torch.profiler.profile | None]:
    """With ``job.torch_profile``, a ``torch.profiler`` over ``rounds`` rounds that writes
    this rank's trace to ``<folder>/rank<r>.json`` (see
    :attr:`~zerobubble.train.config.JobSection.torch_profile`); else (or with no rounds)
    nothing. The warm-up shrinks first when fewer rounds run than it and the recording
    take, so a short job still writes a trace."""
    folder = ctx.cfg.job.torch_profile
    if folder is None or rounds == 0:
        return contextlib.nullcontext()
    warmup = min(TORCH_PROFILE_WARMUP, rounds - 1)
    active = min(TORCH_PROFILE_ACTIVE, rounds - warmup)
    path = Path(folder) / f"rank{ctx.rank}.json"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ctx.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=0, warmup=warmup, active=active, repeat=1),
        on_trace_ready=lambda prof: prof.export_chrome_trace(str(path)),
    )


def _step(ctx: _Ctx, ph: _Phase, *, record: bool, note: str, longest: bool = False) -> None:
    """One training step of ``ph``'s schedule; the slowest rank's times go to rank 0."""
    pipe = ph.pipe.executor
    args, y = ctx.batch(longest)
    iteration = pipe.iteration
    ctx.collector.boundary()  # outside the step, and on every rank before the barrier
    dist.barrier()
    t0, t0_ns = time.perf_counter(), pipe.trace.now()
    losses = ph.pipe.step(*args, target=y)  # the pipeline, then the optimizer step
    t1 = time.perf_counter()
    # The pipeline's part ends with its wait for the last sends.
    end_ns = next(e.end_ns for e in reversed(pipe.trace.events) if e.op == "wait_sends")
    ran = [e for e in pipe.trace.events if e.iteration == iteration and e.action is not None]
    first_ns = min((e.start_ns for e in ran), default=end_ns)  # on the ranks' common epoch
    last_ns = max((e.end_ns for e in ran), default=end_ns)
    loss = 0.0
    if losses:  # shares of the batch loss add up to it; per-sample means are averaged
        both = torch.stack(losses)
        loss = (both.sum() if pipe.count_fn is not None else both.mean()).item()
    mine = torch.tensor(
        [
            (end_ns - t0_ns) / 1e9,
            t1 - t0,
            loss,
            float(losses is not None),
            first_ns / 1e9,
            last_ns / 1e9,
        ],
        dtype=torch.float64,
        device=ctx.device,  # the default group's device (NCCL takes no CPU tensors)
    )
    every = [torch.zeros_like(mine) for _ in range(ctx.world)]
    dist.all_gather(every, mine)
    if ctx.lead:
        step_s = max(float(t[1]) for t in every)
        loss = next(float(t[2]) for t in every if t[3] > 0)
        if record:
            ph.pipe_s.append(max(float(t[0]) for t in every))
            ph.step_s.append(step_s)
        if iteration >= ph.measure_from:
            window = max(float(t[5]) for t in every) - min(float(t[4]) for t in every)
            pipe_s = max(float(t[0]) for t in every)
            ph.fixed_s.append(max(pipe_s - window, 0.0))
            ph.settled_s.append(pipe_s)
        ph.losses.append(loss)
        seed = pipe.options.seed
        length = int(y.shape[-1])
        step_record = StepRecord(ctx.step_index, ph.name, iteration, seed, loss, length, pipe.cuts)
        ctx.steps.append(step_record)
        if ctx.reporter is not None:
            ctx.reporter.step(ph.name, ctx.step_index, loss, step_s, note)
    ctx.step_index += 1


class _Plan(NamedTuple):
    profile: Profile
    mem_limit: int
    schedule: Schedule
    kind: str
    candidates: tuple[Candidate, ...]
    """The plan and the alternatives to try, best prediction first (see :func:`_verify`)."""


@dataclass(frozen=True)
class _Cut:
    """The layer profile and the two cuts compared (see :class:`Balance`)."""

    layers: LayerProfile
    equal: tuple[int, ...]
    balanced: tuple[int, ...]
    measured_equal: tuple[float, ...] | None


def _plan(
    ctx: _Ctx,
    profiled: list[list[TraceEvent]],
    lp: LayerProfile,
    balanced: tuple[int, ...],
    latency: Mapping[tuple[int, int], OpStats],
    base: Schedule,
    fixed_s: list[float],
    segment: tuple[SegmentCost | None, tuple[SegmentMemory, ...] | None],
    steps: list[tuple[Schedule, float]],
    a2a: _ExpertWaits,
) -> _Plan:
    cfg = ctx.cfg
    seg_cost, seg_memory = segment
    f1b, zbh1 = profiled
    S = base.num_stages
    rc = cfg.executor.recompute != "none"  # measured: B includes the recomputation
    split = stage_profile(zbh1, S, skip_iterations=cfg.job.warmup, recompute=rc)
    if a2a.exchanging:
        waited = all_to_all_ms(zbh1, a2a.waits, S, skip_iterations=cfg.job.warmup)
        split = replace(split, a2a_f=waited[0], a2a_b=waited[1])
    full = stage_profile(f1b, S, skip_iterations=cfg.job.warmup, recompute=rc)
    # The latency the schedules paid (both profiled runs' messages), else the ping-pong's.
    paid = message_latency(f1b, zbh1, skip_iterations=cfg.job.warmup)
    lat = tuple((s, paid.get(s, latency[a, b])) for s, a, b in boundary_pairs(base.placement))
    fixed_ms = statistics.median(fixed_s) * 1e3 if fixed_s else 0.0
    prof = Profile(
        split,
        base.placement,
        lat,
        lp,
        balanced,
        None,
        cfg.job.warmup,
        full,
        fixed_ms,
        seg_cost,
        cfg.job.seq_len if seg_cost is not None else None,
        segment_memory=seg_memory,
    )
    prof = _fit_latency(prof, steps)
    costs = prof.cost_model()
    limit = cfg.schedule.mem_limit
    if limit is None:
        peak_1f1b = max(float(m) for m in simulate(base, prof.cost_model(fused=True)).peak_memory)
        if rc:  # the model's 1F1B frees in BW what F kept; its B rebuilt one M_W at least
            peak_1f1b = max(peak_1f1b, float(min_feasible_limit(base.placement, costs)))
        limit = int(cfg.schedule.mem_ratio * peak_1f1b)
    prof = replace(prof, mem_limit=limit)
    try:
        planned, kind = plan_schedule(
            ctx.world,
            cfg.schedule.microbatches,
            costs,
            limit,
            num_layers=lp.num_layers,
            overlap=any(costs.a2a) and not rc,  # a2a: ep > 1; pairs planned without recompute
        )
    except ValueError as exc:  # ScheduleError too
        given = (
            f"--mem-limit {limit}"
            if cfg.schedule.mem_limit is not None
            else f"the limit {limit} (--mem-ratio {cfg.schedule.mem_ratio} x 1F1B's peak)"
        )
        raise PlanError(f"cannot plan {PLANNER} within {given} bytes per device: {exc}") from None
    top = 1 if cfg.job.profile_only else cfg.job.trials
    found = plan_candidates(
        prof,
        (kind, planned),
        cfg.schedule.microbatches,
        limit,
        top=top,
        segments=cfg.schedule.segments,
        pairs=not rc,
    )
    return _Plan(prof, limit, planned, kind, found)


def _fit_latency(prof: Profile, steps: list[tuple[Schedule, float]]) -> Profile:
    """``prof`` charging the latency per cross-device dependency under which the profiled
    ``steps`` ((schedule as run, median pipeline ms)) are best predicted."""

    def predict(latency: float) -> list[float]:
        at = replace(prof, comm_fit=latency)
        return [predict_ms(at, sched) for sched, _ in steps]

    fitted = fit_latency(predict, [ms for _, ms in steps], prof.comm_measured)
    return replace(prof, comm_fit=fitted)


def _report(
    ctx: _Ctx,
    phases: list[_Phase],
    cut: _Cut,
    plan: _Plan,
    trials: tuple[TrialResult, ...],
    *,
    began: float,
) -> JobResult:
    cfg, profile, mem_limit, lp = ctx.cfg, plan.profile, plan.mem_limit, cut.layers
    out = Path(cfg.job.out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"profile": str(profile.save(out / "profile.json"))}
    if cfg.job.torch_profile is not None:
        files["torch profile"] = str(Path(cfg.job.torch_profile) / "rank*.json")
    steps = tuple(ctx.steps)
    (out / "losses.json").write_text(json.dumps([asdict(r) for r in steps], indent=1) + "\n")
    files["losses"] = str(out / "losses.json")
    results: tuple[PhaseResult, ...] = ()
    report = None
    if not cfg.job.profile_only:
        from zerobubble.viz.measured import measured_row, plot_measured

        results = tuple(_analyze(ph, profile, mem_limit) for ph in phases)
        events = phases[-1].events
        write_jsonl(events, out / "trace.jsonl")
        write_chrome_trace(events, out / "trace.chrome.json")
        files["trace"] = str(out / "trace.jsonl")
        files["chrome"] = str(out / "trace.chrome.json")
        report = check_trace(
            events,
            mem_budget=mem_limit,
            segments=plan.schedule.segments,
            overlaps=plan.schedule.overlaps,
        )
        panels = []
        for ph, res in zip(phases, results, strict=True):
            # The iteration of median length: representative, not an outlier.
            it = sorted(res.bubbles, key=lambda b: b.window_ns)[len(res.bubbles) // 2]
            title = (
                f"{ph.name} (measured, iteration {it.iteration}): {it.window_ns / 1e6:.0f} ms, "
                f"bubble {it.bubble_rate:.1%}"
            )
            panels.append((measured_row(ph.events, it.iteration, title), it))
        files["timeline"] = str(plot_measured(panels, out / "timeline.png"))
    stages = range(profile.stages.num_stages)
    balance = Balance(
        cut.equal,
        cut.balanced,
        tuple(stage_costs(lp.costs(), cut.equal)),
        tuple(stage_costs(lp.costs(), cut.balanced)),
        cut.measured_equal,
        tuple(profile.stages.stage_time(s) for s in stages),
    )
    return JobResult(
        config=cfg,
        layers=lp,
        balance=balance,
        profile=profile,
        mem_limit=mem_limit,
        plan_kind=plan.kind,
        plan=plan.schedule,
        phases=results,
        trace_report=report,
        files=files,
        wall_s=time.perf_counter() - began,
        steps=steps,
        tied=ctx.tied_names,
        trials=trials,
        collections=ctx.collector.steps,
    )


def _analyze(ph: _Phase, profile: Profile, mem_limit: int) -> PhaseResult:
    """Figures of the measured iterations; the prediction simulates the schedule as it
    ran with the profile (see :func:`executed_costs`), the replay with these iterations'
    own op times."""
    iters = sorted({e.iteration for e in ph.events if e.iteration >= ph.measure_from})
    bubbles = tuple(
        analyze_iteration(ph.events, k, mem_budget=mem_limit, overlaps=ph.pipe.schedule.overlaps)
        for k in iters
    )
    ran = ph.pipe.schedule
    replayed = None
    if ran.segments == 1 and not ran.overlaps:
        run = stage_profile(
            ph.events,
            ran.num_stages,
            skip_iterations=ph.measure_from,
            recompute=profile.stages.recompute,
        )
        replayed = simulate(ran, profile.replay_model(run))
    return PhaseResult(
        ph.name,
        ran,
        ph.planned,
        tuple(ph.step_s),
        tuple(ph.pipe_s),
        tuple(ph.losses),
        bubbles,
        simulate(ran, executed_costs(profile, ran)),
        profile.step_fixed_ms,
        replayed,
    )
