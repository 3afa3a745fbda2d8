"""The Hugging Face adapter against the models' own forward and loss: chained layers give
bitwise the logits, loss and every gradient of ``transformers``' GPT-2, Llama, Mistral and
Qwen2 (tiny configs shipped in the repo), state dicts under Hugging Face names load back
strictly, and what the adapter cannot honour is refused with a message."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]

from zerobubble.interop import hf  # noqa: E402
from zerobubble.parallel.partition import (  # noqa: E402
    build_stage_modules,
    layer_keys,
    model_name,
    stage_bounds,
)
from zerobubble.schedule.generators import generate  # noqa: E402

pytestmark = [pytest.mark.bitwise, pytest.mark.kernels]  # kernels: rerun on other kernel paths

#: Dropout on everywhere it exists: GPT-2's tiny config has 0.1 on embeddings, attention and
#: residuals; the Llama family gets attention dropout 0.1.
DROPOUT = {"hf-gpt2": {}, "hf-llama": {"attention_dropout": 0.1}}
DROPOUT |= {"hf-mistral": DROPOUT["hf-llama"], "hf-qwen2": DROPOUT["hf-llama"]}


def padded_batch(batch: int, length: int, vocab: int = 256, seed: int = 0):
    """Token ids, a padding mask with a left-padded and a right-padded row, labels -100 on pads."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, : length // 3] = 0
    mask[2, length - length // 2 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def chain(layers, *args, **kwargs):
    x = layers[0](*args, **kwargs)
    for layer in layers[1:]:
        x = layer(x)
    return x


def named_grads(layers) -> dict[str, torch.Tensor]:
    out = {}
    for layer in layers:
        for name, p in layer.named_parameters():
            out[layer.source_name(name)] = p.grad
    return out


def pair(name: str, impl: str, **overrides):
    """The model and an identical copy cut into layers."""
    model = hf.tiny_model(name, attn_implementation=impl, **DROPOUT[name], **overrides).train()
    twin = copy.deepcopy(model)
    return model, twin, hf.causal_lm_layers(twin)


@pytest.mark.parametrize("length", [5, 12])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", hf.TINY_CONFIGS)
def test_layers_give_the_models_logits_loss_and_gradients_bitwise(name, impl, length):
    model, twin, layers = pair(name, impl)
    ids, mask, labels = padded_batch(4, length)
    torch.manual_seed(7)
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    torch.manual_seed(7)
    logits = chain(layers, ids, attention_mask=mask)
    loss = hf.CausalLMLoss(twin)(logits, labels)
    loss.backward()
    assert torch.equal(logits, out.logits)
    assert torch.equal(loss, out.loss)
    grads = named_grads(layers)
    params = dict(model.named_parameters())
    assert set(params) <= set(grads) <= set(model.state_dict())
    for key, grad in grads.items():
        assert grad is not None and torch.equal(grad, model.get_parameter(key).grad), key
    # Dropout really draws: another seed changes the loss.
    torch.manual_seed(8)
    assert not torch.equal(
        hf.CausalLMLoss(twin)(chain(layers, ids, attention_mask=mask), labels), loss
    )


def test_gpt2_ties_its_head_and_llama_does_not():
    gpt2 = hf.causal_lm_layers(hf.tiny_model("hf-gpt2"))
    assert gpt2[-1].lm_head.weight is gpt2[0].wte.weight
    qwen2 = hf.causal_lm_layers(hf.tiny_model("hf-qwen2"))
    assert qwen2[-1].lm_head.weight is qwen2[0].embed_tokens.weight
    llama = hf.causal_lm_layers(hf.tiny_model("hf-llama"))
    assert llama[-1].lm_head.weight is not llama[0].embed_tokens.weight
    assert [type(x).__name__ for x in llama] == [
        "DecoderEmbedding",
        *["DecoderBlock"] * 6,
        "DecoderHead",
    ]


def test_sliding_window_layers_follow_the_models_layer_types():
    qwen2 = hf.causal_lm_layers(hf.tiny_model("hf-qwen2"))
    assert [b.attention_type for b in qwen2[1:-1]] == ["full_attention"] * 3 + [
        "sliding_attention"
    ] * 3
    mistral = hf.causal_lm_layers(hf.tiny_model("hf-mistral"))
    assert {b.attention_type for b in mistral[1:-1]} == {"sliding_attention"}
    llama = hf.causal_lm_layers(hf.tiny_model("hf-llama"))
    assert {b.attention_type for b in llama[1:-1]} == {"full_attention"}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_sequences_without_a_mask_are_masked_per_sequence(impl):
    """Position ids that restart mark packed sequences, as the model does without a cache
    (``use_cache=False`` in its config; with a cache the model does not look for packing)."""
    model, twin, layers = pair("hf-llama", impl, use_cache=False)
    model.eval(), twin.eval()
    ids, _, _ = padded_batch(3, 10)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2], list(range(10)), [0, 1] * 5])
    expected = model(input_ids=ids, position_ids=positions).logits
    logits = chain(layers, ids, position_ids=positions)
    assert torch.equal(logits, expected)
    assert not torch.equal(logits, chain(layers, ids))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_prepared_4d_mask_travels_unchanged(impl):
    model, twin, layers = pair("hf-llama", impl)
    model.eval(), twin.eval()
    ids, _, _ = padded_batch(3, 8)
    allowed = torch.ones(8, 8).tril().bool() & ~torch.eye(8, dtype=torch.bool).roll(1, 1)
    allowed = allowed.expand(3, 1, 8, 8)
    mask = allowed if impl == "sdpa" else torch.zeros(3, 1, 8, 8).masked_fill(~allowed, -1e9)
    expected = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(chain(layers, ids, attention_mask=mask), expected)
    assert layers[0](ids, attention_mask=mask)["attention_mask"] is mask


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_gpt2_position_and_token_type_ids_as_the_model_uses_them(impl):
    model, twin, layers = pair("hf-gpt2", impl)
    ids, mask, labels = padded_batch(3, 7)
    positions = torch.arange(7).repeat(3, 1) + torch.tensor([[0], [5], [9]])
    types = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(1))
    kwargs = {"attention_mask": mask, "position_ids": positions, "token_type_ids": types}
    torch.manual_seed(3)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    torch.manual_seed(3)
    loss = hf.CausalLMLoss(twin)(chain(layers, ids, **kwargs), labels)
    loss.backward()
    assert torch.equal(loss, out.loss)
    for key, grad in named_grads(layers).items():
        assert torch.equal(grad, model.get_parameter(key).grad), key


def test_a_tokenizer_style_mapping_is_the_same_input():
    _, _, layers = pair("hf-gpt2", "sdpa")
    for layer in layers:
        layer.eval()
    ids, mask, _ = padded_batch(3, 6)
    assert torch.equal(
        chain(layers, {"input_ids": ids, "attention_mask": mask}),
        chain(layers, ids, attention_mask=mask),
    )


def test_what_travels_between_blocks_is_small():
    _, _, layers = pair("hf-llama", "eager")
    ids, mask, _ = padded_batch(3, 6)
    x = layers[0](ids, attention_mask=mask)
    assert set(x) == {"hidden", "attention_mask", "position_ids"}
    assert x["attention_mask"].dtype == torch.bool and x["attention_mask"].shape == (3, 6)
    assert x["position_ids"] is None and x["hidden"].requires_grad
    y = layers[1](x)
    assert y["attention_mask"] is x["attention_mask"] and y["hidden"].shape == (3, 6, 64)


# ---- loss normalised by the whole batch's token count ------------------------------------------


def test_count_tokens_counts_shifted_non_ignored_labels():
    labels = torch.tensor([[5, 6, -100, 7], [-100, -100, 8, 9]])
    assert hf.count_tokens(labels) == 4  # [6, -100, 7] and [-100, 8, 9]
    assert hf.count_tokens(labels, ignore_index=9) == 5


@pytest.mark.parametrize("name", ["hf-gpt2", "hf-llama"])
def test_microbatch_losses_with_the_global_count_add_up_to_the_batch_loss(name):
    model, twin, layers = pair(name, "sdpa")
    model.eval(), twin.eval()
    ids, mask, labels = padded_batch(6, 9)
    total = hf.count_tokens(labels)
    loss_fn = hf.CausalLMLoss(twin)
    losses = []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        logits = chain(layers, ids[rows], attention_mask=mask[rows])
        loss = loss_fn(logits, labels[rows], num_items_in_batch=total)
        own = model(
            input_ids=ids[rows],
            attention_mask=mask[rows],
            labels=labels[rows],
            num_items_in_batch=total,
        ).loss
        assert torch.equal(loss, own)
        loss.backward()
        losses.append(loss)
    full = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    full.backward()
    # Summation order differs (per microbatch, then across), so only rounding apart.
    torch.testing.assert_close(sum(losses), full, rtol=1e-6, atol=0)
    for key, grad in named_grads(layers).items():
        torch.testing.assert_close(grad, model.get_parameter(key).grad, rtol=1e-4, atol=1e-7)


def docs_snippet() -> str:
    """docs/hf.md's first ```python block, as written."""
    text = (ROOT / "docs" / "hf.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)[0]


def test_the_docs_snippet_runs_as_written_and_trains_hfs_loss(monkeypatch):
    """On one rank (the environment the launcher gives): HF's normalisation by default."""
    import torch.distributed as dist

    from zerobubble.runtime.launcher import free_port, rank_env

    threads = torch.get_num_threads()
    for key, value in rank_env(0, 1, free_port()).items():
        monkeypatch.setenv(key, value)
    ns: dict = {}
    try:
        exec(docs_snippet(), ns)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(threads)
    model, ids, mask, labels, losses = (ns[k] for k in ("model", "ids", "mask", "labels", "losses"))
    assert bool((mask == 0).any()) and len(losses) == 4  # a padded batch, 4 microbatches
    total = hf.count_tokens(labels)
    means = []
    for j, rows in enumerate(torch.arange(len(ids)).tensor_split(4)):
        batch = {"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows]}
        assert torch.equal(losses[j], model(**batch, num_items_in_batch=total).loss), j
        means.append(model(**batch).loss * len(rows) / len(ids))
    full = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(sum(losses), full, rtol=1e-6, atol=0)  # summed per microbatch
    # What the pipeline trained without the count: the microbatches' means weighted by rows.
    assert abs(sum(means) - full) > 1e-3


def test_loss_refuses_bad_labels_and_counts():
    model = hf.tiny_model("hf-llama")
    loss_fn = hf.CausalLMLoss(model)
    logits = torch.zeros(2, 5, 256)
    with pytest.raises(ValueError, match=r"labels must be a tensor of shape \(2, 5\)"):
        loss_fn(logits, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="num_items_in_batch must be positive"):
        loss_fn(logits, torch.zeros(2, 5, dtype=torch.long), num_items_in_batch=0)


# ---- names ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", hf.TINY_CONFIGS)
def test_state_dict_under_hf_names_loads_strictly_into_the_model(name):
    source = hf.tiny_model(name, seed=1)
    layers = hf.causal_lm_layers(source)
    state = {layer.source_name(k): v for layer in layers for k, v in layer.state_dict().items()}
    assert list(state) == list(source.state_dict())
    target = hf.tiny_model(name, seed=2)
    assert not torch.equal(target.lm_head.weight, source.lm_head.weight)
    target.load_state_dict(state, strict=True)
    for key, value in target.state_dict().items():
        assert torch.equal(value, source.state_dict()[key]), key


def test_source_names_are_hugging_faces():
    llama = hf.causal_lm_layers(hf.tiny_model("hf-llama"))
    assert llama[4].source_name("layer.self_attn.q_proj.weight") == (
        "model.layers.3.self_attn.q_proj.weight"
    )
    assert llama[-1].source_name("lm_head.weight") == "lm_head.weight"
    gpt2 = hf.causal_lm_layers(hf.tiny_model("hf-gpt2"))
    assert gpt2[1].source_name("block.attn.c_attn.weight") == "transformer.h.0.attn.c_attn.weight"
    assert gpt2[0].source_name("wpe.weight") == "transformer.wpe.weight"
    with pytest.raises(
        ValueError, match=r"'attn.weight' is not a parameter or buffer of GPT2Block"
    ):
        gpt2[1].source_name("attn.weight")


@pytest.mark.parametrize(("kind", "devices"), [("1f1b", 2), ("zbv", 2), ("zbv", 4), ("zb-h1", 4)])
def test_stages_name_their_state_as_the_model_does(kind, devices):
    """Every rank's stages (V placements included) under HF names: together the model's keys."""
    model = hf.tiny_model("hf-gpt2", seed=3)
    layers = hf.causal_lm_layers(model)
    schedule = generate(kind, devices, 2 * devices)
    keys = layer_keys(layers)
    bounds = stage_bounds(len(keys), schedule.num_stages)
    state: dict[str, torch.Tensor] = {}
    for rank in range(devices):
        for s, stage in build_stage_modules(layers, schedule, rank).items():
            mine = keys[bounds[s].start : bounds[s].stop]
            for k, v in stage.state_dict().items():
                state[model_name(k, mine, stage)] = v
    assert sorted(state) == sorted(model.state_dict())
    fresh = hf.tiny_model("hf-gpt2", seed=4)
    fresh.load_state_dict(state, strict=True)
    assert torch.equal(
        fresh.transformer.h[5].mlp.c_fc.weight, model.transformer.h[5].mlp.c_fc.weight
    )


@pytest.mark.parametrize("name", ["hf-llama", "hf-gpt2"])
def test_pipeline_uses_hf_names(name, tmp_path):
    """The front door on one rank: named_parameters/state_dict keyed as the HF model is."""
    import torch.distributed as dist

    from zerobubble.pipeline import Pipeline

    model = hf.tiny_model(name, seed=5)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        pipe = Pipeline(hf.causal_lm_layers(model), hf.CausalLMLoss(model), "1f1b", microbatches=2)
        names = [n for n, _ in pipe.named_parameters()]
        assert set(names) <= set(model.state_dict())
        if name == "hf-llama":  # untied: every parameter once, in the model's order
            assert names == [n for n, _ in model.named_parameters()]
        assert list(pipe.state_dict()) == list(model.state_dict())
        other = hf.tiny_model(name, seed=6)
        pipe.load_state_dict(other.state_dict(), strict=True)
        model.load_state_dict(pipe.state_dict(), strict=True)
        for key, value in other.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key
    finally:
        dist.destroy_process_group()


def test_reference_step_takes_a_padded_mapping_and_names_as_the_pipeline(tmp_path):
    """reference_step called as Pipeline.step is: the same losses, gradients and names."""
    import torch.distributed as dist

    from zerobubble.pipeline import Pipeline
    from zerobubble.reference.step import reference_step

    model = hf.tiny_model("hf-llama", seed=5)
    ids, mask, labels = padded_batch(4, 7)
    batch = {"input_ids": ids, "attention_mask": mask}
    ref = hf.causal_lm_layers(copy.deepcopy(model))
    losses, grads = reference_step(
        ref, hf.CausalLMLoss(model), batch, target=labels, microbatches=2
    )
    assert list(grads) == [n for n, _ in model.named_parameters()]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        layers = hf.causal_lm_layers(model)
        pipe = Pipeline(layers, hf.CausalLMLoss(model), "1f1b", microbatches=2)
        got = pipe.step(batch, target=labels)
        assert got is not None and all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))
        for name, p in pipe.named_parameters():
            assert torch.equal(p.grad, grads[name]), name
    finally:
        dist.destroy_process_group()


def test_importing_the_adapter_leaves_transformers_out():
    code = "import sys, zerobubble.interop.hf; print('transformers' in sys.modules)"
    src = str(Path(hf.__file__).parents[2])  # this checkout's src/, not an installed copy
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": src},
    )
    assert out.stdout.strip() == "False"


# ---- what is refused -------------------------------------------------------------------------


def test_a_model_without_either_layout_is_refused():
    class Lm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = transformers.GPT2Config()
            self.body = nn.Linear(2, 2)

    with pytest.raises(ValueError, match="Lm has neither the GPT-2 layout"):
        hf.causal_lm_layers(Lm())
    with pytest.raises(ValueError, match="expected a transformers PreTrainedModel"):
        hf.causal_lm_layers(nn.Linear(2, 2))


def test_cross_attention_is_refused():
    with pytest.raises(ValueError, match="has cross-attention"):
        hf.causal_lm_layers(hf.tiny_model("hf-gpt2", add_cross_attention=True))


def test_a_forward_the_layout_does_not_reproduce_is_refused():
    """Granite has the Llama layout but multiplies the embeddings in its forward."""
    config = transformers.AutoConfig.for_model(
        "granite",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    assert len(hf.causal_lm_layers(transformers.AutoModelForCausalLM.from_config(config))) == 4
    config.embedding_multiplier = 4.0
    with pytest.raises(
        ValueError,
        match=r"GraniteForCausalLM: the layers cut from it do not "
        r"reproduce its own logits in eval mode \(max \|difference\| ",
    ):
        hf.causal_lm_layers(transformers.AutoModelForCausalLM.from_config(config))


def test_the_check_sees_which_layers_slide_beyond_its_batch_length():
    model = hf.tiny_model("hf-mistral", sliding_window=50)
    layers = hf.causal_lm_layers(model)
    assert model.config.sliding_window == 50
    layers[3].attention_type = "full_attention"
    with pytest.raises(ValueError, match="MistralForCausalLM: the layers cut from it do not"):
        hf.check_layers(model, layers)
    assert model.config.sliding_window == 50


def test_the_check_sees_a_missing_dropout():
    model = hf.tiny_model("hf-gpt2")
    layers = hf.causal_lm_layers(model)
    layers[0].drop = nn.Identity()
    with pytest.raises(ValueError, match=r"own logits in train mode \(dropout on\)"):
        hf.check_layers(model, layers)


def test_the_check_leaves_rng_and_modes_alone():
    model = hf.tiny_model("hf-gpt2").train()
    model.transformer.h[2].eval()
    modes = [m.training for m in model.modules()]
    rng = torch.get_rng_state()
    hf.causal_lm_layers(model)
    assert torch.equal(torch.get_rng_state(), rng)
    assert [m.training for m in model.modules()] == modes


def test_bad_layer_inputs_are_explained():
    layers = hf.causal_lm_layers(hf.tiny_model("hf-llama"))
    ids = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"unknown inputs 'labels'.*labels go to the loss"):
        layers[0]({"input_ids": ids, "labels": ids})
    with pytest.raises(ValueError, match="either as one mapping or as input_ids plus keywords"):
        layers[0]({"input_ids": ids}, attention_mask=ids)
    with pytest.raises(ValueError, match="input mapping has no 'input_ids'"):
        layers[0]({"attention_mask": ids})
    with pytest.raises(ValueError, match="input_ids must be an integer tensor or a mapping"):
        layers[0]([1, 2])
    with pytest.raises(
        ValueError, match=r"attention_mask must be \(batch, sequence\).*\(2, 1, 4\)"
    ):
        layers[0](ids, attention_mask=ids[:, None])
    with pytest.raises(ValueError, match="DecoderBlock: expected the previous layer's dict"):
        layers[1](torch.zeros(2, 4, 64))


def test_unknown_attention_types_and_tiny_names_are_refused():
    config = hf.tiny_config("hf-qwen2")
    config.layer_types = ["full_attention"] * 5 + ["chunked_attention"]
    with pytest.raises(ValueError, match="decoder layer 5 uses 'chunked_attention' attention"):
        hf.causal_lm_layers(transformers.AutoModelForCausalLM.from_config(config))
    with pytest.raises(ValueError, match="unknown tiny model 'hf-bert'"):
        hf.tiny_config("hf-bert")


def test_tiny_models_depend_only_on_the_seed():
    a, b = hf.tiny_model("hf-llama", seed=3), hf.tiny_model("hf-llama", seed=3)
    other = b.state_dict()
    assert all(torch.equal(v, other[k]) for k, v in a.state_dict().items())
    assert hf.tiny_config("hf-llama", num_hidden_layers=2).num_hidden_layers == 2
