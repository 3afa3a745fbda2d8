"""Every wait of the optimizer protocol is bounded by the configured comm timeout: a stalled
or dead peer during the synchronous step's all-reduce or the post-validation messages fails
the other ranks with a PeerError naming the rank, the peer or group, the iteration and the
operation, never a raw transport error after the process-group timeout."""

from __future__ import annotations

import pytest
import torch

from ranks import launch
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import Crash, FaultPlan, Stall
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.runtime.executor import ExecutorOptions, PipelineExecutor
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.runtime.partition import build_stage_modules
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

COMM_TIMEOUT = 3.0
PG_TIMEOUT = 120  # far above the comm timeout: a wait that is not bounded by it would show


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
        launch(peer_job, 3, mode, plan, timeout=180, grace=COMM_TIMEOUT + 8)
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
            "of 3s (a rank of the group stuck?)"
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
        "rank 1 failed: no completion within the comm timeout of 3s (peer stuck?)"
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
