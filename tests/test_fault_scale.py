"""Kill/stall matrix of the scale dimensions: a rank killed (SIGKILL) or stalled where its
peers wait in a collective the library issues or causes, one fault per launch.

Roles (each killed once and stalled once, a covering design over where and on which mesh):
the ep all-to-alls (the forward's on ``ExpertGroup.group``, the backward's reverse one on
``.backward``; pp2 x dp2 x ep2 and pp1 x dp4 x ep2), the helper thread's all-to-all of an
overlapped F&B pair (dualpipev, pp2 x dp2 x ep2), the tensor-parallel collectives DTensor
runs inside torch (a forward between blocks and a backward on pp2 x tp2 with and without
sequence parallelism, the optimizer's tp norm reduction on pp1 x tp2), a segment schedule's
pipeline (seq-zb, P=2), DCP's own collectives in ``save_checkpoint`` (the writer stalled or
killed in its write, over a pp2 x dp2 job and a P=3 pipeline) and FSDP's all-gather
(pp2 x dp2). A start-up with different segment cuts on two ranks is refused on both.

What every row asserts: the launcher names the faulty rank first (killed: exit -9;
stalled: ``stalled=True``), every survivor exits 1 on its own with a ``PeerError``, and the
survivor that waited on the faulty rank in the role's collective names it with its mesh
coordinates ("rank 1 (pp 0, dp 1, ep 1) never arrived"). The process group's timeout (so,
every mesh subgroup's) is 60 s and each launch's 45 s: a wait bounded only by the former
would end the launch as a timeout, not as these errors; the comm timeout is 2.5 s.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ranks import launch
from test_seq_runtime import count, model_and_batch, token_loss
from test_tp import batch as tp_batch
from test_tp import layers as tp_layers
from test_tp import loss_fn as tp_loss
from test_tp import mlp_plan
from zerobubble import Pipeline
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.models.moe import MoE, build_moe_mlp
from zerobubble.optim.checkpoint import save_checkpoint
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import Crash, FaultPlan, RankFault, Stall
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.mesh import ParallelSpec, build_mesh
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

COMM_TIMEOUT_S = 2.5
PG_TIMEOUT_S = 60.0  # init_distributed's: every mesh subgroup's too (never reached here)
LAUNCH_TIMEOUT_S = 45.0  # below PG_TIMEOUT_S: a wait bounded by it ends as a launch timeout
GRACE_S = 4.5  # after the first survivor gives up, the others fail within it
ITERATION = 1


@dataclass(frozen=True)
class Row:
    """One launch: ``role`` on ``spec`` (pp, dp, ep, tp, sp), ``where`` the victim fails."""

    role: str
    spec: ParallelSpec
    victim: int
    kind: str
    where: str
    named_by: int
    """The survivor that waited on the victim in the role's collective: it names it."""
    what: str
    """What that survivor's PeerError says it was doing (a regex)."""

    @property
    def id(self) -> str:
        s = self.spec
        mesh = f"pp{s.pp}" + "".join(
            f"x{k}{v}" for k, v in (("dp", s.dp), ("ep", s.ep), ("tp", s.tp)) if v > 1
        )
        return f"{self.role}-{mesh}{'-sp' if s.sequence_parallel else ''}-{self.where}-{self.kind}"


ROWS = [
    Row("ep", ParallelSpec(2, 2, ep=2), 1, "kill", "forward", 0, r"all-to-all of the per-expert"),
    Row("ep", ParallelSpec(2, 2, ep=2), 0, "stall", "backward", 1, r"reverse all-to-all"),
    Row("ep", ParallelSpec(1, 4, ep=2), 3, "stall", "forward", 2, r"all-to-all of the per-expert"),
    Row("overlap", ParallelSpec(2, 2, ep=2), 3, "stall", "helper", 2, r"all-to-all"),
    Row("overlap", ParallelSpec(2, 2, ep=2), 2, "kill", "helper", 3, r"all-to-all"),
    Row("tp", ParallelSpec(2, tp=2), 1, "kill", "forward", 0, r"F\(s0,mb\d\) of iteration 1"),
    Row(
        "tp",
        ParallelSpec(2, tp=2, sequence_parallel=True),
        2,
        "stall",
        "backward",
        3,
        r"BW?\(s1,mb\d\) of iteration 1",
    ),
    Row("tp", ParallelSpec(1, tp=2), 0, "stall", "optimizer", 1, r"iteration 1's gradient norm"),
    Row("segments", ParallelSpec(2), 1, "kill", "forward", 0, r"(wait_recv|post_recv|send) "),
    Row("segments", ParallelSpec(2), 0, "stall", "backward", 1, r"(wait_recv|post_recv|send) "),
    Row(
        "dcp", ParallelSpec(2, 2), 3, "stall", "in_write", 0, r"torch.distributed.checkpoint's save"
    ),
    Row("dcp", ParallelSpec(3), 1, "kill", "in_write", 0, r"torch.distributed.checkpoint's save"),
    Row("fsdp", ParallelSpec(2, 2, fsdp=True), 2, "stall", "unshard", 3, r"unshard\(s1\)"),
]


def test_the_rows_kill_and_stall_every_role():
    roles = {r.role for r in ROWS}
    both = {(role, k) for role in roles - {"fsdp"} for k in ("kill", "stall")}
    assert {(r.role, r.kind) for r in ROWS} >= both
    assert {r.spec.sequence_parallel for r in ROWS if r.role == "tp"} == {False, True}
    assert {r.where for r in ROWS if r.role == "tp"} == {"forward", "backward", "optimizer"}


def fault(kind: str) -> None:
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def _start(row: Row, piddir: str) -> int:
    rank = init_distributed(timeout_s=PG_TIMEOUT_S).rank
    Path(piddir, str(rank)).write_text(str(os.getpid()))
    # Meet before the executor's start-up barrier (bounded by the comm timeout): on a loaded
    # machine the ranks can reach it further apart than that.
    torch.distributed.barrier()
    return rank


def _options(**kw: object) -> ExecutorOptions:
    return ExecutorOptions(comm_timeout_s=COMM_TIMEOUT_S, trace=False, **kw)


def _arm_experts(pipe: Pipeline, row: Row, armed: list[bool]) -> None:
    """Make the victim fail in its MoE layers' exchange once ``armed``: before the forward's
    all-to-all, before the backward's reverse one (a hook on its output), or before the
    forward's on the helper thread of an overlapped pair."""
    for chunk in pipe.executor.chunks.values():
        for m in chunk.module.modules():
            if not isinstance(m, MoE):
                continue
            exchange = m.exchange

            def wrapped(rows, counts, exchange=exchange):
                helper = threading.current_thread() is not threading.main_thread()
                if armed and (row.where == "forward" or (row.where == "helper" and helper)):
                    fault(row.kind)
                out = exchange(rows, counts)
                if armed and row.where == "backward":
                    out.register_hook(lambda g: fault(row.kind))
                return out

            m.exchange = wrapped


def moe_job(row: Row, piddir: str) -> None:
    rank = _start(row, piddir)
    s = row.spec
    mesh = build_mesh(s.pp, s.dp, ep=s.ep)
    kind = "dualpipev" if row.role == "overlap" else "1f1b" if s.pp == 1 else "zb-h1"
    sched = generate(kind, s.pp, 4, overlap=row.role == "overlap")
    layers = build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, seed=0)
    pipe = Pipeline(layers, mlp_loss, sched, mesh=mesh, options=_options())
    pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), OptimConfig())
    armed: list[bool] = []
    if rank == row.victim:
        _arm_experts(pipe, row, armed)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    for k in range(ITERATION + 2):
        if k == ITERATION:
            armed.append(True)
        pipe.step(torch.randn(8, 3, 6, generator=gen), target=torch.randn(8, 3, 3, generator=gen))
    raise AssertionError(f"rank {rank} finished although rank {row.victim} failed")


def tp_job(row: Row, piddir: str) -> None:
    rank = _start(row, piddir)
    s = row.spec
    mesh = build_mesh(s.pp, tp=s.tp, sequence_parallel=s.sequence_parallel)
    plan = mlp_plan(s.sequence_parallel)
    options = _options()
    pipe = Pipeline(
        tp_layers(), tp_loss, "1f1b", microbatches=2, mesh=mesh, tp_plan=plan, options=options
    )
    trainer = pipe.set_optimizer(
        torch.optim.SGD(pipe.parameters(), lr=0.1), OptimConfig(max_norm=1.0)
    )
    armed: list[bool] = []
    if rank == row.victim:
        stage = min(pipe.executor.chunks)
        block = [m for m in pipe.executor.chunks[stage].module.children()][1]
        if row.where == "forward":  # between its first and second block
            block.register_forward_hook(lambda *_: fault(row.kind) if armed else None)
        elif row.where == "backward":

            def on_output(_m, _args, out):
                if armed:
                    out.register_hook(lambda g: fault(row.kind))

            block.register_forward_hook(on_output)
        else:
            trainer.faults = FaultPlan(
                ranks=(RankFault(ITERATION, stage, "optimizer_step", kind=row.kind),)
            )
    for k in range(ITERATION + 2):
        if k == ITERATION:
            armed.append(True)
        x, y = tp_batch(seed=10 + k)
        pipe.step(x, target=y)
    raise AssertionError(f"rank {rank} finished although rank {row.victim} failed")


def segments_job(row: Row, piddir: str) -> None:
    rank = _start(row, piddir)
    sched = generate("seq-zb", 2, 2, segments=2)
    layers, x, y = model_and_batch("gpt", sched.num_stages, 2)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(
        sched, stages, loss_fn=token_loss, count_fn=count, options=_options(cuts=(0, 9, 16))
    )
    stage = sched.stages_of_device[row.victim][0]
    plan = FaultPlan(ranks=(RankFault(ITERATION, stage, row.where, mb=1, kind=row.kind),))
    params = [q for c in pipe.chunks.values() for q in c.module.parameters()]
    trainer = PipelineTrainer(pipe, torch.optim.SGD(params, lr=0.1), OptimConfig(), faults=plan)
    for _ in range(ITERATION + 2):
        trainer.step(x[:4], target=y[:4])
    raise AssertionError(f"rank {rank} finished although rank {row.victim} failed")


def dcp_job(row: Row, piddir: str, root: str) -> None:
    rank = _start(row, piddir)
    s = row.spec
    if s.dp > 1:  # DCP over the whole job
        mesh = build_mesh(s.pp, s.dp)
        layers = build_mlp([4] * 5, seed=0)
        pipe = Pipeline(layers, mlp_loss, "zb-h1", microbatches=2, mesh=mesh, options=_options())
        trainer = pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), OptimConfig())
        step = pipe.step
    else:  # DCP over the pipeline
        mesh = None
        sched = generate("zb-h1", s.pp, 3)
        stages = build_stage_modules(list(build_mlp([4] * 4, seed=0)), sched, rank)
        executor = PipelineExecutor(sched, stages, loss_fn=mlp_loss, options=_options())
        params = [q for c in executor.chunks.values() for q in c.module.parameters()]
        trainer = PipelineTrainer(executor, torch.optim.SGD(params, lr=0.1), OptimConfig())
        step = trainer.step
    if rank == row.victim:  # the plan names the trainer's (pipeline) rank and the saved step
        me = trainer.rank
        trainer.faults = FaultPlan(
            stalls=(Stall(me, 2, 600, point="in_write"),) if row.kind == "stall" else (),
            crashes=(Crash(me, 2, "in_write"),) if row.kind == "kill" else (),
        )
    for _ in range(2):
        step(torch.randn(6, 4), target=torch.randn(6, 4))
    save_checkpoint(trainer, root, mesh=mesh)
    raise AssertionError(f"rank {rank} finished although rank {row.victim} failed")


def fsdp_job(row: Row, piddir: str) -> None:
    rank = _start(row, piddir)
    mesh = build_mesh(2, 2, fsdp=True)
    pipe = Pipeline(
        build_mlp([4] * 5, seed=0), mlp_loss, "zb-h1", microbatches=2, mesh=mesh, options=_options()
    )
    pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.1), OptimConfig())
    sharding = pipe.executor.sharding
    assert sharding is not None
    armed: list[bool] = []
    if rank == row.victim:
        run = sharding.run

        def before_unshard(action):
            if armed and str(action).startswith("unshard"):
                fault(row.kind)
            run(action)

        sharding.run = before_unshard
    for k in range(ITERATION + 2):
        if k == ITERATION:
            armed.append(True)
        pipe.step(torch.randn(4, 4), target=torch.randn(4, 4))
    raise AssertionError(f"rank {rank} finished although rank {row.victim} failed")


JOBS = {"ep": moe_job, "overlap": moe_job, "tp": tp_job, "segments": segments_job, "fsdp": fsdp_job}


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.id)
def test_a_killed_or_stalled_rank_in_a_collective_is_named_first_and_by_its_peers(tmp_path, row):
    world = row.spec.world_size
    piddir = tmp_path / "pids"
    piddir.mkdir()
    args = (row, str(piddir))
    job = JOBS.get(row.role)
    if job is None:
        job, args = dcp_job, (*args, str(tmp_path / "ckpt"))
    with pytest.raises(LaunchError) as err:
        launch(job, world, *args, timeout=LAUNCH_TIMEOUT_S, grace=GRACE_S)
    failures = err.value.failures
    by_rank = {f.rank: f for f in failures}
    assert sorted(by_rank) == list(range(world)), str(err.value)
    first = failures[0]
    if row.kind == "kill":
        assert (first.rank, first.exitcode) == (row.victim, -9), str(err.value)
    elif row.role == "overlap" and not first.stalled:
        # Its main thread, done with the pair's backward, gave up on its own helper (stuck
        # in its F) before the launcher stopped it: named first all the same, as the rank
        # the first survivor waited on (launcher._waited_on).
        assert (first.rank, first.exitcode) == (row.victim, 1), str(err.value)
        assert "TimeoutError: the overlapped F(" in first.error, first.error
    else:
        assert (first.rank, first.exitcode, first.stalled) == (row.victim, None, True), str(
            err.value
        )
        assert "timeout" not in first.error, first.error  # stopped after the survivors failed
    for r in set(range(world)) - {row.victim}:
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text  # failed on its own, not killed
        last = text.strip().splitlines()[-1]
        assert last.startswith(f"zerobubble.runtime.p2p.comm.PeerError: rank {r}"), text
    text = by_rank[row.named_by].error.strip().splitlines()[-1]
    assert re.search(row.what, text), text
    if row.role == "segments":  # the pipeline's own messages name their peer
        assert f"with peer rank {row.victim} failed" in text, text
    else:  # named with its mesh coordinates where the job has a mesh
        meshless = row.role == "dcp" and row.spec.dp == 1
        name = f"rank {row.victim}" if meshless else row.spec.name(row.victim)
        assert f"; {name} never arrived (stalled or dead)" in text, text
    pids = [int(f.read_text()) for f in piddir.iterdir()]
    assert len(pids) == world
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def cuts_job(rank_cuts: dict[int, tuple[int, ...]]) -> str:
    rank = init_distributed(timeout_s=PG_TIMEOUT_S).rank
    sched = generate("seq-zb", 2, 2, segments=2)
    layers, _, _ = model_and_batch("gpt", sched.num_stages, 2)
    try:
        PipelineExecutor(
            sched,
            build_stage_modules(layers, sched, rank),
            loss_fn=token_loss,
            count_fn=count,
            options=_options(cuts=rank_cuts[rank]),
        )
    except ValueError as e:
        return str(e)
    return "constructed"


def test_ranks_that_pass_different_cuts_are_refused_on_every_rank():
    got = launch(cuts_job, 2, {0: (0, 9, 16), 1: (0, 8, 16)}, timeout=LAUNCH_TIMEOUT_S)
    assert got[0] == (
        "rank 0 cuts the sequences at [0, 9, 16] but rank 1 cuts=[0, 8, 16]: every rank must "
        "pass the same ExecutorOptions(cuts=...) (a pipeline's ranks exchange each segment's "
        "boundary values, the replicas sum the same segments' gradients)"
    )
    assert got[1].startswith("rank 1 cuts the sequences at [0, 8, 16] but rank 0 cuts=[0, 9, 16]")
