"""Replicas cannot diverge: the step's decision is agreed over every replica, and the replica
check catches parameters that differ anyway (and every mesh subgroup gets the timeout given
to ``init_distributed``).

One 4-rank launch. A NaN written into one dp replica's gradients after the dp reduction (at
the tail of iteration 1, on global rank 1 only) must make every rank of the job skip that
step: on pp2 x dp2 (sync and conservative post-validation) and on pp2 x dp2 x ep2 (sync and
speculative), where rank 1 is ep rank 1, whose copy of the dense norms the ep merge drops
(before, it stepped on its NaN alone). Afterwards the replicas hold bitwise the same
parameters. Then ``OptimConfig(replica_check_every=1)`` on pp2 x dp2 catches one parameter
element nudged by one ulp on replica 1: every rank raises ``ReplicaDivergence`` naming the
stage and the replica that differs.
"""

from __future__ import annotations

import pytest
import torch

from ranks import launch
from zerobubble import Pipeline
from zerobubble.executor import ExecutorOptions
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.optim.replicas import ReplicaDivergence, checksum
from zerobubble.parallel.mesh import ParallelSpec, build_mesh
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.p2p.comm import group_timeout

pytestmark = pytest.mark.slow

RUNS = (("dp", "sync"), ("dp", "conservative"), ("ep", "sync"), ("ep", "speculative"))
NAN_RANK, NAN_ITERATION = 1, 1
INIT_TIMEOUT_S = 117.0


def run(ep: bool, mode: str) -> dict:
    mesh = build_mesh(2, 2, ep=2 if ep else 1)
    options = ExecutorOptions(comm_timeout_s=30.0, trace=False)
    if ep:
        layers = build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, seed=0)
        shape_x, shape_y = (8, 3, 6), (8, 3, 3)
    else:
        layers, shape_x, shape_y = build_mlp([4] * 5, seed=0), (8, 4), (8, 4)
    pipe = Pipeline(layers, mlp_loss, "zb-h1", microbatches=4, mesh=mesh, options=options)
    trainer = pipe.set_optimizer(
        torch.optim.SGD(pipe.parameters(), lr=0.1), OptimConfig(mode=mode, max_norm=1.0)
    )
    commits: list = []
    trainer.on_commit = commits.append
    if torch.distributed.get_rank() == NAN_RANK:  # after the reduction, on this rank only
        stage = min(pipe.executor.chunks)
        trainer.faults = FaultPlan(grads=(GradFault(NAN_ITERATION, stage, None, "nan"),))
    gen = torch.Generator().manual_seed(100 + mesh.dp_rank)
    for _ in range(3):
        pipe.step(torch.randn(*shape_x, generator=gen), target=torch.randn(*shape_y, generator=gen))
    pipe.drain()
    return {
        "actions": [(c.iteration, str(c.action)) for c in commits],
        "params": {n: p.detach().clone() for n, p in pipe.named_parameters()},
    }


def diverged() -> str:
    mesh = build_mesh(2, 2)
    options = ExecutorOptions(comm_timeout_s=30.0, trace=False)
    pipe = Pipeline(
        build_mlp([4] * 5, seed=0), mlp_loss, "zb-h1", microbatches=4, mesh=mesh, options=options
    )
    config = OptimConfig(replica_check_every=1)
    pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), config)
    gen = torch.Generator().manual_seed(100 + mesh.dp_rank)
    pipe.step(torch.randn(8, 4, generator=gen), target=torch.randn(8, 4, generator=gen))
    if mesh.dp_rank == 1:  # one element of each stage, by one ulp, on replica 1
        with torch.no_grad():
            p = next(iter(pipe.parameters()))
            p.view(-1)[0] = torch.nextafter(p.view(-1)[0], torch.tensor(1e9))
    try:
        pipe.step(torch.randn(8, 4, generator=gen), target=torch.randn(8, 4, generator=gen))
    except ReplicaDivergence as e:
        return f"{e.iteration} {e.stage} {e.ranks} {e}"
    return "no divergence seen"


def subgroup_timeouts() -> list[float]:
    """The transport timeout of every subgroup this rank is in, of three meshes."""
    out = []
    for mesh in (build_mesh(2, 2, ep=2), build_mesh(1, 4, ep=2), build_mesh(2, tp=2)):
        groups = (mesh.pp_group, mesh.dp_group, mesh.ep_group, mesh.edp_group, mesh.tp_group)
        groups += (mesh.ep_backward_group,)
        out += [group_timeout(g).total_seconds() for g in groups if g is not None]
    return out


def job() -> dict:
    init_distributed(timeout_s=INIT_TIMEOUT_S)
    out = {f"{kind}-{mode}": run(kind == "ep", mode) for kind, mode in RUNS}
    out["check"] = diverged()
    out["timeouts"] = subgroup_timeouts()
    return out


def test_a_nan_on_one_replica_after_the_reduction_makes_every_replica_skip():
    results = launch(job, 4, timeout=240)
    for kind, mode in RUNS:
        key = f"{kind}-{mode}"
        actions = [r[key]["actions"] for r in results]
        assert all(a == actions[0] for a in actions), (key, actions)
        assert [a for _, a in actions[0]][NAN_ITERATION] == "skip", (key, actions[0])
        assert [a for _, a in actions[0]].count("skip") == 1, (key, actions[0])
        for pp in (0, 1):  # ranks 2 pp, 2 pp + 1: the dp replicas of pipeline rank pp
            a, b = results[2 * pp][key]["params"], results[2 * pp + 1][key]["params"]
            dense = sorted(n for n in a if ".experts." not in n)  # ep peers: other experts
            assert dense and dense == sorted(n for n in b if ".experts." not in n)
            for n in dense:
                assert torch.equal(a[n], b[n]), (key, pp, n)
                assert bool(torch.isfinite(a[n]).all()), (key, pp, n)
    for r in results:  # every mesh subgroup has init_distributed's timeout (was 30 minutes)
        assert len(r["timeouts"]) >= 9 and set(r["timeouts"]) == {INIT_TIMEOUT_S}, r["timeouts"]
    spec = ParallelSpec(2, 2)
    for rank, r in enumerate(results):
        pp = rank // 2
        stage = pp  # zb-h1 at P=2: pipeline rank pp holds stage pp
        ref, bad = 2 * pp, 2 * pp + 1
        assert r["check"].startswith(f"1 {stage} ({bad},) {spec.name(rank)}: replica check"), r[
            "check"
        ]
        assert (
            f"after iteration 1: stage {stage}'s dense parameters differ between the "
            f"data-parallel replicas: {spec.name(ref)} holds checksums"
        ) in r["check"], r["check"]
        assert f"but {spec.name(bad)} holds" in r["check"], r["check"]


def test_the_checksum_sees_one_ulp_and_two_words_trading_places():
    t = torch.arange(6, dtype=torch.float32)
    base = checksum([t])
    nudged = t.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(10.0))
    assert checksum([nudged]) != base
    swapped = t.clone().view(torch.int64)  # the 64-bit words (0, 1), (2, 3) trade places
    swapped[[0, 1]] = swapped[[1, 0]]
    assert checksum([swapped.view(torch.float32)]) != base
    assert checksum([swapped.view(torch.float32)])[0] == base[0]  # the sum of all alone: no
    odd = torch.arange(7, dtype=torch.uint8)  # 7 bytes: no whole 64-bit word
    assert checksum([odd]) == (21, 0) != checksum([odd + 1])
    assert checksum([t.clone()]) == base
