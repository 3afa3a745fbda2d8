"""Hugging Face models as pipelines, bitwise against the model's own forward and loss.

The reference is ``transformers``' own model called as a user calls it,
``model(input_ids=..., attention_mask=..., labels=..., num_items_in_batch=N)``,
microbatch by microbatch, with dropout seeded as the pipeline seeds it: the stage
``s`` part of microbatch ``j``'s forward in step ``k`` draws from
``derive_seed(seed, k, s, j)`` (a forward pre-hook on the first module of every
stage resets the generator). A tied parameter (GPT-2's ``wte``/``lm_head``) gets
the documented tied order: the reference unties it during the step and adds the
head's gradient to the embedding's afterwards (stage order, as
:func:`~zerobubble.parallel.tied.tied_reference_step`). Then clipping and AdamW on
both sides.

Checked for GPT-2 (tied, dropout 0.1, padding; ``sdpa`` and ``eager``) and Llama
(grouped-query attention, rotary, padding, attention dropout), every kind once on a
covering design of P (2, 4), M (P, 2P + 1), family and attention (see :func:`design`;
P = 4 and the V placement at both P kept): per-microbatch
losses, every gradient and every parameter after every step bitwise, the tied
replicas bitwise equal on every holder, and the gathered state dict loading
strictly into a fresh model equal to the reference's. The sequence length changes
every step (right padding with a mask). The reference does not depend on the
schedule, only on the microbatch count and the stage cut, so the parent computes
each once and the ranks compare digests of their tensors.
"""

from __future__ import annotations

import copy
import hashlib
import sys
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")

import zerobubble  # noqa: E402
from generated import RUNTIME_KINDS, SLOW_SOLVES, generated  # noqa: E402
from ranks import launch  # noqa: E402
from zerobubble.interop import hf  # noqa: E402
from zerobubble.parallel.partition import build_stage_modules, stage_bounds  # noqa: E402
from zerobubble.runtime.loss_terms import collect_loss_terms, objective  # noqa: E402
from zerobubble.runtime.rng import derive_seed  # noqa: E402
from zerobubble.runtime.shapes import BoundaryError, flatten  # noqa: E402
from zerobubble.schedule.generators import GENERATORS  # noqa: E402

TIMEOUT = 600.0
SEED = 1234
BATCH = 10
LENGTHS = (7, 5, 9, 6, 8)
MAX_NORM = 3.0  # both families clip at the first step and not at the next ones
#: name -> (tiny config, overrides).
VARIANTS = {
    "gpt2-sdpa": ("hf-gpt2", {"attn_implementation": "sdpa"}),
    "gpt2-eager": ("hf-gpt2", {"attn_implementation": "eager"}),
    "llama-sdpa": ("hf-llama", {"attn_implementation": "sdpa", "attention_dropout": 0.1}),
    "llama-eager": ("hf-llama", {"attn_implementation": "eager", "attention_dropout": 0.1}),
}


def build(variant: str, seed: int = 0) -> torch.nn.Module:
    name, overrides = VARIANTS[variant]
    return hf.tiny_model(name, seed=seed, **overrides).train()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def batch(step: int, vocab: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``step``'s ids, right-padding mask (1 = token) and labels (-100 on padding)."""
    length = LENGTHS[step % len(LENGTHS)]
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(3, vocab, (BATCH, length), generator=gen)
    real = torch.randint(2, length + 1, (BATCH,), generator=gen)
    real[0] = length  # the longest row sets the length
    mask = (torch.arange(length) < real[:, None]).long()
    return ids, mask, ids.masked_fill(mask == 0, -100)


def digest(t: torch.Tensor) -> str:
    """Bitwise identity of a tensor's values (``+ 0.0`` maps -0.0 to 0.0, as ``torch.equal``)."""
    data = (t.detach().float() + 0.0).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# ---- the reference: the HF model's own forward and loss ----------------------------------------


def _stage_heads(model: torch.nn.Module, bounds: list[range]) -> dict[int, torch.nn.Module]:
    """The model's module where each stage after the first starts (a block, or the final norm)."""
    if hasattr(model, "transformer"):
        blocks, norm = list(model.transformer.h), model.transformer.ln_f
    else:
        blocks, norm = list(model.model.layers), model.model.norm
    return {s: [*blocks, norm][r.start - 1] for s, r in enumerate(bounds) if s > 0}


@contextmanager
def seeded_stages(model, bounds: list[range], step: int, mb: int):
    """Inside: stage ``s``'s part of the forward draws from ``derive_seed(SEED, step, s, mb)``."""
    gen = torch.Generator()

    def reseed(stage: int) -> None:
        torch.set_rng_state(gen.manual_seed(derive_seed(SEED, step, stage, mb)).get_state())

    saved = torch.get_rng_state()
    hooks = [
        m.register_forward_pre_hook(lambda *_, s=s: reseed(s))
        for s, m in _stage_heads(model, bounds).items()
    ]
    reseed(0)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        torch.set_rng_state(saved)


@contextmanager
def untied_head(model):
    """The head's weight as a leaf of its own for the step; afterwards its gradient is added
    to the embedding's (stage order: embedding first) and the tie restored."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head.weight is not emb.weight:
        yield
        return
    own = torch.nn.Parameter(emb.weight.detach().clone())
    head.weight = own
    try:
        yield
    finally:
        head.weight = emb.weight
    emb.weight.grad = emb.weight.grad + own.grad


def every_name(model):
    """Every name of every parameter: a tied head is listed by the stages holding it as
    ``lm_head.weight``, by the embedding's as ``transformer.wte.weight``."""
    return model.named_parameters(remove_duplicate=False)


def reference(variant: str, m: int, num_stages: int, steps: int) -> dict:
    """Digests of the HF model's losses, gradients and parameters after each step."""
    model = build(variant)
    bounds = stage_bounds(len(hf.causal_lm_layers(model, check=False)), num_stages)
    opt = adamw(model.parameters())
    out: dict = {"losses": [], "norms": [], "grads": [], "params": []}
    for k in range(steps):
        ids, mask, labels = batch(k)
        total = hf.count_tokens(labels)
        opt.zero_grad(set_to_none=True)
        losses = []
        with untied_head(model):
            for j, rows in enumerate(torch.tensor_split(torch.arange(BATCH), m)):
                with seeded_stages(model, bounds, k, j):
                    loss = model(
                        input_ids=ids[rows],
                        attention_mask=mask[rows],
                        labels=labels[rows],
                        num_items_in_batch=total,
                    ).loss
                loss.backward()
                losses.append(loss.detach())
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out["losses"].append(losses)
        out["norms"].append(float(norm))
        out["grads"].append({n: digest(p.grad) for n, p in every_name(model)})
        opt.step()
        out["params"].append({n: digest(p) for n, p in every_name(model)})
    out["state"] = {k: digest(v) for k, v in model.state_dict().items()}
    return out


# ---- inside the ranks --------------------------------------------------------------------------


def replica_bytes(pipe: zerobubble.Pipeline) -> list[bytes]:
    """This rank's replicas of GPT-2's tied embedding, one per stage holding it.

    The embedding's stage names it ``transformer.wte.weight``, the head's ``lm_head.weight``.
    """
    names = ("transformer.wte.weight", "lm_head.weight")
    return [
        p.detach().numpy().tobytes()
        for c in pipe.executor.chunks.values()
        for n, p in c.module.named_parameters()
        if pipe._name(c.stage, n) in names
    ]


def run(schedule: zerobubble.Schedule, variant: str, ref: dict, steps: int) -> dict:
    """``steps`` training steps of ``variant`` under ``schedule``, compared with ``ref``."""
    what = f"{variant} {schedule.name} P={schedule.num_devices} M={schedule.num_microbatches}"
    model = build(variant)
    pipe = zerobubble.Pipeline(
        hf.causal_lm_layers(model),
        hf.CausalLMLoss(model),
        schedule,
        options=zerobubble.ExecutorOptions(seed=SEED),
        count_fn=hf.count_tokens,
        tied_check_every=1,
    )
    trainer = pipe.set_optimizer(
        adamw(pipe.parameters()), zerobubble.OptimConfig(max_norm=MAX_NORM)
    )
    actions: list[str] = []
    bad = []

    def commit(c) -> None:
        actions.append(c.action.value)
        if float(c.total_norm) != ref["norms"][c.iteration]:
            bad.append(
                f"{what} step {c.iteration}: norm {c.total_norm} != {ref['norms'][c.iteration]}"
            )

    trainer.on_commit = commit
    for k in range(steps):
        ids, mask, labels = batch(k)
        losses = pipe.step({"input_ids": ids, "attention_mask": mask}, target=labels)
        if pipe.executor.has_last and not (
            losses is not None and all(map(torch.equal, losses, ref["losses"][k]))
        ):
            bad.append(f"{what} step {k}: losses {losses} != {ref['losses'][k]}")
        for name, p in pipe.named_parameters():
            if p.grad is None or digest(p.grad) != ref["grads"][k][name]:
                bad.append(f"{what} step {k}: gradient of {name} differs")
            if digest(p) != ref["params"][k][name]:
                bad.append(f"{what} step {k}: {name} differs after the step")
    pipe.drain()
    # The HF state-dict round trip: every rank's part, gathered, loads strictly.
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, dict(pipe.state_dict()))
    if pipe.rank == 0:
        fresh = build(variant, seed=99)
        fresh.load_state_dict({k: v for part in parts for k, v in part.items()}, strict=True)
        got = {k: digest(v) for k, v in fresh.state_dict().items()}
        bad += [f"{what}: state entry {k} differs" for k, d in ref["state"].items() if got[k] != d]
    return {"bad": bad, "replicas": replica_bytes(pipe), "actions": actions}


def matrix_job(cases: list[tuple[zerobubble.Schedule, str, int]], refs: dict) -> dict:
    zerobubble.init_distributed(timeout_s=120)
    out = {}
    for schedule, variant, steps in cases:
        key = (variant, schedule.num_microbatches, schedule.num_stages)
        out[case_key(schedule, variant)] = run(schedule, variant, refs[key], steps)
    dist.destroy_process_group()
    return out


# ---- the matrix --------------------------------------------------------------------------------


def case_key(schedule: zerobubble.Schedule, variant: str) -> tuple[str, int, str]:
    return (schedule.name, schedule.num_microbatches, variant)


#: The design's rows as (P is 4, M is 2P + 1, Llama, eager): a half fraction of the 2^4
#: product (the rows whose levels sum to an even number). Any two factors take all four
#: level pairs over its eight rows.
ROWS = ((0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1), (0, 1, 1, 0))
ROWS += tuple(tuple(1 - x for x in row) for row in ROWS)

#: Each kind's row. The looped kinds take all eight rows, the V kinds (the last stage on
#: rank 0; checked by :func:`cases`) seven; the searching kinds sit where they solve in
#: about a second (auto at P = 2, M = 2 picks a looped placement); GPT-2 at P = 4, M = 9
#: (row 5) runs looped (interleaved-1f1b: the tied replicas on ranks 0 and 3) and V (zbv:
#: both on rank 0).
ROW = {
    "auto": 0,
    "zb-auto": 1,
    "optimal": 2,
    "gpipe": 3,
    "zb-h2": 4,
    "interleaved-1f1b": 5,
    "zb-h1": 6,
    "1f1b": 7,
    "1f1b-v": 0,
    "dualpipev": 1,
    "optimal-v": 3,
    "zbv-auto": 4,
    "zbv": 5,
    "v-half": 6,
    "v-min": 7,
}
V_KINDS = frozenset(("1f1b-v", "dualpipev", "optimal-v", "zbv-auto", "zbv", "v-half", "v-min"))


def design() -> list[tuple[str, int, int, str]]:
    """(kind, P, M, variant) of every run: a covering design, not the full product.

    Each kind runs once, on its :data:`ROW` of the half fraction, so over the kinds every
    pair of the four other factors occurs, and so does every pair of placement family (V or
    looped) with each of them (test_the_design_covers_every_pair). Neither family nor
    attention implementation touches the schedule: what a kind changes (placement, order,
    the tied replicas' ranks) is checked for each family of kinds at both P and both M with
    a tied and an untied model.
    """
    out = []
    for kind in RUNTIME_KINDS:
        row = ROWS[ROW[kind]]
        p = 4 if row[0] else 2
        m = 2 * p + 1 if row[1] else p
        variant = f"{'llama' if row[2] else 'gpt2'}-{'eager' if row[3] else 'sdpa'}"
        out.append((kind, p, m, variant))
    return out


def cases(p: int) -> list[tuple[zerobubble.Schedule, str, int]]:
    """The design's runs at ``p``. Two chunks where a kind takes a chunk count (8 stages at
    P = 4: the models' 8 layers). GPT-2 runs 5 steps at P = 4, M = 9 (the tied replicas
    after 5 AdamW steps), the rest 2 (the first clips, the second does not; the sequence
    length changes between them).
    """
    out = []
    for kind, q, m, variant in design():
        if q != p:
            continue
        opts = {"chunks": 2} if "chunks" in GENERATORS[kind].options else {}
        steps = 5 if variant.startswith("gpt2") and m > p == 4 else 2
        schedule = generated(kind, p, m, **opts)
        assert (schedule.placement[-1] == 0) == (kind in V_KINDS), (kind, schedule.placement)
        out.append((schedule, variant, steps))
    return out


def test_the_design_covers_every_pair():
    runs = design()
    factors = [
        ["v" if k in V_KINDS else "looped" for k, *_ in runs],
        [p for _, p, _, _ in runs],
        ["long" if m > p else "short" for _, p, m, _ in runs],
        [v.split("-")[0] for *_, v in runs],
        [v.split("-")[1] for *_, v in runs],
    ]
    levels = [set(f) for f in factors]
    assert [len(x) for x in levels] == [2, 2, 2, 2, 2]
    for a in range(len(factors)):
        for b in range(a + 1, len(factors)):
            seen = set(zip(factors[a], factors[b], strict=True))
            assert seen == {(x, y) for x in levels[a] for y in levels[b]}, (a, b)
    assert {v for *_, v in runs} == set(VARIANTS)
    assert [k for k, *_ in runs] == list(RUNTIME_KINDS)  # every kind, once
    assert V_KINDS.issubset(RUNTIME_KINDS) and ROW.keys() == set(RUNTIME_KINDS)
    assert not {(k, p, m) for k, p, m, _ in runs} & SLOW_SOLVES
    # Tied replicas after 5 steps at P = 4, M = 9: a looped and a V kind run GPT-2 there.
    tied = {k in V_KINDS for k, p, m, v in runs if p == 4 and m == 9 and v.startswith("gpt2")}
    assert tied == {False, True}


def check_matrix(p: int) -> None:
    todo = cases(p)
    refs: dict = {}
    for s, variant, steps in todo:
        key = (variant, s.num_microbatches, s.num_stages)
        if key not in refs or len(refs[key]["losses"]) < steps:
            refs[key] = reference(variant, *key[1:], steps)
    results = launch(matrix_job, p, todo, refs, timeout=TIMEOUT)
    actions = set()
    for s, variant, _ in todo:
        key = case_key(s, variant)
        assert [b for r in results for b in r[key]["bad"]] == [], key
        actions.update(results[-1][key]["actions"])
        if variant.startswith("gpt2"):
            replicas = [t for r in results for t in r[key]["replicas"]]
            assert len(replicas) == 2 and replicas[0] == replicas[1], key
    assert actions == {"clip", "step"}  # clipping was exercised, and its absence


@pytest.mark.slow
def test_the_design_at_p2_is_bitwise_the_hf_models_own_training():
    check_matrix(2)


@pytest.mark.slow
def test_the_design_at_p4_is_bitwise_the_hf_models_own_training():
    check_matrix(4)


# ---- what cannot be honoured is refused, naming the stage, the leaf and the fix --------------


def test_each_block_has_its_own_rotary_tables_so_every_cut_is_honoured():
    """The model's one ``rotary_emb`` holds buffers; shared by blocks of different stages it
    could not be honoured, so every block gets its own copy (same values)."""
    model = build("llama-sdpa")
    layers = hf.causal_lm_layers(model)
    tables = [b.rotary_emb.inv_freq for b in layers[1:-1]]
    assert len({t.data_ptr() for t in tables}) == len(tables)
    assert all(torch.equal(t, model.model.rotary_emb.inv_freq) for t in tables)
    schedule = zerobubble.generate("zbv", 4, 4)  # 8 stages: one layer each
    stages = {s for rank in range(4) for s in build_stage_modules(layers, schedule, rank)}
    assert stages == set(range(8))
    layers[2].rotary_emb = layers[1].rotary_emb
    with pytest.raises(ValueError) as err:
        build_stage_modules(layers, schedule, 0)
    assert str(err.value).startswith(
        "buffer 'model.rotary_emb.inv_freq' is shared by layers of different stages: "
        "'model.rotary_emb.inv_freq' (stage 1), 'model.rotary_emb.inv_freq' (stage 2); "
        "the pipeline does not keep buffers in sync across stages: give each layer its own "
        "buffer, or choose boundaries that keep these layers on one stage"
    )


def test_a_head_sharing_memory_but_not_the_parameter_is_refused_by_hf_name():
    model = build("gpt2-sdpa")
    model.lm_head.weight = torch.nn.Parameter(model.transformer.wte.weight.data)
    layers = hf.causal_lm_layers(model)  # the values agree: the check passes
    with pytest.raises(ValueError) as err:
        build_stage_modules(layers, zerobubble.generate("1f1b", 2, 2), 0)
    assert str(err.value) == (
        "parameters 'transformer.wte.weight' (stage 0) and 'lm_head.weight' (stage 1) share "
        "memory but are different Parameter objects; tie them by assigning the same Parameter "
        "(e.g. head.weight = embedding.weight), so the pipeline knows to keep them equal"
    )


def test_a_leaf_that_cannot_travel_names_the_stage_the_leaf_and_the_fix():
    hidden = torch.zeros(2, 5, 64, requires_grad=True)
    boundary = {"hidden": hidden, "attention_mask": None, "position_ids": None, "scale": 0.5}
    with pytest.raises(BoundaryError) as err:
        flatten(boundary, "stage 2 output")
    assert str(err.value) == (
        "stage 2 output['scale']: a float cannot cross a stage boundary; expected a tensor, "
        "None, an int or a bool, nested in tuples, lists or dicts with str keys: make it one "
        "(a number as a tensor: torch.tensor(value)), or compute it in the stage that uses it"
    )


class _HiddenOnly(torch.nn.Module):
    """A hand-cut layer that drops the mask and positions the next block needs."""

    def forward(self, x: dict) -> torch.Tensor:
        return x["hidden"]


def test_mismatched_layouts_between_stages_name_both_stages_the_value_and_the_fix(tmp_path):
    model = build("llama-sdpa")
    layers = hf.causal_lm_layers(model)
    layers = [layers[0], _HiddenOnly(), *layers[1:]]
    ids, mask, labels = batch(1)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pipe = zerobubble.Pipeline(
            layers, hf.CausalLMLoss(model), "zbv", microbatches=2, boundaries=[0, 2, len(layers)]
        )
        with pytest.raises(ValueError) as err:
            pipe.step({"input_ids": ids, "attention_mask": mask}, target=labels)
    finally:
        dist.destroy_process_group()
    assert str(err.value) == (
        "stage 0 -> stage 1: stage 1 (rank 0) cannot consume stage 0's output of "
        "[5, 5, 64] float32 (grad) (microbatch 0): ValueError: DecoderBlock: expected the "
        "previous layer's dict with 'hidden' (a tensor), 'attention_mask' and 'position_ids'; "
        "got Tensor; raised in layer '0' (DecoderBlock); stage 1's first layer must take what "
        "stage 0 gives: change that layer or the one before it, or cut elsewhere "
        "(Pipeline(boundaries=...))"
    )


# ---- other decoder families, from tiny configs ---------------------------------------------------

TINY = {
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 64,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: model_type -> (attention, config overrides): families beyond the shipped tiny configs,
#: each doing something of its own (soft-capped or scaled logits, local/global rotary tables
#: with sliding windows and scaled embeddings, QK norms, fused projections, GPT-2 layout with
#: local attention).
FAMILIES = {
    "gemma2": ("eager", {"final_logit_softcapping": 5.0, "sliding_window": 4}),
    "cohere": ("sdpa", {"logit_scale": 0.5}),
    "gemma3_text": ("sdpa", {"sliding_window": 4, "final_logit_softcapping": 5.0}),
    "phi3": ("eager", {}),
    "olmo2": ("sdpa", {}),
    "gpt_neo": (
        "eager",
        {
            "num_layers": 3,
            "window_size": 4,
            "attention_types": [[["global", "local"], 1], [["global"], 1]],
        },
    ),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_are_bitwise_their_own_model_and_cut_anywhere(family):
    impl, overrides = FAMILIES[family]
    config = transformers.AutoConfig.for_model(family, **TINY, **overrides)
    config._attn_implementation = impl
    for name in ("attention_dropout", "embed_dropout", "resid_dropout", "hidden_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).train()
    twin = copy.deepcopy(model)
    layers = hf.causal_lm_layers(twin)
    ids, mask, labels = batch(0, TINY["vocab_size"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        own = model(input_ids=ids, attention_mask=mask, labels=labels)
        own.loss.backward()
        torch.manual_seed(7)
        x = layers[0](ids, attention_mask=mask)
        for layer in layers[1:]:
            x = layer(x)
        loss = hf.CausalLMLoss(twin)(x, labels)
        loss.backward()
    assert torch.equal(x, own.logits) and torch.equal(loss, own.loss)
    for layer in layers:
        for name, p in layer.named_parameters():
            key = layer.source_name(name)
            assert torch.equal(p.grad, model.get_parameter(key).grad), key
    # One layer per stage: nothing shared that the runtime could not honour.
    schedule = zerobubble.generate("1f1b", len(layers), len(layers))
    assert len(build_stage_modules(layers, schedule, 1)) == 1


@pytest.mark.parametrize("family", ["gpt_neox", "falcon", "phi"])
def test_families_of_another_layout_are_refused(family):
    fields = {k: v for k, v in TINY.items() if k != "head_dim"}  # derived in these configs
    config = transformers.AutoConfig.for_model(family, **fields)
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(ValueError, match=f"{type(model).__name__} has neither the GPT-2 layout"):
        hf.causal_lm_layers(model)


#: Mixtures of experts, built from their config classes (no download).
MOE = {
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    ),
}


def moe_model(family: str, **overrides) -> torch.nn.Module:
    name, fields = MOE[family]
    config = getattr(transformers, name)(**{**TINY, "num_hidden_layers": 2, **fields, **overrides})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family", MOE)
def test_a_moe_model_with_a_router_loss_is_bitwise_its_own_loss_through_the_heads_term(family):
    model = moe_model(family, output_router_logits=True)
    twin = copy.deepcopy(model)
    layers = hf.causal_lm_layers(twin)
    ids, mask, labels = batch(0, TINY["vocab_size"])
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    own.loss.backward()
    with collect_loss_terms(*layers) as terms:
        x = layers[0](ids, attention_mask=mask)
        for layer in layers[1:]:
            x = layer(x)
    # The model's loss is its cross-entropy plus the router loss, bitwise.
    assert list(terms) == ["router_aux"]
    assert torch.equal(terms["router_aux"], model.router_aux_loss_coef * own.aux_loss)
    loss = objective(hf.CausalLMLoss(twin)(x, labels), terms)
    assert torch.equal(loss, own.loss)
    loss.backward()
    for layer in layers:
        for name, p in layer.named_parameters():
            key = layer.source_name(name)
            assert torch.equal(p.grad, model.get_parameter(key).grad), key


@pytest.mark.parametrize("family", MOE)
def test_a_router_loss_of_another_form_is_refused_naming_the_option(family, monkeypatch):
    model = moe_model(family, output_router_logits=True)
    monkeypatch.setattr(model, "num_experts", None)  # the formula's constants are not found
    why = (
        f"{type(model).__name__} \\({family}\\) is built with config.output_router_logits=True: "
        "its loss adds router_aux_loss_coef=0.001 times the routers' load-balancing loss"
    )
    for check in (True, False):
        with pytest.raises(ValueError, match=why + r".*build the model with output_router_logits"):
            hf.causal_lm_layers(model, check=check)
    with pytest.raises(ValueError, match=why):
        hf.CausalLMLoss(model)


def test_router_logits_on_a_family_whose_loss_adds_no_router_loss_say_so(monkeypatch):
    """A family without load_balancing_loss_func only returns the logits: the refusal says
    its loss adds none, names the family and the fix (and the bias update where the
    routers have a bias: DeepSeek-V3)."""
    model = moe_model("mixtral", output_router_logits=True)
    monkeypatch.delattr(sys.modules[type(model).__module__], "load_balancing_loss_func")
    with pytest.raises(
        ValueError,
        match=r"^MixtralForCausalLM \(mixtral\) is built with config.output_router_logits=True, "
        r"but its loss adds no auxiliary router loss: .*build the model with "
        r"output_router_logits=False$",
    ):
        hf.causal_lm_layers(model)
    deepseek = hf.tiny_model("hf-deepseek-v3", output_router_logits=True)
    for build in (hf.causal_lm_layers, hf.CausalLMLoss):
        with pytest.raises(
            ValueError,
            match=r"^DeepseekV3ForCausalLM \(deepseek_v3\) .* adds no auxiliary router loss: the "
            r"flag only makes its forward return the routers' logits.*output_router_logits=False "
            r"\(its routers balance by a bias.*bias_update=rate",
        ):
            build(deepseek)


def test_llama4_with_router_logits_and_granite_moe_hybrid_are_refused_naming_the_family():
    """Both died on a raw AttributeError: Llama4 records its router logits on the text model
    only (and adds no router loss), GraniteMoeHybrid has no rotary embedding by default and
    Mamba layers beside attention."""
    fields = {**TINY, "num_hidden_layers": 2}
    llama4 = transformers.Llama4TextConfig(
        **fields,
        intermediate_size_mlp=64,
        num_local_experts=4,
        num_experts_per_tok=1,
        output_router_logits=True,
    )
    with torch.random.fork_rng(devices=[]):
        model = transformers.Llama4ForCausalLM(llama4)
    with pytest.raises(
        ValueError,
        match=r"^Llama4ForCausalLM \(llama4_text\) is built with config.output_router_logits="
        r"True, but its loss adds no auxiliary router loss.*output_router_logits=False$",
    ):
        hf.causal_lm_layers(model)
    granite = {
        **{k: v for k, v in fields.items() if k != "head_dim"},
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "mamba_n_heads": 4,
        "mamba_d_state": 8,
        "mamba_chunk_size": 8,
    }
    for logits in (True, False):
        config = transformers.GraniteMoeHybridConfig(**granite, output_router_logits=logits)
        with torch.random.fork_rng(devices=[]):
            model = transformers.GraniteMoeHybridForCausalLM(config)
        with pytest.raises(
            ValueError,
            match=r"^GraniteMoeHybridForCausalLM \(granitemoehybrid\) has no rotary embedding "
            r"\(model.rotary_emb is None, config.position_embedding_type=None\).*"
            r"position_embedding_type='rope'\), or cut it into layers by hand$",
        ):
            hf.causal_lm_layers(model)
    config = transformers.GraniteMoeHybridConfig(**granite, position_embedding_type="rope")
    with torch.random.fork_rng(devices=[]):
        model = transformers.GraniteMoeHybridForCausalLM(config)  # Mamba layers by default
    with pytest.raises(
        ValueError,
        match=r"^GraniteMoeHybridForCausalLM \(granitemoehybrid\): decoder layer 0 uses "
        r"'linear_attention' attention; .*cut the model into layers by hand$",
    ):
        hf.causal_lm_layers(model)


@pytest.mark.parametrize("family", MOE)
def test_a_moe_model_without_a_router_loss_is_bitwise_its_own_loss(family):
    model = moe_model(family)  # output_router_logits=False, the configs' default
    twin = copy.deepcopy(model)
    layers = hf.causal_lm_layers(twin)
    ids, mask, labels = batch(0, TINY["vocab_size"])
    own = model(input_ids=ids, attention_mask=mask, labels=labels)
    own.loss.backward()
    x = layers[0](ids, attention_mask=mask)
    for layer in layers[1:]:
        x = layer(x)
    loss = hf.CausalLMLoss(twin)(x, labels)
    loss.backward()
    assert torch.equal(x, own.logits) and torch.equal(loss, own.loss)
    for layer in layers:
        for name, p in layer.named_parameters():
            key = layer.source_name(name)
            assert torch.equal(p.grad, model.get_parameter(key).grad), key
