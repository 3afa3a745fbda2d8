"""The composition matrix: every pair of parallelism features runs bitwise, or is refused.

:mod:`zerobubble.composition` states, for every pair of features, whether it composes.
This module checks that statement on gloo ranks with a covering design: a few jobs, each
switching on many features at once, so that every pair the table accepts is on together in
some job (a pure test checks the design covers them all). Each job trains one step of a small
GPT (MoE blocks where ep is on) and must equal :func:`zerobubble.reference_step` with the
job's options bitwise: the losses and every gradient, gathered whole. Each refused pair is tried
on its own and must raise the table's reason on every rank. Jobs without dp or tp run at
P=4, the others at P=2; the kinds cycle through looped and V placements.

The jobs run in two launches (4 and 8 ranks), each building its meshes in turn.
"""

from __future__ import annotations

import copy
from itertools import combinations
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import zerobubble
from ranks import launch
from zerobubble import composition
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.models.moe import MoEGPTBlock
from zerobubble.parallel.loss import cross_entropy, takes_sharded_logits
from zerobubble.schedule.costs import CostSpec

pytestmark = pytest.mark.slow

IGNORE, T, VOCAB = -100, 8, 16
MESH = frozenset({"dp", "fsdp", "ep", "tp", "sp", "cp"})
"""The features that shape the mesh (the others change what each stage runs)."""
KINDS = ("zb-h1", "zbv", "interleaved-1f1b", "1f1b")
A2A = CostSpec(a2a=1)
"""Costs under which overlapped pairs pay (they hide an all-to-all)."""


def accepted_pairs() -> list[tuple[str, str]]:
    return [c.pair for c in composition.CELLS if c.composes]


def design() -> list[frozenset[str]]:
    """Jobs covering every accepted pair: greedily, each job starts from the first pair no job
    covers yet and takes, in table order, every further feature that keeps it accepted, fits
    8 ranks (two of the dp, tp and cp dims at most) and covers a new pair. Pairs without a
    mesh feature first, in jobs without one (run at P=4)."""
    todo = accepted_pairs()
    jobs: list[frozenset[str]] = []
    for local in (True, False):
        pool = [f for f in composition.FEATURES if not (local and f in MESH)]
        while want := [p for p in todo if not local or not set(p) & MESH]:
            job = set(want[0])
            for f in pool:
                more = composition.closure(job | {f})
                new = any(set(p) <= more and p in todo for p in want)
                fits = world(frozenset(more)) <= 8
                if f not in job and new and fits and composition.refusal(more) is None:
                    job = more
            covered = {p for p in todo if set(p) <= job}
            todo = [p for p in todo if p not in covered]
            jobs.append(frozenset(job))
    return jobs


def refused_jobs() -> list[tuple[frozenset[str], composition.Cell]]:
    return [
        (frozenset(composition.closure(c.pair)), c)
        for c in (*composition.CELLS, *composition.TRIPLES)
        if not c.composes
    ]


def sizes(job: frozenset[str]) -> tuple[int, int, int]:
    """The job's dp, tp and cp sizes (2 where the job uses the dimension)."""
    two = [2 if job & dims else 1 for dims in ({"dp", "fsdp", "ep"}, {"tp", "sp"}, {"cp"})]
    return two[0], two[1], two[2]


def world(job: frozenset[str]) -> int:
    dp, tp, cp = sizes(job)
    return 4 if dp * tp * cp == 1 else 2 * dp * tp * cp


@takes_sharded_logits
def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: Any) -> torch.Tensor:
    return cross_entropy(out, labels, reduction="sum") / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def schedule(job: frozenset[str], index: int, pp: int) -> zerobubble.Schedule:
    """The job's schedule of ``2 * pp`` microbatches (dualpipev pairs need that many)."""
    m = 2 * pp
    if "segments" in job and "overlap" in job:
        return zerobubble.generate("seq-zbv", pp, m, segments=2, overlap=True, costs=A2A)
    if "segments" in job:
        return zerobubble.generate(("seq-zb", "seq-zbv")[index % 2], pp, m, segments=2)
    if "overlap" in job:
        return zerobubble.generate("dualpipev", pp, m, overlap=True, costs=A2A)
    kind = KINDS[index % len(KINDS)]
    return zerobubble.generate(kind, pp, m, chunks=2 if kind == "interleaved-1f1b" else None)


def model(job: frozenset[str], blocks: int) -> list[nn.Module]:
    """Our GPT with ``blocks`` blocks (every other one a MoE block of 4 experts, top 2, under
    ep: left whole under tp, the others tp-sharded), the embedding and the head tied where
    ``ties`` is on, dropout where ``random`` is."""
    cfg = GPTConfig(
        vocab_size=VOCAB, max_seq_len=T, d_model=8, n_heads=2, n_layers=blocks, mlp_ratio=2,
        tie_embeddings="ties" in job, dropout=0.1 if "random" in job else 0.0,
    )  # fmt: skip
    layers = list(build_gpt(cfg))
    if "ep" in job:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(3)
            for i in range(1, blocks + 1, 2):
                layers[i] = MoEGPTBlock(cfg, 4, 2)
    return layers


def batch(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, VOCAB, (rows, T), generator=g)
    y = torch.randint(0, VOCAB, (rows, T), generator=g)
    y[::2, -3:] = IGNORE
    return x, y


def whole(g: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient gathered whole (collective over a DTensor's mesh)."""
    return g.full_tensor() if isinstance(g, DTensor) else g


def run(job: frozenset[str], index: int) -> dict[str, Any]:
    """One job on this launch's ranks: the pipeline's step and the reference's, compared."""
    dp, tp, cp = sizes(job)
    pp = dist.get_world_size() // (dp * tp * cp)
    mesh = zerobubble.build_mesh(
        pp, dp, fsdp="fsdp" in job, ep=2 if "ep" in job else 1, tp=tp,
        sequence_parallel="sp" in job, cp=cp,
    )  # fmt: skip
    sched = schedule(job, index, pp)
    layers = model(job, sched.num_stages)
    recompute = "none" if "recompute" not in job else ("layers", "stage")[index % 2]
    cuts = (0, T // 2, T) if "segments" in job else None
    options = zerobubble.ExecutorOptions(seed=5, recompute=recompute, cuts=cuts)
    m = sched.num_microbatches
    x, y = batch(dp * m)
    pipe = zerobubble.Pipeline(
        copy.deepcopy(layers), token_loss, sched, mesh=mesh, options=options, count_fn=count
    )
    mine = slice(mesh.dp_rank * m, (mesh.dp_rank + 1) * m)
    losses = pipe.step(x[mine], target=y[mine])
    pipe.tied.reduce(0)  # without an optimizer a tie's stages keep their parts until asked
    want_losses, want = zerobubble.reference_step(
        layers, token_loss, x, target=y, microbatches=m, dp=dp, ep=2 if "ep" in job else 1,
        cuts=cuts, tp_mesh=mesh.tp_mesh, sequence_parallel="sp" in job, fsdp="fsdp" in job,
        seed=5 if "random" in job else None, cp=cp, cp_group=mesh.cp_group,
        num_stages=sched.num_stages, count_fn=count,
    )  # fmt: skip
    got = dict(pipe.named_parameters())
    bad = []
    for n in sorted(got):
        a, b = whole(got[n].grad), whole(want[n])
        if not torch.equal(a, b):
            bad.append((n, None if a is None or b is None else float((a - b).abs().max())))
    same = None
    if losses is not None:  # under cp each cp rank's share, cp-rank-major in each replica
        at = (mesh.dp_rank * cp + mesh.cp_rank) * m
        theirs = want_losses[at : at + m]
        same = all(map(torch.equal, losses, theirs))
    return {"names": sorted(got), "bad": bad, "losses": same, "pairs": len(sched.overlaps)}


def ranks(jobs: list[tuple[int, frozenset[str]]], refused: list[frozenset[str]]) -> dict:
    zerobubble.init_distributed(timeout_s=60)
    out: dict[str, Any] = {"jobs": [run(job, i) for i, job in jobs], "refused": []}
    for job in refused:
        try:
            run(job, 0)
            out["refused"].append("")
        except ValueError as e:
            out["refused"].append(str(e))
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    jobs = list(enumerate(design()))
    refused = refused_jobs()
    out = {}
    for size in (4, 8):
        mine = [(i, j) for i, j in jobs if world(j) == size]
        theirs = [j for j, _ in refused if world(j) == size]
        out[size] = launch(ranks, size, mine, theirs, timeout=600)
    return out


def test_the_table_has_every_pair_once():
    pairs = sorted(c.pair for c in composition.CELLS)
    assert pairs == sorted(combinations(composition.FEATURES, 2))


def test_the_design_covers_every_accepted_pair():
    jobs = design()
    for pair in accepted_pairs():
        assert any(set(pair) <= job for job in jobs), pair
    assert all(composition.refusal(job) is None for job in jobs)


def test_every_accepted_job_is_bitwise_the_composed_reference(results):
    jobs = list(enumerate(design()))
    for size, per_rank in results.items():
        mine = [j for _, j in jobs if world(j) == size]
        for rank, out in enumerate(per_rank):
            for job, got in zip(mine, out["jobs"], strict=True):
                assert got["names"] and not got["bad"], (sorted(job), rank, got["bad"])
                assert got["losses"] is not False, (sorted(job), rank)
                if "overlap" in job:
                    assert got["pairs"], sorted(job)


def test_every_refused_pair_is_refused_on_every_rank_with_its_reason(results):
    """Each refused set tried alone (with what it implies: sp brings tp, so it raises the
    table's first refusal inside the set), on every rank, naming the reason and the fix."""
    for size, per_rank in results.items():
        mine = [j for j, _ in refused_jobs() if world(j) == size]
        for out in per_rank:
            for job, message in zip(mine, out["refused"], strict=True):
                c = composition.refusal(job)
                assert c is not None and c.why in message and c.fix in message, (job, message)


def test_the_docs_table_is_the_composition_table():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "scale.md").read_text()
    assert composition.markdown() in text
