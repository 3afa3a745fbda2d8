"""Pipeline x data parallel on a (pp, dp) mesh: gloo ranks against single-process references.

One 4-rank launch (dp=2 x pp=2) trains every kind (1f1b, zb-h1, zbv, zb-auto) for 3
AdamW steps with clipping: losses and parameters must be bitwise those of the
documented reduction order (each replica's microbatch gradients accumulated as the
pipeline does, then summed over the replicas, g_0 + g_1) and within 1e-6 of plain
full-batch training. The same launch checks the mesh's bad input and the trace.
A 6-rank launch (dp=2 x pp=3) checks zbv the same way, then kills a dp peer mid-step:
the survivors name the rank and dim 'dp'.
"""

from __future__ import annotations

import dataclasses
import os
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import zerobubble
from ranks import launch
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.parallel.mesh import build_mesh, pipeline_ranks
from zerobubble.profile.bubbles import analyze_iteration
from zerobubble.program.check import validate_lowered
from zerobubble.program.instructions import Compute, ReduceGrads, WaitReduce
from zerobubble.program.lowering import lower
from zerobubble.program.passes.grad_sync import insert_grad_reduce
from zerobubble.reference.step import dp_reference_step
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.errors import ScheduleError
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.simulate import simulate
from zerobubble.trace.check import check_trace

KINDS = ("1f1b", "zb-h1", "zbv", "zb-auto")
SIZES = (5, 7, 7, 7, 7, 7, 7, 7, 3)  # 8 layers: 4 stages of zbv at P=2
M, LOCAL, STEPS, MAX_NORM = 4, 8, 3, 0.05
TIMEOUT = 240.0


def batches(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    n = LOCAL * dp
    return [(torch.randn(n, 5, generator=gen), torch.randn(n, 3, generator=gen)) for _ in range(3)]


def tied_mlp() -> torch.nn.Sequential:
    """The MLP with layer 6's weight tied to layer 1's (stages 0 and 1 at pp=2)."""
    model = build_mlp(SIZES)
    model[6][0].weight = model[1][0].weight
    return model


def summed_loss(output: torch.Tensor, target: torch.Tensor, num_items) -> torch.Tensor:
    """mlp_loss as a sum over the microbatch divided by the global count (count_fn)."""
    return ((output - target) ** 2).sum() / num_items


def count(target: torch.Tensor) -> int:
    return target.numel()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


# ---- inside the ranks ----------------------------------------------------------------------


def train_all_kinds(pp: int, dp: int, kinds: tuple[str, ...], with_modes: bool) -> dict:
    init_distributed()
    mesh = build_mesh(pp, dp)
    out: dict = {"pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "errors": {}}
    for name, bad in (("world", lambda: build_mesh(pp + 1, dp)),):
        try:
            bad()
        except ValueError as e:
            out["errors"][name] = str(e)
    try:
        zerobubble.Pipeline(build_mlp(SIZES), mlp_loss, generate("1f1b", pp + 1, M), mesh=mesh)
    except ValueError as e:
        out["errors"]["pp"] = str(e)
    runs = [(kind, kind, "sync", False) for kind in kinds]
    if with_modes:  # a NaN on replica 1 in step 1 must skip that step on every rank
        runs += [(f"nan-{m}", "zb-h1", m, False) for m in ("conservative", "speculative")]
        runs.append(("zbv-directed", "zbv", "sync", True))
        runs.append(("tied", "zb-h1", "sync", False))
        runs.append(("count", "1f1b", "sync", False))
    for name, kind, mode, directed in runs:
        options = zerobubble.ExecutorOptions(directed_groups=directed)
        model = tied_mlp() if name == "tied" else build_mlp(SIZES)
        counted = {"count_fn": count} if name == "count" else {}
        loss_fn = summed_loss if counted else mlp_loss
        pipe = zerobubble.Pipeline(
            model, loss_fn, kind, microbatches=M, mesh=mesh, options=options, **counted
        )
        config = zerobubble.OptimConfig(mode=mode, max_norm=MAX_NORM)
        commits: list = []
        pipe.set_optimizer(adamw(pipe.parameters()), config).on_commit = commits.append
        losses = []
        for k, (x, y) in enumerate(batches(dp)):
            part = slice(mesh.dp_rank * LOCAL, (mesh.dp_rank + 1) * LOCAL)
            x = x[part].clone()
            if name.startswith("nan") and k == 1 and mesh.dp_rank == 1:
                x[0, 0] = float("nan")
            got = pipe.step(x, target=y[part])
            if got is not None:
                losses.append(torch.stack(got))
        pipe.drain()
        out[name] = {
            "commits": [(c.iteration, str(c.action)) for c in commits],
            # numpy: tensors would travel as shared memory that dies with the rank
            "params": {n: p.detach().numpy().copy() for n, p in pipe.named_parameters()},
            "losses": [t.numpy() for t in losses],
            "norm": pipe.trainer.last_commit.total_norm,
            "trace": list(pipe.executor.trace.events),
        }
    return out


def train_then_die(out_dir: str) -> None:
    """dp=2 x pp=3: zbv against the references (saved for the test), then a dp peer dies."""
    results = train_all_kinds(3, 2, ("zbv",), False)
    torch.save(results, Path(out_dir) / f"rank{os.environ['RANK']}.pt")
    die_mid_step(3)


def die_mid_step(pp: int) -> None:
    init_distributed()
    mesh = build_mesh(pp, 2)
    options = zerobubble.ExecutorOptions(comm_timeout_s=30.0)
    pipe = zerobubble.Pipeline(
        build_mlp(SIZES), mlp_loss, "zb-h1", microbatches=M, mesh=mesh, options=options
    )
    pipe.set_optimizer(adamw(pipe.parameters()))
    if int(os.environ["RANK"]) == 1:
        assert pipe.executor.reducer is not None
        pipe.executor.reducer.launch = lambda stage, iteration: os._exit(3)
    x, y = batches(2)[0]
    pipe.step(x[:LOCAL], target=y[:LOCAL])


# ---- references ----------------------------------------------------------------------------


def dp_reference(
    dp: int, skip: tuple[int, ...] = ()
) -> tuple[dict[str, torch.Tensor], list[list[torch.Tensor]]]:
    """The documented order (:func:`dp_reference_step`), clipping, AdamW (not in the
    steps of ``skip``)."""
    model = build_mlp(SIZES)
    opt = adamw(model.parameters())
    losses: list[list[torch.Tensor]] = [[] for _ in range(dp)]
    for k, (x, y) in enumerate(batches(dp)):
        if k in skip:
            continue
        parts = [
            (x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]) for r in range(dp)
        ]
        step_losses, _ = dp_reference_step(model, mlp_loss, parts, M)
        for r in range(dp):
            losses[r].append(torch.stack(step_losses[r]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def full_batch_reference(dp: int, tied: bool = False) -> dict[str, torch.Tensor]:
    model = tied_mlp() if tied else build_mlp(SIZES)
    opt = adamw(model.parameters())
    for x, y in batches(dp):
        model.zero_grad(set_to_none=True)
        mlp_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


def check_against_references(results: list[dict], pp: int, dp: int, kinds) -> list[str]:
    exact, ref_losses = dp_reference(dp)
    plain = full_batch_reference(dp)
    bad = []
    for kind in kinds:
        for r in results:
            got = r[kind]
            if got["commits"] != [(k, "clip") for k in range(STEPS)]:
                bad.append(f"{kind}: commits {got['commits']}")
            where = f"{kind} pp{r['pp_rank']} dp{r['dp_rank']}"
            for n, array in got["params"].items():
                p = torch.from_numpy(array)
                if not torch.equal(p, exact[n]):
                    bad.append(f"{where}: {n} differs from the dp reference")
                if not torch.allclose(p, plain[n], rtol=0, atol=1e-6):
                    bad.append(f"{where}: {n} not within 1e-6 of full-batch training")
            if got["losses"]:
                want = ref_losses[r["dp_rank"]]
                if not all(map(torch.equal, map(torch.from_numpy, got["losses"]), want)):
                    bad.append(f"{where}: losses {got['losses']} != {want}")
            if not got["norm"] > MAX_NORM:
                bad.append(f"{where}: norm {got['norm']} does not clip")
        names = {n for r in results for n in r[kind]["params"]}
        if names != set(exact):
            bad.append(f"{kind}: parameters {sorted(names)} are not the model's")
        for pipeline in pipeline_ranks(pp, dp):
            events = [e for g in pipeline for e in results[g][kind]["trace"]]
            report = check_trace(events)
            if not report.ok:
                bad.append(f"{kind} pipeline {pipeline}: trace check: {report.first}")
            bad += trace_findings(kind, events)
            stages = sorted(e.stage for e in events if e.op == "reduce_grads")
            num_stages = generate(kind.removesuffix("-directed"), pp, M).num_stages
            want = sorted(list(range(num_stages)) * STEPS)
            if stages != want:
                bad.append(f"{kind}: reduce_grads of stages {stages}, want {want}")
    return bad


def trace_findings(kind: str, events: list) -> list[str]:
    """The bubble breakdown reports the waits for the reductions; the checker misses none."""
    bad = []
    for k in range(STEPS):
        for dev in analyze_iteration(events, k).devices:
            if not dev.reduce_wait_ns > 0 or sum(dev.parts().values()) != dev.idle_ns:
                bad.append(f"{kind} iteration {k} rank {dev.rank}: breakdown {dev}")
    unwaited = [e for e in events if not (e.op == "wait_reduce" and e.rank == 0)]
    v = check_trace(unwaited).first
    if v is None or (v.check, v.why) != (
        "reduce",
        "no wait_reduce follows the iteration's reductions",
    ):
        bad.append(f"{kind}: a trace without wait_reduce gives {v}")
    return bad


# ---- tests ---------------------------------------------------------------------------------


@pytest.mark.bitwise
def test_dp2_pp2_every_kind_matches_the_references_and_refuses_bad_meshes():
    results = launch(train_all_kinds, 4, 2, 2, KINDS, True, timeout=TIMEOUT)
    assert [(r["pp_rank"], r["dp_rank"]) for r in results] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert check_against_references(results, 2, 2, (*KINDS, "zbv-directed")) == []
    skipped, _ = dp_reference(2, skip=(1,))
    for mode in ("conservative", "speculative"):
        for r in results:
            got = r[f"nan-{mode}"]
            assert got["commits"] == [(0, "clip"), (1, "skip"), (2, "clip")], (mode, r["pp_rank"])
            for n, array in got["params"].items():
                assert torch.equal(torch.from_numpy(array), skipped[n]), (mode, n)
    # A tie across stages: its replicas' gradients are summed over dp, then over pp.
    plain = full_batch_reference(2, tied=True)
    assert "6.0.weight" not in plain and "1.0.weight" in plain
    for name, want in (("tied", plain), ("count", full_batch_reference(2))):
        # count: the loss is a sum over the global count (the replicas' counts summed)
        for r in results:
            twin = results[r["pp_rank"] * 2 + 1 - r["dp_rank"]][name]["params"]
            for n, array in r[name]["params"].items():
                assert (array == twin[n]).all(), (name, n)  # dp replicas agree bitwise
                p = torch.from_numpy(array)
                assert torch.allclose(p, want[n], rtol=0, atol=1e-6), (name, n)
    for r in results:
        assert r["errors"]["world"] == (
            "the world has 4 ranks but the mesh pp=3 x dp=2 needs 6; launch pp*dp = 6 "
            "processes or change --pp/--dp"
        )
        assert r["errors"]["pp"].startswith(
            "schedule '1f1b' has 3 devices but the mesh's 'pp' dim has 2 ranks (mesh pp=2 x dp=2)"
        )


def test_dp2_pp3_zbv_matches_the_references_and_a_dp_peer_that_dies_is_named(tmp_path):
    """One 6-rank launch: zbv trains bitwise as the references, then global rank 1 (pp 0,
    dp 1) dies where it would start reducing; its dp peer names the rank and dim 'dp'."""
    with pytest.raises(LaunchError) as info:
        launch(train_then_die, 6, str(tmp_path), timeout=TIMEOUT, grace=40.0)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(6)]
    assert check_against_references(results, 3, 2, ("zbv",)) == []
    failures = {f.rank: f for f in info.value.failures}
    assert info.value.failures[0].rank == 1 and failures[1].exitcode == 3
    # Rank 0 (rank 1's dp peer, stage 0) was reducing when its peer vanished.
    err = failures[0].error
    assert "PeerError: rank 0: all-reduce of stage 0's gradients over dim 'dp'" in err, err
    assert "in the collective over ranks [0, 1]" in err, err


# ---- the pass (torch-free) -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1", "zbv", "v-min"])
def test_reduce_follows_each_stage_last_weight_gradient(kind):
    sched = generate(kind, 3, 6)
    lowered = insert_grad_reduce(lower(sched))
    validate_lowered(lowered)
    for d, prog in enumerate(lowered.programs):
        assert isinstance(prog[-1], WaitReduce)
        for s in sched.stages_of_device[d]:
            at = prog.index(ReduceGrads(s))
            weights = [
                i
                for i, ins in enumerate(prog)
                if isinstance(ins, Compute)
                and ins.action.stage == s
                and ins.action.op in (Op.W, Op.BW)
            ]
            assert at > max(weights) and len(weights) == 6
            assert all(not isinstance(ins, Compute) for ins in prog[max(weights) + 1 : at]), (
                "only the compute's send may come between"
            )


def test_validate_lowered_refuses_an_early_reduce():
    lowered = insert_grad_reduce(lower(generate("zb-h1", 3, 4)))
    prog = list(lowered.programs[1])
    at = prog.index(ReduceGrads(1))
    prog.insert(at - 3, prog.pop(at))
    bad = type(lowered)(lowered.schedule, (lowered.programs[0], tuple(prog), lowered.programs[2]))
    with pytest.raises(ScheduleError, match=r"reduces stage 1's gradients after 2 of its 4"):
        validate_lowered(bad)


def test_simulated_reductions_run_on_a_comm_lane_and_hide_behind_compute():
    """zbv, P=2, M=4, F=B=W=1 per device: stage 3's reduction (device 0) runs under
    the last BWs of stage 0, stage 2's under device 1's last W of stage 1; only the
    last stage reduced on each device outlasts its compute (r, not 2r)."""
    sched = fuse_local_backward(generate("zbv", 2, 4))
    half = Fraction(1, 2)
    costs = CostModel.from_device_totals(sched.placement, Fraction(1), Fraction(1), Fraction(1))
    plain = simulate(sched, costs)
    assert plain.reductions == ((), ()) and plain.step_time == plain.makespan == Fraction(25, 2)
    assert "exposed_reduce" not in plain.summary()
    got = simulate(sched, dataclasses.replace(costs, reduce=(half,) * 4))
    assert got.reductions == (
        ((3, 10, Fraction(21, 2)), (0, 12, Fraction(25, 2))),
        ((2, 12, Fraction(25, 2)), (1, Fraction(25, 2), 13)),
    )
    assert got.exposed_reduce == (half, half) and got.step_time == 13
    assert got.makespan == plain.makespan  # the compute lanes are untouched
    assert got.summary()["exposed_reduce"] == [0.5, 0.5]
    with pytest.raises(
        ValueError, match=r"reduce=\[1\] must hold one finite number >= 0 \(at most 1e\+15\) per"
    ):
        dataclasses.replace(costs, reduce=(1,))
