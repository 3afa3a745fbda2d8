"""The optimizer protocol on real processes (gloo): synchronous step against single-process
training, post-validation (conservative and speculative, snapshot and inverse rollback)
against the synchronous step under injected faults, version traces, and crash + resume.

Each launch runs many cases inside the spawned ranks (process start-up dominates); ranks
compare in-process and return plain summaries.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import Crash, FaultPlan, GradFault
from zerobubble.optim.rollback import UnsupportedRollbackError
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.runtime.recorder import gather_traces
from zerobubble.schedule.generators import generate
from zerobubble.trace.check import check_trace

pytestmark = pytest.mark.slow

TIMEOUT = 240.0
SIZES = [6] * 6  # five layers
M = 4
ITERS = 20
MAX_NORM = 2.0  # never reached by this model's gradients (<= 0.7) unless a fault scales them
INVERSE_TOL = 1e-5  # relative, after 20 iterations with rollbacks (measured worst: see report)

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.02, weight_decay=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.02),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


def faults(num_stages: int) -> FaultPlan:
    """Every fault case; stage 0 and the last stage sit on the first and last rank."""
    last = num_stages - 1
    return FaultPlan(
        grads=(
            GradFault(3, last, mb=2),  # NaN on the last stage: the early steps roll back to a skip
            GradFault(5, 0, mb=1, kind="inf"),  # Inf on stage 0: rank 0 defers, all skip
            GradFault(8, last, kind="scale", factor=1e3),  # clip only once the last stage adds in
            GradFault(11, last),  # three bad iterations in a row
            GradFault(12, last, kind="scale", factor=1e3),
            GradFault(13, 0, kind="scale", factor=1e3),  # clip known early: rank 0 defers
        )
    )


def batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + i)
    n = 2 * M + 1  # uneven microbatches
    return (torch.randn(n, 6, generator=gen).to(dtype), torch.randn(n, 6, generator=gen).to(dtype))


def layers_of(dtype: torch.dtype) -> list[nn.Module]:
    return list(build_mlp(SIZES, seed=0).to(dtype))


def snapshot(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> tuple[list, list]:
    state = [
        {k: v.clone() for k, v in opt.state[p].items()} if opt.state.get(p) else None
        for p in params
    ]
    return [p.detach().clone() for p in params], state


# ---- runs inside the ranks ------------------------------------------------------------------


def pipeline_run(
    rank, kind, p, opt_name, cfg, plan, *, dtype=torch.float32, trace=False, root=None
):
    """Train ITERS iterations (resuming from and saving to ``root`` every 4 if given);
    returns the trainer, per-iteration snapshots at commit time, and the commits."""
    sched = generate(kind, p, M)
    options = ExecutorOptions(comm_timeout_s=30, trace=trace)
    layers = layers_of(dtype)
    pipe = PipelineExecutor(
        sched, build_stage_modules(layers, sched, rank), loss_fn=mlp_loss, options=options
    )
    params = [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]
    opt = OPTIMIZERS[opt_name](params)
    snaps: dict[int, tuple] = {}
    commits = []

    def record(c) -> None:
        snaps[c.iteration] = snapshot(params, opt)
        commits.append(c)

    trainer = PipelineTrainer(pipe, opt, cfg, faults=plan, on_commit=record)
    start = 0
    if root is not None and latest_checkpoint(root) is not None:
        start = load_checkpoint(trainer, root)["next"]
    for i in range(start, ITERS):
        x, y = batch(i, dtype)
        trainer.step(x, target=y)
        if root is not None and (i + 1) % 4 == 0:
            save_checkpoint(trainer, root, extra={"next": i + 1})
    trainer.drain()
    return trainer, snaps, commits


def reference_run(opt_name, plan, num_stages, *, dtype=torch.float32):
    """Single-process training: clip_grad_norm_ over all parameters, skip if not finite."""
    layers = layers_of(dtype)
    model = nn.Sequential(*layers)
    bounds = stage_bounds(len(layers), num_stages)
    stage_params = {
        s: [q for i in bounds[s] for q in layers[i].parameters()] for s in range(num_stages)
    }
    params = list(model.parameters())
    opt = OPTIMIZERS[opt_name](params)
    snaps = {}
    for i in range(ITERS):
        x, y = batch(i, dtype)
        reference_step(layers, mlp_loss, x, y, M)
        plan.at_tail(i, stage_params)  # NaN/Inf at a microbatch or at the end: same gradients
        for f in plan.grads:
            if f.iteration == i and f.mb is not None:
                f.apply(stage_params[f.stage])
        total = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        if torch.isfinite(total):
            opt.step()
        snaps[i] = snapshot(params, opt)
    return snaps


def offset_of(trainer: PipelineTrainer) -> int:
    return trainer.layout.first[min(trainer.stage_params)]


def differences(name, mine, ref, offset=0, tol=None) -> tuple[list[str], float]:
    """Compare snapshots (this rank's slice of ``ref``); returns problems and the worst
    relative error (0 when bitwise equal)."""
    bad, worst = [], 0.0
    if sorted(mine) != sorted(ref):
        return [f"{name}: committed iterations {sorted(mine)} != {sorted(ref)}"], math.inf
    for it in sorted(mine):
        (ps, st), (rps, rst) = mine[it], ref[it]
        rps, rst = rps[offset : offset + len(ps)], rst[offset : offset + len(ps)]
        pairs = list(zip(ps, rps, strict=True))
        for i, (a, b) in enumerate(zip(st, rst, strict=True)):
            if (a is None) != (b is None) or (a and set(a) != set(b)):
                bad.append(f"{name}: iteration {it} parameter {i}: optimizer state keys differ")
                continue
            pairs += [(a[k], b[k]) for k in a or {}]
        for a, b in pairs:
            if torch.equal(a, b):
                continue
            err = ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
            worst = max(worst, err)
            if tol is None or not err <= tol:
                bad.append(f"{name}: iteration {it}: relative difference {err:.3g}")
                break
    return bad, worst


def pv_job(p: int) -> dict:
    info = init_distributed(timeout_s=60)
    rank, out = info.rank, {"bad": [], "worst": {}, "commits": {}, "traces": {}}
    S = p
    plan = faults(S)
    sync = OptimConfig(max_norm=MAX_NORM)
    # 1. the synchronous step is single-process training, bitwise (fp32 and bf16).
    base = {}
    for opt_name in OPTIMIZERS:
        trainer, snaps, commits = pipeline_run(rank, "zb-h2", p, opt_name, sync, plan)
        base[opt_name] = snaps
        out["commits"][f"sync/{opt_name}"] = [
            (c.iteration, c.version, c.action.value) for c in commits
        ]
        ref = reference_run(opt_name, plan, S)
        out["bad"] += differences(f"sync/{opt_name}", snaps, ref, offset_of(trainer))[0]
    trainer, bf_sync, _ = pipeline_run(rank, "zb-h1", p, "adamw", sync, plan, dtype=torch.bfloat16)
    ref = reference_run("adamw", plan, S, dtype=torch.bfloat16)
    out["bad"] += differences("sync/bf16", bf_sync, ref, offset_of(trainer))[0]
    # 2. post-validation equals the synchronous step after every iteration: every optimizer
    # in both modes with snapshots, and the inverse once per optimizer.
    cases = [(o, spec, "snapshot") for o in OPTIMIZERS for spec in (False, True)]
    cases += [("adamw", True, "inverse"), ("sgd", True, "inverse"), ("adam", False, "inverse")]
    for opt_name, speculative, rollback in cases:
        cfg = OptimConfig(
            mode="speculative" if speculative else "conservative",
            max_norm=MAX_NORM,
            rollback=rollback,
        )
        name = f"{'spec' if speculative else 'cons'}/{rollback}/{opt_name}"
        traced = opt_name == "adamw" and rollback == "snapshot"
        kind = "zb-h2" if speculative else "zb-h1"
        trainer, snaps, commits = pipeline_run(rank, kind, p, opt_name, cfg, plan, trace=traced)
        tol = INVERSE_TOL if rollback == "inverse" else None
        bad, worst = differences(name, snaps, base[opt_name], tol=tol)
        out["bad"] += bad
        out["worst"][name] = worst
        out["commits"][name] = [
            (c.iteration, c.version, c.action.value, c.rolled_back, c.replay) for c in commits
        ]
        out["replays/" + name] = trainer.pipe.replays
        if traced:
            events = gather_traces(trainer.pipe.trace)
            if rank == 0:
                report = check_trace(events, conservative=not speculative)
                out["traces"][name] = [str(v) for v in report.violations]
                out["traces"][name + "/ops"] = sorted({e.op for e in events})
    cfg = OptimConfig(mode="speculative", max_norm=MAX_NORM)
    trainer, snaps, _ = pipeline_run(rank, "zb-h2", p, "adamw", cfg, plan, dtype=torch.bfloat16)
    out["bad"] += differences("spec/bf16", snaps, bf_sync)[0]
    # 3. refusals before any collective.
    sched = generate("zb-h1", p, M)
    pipe = PipelineExecutor(
        sched, build_stage_modules(layers_of(torch.float32), sched, rank), loss_fn=mlp_loss
    )
    mine = [q for c in pipe.chunks.values() for q in c.module.parameters()]
    errors = []
    for make, cfg in (
        (
            lambda: torch.optim.RMSprop(mine),
            OptimConfig(mode="conservative", rollback="inverse"),
        ),
        (lambda: torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1), OptimConfig()),
    ):
        try:
            PipelineTrainer(pipe, make(), cfg)
        except (ValueError, UnsupportedRollbackError) as e:
            errors.append(str(e))
    out["errors"] = errors
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def p2():
    return launch(pv_job, 2, 2, timeout=TIMEOUT)


def test_sync_step_is_single_process_training_bitwise_and_post_validation_matches_it(p2):
    bad = [b for r in p2 for b in r["bad"]]
    assert not bad, "\n".join(bad[:20])
    # Snapshot rollback is exact; the inverse stays within its tolerance (and is not exact).
    for name, worst in p2[0]["worst"].items():
        if "snapshot" in name:
            assert worst == 0.0, name
        else:
            assert 0.0 <= worst <= INVERSE_TOL, (name, worst)
    assert any(w > 0 for n, w in p2[0]["worst"].items() if "inverse" in n)


def test_every_fault_case_happened_and_ranks_agree_on_every_commit(p2):
    for name in p2[0]["commits"]:
        per_rank = [[c[:3] for c in r["commits"][name]] for r in p2]
        assert per_rank[0] == per_rank[1], name
        assert [c[:2] for c in per_rank[0]] == [(i, i + 1) for i in range(ITERS)], name
        actions = {c[0]: c[2] for c in per_rank[0]}
        assert [i for i, a in actions.items() if a == "skip"] == [3, 5, 11], name
        assert [i for i, a in actions.items() if a == "clip"] == [8, 12, 13], name
    spec = {c[0]: c for c in p2[0]["commits"]["spec/snapshot/adamw"]}
    # Rank 0 stepped early and rolled back where only the last stage was bad ...
    assert [i for i, c in spec.items() if c[3]] == [3, 8, 11, 12]
    # ... and every iteration whose speculative successor had stale work was replayed.
    assert [i for i, c in spec.items() if c[4]] == [3, 5, 8, 11, 12, 13]
    assert p2[0]["replays/spec/snapshot/adamw"] == 6
    assert p2[0]["replays/cons/snapshot/adamw"] == 0


def test_traces_satisfy_the_version_invariants(p2):
    traces = p2[0]["traces"]
    assert traces["spec/snapshot/adamw"] == []
    assert traces["cons/snapshot/adamw"] == []
    spec_ops = set(traces["spec/snapshot/adamw/ops"])
    assert {"replay", "opt_provisional", "opt_defer", "opt_rollback", "opt_validate"} <= spec_ops
    assert {"opt_commit", "opt_step", "opt_skip", "opt_prefix"} <= spec_ops
    assert "replay" not in traces["cons/snapshot/adamw/ops"]


def test_bad_trainer_setups_are_refused_with_the_fix(p2):
    errors = p2[0]["errors"]
    assert "RMSprop has no in-place inverse" in errors[0] and "rollback='snapshot'" in errors[0]
    assert "not in rank 0's stages" in errors[1] and "trainer.params" in errors[1]


# ---- crash and resume (P=3) -------------------------------------------------------------------


def crash_job(root: str, crash: Crash | None) -> dict:
    """Speculative post-validation with every fault, checkpoints every 4 iterations."""
    info = init_distributed(timeout_s=60)
    plan = faults(3)
    plan = FaultPlan(plan.grads, (crash,) if crash else ())
    cfg = OptimConfig(mode="speculative", max_norm=MAX_NORM)
    trainer, snaps, commits = pipeline_run(info.rank, "zb-h2", 3, "adamw", cfg, plan, root=root)
    ref = reference_run("adamw", plan, 3)
    ref = {i: ref[i] for i in snaps}  # the iterations this (resumed) run committed
    bad, _ = differences("resumed", snaps, ref, offset_of(trainer))
    dist.destroy_process_group()
    return {"bad": bad, "first": commits[0].iteration, "last": commits[-1].iteration}


def test_crashes_fail_every_rank_clearly_and_resume_reproduces_the_run_bitwise(tmp_path):
    root = str(tmp_path)
    # A rank dies in the middle of saving step 8: the manifest still names step 4.
    with pytest.raises(LaunchError) as err:
        launch(crash_job, 3, root, Crash(1, 8, "during_save"), timeout=TIMEOUT, grace=20)
    by_rank = {f.rank: f for f in err.value.failures}
    assert by_rank[1].error == "killed by signal SIGKILL"
    for r in (0, 2):
        assert by_rank[r].exitcode == 1, by_rank[r].error  # failed on its own, not killed
        text = by_rank[r].error  # a PeerError of the save's bounded confirmation
        assert f"PeerError: rank {r}: confirmation of the checkpoint of step 8" in text, text
        assert "which is not committed: the previous checkpoint stays the newest" in text, text
    assert latest_checkpoint(root)["step"] == 4
    assert (tmp_path / "step_00000008").is_dir()  # written, never committed
    # Resumed at 4, a rank dies between its provisional step and the validation of 13.
    with pytest.raises(LaunchError) as err:
        launch(crash_job, 3, root, Crash(1, 13, "after_provisional"), timeout=TIMEOUT, grace=20)
    by_rank = {f.rank: f for f in err.value.failures}
    assert by_rank[1].error == "killed by signal SIGKILL"
    for r in (0, 2):
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text
        assert f"PeerError: rank {r}:" in text and "with peer rank 1 failed" in text, text
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["step"] == 12 and manifest["path"] == "step_00000012"
    # Resumed at 12, the run finishes and matches single-process training bitwise.
    results = launch(crash_job, 3, root, None, timeout=TIMEOUT)
    for r in results:
        assert r["bad"] == [] and (r["first"], r["last"]) == (12, ITERS - 1)
    assert latest_checkpoint(root)["step"] == ITERS
