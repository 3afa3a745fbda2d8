"""Post-validation (speculative and conservative) and the synchronous step against
single-process training with the same NaN/Inf skips and clipped steps, bitwise, for every
schedule kind at P = 2, 3 or 4 (so the modes are bitwise each other too).

A covering design, not the full product (kind x mode x P): each kind runs once
(:data:`DESIGN`), so that every (placement family, mode), (family, P) and (mode, P) pair is
covered, P = 4 and the V placement included; the V-shaped zbv and dualpipev run all three
modes at P = 3, the case named next. No code path depends on the kind beyond its family: a
mode's protocol is the same at every P and for every kind, and what P changes (ranks,
placements, channels) each family meets at every P. Every run is compared with the
single-process reference, not with a synchronous run of its own: the same property, as the
synchronous step is bitwise that reference.

One launch per P runs its kinds and modes inside the ranks (process start-up dominates).
V-shaped kinds place the last stage on rank 0, so at P >= 3 the validated-state message
from rank d+1 and the V's activations from d+1 share a rank pair: the case that broke when
both travelled on one channel.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from generated import RUNTIME_KINDS, generated
from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.ir import Schedule

WIDTH = 4
LAYERS = 8  # enough for the 2P stages of V-shaped kinds at P = 4
ITERS = 6
MAX_NORM = 2.0  # above this model's gradient norms unless a fault scales them
SKIPS, CLIPS = [1, 3], [2, 4]
MODES = {
    "sync": OptimConfig(max_norm=MAX_NORM),
    "cons": OptimConfig(mode="conservative", max_norm=MAX_NORM),
    "spec": OptimConfig(mode="speculative", max_norm=MAX_NORM),
}


def fault_plan(num_stages: int) -> FaultPlan:
    last = num_stages - 1
    return FaultPlan(
        grads=(
            GradFault(1, last, mb=0),  # NaN where only the full state shows it: roll back, skip
            GradFault(2, last, kind="scale", factor=1e3),  # clip once the last stage adds in
            GradFault(3, 0, mb=1, kind="inf"),  # Inf on stage 0: known early, all defer
            GradFault(4, 0, kind="scale", factor=1e3),  # clip known early
        )
    )


def batch(i: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + i)
    n = 2 * m + 1  # uneven microbatches
    return torch.randn(n, WIDTH, generator=gen), torch.randn(n, WIDTH, generator=gen)


def layers() -> list[nn.Module]:
    return list(build_mlp([WIDTH] * (LAYERS + 1), seed=1))


def snapshot(stage_params, opt) -> dict:
    """Per stage: parameter values and optimizer state, copied."""
    return {
        s: [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in ps]
        for s, ps in stage_params.items()
    }


def reference(num_stages: int, m: int) -> list[dict]:
    """Single-process training with the same faults; per iteration, every stage's snapshot."""
    ls = layers()
    bounds = stage_bounds(len(ls), num_stages)
    stage_params = {
        s: [q for i in bounds[s] for q in ls[i].parameters()] for s in range(num_stages)
    }
    params = list(nn.Sequential(*ls).parameters())
    opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    plan, out = fault_plan(num_stages), []
    for i in range(ITERS):
        x, y = batch(i, m)
        reference_step(ls, mlp_loss, x, y, m)
        plan.at_tail(i, stage_params)
        for f in plan.grads:
            if f.iteration == i and f.mb is not None:
                f.apply(stage_params[f.stage])
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        if torch.isfinite(total):
            opt.step()
        out.append(snapshot(stage_params, opt))
    return out


def first_difference(name: str, mine: list[dict], ref: list[dict]) -> str | None:
    if len(mine) != len(ref):
        return f"{name}: {len(mine)} commits, expected {len(ref)}"
    for it, (a, b) in enumerate(zip(mine, ref, strict=True)):
        for s in a:
            for i, ((p, st), (rp, rst)) in enumerate(zip(a[s], b[s], strict=True)):
                same = torch.equal(p, rp) and st.keys() == rst.keys()
                if not (same and all(torch.equal(st[k], rst[k]) for k in st)):
                    return f"{name}: iteration {it} stage {s} parameter {i} differs"
    return None


def run(rank: int, sched: Schedule, mode: str) -> tuple[list[dict], list, int]:
    m = sched.num_microbatches
    cfg = MODES[mode]
    options = ExecutorOptions(comm_timeout_s=60, trace=False)
    stages = build_stage_modules(layers(), sched, rank)
    pipe = PipelineExecutor(sched, stages, loss_fn=mlp_loss, options=options)
    params = [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]
    opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    snaps, commits = [], []

    def record(c) -> None:
        snaps.append(snapshot(trainer.stage_params, opt))
        commits.append((c.iteration, c.action.value))

    trainer = PipelineTrainer(pipe, opt, cfg, faults=fault_plan(sched.num_stages), on_commit=record)
    for i in range(ITERS):
        trainer.step(*batch(i, m)[:1], target=batch(i, m)[1])
    trainer.drain()
    return snaps, commits, pipe.replays


PS = (2, 3, 4)

#: kind -> (P, modes): each kind once (a covering design, see the module docstring); the
#: searching kinds at P = 2, where they solve in about a second.
DESIGN = {
    "gpipe": (4, ("sync",)),
    "1f1b": (4, ("cons",)),
    "interleaved-1f1b": (4, ("spec",)),
    "zb-h1": (3, ("sync",)),
    "zb-h2": (3, ("spec",)),
    "zb-auto": (2, ("cons",)),
    "optimal": (2, ("sync",)),
    "auto": (2, ("spec",)),
    "v-half": (4, ("sync",)),
    "zbv": (3, ("sync", "cons", "spec")),
    "v-min": (4, ("spec",)),
    "dualpipev": (3, ("sync", "cons", "spec")),
    "1f1b-v": (2, ("spec",)),
    "zbv-auto": (2, ("cons",)),
    "optimal-v": (2, ("sync",)),
}
#: The kinds on the V placement (the last stage on rank 0; ``auto`` may pick either).
V_KINDS = frozenset(("v-half", "zbv", "v-min", "dualpipev", "1f1b-v", "zbv-auto", "optimal-v"))


def design(p: int) -> dict[str, tuple[str, ...]]:
    """The kinds :data:`DESIGN` runs at ``p``, with their modes."""
    return {k: modes for k, (q, modes) in DESIGN.items() if q == p}


def matrix_job(schedules: dict[str, Schedule], modes: dict[str, tuple[str, ...]]) -> dict:
    rank = init_distributed(timeout_s=120).rank
    refs: dict[int, list[dict]] = {}
    out: dict = {"bad": [], "commits": {}, "replays": {}}
    for kind, sched in schedules.items():
        m = sched.num_microbatches
        for mode in modes[kind]:
            snaps, commits, replays = run(rank, sched, mode)
            out["commits"][kind, mode] = commits
            out["replays"][kind, mode] = replays
            S = sched.num_stages
            if S not in refs:  # every kind at this P cuts the same model into S stages
                refs[S] = reference(S, m)
            bad = first_difference(f"{kind}/{mode} vs single process", snaps, refs[S])
            if bad:
                out["bad"].append(bad)
    dist.destroy_process_group()
    return out


def check(results: list[dict], modes: dict[str, tuple[str, ...]], p: int) -> None:
    bad = [b for r in results for b in r["bad"]]
    assert not bad, "\n".join(bad)
    expected = [
        (i, "skip" if i in SKIPS else "clip" if i in CLIPS else "step") for i in range(ITERS)
    ]
    for kind, kind_modes in modes.items():
        for mode in kind_modes:
            for r in results:
                assert r["commits"][kind, mode] == expected, (kind, mode, p)
            # Every skipped or clipped iteration but the last forces a replay of its
            # successor's speculative work; conservative and sync never replay.
            assert results[0]["replays"][kind, mode] == (4 if mode == "spec" else 0), (kind, p)


def schedules(kinds: list[str], p: int) -> dict[str, Schedule]:
    """Built once here, not on every rank for every mode (the search kinds take seconds)."""
    return {kind: generated(kind, p, 2 * p) for kind in kinds}


def test_covering_design_covers_every_pair():
    runs = {(k, mode, p) for k, (p, modes) in DESIGN.items() for mode in modes}
    assert DESIGN.keys() == set(RUNTIME_KINDS) and V_KINDS.issubset(DESIGN)
    for family in (V_KINDS, DESIGN.keys() - V_KINDS - {"auto"}):
        mine = {(mode, p) for k, mode, p in runs if k in family}
        assert {mode for mode, _ in mine} == set(MODES) and {p for _, p in mine} == set(PS)
    assert {(mode, p) for _, mode, p in runs} == {(mode, p) for mode in MODES for p in PS}
    assert any(p >= 3 and k in V_KINDS and len(m) == 3 for k, (p, m) in DESIGN.items())


@pytest.mark.parametrize(
    "p", [pytest.param(p, marks=pytest.mark.slow if p != 3 else ()) for p in PS]
)
def test_the_design_matches_sync_bitwise(p):
    """P = 3 runs the V-shaped zbv and dualpipev in every mode (marked slow at P = 2, 4)."""
    kinds = design(p)
    for kind in kinds.keys() - {"auto"}:
        assert (generated(kind, p, 2 * p).placement[-1] == 0) == (kind in V_KINDS), kind
    check(launch(matrix_job, p, schedules(list(kinds), p), kinds, timeout=900), kinds, p)
