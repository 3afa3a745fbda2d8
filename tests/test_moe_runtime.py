"""Our MoE block in pipelines: its load-balancing loss term on several stages at P = 2 and
P = 3 under zb-h1, zbv and dualpipev (bitwise against :func:`reference_step`), and
pp = 2 x ep = 2 under dualpipev with and without the overlapped pairs (bitwise against
each other and against :func:`ep_reference_step`)."""

from __future__ import annotations

import pytest
import torch

import zerobubble
from ranks import launch
from zerobubble.models import mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.parallel.mesh import build_mesh
from zerobubble.reference.ep import ep_reference_step
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.loss_terms import collect_loss_terms
from zerobubble.schedule.generators import generate

SIZES, E, K, M, LOCAL, T = (6, 8, 3), 4, 2, 6, 12, 3
BALANCE = 0.05


def model(blocks: int) -> torch.nn.Sequential:
    return build_moe_mlp(
        SIZES, hidden=16, num_experts=E, top_k=K, blocks=blocks, seed=0, balance=BALANCE
    )


def batch(rows: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, T, SIZES[0], generator=g), torch.randn(rows, T, SIZES[2], generator=g)


def test_the_balance_term_is_switchs_load_balancing_loss():
    """One MoE, one forward: the term is ``balance * E * sum_e f_e P_e`` computed by hand."""
    layers = model(1)
    moe = layers[1].moe
    x = layers[1].norm(layers[0](batch(4)[0])).reshape(-1, SIZES[1])
    with collect_loss_terms(layers) as found:
        layers(batch(4)[0])
    probs = moe.router(x).softmax(-1)
    chosen = probs.topk(K, dim=-1).indices
    share = torch.bincount(chosen.reshape(-1), minlength=E).float() / chosen.numel()
    want = (share * probs.mean(0)).sum() * (BALANCE * E)
    assert list(found) == ["router_balance"]
    assert torch.equal(found["router_balance"], want)
    assert 0 < float(found["router_balance"].detach()) < 1


# ---- P = 2 and P = 3 under three kinds ----------------------------------------------------------

KINDS = ("zb-h1", "zbv", "dualpipev")


def pipeline_steps(p: int) -> dict:
    init_distributed()
    out = {}
    for kind in KINDS:
        sched = generate(kind, p, M, overlap=kind == "dualpipev")
        pipe = zerobubble.Pipeline(model(2 * p - 2), mlp_loss, sched)
        terms: dict = {}
        x, y = batch(LOCAL)
        losses = pipe.step(x, target=y, terms=terms)
        out[kind] = {
            "losses": losses,
            "terms": terms,
            "grads": {n: q.grad.clone() for n, q in pipe.named_parameters()},
        }
    return out


@pytest.mark.bitwise
@pytest.mark.parametrize("p", [2, 3])
def test_balance_terms_on_every_stage_train_bitwise_the_reference(p):
    """2P - 2 MoE blocks (one per stage of the V placements, between two Linears): losses,
    each microbatch's term and every gradient are bitwise those of one process over the same
    microbatches, under zb-h1, zbv and dualpipev (its F&B pairs run at once)."""
    results = launch(pipeline_steps, p, p, timeout=240)
    terms_want: dict = {}
    want_losses, want_grads = reference_step(
        list(model(2 * p - 2)), mlp_loss, *batch(LOCAL), M, terms=terms_want
    )
    assert set(terms_want) == {"router_balance"}
    for kind in KINDS:
        last = [r[kind] for r in results if r[kind]["losses"] is not None]
        assert len(last) == 1, kind
        assert all(map(torch.equal, last[0]["losses"], want_losses)), kind
        got_terms = last[0]["terms"]["router_balance"]
        assert all(map(torch.equal, got_terms, terms_want["router_balance"])), kind
        grads = {n: g for r in results for n, g in r[kind]["grads"].items()}
        assert grads.keys() == want_grads.keys()
        assert all(torch.equal(g, want_grads[n]) for n, g in grads.items()), kind


# ---- pp = 2 x ep = 2, overlapped pairs on and off ------------------------------------------------


def ep_steps() -> dict:
    init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    x, y = batch(2 * LOCAL, seed=1)
    part = slice(mesh.dp_rank * LOCAL, (mesh.dp_rank + 1) * LOCAL)
    out = {}
    for overlap in (True, False):
        sched = generate("dualpipev", 2, M, overlap=overlap)
        pipe = zerobubble.Pipeline(model(2), mlp_loss, sched, mesh=mesh)
        losses = pipe.step(x[part], target=y[part])
        out[overlap] = {
            "losses": losses,
            "grads": {n: q.grad.clone() for n, q in pipe.named_parameters()},
            "paired": len(pipe.schedule.overlaps),
        }
    out["dp_rank"] = mesh.dp_rank
    return out


@pytest.mark.bitwise
def test_pp2_ep2_dualpipev_with_and_without_overlap_is_bitwise_the_reference():
    """4 ranks, 2 MoE blocks with balance terms, experts sharded over the 2 dp replicas:
    dualpipev with its pairs running at once and without pairs give the same bits, losses and
    every reduced gradient, and those of the single-process pp x ep reference."""
    results = launch(ep_steps, 4, timeout=240)
    x, y = batch(2 * LOCAL, seed=1)
    parts = [(x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]) for r in range(2)]
    want_losses, want_grads = ep_reference_step(model(2), mlp_loss, parts, M, 2)
    assert all(r[True]["paired"] > 0 and r[False]["paired"] == 0 for r in results)
    for r in results:
        on, off = r[True], r[False]
        assert (on["losses"] is None) == (off["losses"] is None)
        if on["losses"] is not None:
            assert all(map(torch.equal, on["losses"], off["losses"]))
            assert all(map(torch.equal, on["losses"], want_losses[r["dp_rank"]]))
        assert on["grads"].keys() == off["grads"].keys()
        for n, g in on["grads"].items():
            assert torch.equal(g, off["grads"][n]), n
            assert torch.equal(g, want_grads[n]), n


# ---- DeepSeek-V3's MoE (shared experts, bias-balanced sigmoid routing) ---------------------------

DS_M = 4


def ds_batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (8, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # padding on one row: its labels are ignored
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask}, labels


def test_deepseek_v3_layers_compute_the_models_own_loss():
    """Its loss is cross-entropy alone (no auxiliary loss): the layers' loss with the batch's
    token count is HF's within 1e-6 relative (another summation order)."""
    from zerobubble.interop import hf

    model = hf.tiny_model("hf-deepseek-v3")
    layers = hf.causal_lm_layers(model)  # check_layers: a forward of both, compared
    inputs, labels = ds_batch()
    own = model(**inputs, labels=labels)
    loss_fn = hf.CausalLMLoss(model)
    x = layers[0](inputs)
    for layer in layers[1:]:
        x = layer(x)
    got = loss_fn(x, labels, loss_fn.count_fn(labels))
    assert [type(b.layer.mlp).__name__ for b in layers[1:-1]] == [
        "DeepseekV3MLP",
        "DeepseekV3MoE",
        "DeepseekV3MoE",
    ]
    torch.testing.assert_close(got, own.loss, rtol=1e-6, atol=0)


def deepseek_job(refs: tuple) -> list[str]:
    from zerobubble.interop import hf

    init_distributed()
    p = torch.distributed.get_world_size()
    inputs, labels = ds_batch()
    bad = []
    for kind in ("zb-h1", "dualpipev"):
        model = hf.tiny_model("hf-deepseek-v3")
        sched = generate(kind, p, DS_M, overlap=kind == "dualpipev")
        pipe = zerobubble.Pipeline(hf.causal_lm_layers(model), hf.CausalLMLoss(model), sched)
        losses = pipe.step(inputs, target=labels)
        if losses is not None and not all(map(torch.equal, losses, refs[0])):
            bad.append(f"{kind}: losses {losses} != {refs[0]}")
        for name, param in pipe.named_parameters():
            if param.grad is None or not torch.equal(param.grad, refs[1][name]):
                bad.append(f"{kind}: gradient of {name} differs")
    torch.distributed.destroy_process_group()
    return bad


@pytest.mark.bitwise
def test_deepseek_v3_trains_bitwise_the_reference_under_zb_h1_and_overlapped_dualpipev():
    """P = 2: a dense block, then two MoE blocks (a shared expert, routed experts, the
    routing bias); losses and every gradient bitwise those of one process over the same
    microbatches, under zb-h1 and under dualpipev with its pairs running at once."""
    from zerobubble.interop import hf

    model = hf.tiny_model("hf-deepseek-v3")
    inputs, labels = ds_batch()
    refs = reference_step(
        hf.causal_lm_layers(model),
        hf.CausalLMLoss(model),
        inputs,
        target=labels,
        microbatches=DS_M,
    )
    assert [b for r in launch(deepseek_job, 2, refs, timeout=240) for b in r] == []
