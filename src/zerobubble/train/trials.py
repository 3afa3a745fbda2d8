"""Trust, but verify: the plan's best candidates, ranked by prediction, chosen by measurement.

The simulator prices what the profile measured (each op's compute, its host tail,
the boundary latency), but not everything a run pays (the machine's load, cache
effects, the messages' interplay with compute on a shared core). So a plan that wins
on paper may lose when run. The job therefore keeps the planner's few best
*candidates*: the plan and the fixed kinds of the profiled stage count that fit the
memory limit, each predicted as the executor will run it (B/W pairs that delay no one
fused, costed by :func:`executed_costs`); they train a few steps each, taking turns,
and the fastest median step wins. Ties (equal medians) go to the better prediction.

With sequence segments (``segments`` > 1 and a profile that measured the segment cost),
the segment kinds join them (:data:`SEGMENT_KINDS`, at k and at the powers of two below
it, cut by :meth:`Profile.cuts`), and the best-predicted of them is always tried: so the
choice of k is made by measurement too.

Overlapped F&B pairs (where the executor may run them, ``pairs=True``): a plan that paired
is tried with its pairs and without them, so the pairs are kept by measurement too; and
where the profile measured an all-to-all, the :data:`PAIRED_KINDS` join with their pairs
(kept, like every candidate, only if the profile's stage count prices them).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.profile.costs_file import Profile
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate

ALTERNATIVES = ("zb-auto", "zb-h2", "zb-h1")
"""Kinds tried beside the plan: one stage per device like the profile, so the profile's
per-stage costs price them (the searching ``zb-auto`` under the plan's memory limit)."""
SEGMENT_KINDS = ("seq-zb", "seq1f1b")
"""Kinds that cut each sequence into segments, tried beside the plan when segments > 1."""
PAIRED_KINDS = ("dualpipev",)
"""Kinds tried with their overlapped pairs beside the plan when the profile measured an
all-to-all (DualPipeV's own pairs: two stages per device)."""


@dataclass(frozen=True)
class Candidate:
    """A schedule the job may train with, and what the profile predicts for it."""

    kind: str
    schedule: Schedule
    predicted_ms: float
    """Predicted pipeline step (ms) of the schedule as the executor runs it
    (:func:`predict_ms`)."""
    cuts: tuple[int, ...] | None = None
    """The token boundaries of a segment schedule's segments (None without segments)."""

    @property
    def pairs(self) -> int:
        """The schedule's overlapped F&B pairs (0: every action runs alone)."""
        return len(self.schedule.overlaps)


class MeasuredSteps:
    """Medians of a run's measured steps, for the result classes that hold them."""

    step_s: tuple[float, ...]
    """Wall time of each measured step (pipeline + optimizer), slowest rank."""
    pipe_s: tuple[float, ...]
    """Wall time of each measured pipeline step alone, slowest rank."""

    @property
    def step_time(self) -> float:
        return statistics.median(self.step_s)

    @property
    def pipe_time(self) -> float:
        return statistics.median(self.pipe_s)


@dataclass(frozen=True)
class TrialResult(MeasuredSteps):
    """A candidate's measured trial steps (warm-up excluded)."""

    kind: str
    predicted_ms: float
    step_s: tuple[float, ...]
    pipe_s: tuple[float, ...]
    chosen: bool
    pairs: int = 0
    """The candidate's overlapped F&B pairs."""


def executed_costs(profile: Profile, sched: Schedule) -> CostModel:
    """Per-stage costs of ``sched`` as executed: a stage that runs a split B takes the
    split run's F, B, W; the others (1F1B, stages whose B/W pairs were all fused) the
    unsplit run's F and BW; a segment schedule's per segment (:meth:`Profile.segment_model`)."""
    return profile.segment_model(_microbatch_costs(profile, sched), sched.segments)


def _microbatch_costs(profile: Profile, sched: Schedule) -> CostModel:
    split = set(sched.split_stages())
    if len(split) == sched.num_stages:
        return profile.cost_model()  # needs no unsplit run
    whole = profile.cost_model(fused=True)
    if not split:
        return whole
    return profile.cost_model().with_stages_from(whole, set(range(sched.num_stages)) - split)


def predict_ms(profile: Profile, sched: Schedule) -> float:
    """The predicted pipeline step of ``sched`` as it will run (``sched`` already fused
    or not, as the executor will run it): the simulated makespan plus the profile's
    fixed time per step (:attr:`Profile.step_fixed_ms`)."""
    return float(simulate(sched, executed_costs(profile, sched)).makespan) + profile.step_fixed_ms


def plan_candidates(
    profile: Profile,
    plan: tuple[str, Schedule],
    num_microbatches: int,
    mem_limit: int,
    *,
    top: int,
    segments: int = 1,
    pairs: bool = True,
) -> tuple[Candidate, ...]:
    """At most ``top`` candidates, best prediction first: ``plan`` (kind, schedule), the
    :data:`ALTERNATIVES` and, with ``segments`` > 1, the :data:`SEGMENT_KINDS` at
    :func:`segment_counts` that fit ``mem_limit``; no two that would run alike (the plan
    keeps its name when an alternative is the same schedule). With segments the best
    segment candidate is among them, in place of the last if it has to be. With ``pairs``
    (the executor may overlap: no recomputation), a paired plan also without its pairs
    (``KIND without pairs``) and, where the profile measured an all-to-all, the
    :data:`PAIRED_KINDS` with theirs (``KIND with pairs``) that fit."""
    if top < 1:
        raise ValueError(f"top must be >= 1, got {top}")
    if segments > 1:
        profile.cuts(segments)  # raises, naming the fix, without a measured segment cost
    costs = profile.cost_model()
    num_devices = plan[1].num_devices
    found = [plan]
    if pairs and plan[1].overlaps:  # measured with and without its pairs
        found.append(
            (f"{plan[0]} without pairs", plan[1].with_actions(plan[1].actions, overlaps=()))
        )
    for kind in PAIRED_KINDS if pairs and any(costs.a2a) else ():
        sched = generate(kind, num_devices, num_microbatches, overlap=True)
        if sched.num_stages == costs.num_stages:
            try:
                validate(sched, mem_limit=mem_limit, costs=costs)
            except ValueError:  # does not fit the limit
                continue
            found.append((f"{kind} with pairs", sched))
    for kind in ALTERNATIVES:
        searches = "mem_limit" in GENERATORS[kind].options
        try:
            sched = generate(
                kind,
                num_devices,
                num_microbatches,
                costs=CostSpec(stage_costs=costs) if searches else None,
                mem_limit=mem_limit if searches else None,
            )
            validate(sched, mem_limit=mem_limit, costs=costs)
        except ValueError:  # does not fit the limit (ScheduleError is a ValueError)
            continue
        found.append((kind, sched))
    for name, sched in segment_schedules(num_devices, num_microbatches, segments):
        try:
            model = profile.segment_model(costs, sched.segments)
            validate(sched, mem_limit=mem_limit, costs=model)
        except ValueError:  # does not fit the limit
            continue
        found.append((name, sched))
    out: list[Candidate] = []
    seen: set[tuple[object, ...]] = set()
    for kind, sched in found:
        ran = fuse_local_backward(sched)
        key = (sched.segments, ran.overlaps, *(tuple(acts) for acts in ran.actions))
        if sched.num_stages != plan[1].num_stages or key in seen:
            continue
        seen.add(key)
        cuts = profile.cuts(sched.segments) if sched.segments > 1 else None
        out.append(Candidate(kind, sched, predict_ms(profile, ran), cuts))
    order = sorted(range(len(out)), key=lambda i: (out[i].predicted_ms, i))
    chosen = order[:top]
    cut = [i for i in order if out[i].cuts is not None]
    if top > 1 and cut and not any(out[i].cuts is not None for i in chosen):
        chosen[-1] = cut[0]
    return tuple(out[i] for i in chosen)


def segment_schedules(
    num_devices: int, num_microbatches: int, segments: int
) -> list[tuple[str, Schedule]]:
    """The :data:`SEGMENT_KINDS` at each of :func:`segment_counts`, named ``kind(k=K)``."""
    return [
        (f"{kind}(k={k})", generate(kind, num_devices, num_microbatches, segments=k))
        for k in segment_counts(segments)
        for kind in SEGMENT_KINDS
    ]


def segment_counts(segments: int) -> tuple[int, ...]:
    """The segment counts the candidates try for ``segments``: every k from 2 to it (none
    for 1); :func:`candidates` keeps those that fit the memory limit."""
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    return tuple(range(2, segments + 1))


def fastest(trials: list[tuple[float, float]]) -> int:
    """Index of the fastest trial among ``(median step s, predicted ms)`` pairs: the
    smallest measured median, ties to the smaller prediction, then to the earlier."""
    if not trials:
        raise ValueError("no trial to choose from")
    return min(range(len(trials)), key=lambda i: (trials[i][0], trials[i][1], i))


def overlapping(results: Sequence[TrialResult]) -> tuple[str, ...]:
    """The tried candidates whose measured step range (min to max) overlaps the chosen
    one's: what the trial could not tell apart from the winner, at its number of steps."""
    won = next((r for r in results if r.chosen), None)
    if won is None:
        return ()
    lo, hi = min(won.step_s), max(won.step_s)
    return tuple(
        r.kind for r in results if not r.chosen and min(r.step_s) <= hi and max(r.step_s) >= lo
    )
