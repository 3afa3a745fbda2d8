"""Overlapped F&B pairs composed with tensor parallelism and with FSDP (gloo, 4 ranks each).

A pair runs one stage's F beside another stage's backward on two threads. With tp each stage
of a rank is parallelized over its own tp lane (``PipelineMesh.with_tp_lanes``: the same tp
ranks, a process group of its own), so the DTensor collectives of the two halves never
share a group. With FSDP the two halves are two stages, each its own FSDP root, and FSDP's
collectives (the unshard before a stage's first F, the reduce-scatter after its last W) run
outside the pairs.

* ``pp=2 x tp=2``: our GPT (attention and MLP tp collectives, loss parallel) under zbv and
  dualpipev with pairs, sequence parallelism off and on: losses and every gradient (local
  shard and placements) bitwise :func:`zerobubble.reference_step` with ``tp_mesh``, in
  ``REPEATS`` runs per case (a race shows only sometimes), and bitwise the same kind run
  without pairs. One more run per case starts the two halves in opposite orders on the
  two tp ranks (:func:`skewed`), which on one shared group would meet one half's collective
  with the other's; a ``parallelize_fn`` that puts every stage on the job's one tp group
  is refused on every rank. Trained: a tied GPT under dualpipev with pairs, two AdamW steps
  with clipping (the norm over the stages' two tp lanes, the tie's two replicas on two
  lanes of one rank), every parameter bitwise the same run without pairs.
* ``pp=2 x dp=2``, ``fsdp=True``: the same pairs over a GPT, bitwise
  :func:`zerobubble.reference_step` with ``dp=2`` (gradients gathered from their shards).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import zerobubble
from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.mesh import PipelineMesh, build_mesh
from zerobubble.parallel.tp import default_plan, parallelize_stage
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.overlap import OverlapFn, OverlapPair
from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule

pytestmark = pytest.mark.slow

PP, M, REPEATS = 2, 4, 2
GPT = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=2, seed=1)
B, T = 4, 8
TP_CASES = (("zbv", False), ("dualpipev", True))
FSDP_KINDS = ("zbv", "dualpipev")


def schedule(kind: str, pairs: bool) -> Schedule:
    if not pairs:
        return generate(kind, PP, M)
    # zbv pairs only where an all-to-all would hide: give it one to pair for
    sched = generate(kind, PP, M, overlap=True, costs=CostSpec(a2a=1) if kind == "zbv" else None)
    assert sched.overlaps and all(f.stage != b.stage for f, b in sched.overlaps)
    return sched


def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    ids = torch.randint(0, GPT.vocab_size, (rows, T), generator=g)
    return ids, torch.randint(0, GPT.vocab_size, (rows, T), generator=g)


def shard(t: torch.Tensor) -> tuple[torch.Tensor, str]:
    """A gradient's local values and its placements (lane-free: the mesh is not compared)."""
    if isinstance(t, DTensor):
        return t.to_local(), str(t.placements)
    return t, "plain"


def skewed(tp_rank: int) -> OverlapFn:
    """Runs a pair's halves at once, the F started first on tp rank 0 and the backward
    first on the others (each half a moment ahead: its first collective waits for its
    peers before the other half starts)."""

    def run(pair: OverlapPair) -> None:
        first, second = pair.run_forward, pair.run_backward
        if tp_rank:
            first, second = second, first
        failed: list[BaseException] = []

        def ahead() -> None:
            try:
                first()
            except BaseException as e:  # raised on the caller's thread below
                failed.append(e)

        helper = threading.Thread(target=ahead)
        helper.start()
        time.sleep(0.02)
        second()
        helper.join()
        if failed:
            raise failed[0]

    return run


def tp_run(
    mesh: PipelineMesh, kind: str, pairs: bool, hook: OverlapFn | None = None
) -> tuple[list | None, dict]:
    pipe = Pipeline(
        list(build_gpt(GPT)), gpt_loss, schedule(kind, pairs), mesh=mesh,
        options=ExecutorOptions(overlap_fn=hook),
    )  # fmt: skip
    x, y = batch(B)
    losses = pipe.step(x, target=y)
    return losses, {n: shard(p.grad) for n, p in pipe.named_parameters()}


def same(a: tuple[list | None, dict], b: tuple[list | None, dict]) -> list[str]:
    """What differs between two runs (losses, or the names of the gradients), bitwise."""
    bad = [] if (a[0] is None) == (b[0] is None) else ["losses held"]
    if a[0] is not None and b[0] is not None and not all(map(torch.equal, a[0], b[0])):
        bad.append("losses")
    for name, (g, where) in a[1].items():
        h, there = b[1][name]
        if where != there or not torch.equal(g, h):
            bad.append(name)
    return bad


def one_group_for_all(stage: int, module: nn.Module, mesh: PipelineMesh) -> nn.Module:
    """A parallelize_fn that ignores the stage's lane: every stage on the job mesh's tp."""
    tp = mesh.mesh["tp"]
    plan = default_plan(module, tp.size(), stage=stage, sequence_parallel=False)
    parallelize_stage(module, tp, plan, stage=stage)
    return module


def trained(mesh: PipelineMesh, pairs: bool) -> dict[str, tuple[torch.Tensor, str]]:
    """A tied GPT trained two AdamW steps (clipped) under dualpipev: every parameter's shard."""
    cfg = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=2, seed=1,
                    tie_embeddings=True)  # fmt: skip
    pipe = Pipeline(list(build_gpt(cfg)), gpt_loss, schedule("dualpipev", pairs), mesh=mesh)
    pipe.set_optimizer(
        torch.optim.AdamW(pipe.parameters(), lr=0.01), zerobubble.OptimConfig(max_norm=0.5)
    )
    x, y = batch(B)
    for _ in range(2):
        pipe.step(x, target=y)
    return {n: shard(p.detach()) for n, p in pipe.named_parameters()}


def tp_job() -> dict:
    init_distributed(timeout_s=120)
    out: dict = {}
    for kind, sp in TP_CASES:
        mesh = build_mesh(PP, tp=2, sequence_parallel=sp)
        assert mesh.tp_mesh is not None
        want_losses, want = zerobubble.reference_step(
            list(build_gpt(GPT)), gpt_loss, *batch(B)[:1], target=batch(B)[1],
            microbatches=M, tp_mesh=mesh.tp_mesh, sequence_parallel=sp,
            num_stages=2 * PP,
        )  # fmt: skip
        ref = (want_losses, {n: shard(g) for n, g in want.items()})
        plain = tp_run(mesh, kind, pairs=False)
        hooks = [None] * REPEATS + [skewed(mesh.tp_rank)]
        runs = [tp_run(mesh, kind, True, hook) for hook in hooks]
        out[kind, sp] = {
            "held": plain[0] is not None,
            "plain vs reference": same(plain, (plain[0] and ref[0], ref[1])),
            "pairs vs reference": [same(r, (r[0] and ref[0], ref[1])) for r in runs],
            "pairs vs plain": [same(r, plain) for r in runs],
        }
    mesh = build_mesh(PP, tp=2)
    out["trained"] = [trained(mesh, pairs) for pairs in (False, True)]
    with pytest.raises(ValueError) as e:
        Pipeline(
            list(build_gpt(GPT)), gpt_loss, schedule("dualpipev", True), mesh=mesh,
            parallelize_fn=one_group_for_all,
        )  # fmt: skip
    out["refused"] = str(e.value)
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def tp_ranks() -> list[dict]:
    return launch(tp_job, PP * 2, timeout=600)


@pytest.mark.bitwise
def test_pairs_under_tp_are_bitwise_the_reference_and_the_run_without_pairs(tp_ranks):
    for kind, sp in TP_CASES:
        held = [r[kind, sp]["held"] for r in tp_ranks]
        assert held == [True, True, False, False], (kind, sp)  # the V: last stage on pp 0
        for rank, r in enumerate(tp_ranks):
            case = r[kind, sp]
            assert case["plain vs reference"] == [], (kind, sp, rank)
            assert case["pairs vs reference"] == [[]] * (REPEATS + 1), (kind, sp, rank)
            assert case["pairs vs plain"] == [[]] * (REPEATS + 1), (kind, sp, rank)


def test_pairs_under_tp_train_bitwise_the_run_without_pairs(tp_ranks):
    for rank, r in enumerate(tp_ranks):
        plain, paired = r["trained"]
        assert plain.keys() == paired.keys(), rank
        assert ("0.tok.weight" in plain) == (rank < 2), rank  # the V: both ends on pp 0
        bad = [
            n
            for n, (p, where) in plain.items()
            if paired[n][1] != where or not torch.equal(paired[n][0], p)
        ]
        assert not bad, (rank, bad)


def test_stages_of_a_pair_on_one_tp_group_are_refused_on_every_rank(tp_ranks):
    for r in tp_ranks:
        assert r["refused"].startswith("schedule 'dualpipev' runs the halves of its F&B pairs")
        assert (
            "rank 0 overlaps F(s0,mb3) with BW(s3,mb1), but stages 0 and 3 run their DTensor "
            "collectives on one process group" in r["refused"]
        ), r["refused"]


# ---- FSDP ----------------------------------------------------------------------------------------


def fsdp_job() -> dict:
    init_distributed(timeout_s=120)
    mesh = build_mesh(PP, 2, fsdp=True)
    x, y = batch(2 * B)
    mine = slice(mesh.dp_rank * B, (mesh.dp_rank + 1) * B)
    out: dict = {}
    for kind in FSDP_KINDS:
        want_losses, want = zerobubble.reference_step(
            list(build_gpt(GPT)), gpt_loss, x, target=y, microbatches=M, dp=2
        )
        bad = []
        for _ in range(REPEATS):
            pipe = Pipeline(list(build_gpt(GPT)), gpt_loss, schedule(kind, True), mesh=mesh)
            assert pipe.executor.sharding is not None
            losses = pipe.step(x[mine], target=y[mine])
            wrong = [
                n
                for n, p in pipe.named_parameters()
                if not torch.equal(p.grad.full_tensor(), want[n])
            ]
            if losses is not None:
                part = want_losses[mesh.dp_rank * M : (mesh.dp_rank + 1) * M]
                wrong += [] if all(map(torch.equal, losses, part)) else ["losses"]
            bad.append(wrong)
        out[kind] = bad
    torch.distributed.destroy_process_group()
    return out


@pytest.mark.bitwise
def test_pairs_under_fsdp_are_bitwise_the_reference():
    ranks = launch(fsdp_job, PP * 2, timeout=600)
    for kind in FSDP_KINDS:
        for rank, r in enumerate(ranks):
            assert r[kind] == [[]] * REPEATS, (kind, rank)
