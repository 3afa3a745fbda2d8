"""Overlapped F&B pairs on every kind that takes them, under mixture-of-experts blocks, at P = 3.

A pair's halves run at once on two threads. They are always of two stages (the validator
refuses a pair of one stage: its module and weight-gradient store would be shared), so
nothing of a stage is touched by two threads; the process's default random generators,
which a forward seeds and a graph-level split's W replays, are held by one half at a time.

Each paired case runs its step ``REPEATS`` times in one launch (a race shows only
sometimes), once more with the pairs run in sequence by a hook, and is compared bitwise
with :func:`~zerobubble.reference.step.reference_step` over the same microbatches:
losses, loss terms and every gradient; so are cases without pairs (zb-h1, zb-h2, zbv).
Kinds with one stage per device refuse pairs. Expert parallelism (ep = 2) over the same
kinds and families: ``tests/test_hf_ep.py`` (pp = 3 x dp = 2 x ep = 2).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerobubble
from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.models import mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.overlap import OverlapPair
from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule

P, M, REPEATS = 3, 6, 3
A2A = CostSpec(a2a=1)  # the pass pairs where an all-to-all would hide


def paired(kind: str) -> Schedule:
    options = {"chunks": 2} if kind == "interleaved-1f1b" else {}
    sched = generate(kind, P, M, overlap=True, costs=A2A, **options)
    assert sched.overlaps and all(f.stage != b.stage for f, b in sched.overlaps)
    return sched


def in_sequence(pair: OverlapPair) -> None:
    pair.run_forward()
    pair.run_backward()


# ---- the models ---------------------------------------------------------------------------------

SIZES, E, K, T = (6, 8, 3), 4, 2, 3


def our_moe(stages: int) -> nn.Sequential:
    """A MoE block (with its balance term) on every stage but the two ends."""
    return build_moe_mlp(
        SIZES, hidden=16, num_experts=E, top_k=K, blocks=stages - 2, seed=0, balance=0.05
    )


def our_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(12, T, SIZES[0], generator=g), torch.randn(12, T, SIZES[2], generator=g)


def hf_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (6, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}, ids.masked_fill(mask == 0, -100)


def build(name: str, stages: int) -> tuple[list[nn.Module], object, tuple]:
    """``(layers, loss_fn, (inputs, target))`` of model ``name`` cut for ``stages`` stages."""
    if name == "ours":
        return list(our_moe(stages)), mlp_loss, our_batch()
    from zerobubble.interop import hf

    model = hf.tiny_model(name, num_hidden_layers=stages - 2)
    return hf.causal_lm_layers(model), hf.CausalLMLoss(model), hf_batch()


# (kind, model, pairs): a covering design over the kinds, the models and pairs on/off (every
# kind that pairs with two models, every model with pairs, the kinds that cannot pair too),
# not the product; tests/test_hf_ep.py runs dualpipev's pairs on five of these families
CASES = [
    ("zbv", "hf-mixtral", True),
    ("zbv", "ours", True),
    ("dualpipev", "hf-deepseek-v3", True),
    ("dualpipev", "hf-qwen3-moe", True),
    ("interleaved-1f1b", "hf-olmoe", True),
    ("interleaved-1f1b", "hf-qwen2-moe", True),
    ("zb-h1", "hf-olmoe", False),
    ("zb-h2", "hf-qwen2-moe", False),
    ("zbv", "hf-deepseek-v3", False),
]


def schedule(kind: str, pairs: bool) -> Schedule:
    return paired(kind) if pairs else generate(kind, P, M)


def run_cases(cases: list[tuple[str, str, bool]]) -> dict:
    """The ranks' part of both tests below, in one launch: ``cases``, then :func:`noisy_steps`."""
    init_distributed(timeout_s=120)
    out: dict = {}
    for kind, name, pairs in cases:
        sched = schedule(kind, pairs)
        runs = []
        for hook in [None] * REPEATS + [in_sequence] if pairs else [None]:
            layers, loss_fn, (x, y) = build(name, sched.num_stages)
            pipe = zerobubble.Pipeline(
                layers, loss_fn, sched, options=ExecutorOptions(overlap_fn=hook)
            )
            terms: dict = {}
            losses = pipe.step(x, target=y, terms=terms)
            grads = {n: q.grad.clone() for n, q in pipe.named_parameters() if q.grad is not None}
            runs.append((losses, terms, grads))
        out[kind, name, pairs] = runs
    out["noisy"] = noisy_steps()
    out["recomputed"] = recomputed_steps()
    torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return launch(run_cases, P, CASES, timeout=600)


@pytest.mark.bitwise
def test_pairs_on_every_kind_are_bitwise_the_reference_every_time(ranks):
    results = ranks
    for kind, name, pairs in CASES:
        stages = schedule(kind, pairs).num_stages
        layers, loss_fn, (x, y) = build(name, stages)
        want_terms: dict = {}
        want_losses, want_grads = reference_step(layers, loss_fn, x, y, M, terms=want_terms)
        case = (kind, name, pairs)
        for i in range(len(results[0][case])):
            runs = [r[case][i] for r in results]
            last = [(losses, terms) for losses, terms, _ in runs if losses is not None]
            assert len(last) == 1, case
            losses, terms = last[0]
            assert all(map(torch.equal, losses, want_losses)), (case, i)
            assert terms.keys() == want_terms.keys()
            for term, values in terms.items():
                assert all(map(torch.equal, values, want_terms[term])), (case, i, term)
            grads = {n: g for _, _, gr in runs for n, g in gr.items()}
            assert grads.keys() == {n for n, g in want_grads.items() if g is not None}
            bad = [n for n, g in grads.items() if not torch.equal(g, want_grads[n])]
            assert not bad, (case, i, bad)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2", "1f1b"])
def test_kinds_with_one_stage_per_device_refuse_pairs(kind):
    with pytest.raises(ValueError, match="places one stage per device"):
        generate(kind, P, M, overlap=True, costs=A2A)


# ---- a forward's draws beside a W that replays draws -------------------------------------------


class NoisyScale(nn.Module):
    """A per-feature gain (a bare parameter: the B/W split gives the module its graph-level
    split, whose W replays the forward) between two dropouts, with a long computation (which
    releases the GIL) between the draws: a race on the generator would land there."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.drop = nn.Dropout(0.5)
        self.register_buffer("work", torch.ones(160, 160) / 160, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(x * self.gain)
        w = self.work
        for _ in range(6):
            w = w @ self.work  # no effect on the output; the other thread runs meanwhile
        return self.drop(h) + 0 * w.sum()


def noisy_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(2 * P):
        out += [nn.Linear(8, 8), NoisyScale(8)]
    return out


def noisy_batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)


def noisy_steps() -> list:
    """dualpipev's pairs over :func:`noisy_layers`, ``REPEATS`` times (in :func:`run_cases`)."""
    sched = generate("dualpipev", P, M, overlap=True)
    out = []
    for _ in range(REPEATS):
        pipe = zerobubble.Pipeline(noisy_layers(), mlp_loss, sched)
        x, y = noisy_batch()
        losses = pipe.step(x, target=y)
        out.append((losses, {n: q.grad.clone() for n, q in pipe.named_parameters()}))
    return out


@pytest.mark.bitwise
def test_a_forward_that_draws_beside_a_w_that_replays_draws_is_bitwise_the_reference(ranks):
    """dualpipev's pairs put F (dropout) beside BW, whose W replays a graph-split module's
    forward from its generator state: both use the process's default generator, which the
    rank's forward holds, so the replay waits. Bitwise the reference, every run."""
    results = [r["noisy"] for r in ranks]
    x, y = noisy_batch()
    want_losses, want_grads = reference_step(
        noisy_layers(), mlp_loss, x, target=y, microbatches=M, seed=0, num_stages=2 * P
    )
    for i in range(REPEATS):
        losses = next(r[i][0] for r in results if r[i][0] is not None)
        assert all(map(torch.equal, losses, want_losses)), i
        grads = {n: g for r in results for n, g in r[i][1].items()}
        assert grads.keys() == want_grads.keys()
        assert all(torch.equal(g, want_grads[n]) for n, g in grads.items()), i


# ---- recompute in the pairs: a backward's replay beside a forward ------------------------------


class NoisyLinear(nn.Module):
    """A linear layer between two dropouts with a long computation between the draws (as
    :class:`NoisyScale`), its parameters in a child (so "layers" recompute checkpoints it)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("work", torch.ones(160, 160) / 160, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.lin(x))
        w = self.work
        for _ in range(6):
            w = w @ self.work
        return self.drop(h) + 0 * w.sum()


def moe_noisy_layers() -> list[nn.Module]:
    """Per stage of 2P, a MoE model's layer (its ends, or a MoE block) then a NoisyLinear."""
    moe = build_moe_mlp((8, 8, 8), hidden=16, num_experts=E, top_k=K, blocks=2 * P - 2, seed=0)
    torch.manual_seed(1)
    return [x for layer in moe for x in (layer, NoisyLinear(8))]


RECOMPUTED = [(kind, rc) for kind in ("zbv", "dualpipev") for rc in ("none", "stage", "layers")]


def recomputed_steps() -> dict:
    """Each of :data:`RECOMPUTED` ``REPEATS`` times, without recompute once (in
    :func:`run_cases`)."""
    out: dict = {}
    for kind, recompute in RECOMPUTED:
        sched = paired(kind)
        runs = []
        for _ in range(1 if recompute == "none" else REPEATS):
            options = ExecutorOptions(recompute=recompute)
            pipe = zerobubble.Pipeline(moe_noisy_layers(), mlp_loss, sched, options=options)
            x, y = noisy_batch()
            losses = pipe.step(x, target=y)
            runs.append((losses, {n: q.grad.clone() for n, q in pipe.named_parameters()}))
        out[kind, recompute] = runs
    return out


@pytest.mark.bitwise
def test_recompute_in_pairs_is_bitwise_the_reference_and_the_run_without_it(ranks):
    """zbv's and dualpipev's pairs over MoE blocks and dropout, recompute "stage" and
    "layers": a backward's replay draws F's numbers again while the pair's forward draws its
    own on the other thread (both hold the rank's generators only under its lock). Losses
    and every gradient bitwise the reference, and the run without recompute, every run."""
    x, y = noisy_batch()
    want_losses, want_grads = reference_step(
        moe_noisy_layers(), mlp_loss, x, target=y, microbatches=M, seed=0, num_stages=2 * P
    )
    for kind, recompute in RECOMPUTED:
        for i in range(1 if recompute == "none" else REPEATS):
            case = (kind, recompute, i)
            runs = [r["recomputed"][kind, recompute][i] for r in ranks]
            plain = [r["recomputed"][kind, "none"][0] for r in ranks]
            losses = next(losses for losses, _ in runs if losses is not None)
            assert all(map(torch.equal, losses, want_losses)), case
            grads = {n: g for _, gr in runs for n, g in gr.items()}
            without = {n: g for _, gr in plain for n, g in gr.items()}
            assert grads.keys() == want_grads.keys() == without.keys(), case
            bad = [
                n
                for n, g in grads.items()
                if not (torch.equal(g, want_grads[n]) and torch.equal(g, without[n]))
            ]
            assert not bad, (case, bad)
