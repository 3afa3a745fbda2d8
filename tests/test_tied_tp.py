"""Tied embeddings with tensor parallelism (gloo, pp2 x tp2, 4 ranks).

Our GPT with ``tie_embeddings=True``: the token table (vocabulary-sharded) and the LM head
(column-wise, its logits left sharded for loss parallel) are both ``Shard(0)`` of the one
weight. Under zb-h1 the tie spans ranks 0 and 1 of each tp slice; under zbv (a V: stages 0
and 3 on pipeline rank 0) one rank holds both replicas, which share one local shard. One
step's losses and gradient shards are bitwise :func:`zerobubble.reference_step` with the
tp mesh (each stage its own replica, the tie's gradients summed in stage order); then two
AdamW steps with the tie's replicas compared every step (``tied_check_every=1``) leave the
replicas bitwise equal on every rank.

With the tie inside one stage (pp1 x dp2 x tp2: embedding and head on the one stage) the
plan's two styles give the one weight the same ``Shard(0)`` layout, so it stays one
Parameter: bitwise the reference (dp=2 with the tp mesh), within ``TOL`` of the model without
tp, and one step of AdamW leaves the embedding and the head one tensor.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt, gpt_loss

pytestmark = pytest.mark.slow

CFG = GPTConfig(vocab_size=16, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, tie_embeddings=True)
M = 2
TOL = 1e-6
"""The tied gradient against the model without tp: the vocab-parallel sums round apart."""


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    if isinstance(a, DTensor):
        return a.placements == b.placements and torch.equal(a.to_local(), b.to_local())
    return torch.equal(a, b)


def one_stage() -> dict:
    """pp1 x dp2 x tp2: the tie inside the one stage."""
    zerobubble.init_distributed(timeout_s=60)
    mesh = zerobubble.build_mesh(1, 2, tp=2)
    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, 16, (8, 8), generator=gen) for _ in range(2))
    model = build_gpt(CFG)
    mine = slice(4 * mesh.dp_rank, 4 * mesh.dp_rank + 4)
    pipe = zerobubble.Pipeline(copy.deepcopy(model), gpt_loss, "1f1b", microbatches=M, mesh=mesh)
    losses = pipe.step(x[mine], target=y[mine])
    _, want = zerobubble.reference_step(
        model, gpt_loss, x, target=y, microbatches=M, dp=2, tp_mesh=mesh.tp_mesh
    )
    _, plain = zerobubble.reference_step(model, gpt_loss, x, target=y, microbatches=M, dp=2)
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    tied = grads["0.tok.weight"].full_tensor()
    out = {
        "bad": [n for n, g in grads.items() if g is None or not same(g, want[n])],
        "names": sorted(grads),
        "losses": losses is not None,
        "rel": float((tied - plain["0.tok.weight"]).norm() / plain["0.tok.weight"].norm()),
    }
    pipe.set_optimizer(torch.optim.AdamW(pipe.parameters(), lr=0.05))
    pipe.step(x[mine], target=y[mine])
    stage = next(iter(pipe._stages.values()))
    out["one"] = stage.get_parameter("0.tok.weight") is stage.get_parameter("4.weight")
    dist.destroy_process_group()
    return out


def test_a_tie_inside_one_stage_under_tp_stays_one_parameter():
    for rank, r in enumerate(launch(one_stage, 4, timeout=300)):
        assert r["names"] and r["bad"] == [], (rank, r["bad"])
        assert "4.weight" not in r["names"] and r["losses"] and r["one"], rank
        assert r["rel"] < TOL, (rank, r["rel"])


def job(kind: str) -> dict:
    zerobubble.init_distributed(timeout_s=60)
    mesh = zerobubble.build_mesh(2, tp=2)
    gen = torch.Generator().manual_seed(5)
    x, y = (torch.randint(0, 16, (4, 8), generator=gen) for _ in range(2))
    torch.manual_seed(0)
    model = build_gpt(CFG)
    pipe = zerobubble.Pipeline(copy.deepcopy(model), gpt_loss, kind, microbatches=M, mesh=mesh)
    losses = pipe.step(x, target=y)
    pipe.tied.reduce(0)  # without an optimizer the tie's replicas hold their own stage's part
    want_losses, want = zerobubble.reference_step(
        model, gpt_loss, x, target=y, microbatches=M, tp_mesh=mesh.tp_mesh,
        num_stages=pipe.schedule.num_stages,
    )  # fmt: skip
    grads = {n: p.grad for n, p in pipe.named_parameters()}
    out = {
        "bad": [n for n, g in grads.items() if g is None or not same(g, want[n])],
        "names": sorted(grads),
        "losses": None if losses is None else all(map(torch.equal, losses, want_losses)),
        "shared": _shared_storage(pipe),
    }
    trained = zerobubble.Pipeline(
        copy.deepcopy(model), gpt_loss, kind, microbatches=M, mesh=mesh, tied_check_every=1
    )
    trained.set_optimizer(torch.optim.AdamW(trained.parameters(), lr=0.05))
    for _ in range(2):
        trained.step(x, target=y)
    trained.drain()
    trained.tied.check(99)  # raises if the replicas differ across ranks
    out["shared_after"] = _shared_storage(trained)
    dist.destroy_process_group()
    return out


def _shared_storage(pipe: zerobubble.Pipeline) -> bool | None:
    """On a rank holding two replicas of the tie: whether they share one local shard."""
    replicas = [p for g in pipe.tied.groups for p in g.replicas.values()]
    if len(replicas) < 2:
        return None
    ptrs = {p.to_local().data_ptr() if isinstance(p, DTensor) else p.data_ptr() for p in replicas}
    return len(ptrs) == 1


@pytest.mark.parametrize("kind", ["zb-h1", "zbv"])
def test_tied_embeddings_under_tp_are_bitwise_the_reference_and_stay_tied(kind):
    results = launch(job, 4, kind, timeout=300)
    for rank, r in enumerate(results):
        assert r["names"] and r["bad"] == [], (rank, r["bad"])
        assert r["losses"] is not False, rank
    assert sum(r["losses"] is True for r in results) == 2  # the last stage's tp ranks
    held_twice = [r["shared"] for r in results if r["shared"] is not None]
    if kind == "zbv":  # pipeline rank 0 (global ranks 0 and 1) holds stages 0 and 3
        assert held_twice == [True, True]
        assert [r["shared_after"] for r in results if r["shared_after"] is not None] == [
            True,
            True,
        ]
    else:
        assert held_twice == []
