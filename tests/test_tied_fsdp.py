"""Tied embeddings with FSDP: pp2 x dp2 on gloo (4 ranks, one launch for both kinds).

Our GPT with ``tie_embeddings=True`` (the token table and the LM head one Parameter),
``build_mesh(2, 2, fsdp=True)``. Every holder stage's replica is sharded alike over dp
(``Shard(0)``, a 17-row table: FSDP pads rank 1's shard), so the tie's reduction adds the
holder stages' reduce-scattered shards. Under zb-h1 the tie spans pipeline ranks 0 and 1;
under zbv (a V: stages 0 and 3 on pipeline rank 0) one rank holds both replicas, which
keep one sharded memory. Per kind:

* one step's losses and gradients, gathered: bitwise :func:`zerobubble.reference_step`
  with ``dp=2`` and the pipeline's ``num_stages`` (each stage its own replica, the tie's
  gradients the dp sums added in stage order), and the state dict lists the tie under its
  first name only;
* two AdamW steps (no clipping), the replicas compared every step (``tied_check_every=1``):
  the parameters and AdamW state, gathered, bitwise the same job with ``fsdp=False``; the
  first step's global norm, FSDP's and the DDP-style path's, within ``NORM_TOL`` of the
  reference gradients' norm with the tie counted once (twice would be far outside).
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

CFG = GPTConfig(vocab_size=17, max_seq_len=8, d_model=8, n_heads=2, n_layers=2, tie_embeddings=True)
M, STEPS = 2, 2
KINDS = ("zb-h1", "zbv")
TIE = "0.tok.weight"
NORM_TOL = 1e-6
"""The reported global norm against the reference's: rounding (shard norms combined)."""


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of step ``k`` (both replicas' rows)."""
    gen = torch.Generator().manual_seed(5 + k)
    return tuple(torch.randint(0, 17, (8, 8), generator=gen) for _ in range(2))  # type: ignore[return-value]


def mine(x: torch.Tensor, mesh: zerobubble.PipelineMesh) -> torch.Tensor:
    return x.tensor_split(2)[mesh.dp_rank]


def train(model, kind: str, mesh, fsdp: bool) -> tuple[dict, float]:
    pipe = zerobubble.Pipeline(
        copy.deepcopy(model), gpt_loss, kind, microbatches=M, mesh=mesh.with_fsdp(fsdp),
        tied_check_every=1,
    )  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.05)
    pipe.set_optimizer(opt)
    norms = []
    for k in range(STEPS):
        x, y = batch(k)
        pipe.step(mine(x, mesh), target=mine(y, mesh))
        assert pipe.trainer is not None and pipe.trainer.last_commit is not None
        norms.append(pipe.trainer.last_commit.total_norm)
    pipe.drain()
    pipe.tied.check(99)  # raises if the replicas differ across ranks
    state = {
        n: [full(p), *(full(v) for _, v in sorted(opt.state[p].items()))]
        for n, p in pipe.named_parameters()
    }
    return state, norms[0]


def shared_shard(pipe: zerobubble.Pipeline) -> bool | None:
    """On a rank holding two replicas of the tie: whether they share one local shard."""
    replicas = [p for g in pipe.tied.groups for p in g.replicas.values()]
    if len(replicas) < 2:
        return None
    return len({p.to_local().untyped_storage().data_ptr() for p in replicas}) == 1


def job(kinds: tuple[str, ...]) -> dict:
    zerobubble.init_distributed(timeout_s=60)
    mesh = zerobubble.build_mesh(2, 2, fsdp=True)
    torch.manual_seed(0)
    model = build_gpt(CFG)
    out: dict = {}
    for kind in kinds:
        pipe = zerobubble.Pipeline(copy.deepcopy(model), gpt_loss, kind, microbatches=M, mesh=mesh)
        x, y = batch(0)
        losses = pipe.step(mine(x, mesh), target=mine(y, mesh))
        pipe.tied.reduce(0)  # without an optimizer the replicas hold their own stage's part
        want_losses, want = zerobubble.reference_step(
            model, gpt_loss, x, target=y, microbatches=M, dp=2,
            num_stages=pipe.schedule.num_stages,
        )  # fmt: skip
        grads = {n: p.grad for n, p in pipe.named_parameters()}
        sharded = all(isinstance(g, DTensor) for g in grads.values() if g is not None)
        r = mesh.dp_rank * M
        got = {
            "bad": [n for n, g in grads.items() if g is None or not torch.equal(full(g), want[n])],
            "names": sorted(grads),
            "sharded": sharded,
            "losses": None
            if losses is None
            else all(map(torch.equal, losses, want_losses[r : r + M])),
            "shared": shared_shard(pipe),
            "state_keys": sorted(pipe.state_dict()),
        }
        (fsdp, norm), (ddp, ddp_norm) = (
            train(model, kind, mesh, True),
            train(model, kind, mesh, False),
        )
        # the step's global norm, the tie counted once (the reference lists it once)
        want_norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in want.values() if g is not None])
        ).item()
        got["norms"] = [abs(n - want_norm) / want_norm for n in (norm, ddp_norm)]
        tie = torch.linalg.vector_norm(want[TIE]).item()
        got["twice"] = abs((want_norm**2 + tie**2) ** 0.5 - want_norm) / want_norm
        got["trained"] = sorted(fsdp) == sorted(ddp) and all(
            all(map(torch.equal, fsdp[n], ddp[n])) and len(fsdp[n]) == 4 for n in fsdp
        )
        got["trained_names"] = sorted(fsdp)
        out[kind] = got
        dist.barrier()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(job, 4, KINDS, timeout=400)


@pytest.mark.parametrize("kind", KINDS)
def test_tied_embeddings_under_fsdp_are_bitwise_the_reference_and_the_ddp_job(results, kind):
    for rank, everything in enumerate(results):
        r = everything[kind]
        assert r["names"] and r["bad"] == [], (rank, r["bad"])
        assert r["sharded"], rank
        assert r["losses"] is not False, rank
        assert r["trained"], rank
        assert (TIE in r["state_keys"]) == (TIE in r["names"]) == (TIE in r["trained_names"])
        assert "4.weight" not in r["state_keys"] and "4.weight" not in r["names"], rank
    for r in results:  # FSDP's norm combines shard norms: rounding apart, within NORM_TOL
        assert max(r[kind]["norms"]) <= NORM_TOL < r[kind]["twice"], r[kind]["norms"]
    assert sum(r[kind]["losses"] is True for r in results) == 2  # the last stage's dp ranks
    held_twice = [r[kind]["shared"] for r in results if r[kind]["shared"] is not None]
    assert held_twice == ([True, True] if kind == "zbv" else [])
    # the tie under its first name on every rank holding a replica: zbv's pipeline rank 0
    assert sum(TIE in r[kind]["names"] for r in results) == (2 if kind == "zbv" else 4)
