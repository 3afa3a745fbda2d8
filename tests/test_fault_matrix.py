"""Kill/stall matrix: at P=4 (zbv: the V placement, two stages per rank, so a first, a last
and two middle ranks), every rank failing in the forward, the backward and the optimizer step
of iteration 1 of a synchronous-step run, killed (SIGKILL) or stalled. Two-rank pipelines
fail in test_fault_scale.py (segments, tp, DCP) and test_optim_peers.py.

A covering design, not the full product: every (rank, phase) pair runs once, with the
fault kind alternating so that every (rank, kind) and every (phase, kind) pair of each P
is covered too (half of the launches of the product; no code path depends on the triple).

What must hold in every case: nothing hangs (each launch is bounded), the launcher reports
the rank that failed first with its status (a killed rank: -9; a stalled rank: named first
as stalled, killed by the launcher after the grace period, once the survivors gave up on
it), no process outlives the launcher, and every survivor fails with a ``PeerError`` naming
its rank, the peer, the iteration and the operation. In the optimizer-step cases the
survivors wait in the synchronous step's all-reduce, bounded by ``comm_timeout_s``: their
``PeerError`` names the collective's group instead of one peer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, RankFault
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

KINDS = {4: "zbv"}
M = 4
COMM_TIMEOUT_S = 2.0
PG_TIMEOUT_S = 8.0  # the process group's own timeout: longer than COMM_TIMEOUT_S, never reached
GRACE_S = 4.0  # after the first survivor gives up on a stalled rank, the rest follow within it
ITERATION = 1

PHASES = ("forward", "backward", "optimizer_step")
CASES = [
    (p, rank, phase, ("kill", "stall")[(rank + i) % 2])
    for p in KINDS
    for rank in range(p)
    for i, phase in enumerate(PHASES)
]


def test_the_cases_cover_every_pair():
    for p in KINDS:
        mine = [c[1:] for c in CASES if c[0] == p]
        assert sorted((r, ph) for r, ph, _ in mine) == sorted(
            (r, ph) for r in range(p) for ph in PHASES
        )
        assert {(r, k) for r, _, k in mine} == {(r, k) for r in range(p) for k in ("kill", "stall")}
        assert {(ph, k) for _, ph, k in mine} == {
            (ph, k) for ph in PHASES for k in ("kill", "stall")
        }


def fault_job(p: int, rank_to_fail: int, phase: str, kind: str, piddir: str) -> None:
    info = init_distributed(timeout_s=PG_TIMEOUT_S)
    Path(piddir, str(info.rank)).write_text(str(os.getpid()))
    sched = generate(KINDS[p], p, M)
    # The rank's first forward and first backward (its lowest and its highest stage), so that
    # in every phase other ranks still wait for what it should send in this iteration.
    held = [s for s, d in enumerate(sched.placement) if d == rank_to_fail]
    stage = max(held) if phase == "backward" else min(held)
    plan = FaultPlan(ranks=(RankFault(ITERATION, stage, phase, mb=1, kind=kind),))
    layers = list(build_mlp([4] * (sched.num_stages + 1), seed=0))
    # Meet before the executor's start-up barrier, which has only COMM_TIMEOUT_S: on a loaded
    # machine the ranks can reach it further apart than that.
    torch.distributed.barrier()
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, info.rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=COMM_TIMEOUT_S),
    )
    params = [q for c in pipe.chunks.values() for q in c.module.parameters()]
    opt = torch.optim.SGD(params, lr=0.1)
    trainer = PipelineTrainer(pipe, opt, OptimConfig(max_norm=1.0), faults=plan)
    gen = torch.Generator().manual_seed(0)
    for _ in range(ITERATION + 2):
        trainer.step(torch.randn(M, 4, generator=gen), target=torch.randn(M, 4, generator=gen))
    raise AssertionError(f"rank {info.rank} finished although rank {rank_to_fail} failed")


def case_id(case) -> str:
    p, rank, phase, kind = case
    return f"P{p}-rank{rank}-{phase}-{kind}"


@pytest.mark.parametrize(
    "case",
    CASES,
    ids=case_id,
)
def test_a_killed_or_stalled_rank_is_reported_and_every_survivor_names_it(tmp_path, case):
    p, victim, phase, kind = case
    with pytest.raises(LaunchError) as err:
        launch(fault_job, p, p, victim, phase, kind, str(tmp_path), timeout=120, grace=GRACE_S)
    failures = err.value.failures
    by_rank = {f.rank: f for f in failures}
    assert sorted(by_rank) == list(range(p)), str(err.value)
    if kind == "kill":
        assert failures[0].rank == victim, str(err.value)
        assert (failures[0].exitcode, failures[0].error) == (-9, "killed by signal SIGKILL")
    else:
        stalled = failures[0]  # blamed first, though the survivors gave up before it was killed
        assert (stalled.rank, stalled.exitcode, stalled.stalled) == (victim, None, True), str(
            err.value
        )
        assert re.fullmatch(
            r"stalled: no progress for \d+\.\ds \(running outside any communication wait\) "
            rf"while rank \d+ died waiting( on it| in a collective); killed {GRACE_S:g}s after "
            r"rank \d+ failed",
            stalled.error,
        ), stalled.error
    for r in set(range(p)) - {victim}:
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text  # failed on its own, not killed
        last = text.strip().splitlines()[-1]
        assert last.startswith(f"zerobubble.runtime.p2p.comm.PeerError: rank {r}: "), text
        assert f"iteration {ITERATION}" in last, text
        if phase == "optimizer_step":  # the step's all-reduce: the group stands for the peer
            assert re.search(r"all-reduce .* in the collective over ranks \[[\d, ]+\] failed", last)
        else:
            assert re.search(r"with peer rank \d+ failed", last), text
            assert re.search(r": (wait_recv|post_recv|send) ", last), text
    pids = [int(f.read_text()) for f in tmp_path.iterdir()]
    assert len(pids) == p
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
