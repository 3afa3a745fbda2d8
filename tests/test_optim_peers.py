"""Every wait of the optimizer protocol is bounded by the configured comm timeout: a stalled
or dead peer during the synchronous step's all-reduce or the post-validation messages fails
the other ranks with a PeerError naming the rank, the peer or group, the iteration and the
operation, never a raw transport error after the process-group timeout. A rank that stalls
is the one the launcher names (not a survivor that timed out waiting on it), in a save too;
on a dp x pp mesh every message names global ranks."""

from __future__ import annotations

import re

import pytest
import torch

from ranks import launch
from zerobubble import Pipeline
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.checkpoint import save_checkpoint
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import Crash, FaultPlan, Stall
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

COMM_TIMEOUT = 2.0
PG_TIMEOUT = 120  # far above the comm timeout: a wait that is not bounded by it would show
#: The survivors' time, after the first failure, to fail on their own: a comm timeout for a
#: wait that began just then, and slack for a loaded machine.
GRACE = COMM_TIMEOUT + 4


def peer_job(mode: str, plan: FaultPlan) -> None:
    info = init_distributed(timeout_s=PG_TIMEOUT)
    sched = generate("zb-h1", 3, 3)
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(list(build_mlp([4] * 4, seed=0)), sched, info.rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=COMM_TIMEOUT, trace=False),
    )
    cfg = OptimConfig(max_norm=1.0) if mode == "sync" else OptimConfig(mode="conservative")
    trainer = PipelineTrainer(pipe, torch.optim.SGD(trainer_params(pipe), lr=0.1), cfg, faults=plan)
    for _ in range(3):
        trainer.step(torch.randn(6, 4), target=torch.randn(6, 4))
    trainer.drain()


def trainer_params(pipe: PipelineExecutor) -> list[torch.Tensor]:
    return [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]


def failures(mode: str, plan: FaultPlan) -> dict:
    with pytest.raises(LaunchError) as err:
        launch(peer_job, 3, mode, plan, timeout=180, grace=GRACE)
    return {f.rank: f for f in err.value.failures}


def test_stalled_peer_in_the_sync_all_reduce_fails_within_the_comm_timeout():
    by_rank = failures("sync", FaultPlan(stalls=(Stall(1, 1, 600),)))
    assert by_rank[1].exitcode is None  # the stalled rank was stopped
    for r in (0, 2):
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text
        assert (
            f"PeerError: rank {r}: all-reduce of iteration 1's gradient-norm state in the "
            "collective over ranks [0, 1, 2] failed: no completion within the comm timeout "
            f"of {COMM_TIMEOUT:g}s (a rank of the group stuck?)"
        ) in text, text


def test_dead_peer_in_the_sync_all_reduce_is_a_peer_error():
    by_rank = failures("sync", FaultPlan(crashes=(Crash(1, 1, "at_tail"),)))
    assert by_rank[1].error == "killed by signal SIGKILL"
    for r in (0, 2):
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text
        assert (
            f"PeerError: rank {r}: all-reduce of iteration 1's gradient-norm state in the "
            "collective over ranks [0, 1, 2] failed:"
        ) in text, text


def test_stalled_and_dead_peers_in_post_validation_name_the_peer_and_the_message():
    by_rank = failures("pv", FaultPlan(stalls=(Stall(1, 1, 600),)))
    text = by_rank[2].error
    assert (
        "PeerError: rank 2: receive of iteration 1's gradient-norm prefix state with peer "
        f"rank 1 failed: no completion within the comm timeout of {COMM_TIMEOUT:g}s (peer stuck?)"
    ) in text, text
    text = by_rank[0].error  # waits for the validated state of iteration 1 from rank 1
    assert (
        "PeerError: rank 0: receive of iteration 1's validated optimizer state with peer rank 1"
        in text
    ), text
    by_rank = failures("pv", FaultPlan(crashes=(Crash(1, 1, "at_tail"),)))
    assert by_rank[1].error == "killed by signal SIGKILL"
    assert (
        "PeerError: rank 2: receive of iteration 1's gradient-norm prefix state with peer "
        "rank 1 failed" in by_rank[2].error
    )


# ---- stalled ranks: named by the launcher; a stalled peer in a save; global ranks on a mesh ---


def stall_on_mesh_job() -> None:
    """dp=2 x pp=2, synchronous step: global rank 0 (pp 0, dp 0) stalls at the tail of
    iteration 1, before the gradient-norm all-reduce over its pipeline, ranks [0, 2]."""
    info = init_distributed(timeout_s=PG_TIMEOUT)
    mesh = build_mesh(2, 2)
    options = ExecutorOptions(comm_timeout_s=COMM_TIMEOUT, trace=False)
    model = build_mlp([4] * 5, seed=0)
    pipe = Pipeline(model, mlp_loss, "zb-h1", microbatches=4, mesh=mesh, options=options)
    cfg = OptimConfig(max_norm=1.0)
    trainer = pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), cfg)
    if info.rank == 0:
        trainer.faults = FaultPlan(stalls=(Stall(0, 1, 600),))
    for _ in range(4):
        pipe.step(torch.randn(8, 4), target=torch.randn(8, 4))


def test_a_stalled_rank_on_a_mesh_is_named_and_messages_use_global_ranks():
    with pytest.raises(LaunchError) as err:
        launch(stall_on_mesh_job, 4, timeout=180, grace=GRACE)
    first = err.value.failures[0]
    assert (first.rank, first.exitcode, first.stalled) == (0, None, True), str(err.value)
    assert re.fullmatch(
        r"stalled: no progress for \d+\.\ds \(running outside any communication wait\) while "
        rf"rank \d died waiting( on it| in a collective); killed {GRACE:g}s after rank \d failed",
        first.error,
    ), first.error
    assert str(err.value).startswith("rank 0 stalled (the others failed waiting on it):")
    by_rank = {f.rank: f for f in err.value.failures}
    text = by_rank[2].error  # pipeline rank 1 of dp replica 0: it named itself rank 1 before
    assert by_rank[2].exitcode == 1, text
    assert (
        "PeerError: rank 2 (pipeline rank 1): all-reduce of iteration 1's gradient-norm state "
        "in the collective over ranks [0, 2] (pipeline ranks [0, 1]) failed: no completion "
        f"within the comm timeout of {COMM_TIMEOUT:g}s"
    ) in text, text
    for r in (1, 2, 3):  # a dp collective names the dp group (it named the pipeline before)
        for group in re.findall(r"over dim 'dp'.* over ranks \[(\d+), (\d+)\]", by_rank[r].error):
            assert tuple(map(int, group)) == (r - r % 2, r - r % 2 + 1), by_rank[r].error


def stall_in_save_job(root: str) -> None:
    info = init_distributed(timeout_s=PG_TIMEOUT)
    sched = generate("zb-h1", 3, 3)
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(list(build_mlp([4] * 4, seed=0)), sched, info.rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=COMM_TIMEOUT, trace=False),
    )
    plan = FaultPlan(stalls=(Stall(1, 2, 600, point="during_save"),))
    opt = torch.optim.SGD(trainer_params(pipe), lr=0.1)
    trainer = PipelineTrainer(pipe, opt, OptimConfig(max_norm=1.0), faults=plan)
    for _ in range(2):
        trainer.step(torch.randn(6, 4), target=torch.randn(6, 4))
    save_checkpoint(trainer, root)


def test_a_peer_stalled_in_a_save_is_named_within_the_comm_timeout(tmp_path):
    """The process group's timeout is 120 s and the launch's 60 s: a wait bounded by the
    former would end as the launch's timeout, not as these errors."""
    with pytest.raises(LaunchError) as err:
        launch(stall_in_save_job, 3, str(tmp_path), timeout=60, grace=GRACE)
    first = err.value.failures[0]
    assert (first.rank, first.stalled) == (1, True), str(err.value)
    by_rank = {f.rank: f for f in err.value.failures}
    for r in (0, 2):
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text
        assert (
            f"PeerError: rank {r}: confirmation of the checkpoint of step 2 ({tmp_path}/"
            "step_00000002), which is not committed: the previous checkpoint stays the newest "
            f"with peer rank 1 failed: no completion within {COMM_TIMEOUT}s; rank 1 never arrived "
            "(stalled or "
            "dead): "
        ) in text, text
    assert not (tmp_path / "manifest.json").exists()
