"""Expert parallelism with random ops, with a parameter tied across stages and with
sequence segments, bitwise the one reference (``zerobubble.reference_step(dp=2, ep=2,
seed=..., num_stages=..., cuts=...)``).

One 4-rank gloo launch, pp=2 x dp=2 x ep=2, the MoE GPT with dropout 0.1 and a seed:
zbv for two steps (step 1 draws other masks than step 0); zb-h1 and zbv with the LM head
tied to the token embedding (across ranks, and within pp rank 0's two V stages); seq-zb
with two segments and the tie. Each rank's losses and gradients (after the dp, edp and tie
reductions) are torch.equal the reference's; the reference runs its replicas in threads,
so it is run twice and must agree with itself, and must leave the caller's generator alone.

In the same launch, dualpipev's overlapped F&B pairs over a four-block MoE GPT with dropout,
with activation recompute "stage" and "layers" (``REPEATS`` runs each) and without: a
recomputation in B replays its stage's all-to-alls beside the pair's forward on the other
thread (on the backwards' ep lane, giving up the rank's generator lock while it waits), so
both threads run all-to-alls and draw dropout masks at once; once more with the halves
started in opposite orders on the two ep peers (which deadlocks if a waiting thread keeps
the lock). Losses and gradients bitwise the reference and the run without recompute, every
run.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import zerobubble
from ranks import launch
from zerobubble.models import GPTConfig, gpt_loss
from zerobubble.models.moe import build_moe_gpt
from zerobubble.parallel.mesh import build_mesh
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.overlap import OverlapPair
from zerobubble.schedule.costs import CostSpec

CFG = GPTConfig(
    vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=2, mlp_ratio=2, dropout=0.1
)
M, LOCAL, SEED, CUTS = 4, 4, 11, (0, 3, 8)


def gpt(tied: bool) -> torch.nn.Sequential:
    return build_moe_gpt(dataclasses.replace(CFG, tie_embeddings=tied), num_experts=4, top_k=2)


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: Any) -> torch.Tensor:
    """A sum over the tokens over the batch's count: a segment's share of the batch loss."""
    return F.cross_entropy(out.flatten(0, 1), labels.flatten(), reduction="sum") / num_items


def count(labels: torch.Tensor) -> int:
    return labels.numel()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(0, CFG.vocab_size, (2 * LOCAL, CFG.max_seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# name -> (schedule, tied, steps, segments)
CASES: dict[str, tuple[str, bool, int, bool]] = {
    "dropout-zbv": ("zbv", False, 2, False),
    "tied-zb-h1": ("zb-h1", True, 1, False),
    "tied-zbv": ("zbv", True, 1, False),
    "segments-tied": ("seq-zb", True, 1, True),
}


def job() -> dict[str, list[tuple[list | None, dict[str, torch.Tensor]]]]:
    init_distributed(timeout_s=60)
    mesh = build_mesh(2, 2, ep=2)
    rows = slice(mesh.dp_rank * LOCAL, (mesh.dp_rank + 1) * LOCAL)
    out = {}
    for name, (kind, tied, steps, segments) in CASES.items():
        options = zerobubble.ExecutorOptions(seed=SEED, cuts=CUTS if segments else None)
        sched: Any = zerobubble.generate(kind, 2, M, segments=2) if segments else kind
        loss_fn, count_fn = (token_loss, count) if segments else (gpt_loss, None)
        pipe = zerobubble.Pipeline(
            gpt(tied), loss_fn, sched, microbatches=M, mesh=mesh, options=options,
            count_fn=count_fn,
        )  # fmt: skip
        got = []
        for k in range(steps):
            x, y = batch(k)
            losses = pipe.step(x[rows], target=y[rows])
            pipe.tied.reduce(k)  # collective: the stages' parts of a tie summed (no optimizer)
            grads = {n: p.grad.clone() for n, p in pipe.named_parameters() if p.grad is not None}
            got.append((losses, grads))
            for p in pipe.parameters():
                p.grad = None
        out[name] = got
    out["pairs"] = paired_steps(mesh)
    torch.distributed.destroy_process_group()
    return out


# ---- overlapped pairs with recompute under ep -----------------------------------------------

PAIRED_CFG = dataclasses.replace(CFG, n_layers=4)
RECOMPUTE, REPEATS = ("none", "stage", "layers", "crossed"), 4
""""crossed": recompute "stage" with each pair's halves started in opposite orders on the
two ep peers (:func:`crossed`)."""


def crossed(dp_rank: int) -> Callable[[OverlapPair], None]:
    """An overlap hook that starts the backward (whose replay takes the generator lock) on
    dp rank 0 and the forward on dp rank 1, the other half a moment later, each on a
    thread of its own: each rank's first half then holds its lock and waits at an
    all-to-all for its peer's, whose other half holds the peer's lock. Only a holder that
    gives the lock up while it waits lets the second halves in."""

    def run(pair: OverlapPair) -> None:
        halves = [pair.run_backward, pair.run_forward][:: 1 if dp_rank == 0 else -1]
        errors: list[BaseException] = []

        def guarded(half: Callable[[], None]) -> None:
            try:
                half()
            except BaseException as e:  # re-raised on the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=guarded, args=(h,)) for h in halves]
        threads[0].start()
        time.sleep(0.2)
        threads[1].start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    return run


def paired_schedule() -> zerobubble.Schedule:
    sched = zerobubble.generate("dualpipev", 2, M, overlap=True, costs=CostSpec(a2a=1))
    assert sched.overlaps
    return sched


def paired_steps(mesh: Any) -> dict[str, list[tuple[list | None, dict[str, torch.Tensor]]]]:
    """Each of :data:`RECOMPUTE` under dualpipev's pairs (``REPEATS`` runs, "none" once)."""
    rows = slice(mesh.dp_rank * LOCAL, (mesh.dp_rank + 1) * LOCAL)
    x, y = batch(0)
    out: dict[str, list] = {}
    for recompute in RECOMPUTE:
        runs = []
        for _ in range(1 if recompute == "none" else REPEATS):
            model = build_moe_gpt(PAIRED_CFG, num_experts=4, top_k=2)
            hook = crossed(mesh.dp_rank) if recompute == "crossed" else None
            mode = "stage" if recompute == "crossed" else recompute
            options = zerobubble.ExecutorOptions(seed=SEED, recompute=mode, overlap_fn=hook)
            pipe = zerobubble.Pipeline(
                model, gpt_loss, paired_schedule(), mesh=mesh, options=options
            )
            losses = pipe.step(x[rows], target=y[rows])
            runs.append((losses, {n: p.grad.clone() for n, p in pipe.named_parameters()}))
        out[recompute] = runs
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(job, 4, timeout=240)


def reference(
    name: str, step: int, seed: int = SEED
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    kind, tied, _, segments = CASES[name]
    x, y = batch(step)
    stages = 4 if kind == "zbv" else 2
    extra: dict[str, Any] = {"cuts": CUTS, "count_fn": count} if segments else {}
    return zerobubble.reference_step(
        gpt(tied), token_loss if segments else gpt_loss, x, target=y, microbatches=M, dp=2,
        ep=2, seed=seed, step=step, num_stages=stages, **extra,
    )  # fmt: skip


@pytest.mark.bitwise
@pytest.mark.parametrize("name", list(CASES))
def test_ep_with_dropout_ties_and_segments_is_the_reference_bitwise(results, name):
    for step in range(CASES[name][2]):
        before = torch.get_rng_state()
        want_losses, want = reference(name, step)
        assert torch.equal(torch.get_rng_state(), before)  # the caller's generator untouched
        again_losses, again = reference(name, step)  # the replicas' threads: the same again
        assert all(map(torch.equal, again_losses, want_losses))
        assert again.keys() == want.keys() and all(torch.equal(again[n], want[n]) for n in want)
        held: set[str] = set()
        for rank, out in enumerate(results):
            losses, grads = out[name][step]
            dp_rank = rank % 2
            if losses is not None:
                mine = want_losses[dp_rank * M : (dp_rank + 1) * M]
                assert all(map(torch.equal, losses, mine)), (name, step, rank)
            for n, g in grads.items():
                assert torch.equal(g, want[n]), (name, step, rank, n)
            held |= grads.keys()
        assert held == want.keys(), (name, held ^ want.keys())
        if CASES[name][1]:
            assert "0.tok.weight" in want and f"{CFG.n_layers + 2}.weight" not in want
    other = reference(name, 0, SEED + 1)[0]  # dropout draws: another seed, other losses
    assert not any(map(torch.equal, other, reference(name, 0)[0]))


@pytest.mark.bitwise
def test_pairs_with_recompute_under_ep_are_the_reference_and_the_run_without_bitwise(results):
    """dualpipev's pairs at pp=2 x dp=2 x ep=2 with dropout: recompute "stage" and "layers"
    (and "stage" with the halves crossed) give the reference's losses and gradients, and the
    run's without recompute, every run."""
    x, y = batch(0)
    want_losses, want = zerobubble.reference_step(
        build_moe_gpt(PAIRED_CFG, num_experts=4, top_k=2), gpt_loss, x, target=y,
        microbatches=M, dp=2, ep=2, seed=SEED, num_stages=paired_schedule().num_stages,
    )  # fmt: skip
    for recompute in RECOMPUTE:
        for i in range(1 if recompute == "none" else REPEATS):
            held: set[str] = set()
            for rank, out in enumerate(results):
                losses, grads = out["pairs"][recompute][i]
                _, plain = out["pairs"]["none"][0]
                if losses is not None:
                    mine = want_losses[rank % 2 * M : (rank % 2 + 1) * M]
                    assert all(map(torch.equal, losses, mine)), (recompute, i, rank)
                assert grads.keys() == plain.keys(), (recompute, i, rank)
                bad = [
                    n
                    for n, g in grads.items()
                    if not (torch.equal(g, want[n]) and torch.equal(g, plain[n]))
                ]
                assert not bad, (recompute, i, rank, bad)
                held |= grads.keys()
            assert held == want.keys(), recompute
