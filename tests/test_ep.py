"""Expert parallelism: the mesh's ep dim, the dropless MoE block, and pp x ep on gloo
ranks bitwise against the single-process reference (:func:`ep_reference_step`).

One 4-rank launch builds the pp=2 x dp=2 x ep=2 and pp=1 x dp=4 x ep=2 meshes (their
groups), runs one step of zb-h1 and of zbv on the first (and of zbv with a MoE GPT) and
one of 1f1b on the second (gradients after the reduction and losses against the
reference; expert weight gradients deferred to W), and trains zb-h1 for two AdamW steps
with clipping in each step mode (parameters against the reference trained with
``clip_grad_norm_``). Two more launches resume pp=2 x ep=2 training from a checkpoint;
a 2-rank one kills an ep peer at the all-to-all: the survivor names it."""

from __future__ import annotations

import os

import pytest
import torch

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, gpt_loss, mlp_loss
from zerobubble.models.moe import (
    MoE,
    build_moe_gpt,
    build_moe_mlp,
    dispatch_order,
    run_experts,
)
from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
from zerobubble.parallel.ep import ExpertGroup, is_expert
from zerobubble.parallel.mesh import ParallelSpec, build_mesh
from zerobubble.reference.ep import ep_reference_step
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.runtime.split import split_share
from zerobubble.schedule.ir import Action, Op

SIZES = (6, 8, 3)
E, K, M, LOCAL, T = 4, 2, 4, 8, 3
MAX_NORM = 0.05
TIMEOUT = 240.0


def model(skewed: bool = False) -> torch.nn.Sequential:
    """The tiny MoE model; ``skewed``: the routers are zero, so every token goes to the same
    two experts (ties), both on one ep rank: the other receives no rows."""
    layers = build_moe_mlp(SIZES, hidden=16, num_experts=E, top_k=K, blocks=2, seed=0)
    if skewed:
        with torch.no_grad():
            for block in (layers[1], layers[2]):
                block.moe.router.weight.zero_()
    return layers


GPT = GPTConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, mlp_ratio=2)


def moe_gpt() -> torch.nn.Sequential:
    return build_moe_gpt(GPT, num_experts=E, top_k=K)


def gpt_parts(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, GPT.vocab_size, (dp * LOCAL, GPT.max_seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    return [(x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]) for r in range(dp)]


def batch(dp: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(dp * LOCAL, T, SIZES[0], generator=g)
    return x, torch.randn(dp * LOCAL, T, SIZES[2], generator=g)


def parts(dp: int, step: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = batch(dp, step)
    return [(x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]) for r in range(dp)]


# ---- the spec and the block, in one process --------------------------------------------------


def test_parallel_spec_refuses_bad_ep():
    with pytest.raises(ValueError) as e:
        ParallelSpec(2, 3, ep=2)
    assert str(e.value) == (
        "ep=2 must divide dp=3 (experts are sharded over ep ranks inside the data-parallel "
        "ranks); choose dp as a multiple of ep"
    )
    with pytest.raises(ValueError, match=r"^mesh sizes must be >= 1, got pp=2, dp=2, ep=0$"):
        ParallelSpec(2, 2, ep=0)
    spec = ParallelSpec(2, 4, ep=2)
    assert (spec.world_size, spec.edp) == (8, 2)


def test_expert_group_and_shard_refuse_bad_sizes():
    with pytest.raises(ValueError) as e:
        ExpertGroup(None, 0, 2)
    assert str(e.value) == (
        "ExpertGroup(rank=0, size=2) needs 0 <= rank < size and a process group when "
        "size > 1; build it with ExpertGroup.of(mesh)"
    )
    moe = MoE(8, 16, E, K)
    with pytest.raises(ValueError) as e:
        moe.shard(ExpertGroup(object(), 0, 3))  # type: ignore[arg-type]  # never used
    assert str(e.value) == (
        "ep=3 must divide num_experts=4; choose ep among the divisors of the expert count"
    )
    with pytest.raises(ValueError, match=r"^top_k=5 must be in \[1, num_experts=4\]$"):
        MoE(8, 16, E, 5)


@pytest.mark.bitwise
@pytest.mark.kernels
@pytest.mark.parametrize("skewed", [False, True])
def test_moe_at_ep1_is_a_dense_loop_over_experts_bitwise(skewed):
    """The block equals, bitwise, each expert run on its tokens' rows (token order, the
    same per-expert shapes), weighted and summed per token. Dropless: all N * k pairs are
    computed, even when the router sends every token to experts 0 and 1 (skewed)."""
    torch.manual_seed(0)
    moe = MoE(8, 16, E, K)
    x = torch.randn(5, 7, 8)
    if skewed:
        x = x.abs()
        with torch.no_grad():
            moe.router.weight.copy_(torch.tensor([1.0, 0.5, -1.0, -1.0]).unsqueeze(1))
    got = moe(x)
    tokens = x.reshape(-1, 8)
    weights, chosen = moe.route(tokens)
    _, _, counts = dispatch_order(chosen, E)
    assert counts.sum().item() == 35 * K  # dropless: every (token, k) pair is computed
    assert counts.tolist() == ([35, 35, 0, 0] if skewed else [20, 17, 18, 15])
    per_pair = torch.empty(35, K, 8)
    for e in range(E):
        tok, slot = (chosen == e).nonzero(as_tuple=True)  # token order
        per_pair[tok, slot] = moe.experts[str(e)](tokens[tok])
    want = (per_pair * weights.unsqueeze(-1)).sum(1).view(5, 7, 8)
    assert torch.equal(got, want)  # bitwise against the dense loop


@pytest.mark.parametrize(
    ("counts", "want"),
    [
        # src 0: e0 [0], e1 [1, 2]; src 1: e0 [3, 4], e1 [5, 6]
        ([[1, 2], [2, 2]], [[0, 3, 4], [1, 2, 5, 6]]),
        # src 0: e1 [0, 1], e2 [2]; src 1: e0 [3, 4, 5]; src 2: e0 [6], e1 [7]
        ([[0, 2, 1], [3, 0, 0], [1, 1, 0]], [[3, 4, 5, 6], [0, 1, 7], [2]]),
    ],
)
def test_run_experts_groups_rows_by_expert_in_source_order(counts, want):
    """Received rows (sources x local experts) reach each expert as one block, source 0's
    rows first; the outputs come back in the received layout."""
    seen: list[list[float]] = []

    class Record(torch.nn.Module):
        def forward(self, x):
            seen.append(x.squeeze(1).tolist())
            return x * 10

    table = torch.tensor(counts)
    rows = torch.arange(float(table.sum())).unsqueeze(1)
    out = run_experts([Record() for _ in counts[0]], rows, table)
    assert seen == [[float(r) for r in rows_e] for rows_e in want]
    assert torch.equal(out, rows * 10)


@pytest.mark.bitwise
@pytest.mark.kernels
def test_ep_reference_at_ep1_is_the_dp_reference_order():
    """With ep=1 and one replica the reference is plain per-microbatch autograd."""
    ref = model()
    ((x, y),) = parts(1)
    losses, grads = ep_reference_step(ref, mlp_loss, [(x, y)], M, 1)
    plain = model()
    want = []
    for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
        loss = mlp_loss(plain(xj), yj)
        (loss * (len(xj) / LOCAL)).backward()
        want.append(loss.detach())
    assert all(map(torch.equal, losses[0], want))
    for n, p in plain.named_parameters():
        assert torch.equal(grads[n], p.grad), n


# ---- inside the ranks ------------------------------------------------------------------------


class Deferral(StepHooks):
    """After each B of a stage holding experts: ``(stage, mb, no expert gradient yet,
    the store holds the microbatch's W work)``."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.after_b: list[tuple[int, int, bool, bool]] = []

    def after_compute(self, action: Action) -> None:
        if action.op is not Op.B:
            return
        chunk = self.executor.chunks[action.stage]
        experts = [p for p in chunk.module.parameters() if is_expert(p)]
        if experts:
            none = all(p.grad is None for p in experts)
            pending = (action.stage, action.mb) in chunk.store.in_flight(action.stage)
            self.after_b.append((action.stage, action.mb, none, pending))


def groups(mesh) -> dict:
    import torch.distributed as dist

    def ranks(g):
        return None if g is None else dist.get_process_group_ranks(g)

    return {
        "ep": ranks(mesh.ep_group),
        "edp": ranks(mesh.edp_group),
        "dp": ranks(mesh.dp_group),
        "pp": ranks(mesh.pp_group),
        "ep_rank": mesh.ep_rank,
    }


def one_step(
    mesh, kind: str, gpt: bool = False, recompute: str = "none", skewed: bool = False
) -> dict:
    layers, loss_fn = (moe_gpt(), gpt_loss) if gpt else (model(skewed), mlp_loss)
    options = zerobubble.ExecutorOptions(recompute=recompute)
    pipe = zerobubble.Pipeline(layers, loss_fn, kind, microbatches=M, mesh=mesh, options=options)
    hooks = Deferral(pipe.executor)
    x, y = (gpt_parts if gpt else parts)(mesh.dp_size)[mesh.dp_rank]
    losses = pipe.executor.step(x, target=y, hooks=hooks)
    split = [c.module for c in pipe.executor.chunks.values() if c.split]
    shares = [split_share(m) for m in split]
    return {
        "losses": None if losses is None else [t.numpy() for t in losses],
        "grads": {n: p.grad.numpy().copy() for n, p in pipe.named_parameters()},
        "after_b": hooks.after_b,
        "unsplit": [u for s in shares for u in s.unsplit],
        "split_experts": sum(is_expert(p) for m in split for p in m.parameters()),
        "b_planned": sum(
            a.op is Op.B and any(map(is_expert, pipe.executor.chunks[a.stage].module.parameters()))
            for a in pipe.schedule.actions[pipe.rank]
        ),
    }


def run_ranks() -> dict:
    init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    wide = build_mesh(1, 4, ep=2)
    out: dict = {"dp_rank": mesh.dp_rank, "groups": (groups(mesh), groups(wide))}
    for kind in ("zb-h1", "zbv"):
        out[kind] = one_step(mesh, kind)
    out["wide"] = one_step(wide, "1f1b")
    out["ep1"] = one_step(build_mesh(2, 2), "zb-h1")  # whole experts on every dp replica
    out["gpt"] = one_step(mesh, "zbv", gpt=True)
    out["recompute"] = one_step(mesh, "zb-h1", recompute="layers")  # B repeats the all-to-all
    out["skewed"] = one_step(mesh, "zb-h1", skewed=True)
    for mode in ("sync", "conservative", "speculative"):
        pipe = zerobubble.Pipeline(model(), mlp_loss, "zb-h1", microbatches=M, mesh=mesh)
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
        config = zerobubble.OptimConfig(mode=mode, max_norm=MAX_NORM)
        trainer = pipe.set_optimizer(opt, config)
        commits: list = []
        trainer.on_commit = commits.append
        for k in range(2):
            x, y = parts(2, k)[mesh.dp_rank]
            pipe.step(x, target=y)
        pipe.drain()
        out[f"train-{mode}"] = {
            "params": {n: p.detach().numpy().copy() for n, p in pipe.named_parameters()},
            "norm": float(trainer.last_commit.total_norm),
            "commits": [str(c.action) for c in commits],
        }
    # The whole model's state dict loads strictly: the other ep ranks' experts are known.
    other = build_moe_mlp(SIZES, hidden=16, num_experts=E, top_k=K, blocks=2, seed=1)
    pipe.load_state_dict(other.state_dict())
    whole = dict(other.named_parameters())
    out["loaded"] = [n for n, p in pipe.named_parameters() if not torch.equal(p, whole[n])]
    out["state_keys"] = sorted(pipe.state_dict())
    return out


def reference_train() -> tuple[dict[str, torch.Tensor], float]:
    ref = model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    norm = 0.0
    for k in range(2):
        ep_reference_step(ref, mlp_loss, parts(2, k), M, 2)
        norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        opt.step()
    return {n: p.detach() for n, p in ref.named_parameters()}, norm


@pytest.mark.bitwise
@pytest.mark.kernels
def test_pp2_ep2_matches_the_single_process_reference_bitwise():
    results = launch(run_ranks, 4, timeout=TIMEOUT)
    narrow = [r["groups"][0] for r in results]
    assert [g["ep"] for g in narrow] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["edp"] for g in narrow] == [None] * 4  # dp / ep = 1: experts not reduced
    assert [g["dp"] for g in narrow] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["pp"] for g in narrow] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["ep_rank"] for g in narrow] == [0, 1, 0, 1]
    wide = [r["groups"][1] for r in results]
    assert [g["ep"] for g in wide] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [g["edp"] for g in wide] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [g["dp"] for g in wide] == [[0, 1, 2, 3]] * 4
    split_experts = {"zb-h1": 0, "zbv": 0, "wide": 0, "recompute": 0, "skewed": 0}
    b_of_experts = dict(split_experts)
    first_b = dict(split_experts)
    # skewed: all tokens of both blocks go to experts 2 and 3 (ep rank 1's; topk's ties)
    _, chosen = model(skewed=True)[1].moe.route(torch.randn(10, SIZES[1]))
    assert chosen.sort(-1).values.tolist() == [[2, 3]] * 10
    for key, dp in (("zb-h1", 2), ("zbv", 2), ("wide", 4), ("recompute", 2), ("skewed", 2)):
        skewed = key == "skewed"
        want_losses, want = ep_reference_step(model(skewed), mlp_loss, parts(dp), M, 2)
        held: dict[str, int] = {}
        for g, r in enumerate(results):
            got = r[key]
            dp_rank = g % dp
            for n, array in got["grads"].items():
                held[n] = held.get(n, 0) + 1
                grad = torch.from_numpy(array)
                if key == "wide" and ".experts." not in n:
                    # 4 replicas: gloo's ring adds in its own order (parallel/dp.py); every
                    # replica gets the same sum, within (dp - 1) eps sum|g_r| of rank order
                    assert torch.equal(grad, torch.from_numpy(results[0][key]["grads"][n]))
                    assert torch.allclose(grad, want[n], rtol=0, atol=1e-7), (key, g, n)
                else:  # expert grads summed over edp (2 ranks: g_0 + g_1) or not at all
                    assert torch.equal(grad, want[n]), (key, g, n)
            if got["losses"] is not None:
                assert all(
                    map(torch.equal, map(torch.from_numpy, got["losses"]), want_losses[dp_rank])
                )
            # Split stages (those whose B runs apart from W) defer every weight gradient,
            # the experts' included: after a B the store holds the microbatch's W work,
            # and the first B leaves the expert gradients untouched.
            assert not [u for u in got["unsplit"] if ".moe." in u[0]], (key, got["unsplit"])
            assert all(pending for _, _, _, pending in got["after_b"]), (key, got["after_b"])
            # B of microbatch 0 (before any W) leaves the expert gradients unset
            assert all(none for _, mb, none, _ in got["after_b"] if mb == 0), key
            split_experts[key] += got["split_experts"]
            b_of_experts[key] += len(got["after_b"])
            first_b[key] += sum(mb == 0 for _, mb, _, _ in got["after_b"])
            assert len(got["after_b"]) == got["b_planned"], key  # every B was seen
        # every parameter of the whole model is held: dense ones on every replica, each
        # expert on the dp / ep replicas of its ep rank
        assert set(held) == set(want), key
        for n, count in held.items():
            expert = ".experts." in n
            assert count == (dp // 2 if expert else dp), (key, n)
        assert sum(".experts." in n for n in held) == 2 * E * 3  # 2 blocks, E experts, 3 Linears
    # Expert weights in split stages, over the ranks: a rank holds 2 experts x 3 Linears
    # = 6 per MoE block. zb-h1: stage 1 (layers 2-3, one block) on pp rank 1 of both
    # replicas (12); zbv: stages 1 and 2 (one block each) on pp rank 1 of both (24).
    assert split_experts == {"zb-h1": 12, "zbv": 24, "wide": 0, "recompute": 12, "skewed": 12}
    # zb-h1: stage 1's B of each microbatch on 2 replicas; zbv fuses some of the B/W
    # pairs of stages 1 and 2 into BW (the executor's fuse_local_backward), 5 Bs remain.
    assert b_of_experts == {"zb-h1": 2 * M, "zbv": 2 * 5, "wide": 0, "recompute": 2 * M} | {
        "skewed": 2 * M
    }
    assert first_b == {"zb-h1": 2, "zbv": 2, "wide": 0, "recompute": 2, "skewed": 2}, first_b
    # ep=1 on dp=2: every replica runs all experts on its own tokens, all gradients
    # summed over dp (2 ranks: g_0 + g_1), bitwise the reference played with ep=1
    want_losses, want = ep_reference_step(model(), mlp_loss, parts(2), M, 1)
    for g, r in enumerate(results):
        got = r["ep1"]
        assert got["split_experts"] == 0 and got["after_b"] == []  # nothing is marked
        for n, array in got["grads"].items():
            assert torch.equal(torch.from_numpy(array), want[n]), ("ep1", g, n)
        if got["losses"] is not None:
            losses = list(map(torch.from_numpy, got["losses"]))
            assert all(map(torch.equal, losses, want_losses[g % 2]))
    assert sum(".experts." in n for r in results for n in r["ep1"]["grads"]) == 2 * 2 * E * 3
    # A GPT with MoE blocks (attention, then the MoE) under zbv, bitwise the same way
    want_losses, want = ep_reference_step(moe_gpt(), gpt_loss, gpt_parts(2), M, 2)
    held = []
    for g, r in enumerate(results):
        got = r["gpt"]
        for n, array in got["grads"].items():
            held.append(n)
            assert torch.equal(torch.from_numpy(array), want[n]), ("gpt", g, n)
        if got["losses"] is not None:
            losses = list(map(torch.from_numpy, got["losses"]))
            assert all(map(torch.equal, losses, want_losses[g % 2]))
        assert all(pending for _, _, _, pending in got["after_b"])
    experts = sorted(n for n in want if ".experts." in n)
    dense = sorted(n for n in want if ".experts." not in n)
    assert sorted(n for n in held if ".experts." in n) == experts  # each on one rank
    assert sorted(n for n in held if ".experts." not in n) == sorted(dense * 2)
    params, norm = reference_train()
    for mode in ("sync", "conservative", "speculative"):  # post-validation: the same steps
        for r in results:
            got = r[f"train-{mode}"]
            assert got["commits"] == ["clip", "clip"], (mode, got["commits"])
            assert got["norm"] == norm, mode  # bitwise: clip_grad_norm_ over the whole model
            for n, array in got["params"].items():
                assert torch.equal(torch.from_numpy(array), params[n]), (mode, n)
    assert norm > MAX_NORM
    for r in results:
        assert r["loaded"] == []
    expert_keys = [k for r in results for k in r["state_keys"] if ".experts." in k]
    # dp / ep = 1: each of the 2 blocks x E experts x 3 weights is held by one rank
    assert len(expert_keys) == len(set(expert_keys)) == 2 * E * 3


# ---- checkpoints -----------------------------------------------------------------------------


def resume_job(root: str, resume: bool) -> dict:
    """zb-h1 on pp=2 x dp=2 x ep=2, AdamW with clipping for 3 steps; the first run saves
    after step 2, the second loads it and runs step 3."""
    init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    pipe = zerobubble.Pipeline(model(), mlp_loss, "zb-h1", microbatches=M, mesh=mesh)
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    trainer = pipe.set_optimizer(opt, zerobubble.OptimConfig(max_norm=MAX_NORM))
    if resume:
        load_checkpoint(trainer, root, mesh=mesh)
    for k in range(2 if resume else 0, 3):
        x, y = parts(2, k)[mesh.dp_rank]
        pipe.step(x, target=y)
        if not resume and k == 1:
            save_checkpoint(trainer, root, mesh=mesh)
    pipe.drain()
    return {
        n: (p.detach().numpy().tobytes(), {f: v.numpy().tobytes() for f, v in opt.state[p].items()})
        for n, p in pipe.named_parameters()
    }


@pytest.mark.bitwise
def test_pp2_ep2_resumes_from_a_checkpoint_bitwise(tmp_path):
    """Each ep rank's experts are saved under their global names and come back to the
    same rank: the resumed run's parameters and AdamW state equal the uninterrupted run's."""
    first = launch(resume_job, 4, str(tmp_path), False, timeout=TIMEOUT)
    second = launch(resume_job, 4, str(tmp_path), True, timeout=TIMEOUT)
    assert any(".experts." in n for n in first[1])
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a.keys() == b.keys()
        for n in a:
            assert a[n] == b[n], (rank, n)


# ---- an ep peer that dies --------------------------------------------------------------------


def die_at_the_all_to_all() -> None:
    """pp=1 x dp=2 x ep=2: rank 1 exits where its first MoE layer would exchange tokens."""
    init_distributed()
    mesh = build_mesh(1, 2, ep=2)
    options = zerobubble.ExecutorOptions(comm_timeout_s=30.0)
    pipe = zerobubble.Pipeline(
        model(), mlp_loss, "1f1b", microbatches=M, mesh=mesh, options=options
    )
    if mesh.ep_rank == 1:
        for m in pipe.executor.chunks[0].module.modules():
            if isinstance(m, MoE):
                m.exchange = lambda rows, counts: os._exit(3)
    x, y = parts(2)[mesh.dp_rank]
    pipe.step(x, target=y)


def test_an_ep_peer_that_dies_is_named():
    with pytest.raises(LaunchError) as info:
        launch(die_at_the_all_to_all, 2, timeout=TIMEOUT, grace=40.0)
    failures = {f.rank: f for f in info.value.failures}
    assert info.value.failures[0].rank == 1 and failures[1].exitcode == 3
    err = failures[0].error
    assert "PeerError: rank 0: all-to-all of the per-expert token counts over dim 'ep'" in err, err
    assert "in the collective over ranks [0, 1]" in err, err
