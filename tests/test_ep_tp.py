"""Expert parallelism with tensor parallelism: pp=2 x dp=2 (ep=2) x tp=2 on gloo (8 ranks,
one launch).

The experts are replicated over tp (no expert-tensor parallelism): each tp rank holds its
ep rank's experts whole and runs the ep all-to-all with the ranks of its own tp rank (one
ep group per (pp, edp, tp) coordinate). A tiny Hugging Face Mixtral (its router loss on),
two decoder layers, M=2:

* zb-h1 without sequence parallelism (the MoE block's input replicated over tp);
* zbv with sequence parallelism (the MoE block gathers the sequence, ``whole_sequence``).

Each: losses and every gradient (local shard and placements; an expert tensor's rows of
this ep rank) bitwise ``zerobubble.reference_step(dp=2, ep=2, tp_mesh=...)`` on every rank;
the ep groups are the ranks of one tp rank; the expert gradients equal on the two tp ranks
of a (pp, dp) coordinate; and every gradient, whole, within ``REL`` of the ep-only
reference (``reference_step(dp=2, ep=2)``, tp=1) of the largest: tp changes the rounding
of the attention's partial sums, nothing else, so the experts (and everything) get the
gradients of the ep-only run; the trainer's clipping norm (every expert counted once, not
once per tp rank) is the same on every rank and within ``REL`` of the ep-only gradients'.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zerobubble
from ranks import launch
from zerobubble.interop.hf import CausalLMLoss, causal_lm_layers, tiny_model
from zerobubble.parallel.ep import LocalGroup, Turns
from zerobubble.parallel.experts import expert_shard
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.tp import ReplicatedExpertsWarning
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.launcher import init_distributed

pytestmark = [pytest.mark.slow, pytest.mark.bitwise]

PP, DP, EP, TP, M = 2, 2, 2, 2, 2
LOCAL, T = 4, 6  # rows per replica, tokens (tp divides them: sequence parallelism)
RUNS = ((False, "zb-h1"), (True, "zbv"))
"""(sequence parallelism, schedule)."""
NO_CLIP = zerobubble.OptimConfig(max_norm=1e9)
REL = 1e-5
"""Against the ep-only reference, relative to the largest gradient (tp's partial sums add
in another order; measured in the test's message on failure)."""


def model() -> Any:
    return tiny_model("hf-mixtral", num_hidden_layers=2, seed=2)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 256, (DP * LOCAL, T), generator=torch.Generator().manual_seed(31))
    return ids, ids.clone()


def one_run(sp: bool, kind: str) -> dict[str, Any]:
    mesh = build_mesh(PP, DP, ep=EP, tp=TP, sequence_parallel=sp)
    ids, labels = batch()
    rows = slice(mesh.dp_rank * LOCAL, (mesh.dp_rank + 1) * LOCAL)
    m = model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReplicatedExpertsWarning)  # the stated choice
        pipe = Pipeline(causal_lm_layers(m), CausalLMLoss(m), kind, microbatches=M, mesh=mesh)
        # lr 0, no clipping: the gradients stay as the step left them; the trainer's norm
        trainer = pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.0), NO_CLIP)
        losses = pipe.step(ids[rows], target=labels[rows])
        pipe.drain()
        assert trainer.last_commit is not None
        ref_model = model()
        ref_losses, ref = zerobubble.reference_step(
            causal_lm_layers(ref_model), CausalLMLoss(ref_model), ids, target=labels,
            microbatches=M, dp=DP, ep=EP, tp_mesh=mesh.tp_mesh, sequence_parallel=sp,
            num_stages=pipe.schedule.num_stages,
        )  # fmt: skip
    bad, full, experts = [], {}, {}
    for n, p in pipe.named_parameters():  # the same order on every tp rank: collectives
        got, want = p.grad, ref[n]
        shard = expert_shard(p)
        if shard is not None:
            want = want[shard[0] : shard[1]]
            experts[n] = (shard, got.clone())
        if isinstance(got, DTensor):
            same = got.placements == want.placements and torch.equal(
                got.to_local(), want.to_local()
            )
            full[n] = got.full_tensor()
        else:
            same = not isinstance(want, DTensor) and torch.equal(got, want)
            full[n] = got.clone()
        if not same:
            bad.append(n)
    mine = ref_losses[mesh.dp_rank * M : (mesh.dp_rank + 1) * M]
    return {
        "coords": (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank),
        "ep_ranks": dist.get_process_group_ranks(mesh.ep_group),
        "edp": mesh.edp_group,
        "losses": None if losses is None else all(map(torch.equal, losses, mine)),
        "norm": float(trainer.last_commit.total_norm),
        "bad": bad,
        "full": full,
        "experts": experts,
    }


def job() -> dict:
    init_distributed(timeout_s=120)
    return {(run, dist.get_rank()): one_run(*run) for run in RUNS}


@pytest.fixture(scope="module")
def results() -> dict:
    out: dict = {}
    for r in launch(job, PP * DP * TP, timeout=300.0):
        out.update(r)
    return out


def ep_only() -> dict[str, torch.Tensor]:
    """The same step with ep and no tp: every gradient, whole."""
    m = model()
    ids, labels = batch()
    _, grads = zerobubble.reference_step(
        causal_lm_layers(m), CausalLMLoss(m), ids, target=labels, microbatches=M, dp=DP, ep=EP
    )
    return grads


@pytest.mark.parametrize("run", RUNS)
def test_ep_with_tp_is_bitwise_the_composed_reference(results: dict, run: tuple) -> None:
    want = ep_only()
    scale = max(float(g.abs().max()) for g in want.values())
    err, held = 0.0, set()
    for rank in range(PP * DP * TP):
        r = results[run, rank]
        pp, _, tp = r["coords"]
        assert r["bad"] == [], (rank, r["bad"])
        assert r["losses"] in (True, None), rank
        # one ep group per (pp, tp): the dp ranks of this tp rank
        assert r["ep_ranks"] == [(pp * DP + d) * TP + tp for d in range(DP)], rank
        assert r["edp"] is None  # dp == ep: every expert held once per tp lane
        twin = results[run, rank ^ 1]  # the other tp rank of this (pp, dp)
        assert r["experts"].keys() == twin["experts"].keys(), rank
        for n, (shard, g) in r["experts"].items():
            assert twin["experts"][n][0] == shard
            assert torch.equal(g, twin["experts"][n][1]), (rank, n)  # equal over tp
            err = max(err, float((g - want[n][shard[0] : shard[1]]).abs().max()) / scale)
            held.add(n)
        for n, g in r["full"].items():
            if n not in r["experts"]:
                err = max(err, float((g - want[n]).abs().max()) / scale)
                held.add(n)
    assert held == want.keys()  # the experts of every layer among them
    assert sum(results[run, rank]["losses"] is True for rank in range(8)) == DP * TP
    assert err < REL, err
    # the clipping norm counts every expert once (not once per tp rank)
    norms = {results[run, rank]["norm"] for rank in range(PP * DP * TP)}
    assert len(norms) == 1, norms
    whole = float(torch.nn.utils.get_total_norm(list(want.values())))
    assert abs(norms.pop() - whole) < REL * whole


def test_the_threaded_references_turns_fix_the_order_and_a_lone_exchange_raises() -> None:
    """The replicas' threads run one at a time, in an order fixed by the program (what keeps
    their tp collectives in one order on every tp rank); an exchange nobody meets raises."""

    def threads(turns: Turns, body: Callable[[int], None]) -> list[BaseException]:
        failed: list[BaseException] = []

        def run(r: int) -> None:
            try:
                turns.begin(r)
                body(r)
                turns.end(r)
            except BaseException as e:
                failed.append(e)
                turns.abort()

        ts = [threading.Thread(target=run, args=(r,)) for r in range(turns.size)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return failed

    for _ in range(5):
        turns, log = Turns(2), []
        group = LocalGroup(turns, 0, 2)

        def body(r: int, group: LocalGroup = group, log: list = log) -> None:
            log.append((r, "before"))
            got = group.exchange(r, [torch.tensor(10 * r + d) for d in range(2)])
            log.append((r, [int(t) for t in got]))

        assert threads(turns, body) == []
        assert log == [(0, "before"), (1, "before"), (1, [1, 11]), (0, [0, 10])]
    turns = Turns(2, timeout_s=30.0)
    lone = LocalGroup(turns, 0, 2)
    failed = threads(turns, lambda r: None if r else lone.exchange(0, [torch.zeros(1)] * 2))
    assert [type(e) for e in failed] == [RuntimeError]
    assert "replica 0 cannot go on" in str(failed[0])
