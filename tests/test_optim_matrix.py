"""Post-validation (speculative and conservative) and the synchronous step against
single-process training with the same NaN/Inf skips and clipped steps, bitwise, for every
schedule kind at P = 2, 3 and 4 (so the modes are bitwise each other too).

A covering design, not the full product (kind x mode x P): each kind runs one mode per P,
the mode rotating with the kind's position, so every (kind, mode), (kind, P) and
(mode, P) pair is covered (3 of the product's 9 runs per kind). No code path depends on
the triple: a mode's protocol is the same at every P, and what P changes (ranks,
placements, channels) every kind meets at every P. Every run is compared with the
single-process reference, not with a synchronous run of its own: the same property, as
the synchronous step is bitwise that reference. The V-shaped kinds at P = 3 also run all
three modes on their own (below), the case named next.

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


def covering_modes(kind: str, p: int) -> tuple[str, ...]:
    """The one mode ``kind`` runs at ``p``, rotating with the kind's position so that every
    (mode, P) pair occurs too."""
    i = RUNTIME_KINDS.index(kind)
    return (list(MODES)[(PS.index(p) + i) % len(MODES)],)


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


FAST_P3 = ["zbv", "dualpipev"]


def test_covering_design_covers_every_pair():
    runs = {(k, mode, p) for p in PS for k in RUNTIME_KINDS for mode in covering_modes(k, p)}
    assert {(k, p) for k, _, p in runs} == {(k, p) for k in RUNTIME_KINDS for p in PS}
    assert {(k, mode) for k, mode, _ in runs} == {
        (k, mode) for k in RUNTIME_KINDS for mode in MODES
    }
    assert {(mode, p) for _, mode, p in runs} == {(mode, p) for mode in MODES for p in PS}
    assert len(runs) == 3 * len(RUNTIME_KINDS)


@pytest.mark.parametrize("kind", FAST_P3)
def test_speculative_v_schedules_at_p3_match_sync_bitwise(kind):
    modes = {kind: ("sync", "cons", "spec")}
    check(launch(matrix_job, 3, schedules([kind], 3), modes, timeout=240), modes, 3)


@pytest.mark.slow
@pytest.mark.parametrize("p", PS)
def test_every_kind_post_validation_matches_sync_bitwise(p):
    kinds = [k for k in RUNTIME_KINDS if p != 3 or k not in FAST_P3]  # those run in full above
    modes = {k: covering_modes(k, p) for k in kinds}
    check(launch(matrix_job, p, schedules(kinds, p), modes, timeout=900), modes, p)
