"""Loss terms that layers add in their forward (issue 24 item 1): the objective is the main
loss plus every term, each stage back-propagates its own terms, and a pipeline reproduces
the single-process reference bitwise (toy layers here, HF mixture-of-experts below)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerobubble
from generated import generated
from ranks import launch
from test_chunk import run_order, sequential_order
from zerobubble.reference.step import reference_step
from zerobubble.runtime.loss_terms import add_loss_term, collect_loss_terms, objective
from zerobubble.runtime.split import WeightGradStore
from zerobubble.runtime.stage import StageChunk


class Termed(nn.Module):
    """A layer that adds ``name``: ``coef * mean(h ** 2)`` of its output (None: no term)."""

    def __init__(self, width: int, name: str | None, coef: float = 0.25) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.name, self.coef = name, coef

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.name is not None:
            add_loss_term(self, self.name, self.coef * h.pow(2).mean())
        return h


def toy(names: list[str | None], width: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(Termed(width, n) for n in names))


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).pow(2).mean()


def data(n: int = 6, width: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


# ---- the API ------------------------------------------------------------------------------------


def test_a_term_outside_a_collecting_forward_names_the_layer_the_term_and_the_fix():
    layer = Termed(4, "aux")
    with pytest.raises(
        ValueError, match=r"Termed added loss term 'aux' outside .*collect_loss_terms"
    ):
        layer(torch.zeros(2, 4))


def test_a_term_must_be_a_float_scalar():
    layer = Termed(4, None)
    with collect_loss_terms(layer), pytest.raises(ValueError, match=r"'v' as \(2,\).*scalar"):
        add_loss_term(layer, "v", torch.zeros(2))
    with collect_loss_terms(layer), pytest.raises(ValueError, match="'v' as int"):
        add_loss_term(layer, "v", 3)  # type: ignore[arg-type]


def test_collect_sums_each_name_in_layer_order_and_leaves_no_sink_behind():
    model = toy(["a", "b", "a", None])
    x, _ = data()
    with collect_loss_terms(model) as terms:
        h = x
        parts = []
        for layer in model:
            h = layer(h)
            parts.append(layer.coef * h.pow(2).mean())
    assert list(terms) == ["a", "b"]
    assert torch.equal(terms["a"], parts[0] + parts[2]) and torch.equal(terms["b"], parts[1])
    loss = mse(h, x)
    assert torch.equal(objective(loss, terms), loss + terms["a"] + terms["b"])
    with pytest.raises(ValueError, match="outside"):
        model(x)


# ---- one process: chunks ------------------------------------------------------------------------

NAMES = ["a", None, "b", "a", None, "a"]


def chunks_of(model: nn.Sequential, cuts: list[int], **kw) -> list[StageChunk]:
    bounds = [*cuts, len(model)]
    n = len(cuts)
    store = WeightGradStore()
    return [
        StageChunk(
            model[bounds[s] : bounds[s + 1]],
            s,
            n,
            loss_fn=mse if s == n - 1 else None,
            store=store,
            **kw,
        )
        for s in range(n)
    ]


@pytest.mark.parametrize("recompute", ["none", "stage"])
def test_chunks_train_the_loss_plus_every_term_bitwise_as_plain_autograd(recompute):
    model = toy(NAMES)
    ref = copy.deepcopy(model)
    x, y = data()
    terms: dict[str, list[torch.Tensor]] = {}
    ref_losses, ref_grads = reference_step(ref, mse, x, target=y, microbatches=2, terms=terms)
    # The reference is plain autograd of (loss + a + b) * n_j / N per microbatch.
    plain = copy.deepcopy(model)
    for j, (xj, yj) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        with collect_loss_terms(plain) as found:
            loss = mse(plain(xj), yj) + found["a"] + found["b"]
        assert torch.equal(loss, ref_losses[j])
        assert torch.equal(found["a"], terms["a"][j]) and torch.equal(found["b"], terms["b"][j])
        (loss * 0.5).backward()
    for name, p in plain.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name
    # Five stages; stages 1 and 3 add no term and pass the sums on (with recompute="stage"
    # the sums are outputs of the checkpointed region and its replay adds nothing twice).
    chunks = chunks_of(model, [0, 1, 2, 4, 5], recompute=recompute)
    schedule = zerobubble.generate("zb-h1", 5, 2)
    losses = run_order(chunks, sequential_order(schedule), x, y, 2)
    assert all(map(torch.equal, losses, ref_losses))
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, ref_grads[name]), name


def test_the_last_stage_reports_each_term_per_microbatch():
    model = toy(NAMES)
    x, y = data()
    c0, c1 = chunks_of(model, [0, 3])
    h = c0.forward(0, x)
    loss = c1.forward(0, h, target=y)
    got = c1.take_terms(0)
    assert sorted(got) == ["a", "b"] and not got["a"].requires_grad
    with collect_loss_terms(model) as found:
        out = model(x)
    assert torch.equal(got["a"], found["a"]) and torch.equal(got["b"], found["b"])
    assert torch.equal(loss, objective(mse(out, y), found))
    assert c1.take_terms(0) == {}  # taken once


def test_a_term_in_a_checkpointed_layer_is_refused_naming_the_fix():
    chunk = StageChunk(toy(["a", None]), 0, 2, recompute="layers")
    with pytest.raises(
        ValueError,
        match=r"Termed added loss term 'a' with gradients disabled.*"
        r"recompute='stage'",
    ):
        chunk.forward(0, torch.zeros(2, 4))


def test_terms_with_sequence_segments_are_refused():
    from zerobubble.runtime.sequence.kv import SegmentOf

    chunk = StageChunk(toy(["a"]), 0, 2)
    with pytest.raises(ValueError, match=r"stage 0: loss terms .* not supported with sequence"):
        chunk.forward(0, torch.zeros(2, 4), segment=SegmentOf(0, 0, 2, 0))


# ---- several processes: toy layers --------------------------------------------------------------

TIMEOUT = 240
TOY_M = 4


def toy_reference() -> dict:
    x, y = data(8)
    terms: dict[str, list[torch.Tensor]] = {}
    losses, grads = reference_step(toy(NAMES), mse, x, target=y, microbatches=TOY_M, terms=terms)
    return {"losses": losses, "grads": grads, "terms": terms}


def toy_job(kinds: list[str], ref: dict) -> list[str]:
    zerobubble.init_distributed(timeout_s=120)
    p = dist.get_world_size()
    x, y = data(8)
    bad = []
    for kind in kinds:
        pipe = zerobubble.Pipeline(toy(NAMES), mse, generated(kind, p, TOY_M))
        losses: list[torch.Tensor] = []
        terms: dict[str, list[torch.Tensor]] = {}
        pipe.step(x, target=y, losses=losses, terms=terms)
        if pipe.executor.has_last:
            if not all(map(torch.equal, losses, ref["losses"])):
                bad.append(f"{kind}: losses {losses} != {ref['losses']}")
            if terms.keys() != ref["terms"].keys() or not all(
                all(map(torch.equal, terms[n], ref["terms"][n])) for n in terms
            ):
                bad.append(f"{kind}: terms {terms} != {ref['terms']}")
        elif losses or terms:
            bad.append(f"{kind}: rank {pipe.rank} without the last stage reported {terms}")
        for name, param in pipe.named_parameters():
            if param.grad is None or not torch.equal(param.grad, ref["grads"][name]):
                bad.append(f"{kind}: gradient of {name} differs")
        # Through the trainer too: the objective is what it steps on, terms still reported.
        pipe.set_optimizer(torch.optim.SGD(pipe.parameters(), lr=0.0))
        again: dict[str, list[torch.Tensor]] = {}
        out = pipe.step(x, target=y, terms=again)
        pipe.drain()
        if pipe.executor.has_last and not (
            out is not None
            and all(map(torch.equal, out, ref["losses"]))
            and all(all(map(torch.equal, again[n], ref["terms"][n])) for n in ref["terms"])
        ):
            bad.append(f"{kind}: the trainer's step reports {out}, {again}")
    dist.destroy_process_group()
    return bad


@pytest.mark.slow
@pytest.mark.bitwise
def test_terms_on_several_stages_are_bitwise_the_reference_at_p3_under_zb_h1_and_zbv():
    ref = toy_reference()
    results = launch(toy_job, 3, ["zb-h1", "zbv"], ref, timeout=TIMEOUT)
    assert [b for r in results for b in r] == []


# ---- Hugging Face mixtures of experts with their router loss ------------------------------------

transformers = pytest.importorskip("transformers")
from zerobubble.interop import hf  # noqa: E402

HF_M = 4
MOE_KINDS = ["zb-h1", "zbv", "dualpipev"]


def hf_batch(padded: bool, rows: int = 8, length: int = 6) -> tuple[dict, torch.Tensor]:
    """Token ids (and a right-padded mask) with labels; padding is labelled -100."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (rows, length), generator=g)
    inputs: dict = {"input_ids": ids}
    labels = ids.clone()
    if padded:
        mask = torch.ones(rows, length, dtype=torch.long)
        for r in range(0, rows, 3):
            mask[r, length - 1 - r % 4 :] = 0
        labels[mask == 0] = -100
        inputs["attention_mask"] = mask
    return inputs, labels


@pytest.mark.parametrize("name", hf.TINY_MOE_CONFIGS)
@pytest.mark.parametrize("padded", [False, True])
def test_the_layers_objective_is_the_models_own_loss_with_its_router_loss(name, padded):
    """HF's loss (mean cross-entropy plus the router loss) against the layers' objective with
    the batch's token count (sum over tokens / count: another summation order, so within
    1e-6 relative; the router term itself is bitwise the model's)."""
    model = hf.tiny_model(name)
    layers = hf.causal_lm_layers(copy.deepcopy(model))
    inputs, labels = hf_batch(padded)
    own = model(**inputs, labels=labels)
    loss_fn = hf.CausalLMLoss(model)
    with collect_loss_terms(*layers) as terms:
        x = layers[0](inputs)
        for layer in layers[1:]:
            x = layer(x)
        got = objective(loss_fn(x, labels, loss_fn.count_fn(labels)), terms)
    assert list(terms) == ["router_aux"] and float(terms["router_aux"].detach()) > 0
    assert torch.equal(terms["router_aux"], model.router_aux_loss_coef * own.aux_loss)
    torch.testing.assert_close(got, own.loss, rtol=1e-6, atol=0)


def test_the_check_refuses_layers_whose_router_term_is_not_the_models():
    model = hf.tiny_model("hf-mixtral")
    layers = hf.causal_lm_layers(model)
    head = layers[-1]
    head.router = dataclasses.replace(head.router, coef=0.5)
    with pytest.raises(ValueError, match=r"loss term 'router_aux' \(.*\) is not the model's own"):
        hf.check_layers(model, layers)
    head.router = None
    with pytest.raises(ValueError, match=r"add the loss terms \[\] but the model's loss adds"):
        hf.check_layers(model, layers)


def moe_reference(name: str, padded: bool) -> dict:
    model = hf.tiny_model(name)
    inputs, labels = hf_batch(padded)
    terms: dict[str, list[torch.Tensor]] = {}
    losses, grads = reference_step(
        hf.causal_lm_layers(model),
        hf.CausalLMLoss(model),
        inputs,
        target=labels,
        microbatches=HF_M,
        terms=terms,
    )
    return {"losses": losses, "grads": grads, "terms": terms}


def moe_job(cases: list[tuple[str, str]], padded: bool, refs: dict) -> list[str]:
    zerobubble.init_distributed(timeout_s=120)
    p = dist.get_world_size()
    inputs, labels = hf_batch(padded)
    bad = []
    for name, kind in cases:
        ref = refs[name]
        model = hf.tiny_model(name)
        pipe = zerobubble.Pipeline(
            hf.causal_lm_layers(model), hf.CausalLMLoss(model), generated(kind, p, HF_M)
        )
        terms: dict[str, list[torch.Tensor]] = {}
        losses = pipe.step(inputs, target=labels, terms=terms)
        what = f"{name} {kind} P={p}"
        if pipe.executor.has_last:
            if losses is None or not all(map(torch.equal, losses, ref["losses"])):
                bad.append(f"{what}: losses {losses} != {ref['losses']}")
            if list(terms) != ["router_aux"] or not all(
                map(torch.equal, terms["router_aux"], ref["terms"]["router_aux"])
            ):
                bad.append(f"{what}: terms {terms} != {ref['terms']}")
        for key, param in pipe.named_parameters():
            if param.grad is None or not torch.equal(param.grad, ref["grads"][key]):
                bad.append(f"{what}: gradient of {key} differs")
    dist.destroy_process_group()
    return bad


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.parametrize(("p", "padded"), [(2, True), (3, False)])
def test_mixtral_with_its_router_loss_is_bitwise_the_reference_under_zb_h1_zbv_dualpipev(p, padded):
    """The issue's matrix {P=2, P=3} x {zb-h1, zbv, dualpipev}, one launch per P (with and
    without padding, the router loss's two branches); Qwen3-MoE under zbv at P=3."""
    cases = [("hf-mixtral", kind) for kind in MOE_KINDS]
    if p == 3:
        cases.append(("hf-qwen3-moe", "zbv"))
    refs = {name: moe_reference(name, padded) for name in {name for name, _ in cases}}
    for ref in refs.values():
        assert all(float(t) > 0 for t in ref["terms"]["router_aux"])
    results = launch(moe_job, p, cases, padded, refs, timeout=TIMEOUT)
    assert [b for r in results for b in r] == []


def test_the_router_stays_on_plain_autograd_so_its_logits_loss_gradient_is_kept():
    """The graph-level split would differentiate the MoE block's output only, dropping the
    gradient the router loss sends into the router's logits: the block names its router in
    unsplit_submodules(), and the experts still defer their weight gradients to W."""
    from zerobubble.runtime.split import unsplit_modules

    layers = hf.causal_lm_layers(hf.tiny_model("hf-mixtral"))
    chunk = StageChunk(nn.Sequential(*layers[1:3]), 1, 3)
    unsplit = {name for name, _ in unsplit_modules(chunk.module)}
    assert {"0.layer.mlp.gate", "1.layer.mlp.gate"} <= unsplit
    assert not any("experts" in name for name in unsplit)
