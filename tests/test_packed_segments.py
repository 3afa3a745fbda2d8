"""Sequence segments on the inputs long-context training uses (issue 44): packed documents,
sliding windows and rotary embeddings whose frequencies depend on the length.

Each case is held to two references:

* Hugging Face's own pass over the whole sequence (the model's forward without a cache,
  the training setting in which it applies its packed-sequence mask, and
  ``loss.backward()``): every logit, the loss and every parameter gradient of k segments
  (:func:`~zerobubble.runtime.sequence.kv.run_segments`) within :data:`BOUND`, float32
  rounding at the values' scale (the segments' kernels run on other shapes and their
  gradients sum in another order, so nothing is bitwise: docs/long-context.md);
* the pipeline (P = 2 ranks over gloo, seq-zb and seq1f1b) bitwise against
  :func:`~zerobubble.reference.step.segment_reference_step`, and within :data:`BOUND` of
  :func:`~zerobubble.reference.step.reference_step` over the whole sequence.

The attention is made position-sensitive (the query and key projections scaled by 8, so
the scores span several units and a key seen or missed, or a position rotated otherwise,
moves the output by orders more than the bound), and each guarded error is shown to be one:
HF's pass with a cache (no packed mask) and the segments without the rotary guard both
differ by more than :data:`WRONG`.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from generated import generated
from ranks import launch
from test_seq_runtime import stage_step_grads
from zerobubble.parallel.partition import model_name
from zerobubble.reference.step import reference_step, segment_reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.sequence.kv import SegmentContext, run_segments, segment_scope

transformers = pytest.importorskip("transformers")

from zerobubble.interop import hf, hf_layers  # noqa: E402

IGNORE = -100
T = 24
ROWS = 5
BOUND = (1e-5, 1e-6)
"""``(rtol, atol)``: float32 rounding; ``atol`` relative to the largest value of the logits,
or of all the parameter gradients."""
WRONG = 1e-3
"""A wrong mask or rotation moves the logits by more than this, relative to their largest."""

DOCUMENTS = [[7, 10, 7], [3, 15, 6], [24], [12, 12], [1, 5, 5, 13]]
"""Each row's document lengths: most documents straddle a cut of :data:`CUTS`."""
CUTS = [(0, 5, 12, 20, 24), (0, 10, 24), (0, 1, 23, 24)]


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def ids(seed: int = 0, n: int = ROWS, t: int = T) -> torch.Tensor:
    return torch.randint(3, 256, (n, t), generator=torch.Generator().manual_seed(seed))


def packed_positions() -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])


def labels_of(tokens: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Next-token labels shifted once for the whole sequence (position t scores token t+1),
    ignored at the end and wherever ``keep`` (per position) is False at t or t + 1."""
    y = torch.full_like(tokens, IGNORE)
    y[:, :-1] = tokens[:, 1:]
    if keep is not None:
        y[:, :-1] = y[:, :-1].masked_fill(~(keep[:, :-1] & keep[:, 1:]), IGNORE)
    return y


def sharpen(model: nn.Module) -> nn.Module:
    """Scale every query and key projection by 8: position-sensitive attention."""
    cfg = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3's fused projection: q and k rows
                hd = cfg.hidden_size // cfg.num_attention_heads
                attn.qkv_proj.weight[
                    : (cfg.num_attention_heads + cfg.num_key_value_heads) * hd
                ] *= 8
            else:
                attn.q_proj.weight.mul_(8)
                attn.k_proj.weight.mul_(8)
    return model


def built(config: Any) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return sharpen(transformers.AutoModelForCausalLM.from_config(config)).train()


def llama(impl: str = "sdpa", **fields: Any) -> nn.Module:
    config = hf.tiny_config(
        "hf-llama", num_hidden_layers=2, attn_implementation=impl, tie_word_embeddings=False
    )
    for key, value in fields.items():
        setattr(config, key, value)
    return built(config)


def windowed(family: str, window: int) -> nn.Module:
    """Mistral (every layer slides), Qwen2 (``use_sliding_window`` from layer 2 on, by
    ``max_window_layers``), Gemma-2 (sliding and full alternate; attention logits and
    final logits soft-capped, eager attention) or Gemma-3 (sliding and full alternate, each
    with its own rotary table)."""
    if family == "mistral":
        return built(hf.tiny_config("hf-mistral", num_hidden_layers=2, sliding_window=window))
    if family == "qwen2":
        config = hf.tiny_config(
            "hf-qwen2", num_hidden_layers=4, max_window_layers=2, sliding_window=window
        )
        return built(config)
    if family == "gemma3":
        config = transformers.Gemma3TextConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=128,
            sliding_window=window,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=5.0,
            tie_word_embeddings=False,
            pad_token_id=0,
        )
        return built(config)
    config = transformers.Gemma2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=window,
        attn_logit_softcapping=5.0,
        final_logit_softcapping=5.0,
        tie_word_embeddings=False,  # the pipeline test names each stage's own parameters
        pad_token_id=0,
    )
    return built(config)


def padding() -> torch.Tensor:
    """Row 1 left-padded, row 2 right-padded."""
    mask = torch.ones(ROWS, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 17:] = 0
    return mask


def case(spec: tuple) -> tuple[nn.Module, dict, torch.Tensor]:
    """``(model, batch, labels)`` of a spec: ``("packed", impl)``, ``("window", family,
    window, padded)``."""
    tokens = ids()
    if spec[0] == "packed":
        positions = packed_positions()
        # a document's last token does not score the next document's first
        labels = labels_of(tokens)
        labels[:, :-1] = labels[:, :-1].masked_fill(positions[:, 1:] == 0, IGNORE)
        return llama(spec[1]), {"input_ids": tokens, "position_ids": positions}, labels
    _, family, window, padded = spec
    model = windowed(family, window)
    if not padded:
        return model, {"input_ids": tokens}, labels_of(tokens)
    mask = padding()
    return model, {"input_ids": tokens, "attention_mask": mask}, labels_of(tokens, mask.bool())


def hf_pass(model: nn.Module, batch: dict, labels: torch.Tensor, n: int, **kw: Any) -> tuple:
    """HF's own whole-sequence pass: logits, loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    logits = model(**batch, use_cache=False, **kw).logits
    loss = token_loss(logits, labels, n)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), loss.detach(), grads


def close(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str = "") -> float:
    rtol, atol = BOUND
    torch.testing.assert_close(
        actual, expected, rtol=rtol, atol=atol * scale, msg=lambda m: f"{what} {m}"
    )
    return float((actual - expected).abs().max()) / scale


def against_hf(model: nn.Module, batch: dict, labels: torch.Tensor, cuts: tuple, rows=None):
    """k segments of the adapter's layers against HF's own pass: the largest differences of
    logits and gradients relative to their largest values."""
    layers = hf.causal_lm_layers(model)
    n = count(labels)
    logits, loss, grads = hf_pass(model, batch, labels, n)
    run = run_segments(layers, batch, cuts, lambda out: token_loss(out, labels, n))
    keep = torch.ones(logits.shape[:2], dtype=torch.bool) if rows is None else rows
    scale = float(logits[keep].abs().max())
    worst = close(run.output[keep], logits[keep], scale, "logits")
    close(run.loss, loss, float(loss), "loss")
    gscale = max(float(g.abs().max()) for g in grads.values())
    for name, p in model.named_parameters():
        if name in grads:
            assert p.grad is not None, name
            worst = max(worst, close(p.grad, grads[name], gscale, name))
    model.zero_grad(set_to_none=True)
    return worst


# ---- packed documents ---------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_layers_are_hfs_packed_pass_bitwise_and_hf_with_a_cache_is_not(impl):
    """The adapter's layers over the whole packed sequence are HF's forward without a cache
    bitwise (its packed-sequence mask: no token sees another document). HF's forward with
    its default cache builds no such mask and attends across documents, by far more than
    the bound: what a segment did before, and what the layers do not copy."""
    model, batch, _ = case(("packed", impl))
    layers = hf.causal_lm_layers(model)
    with torch.no_grad():
        x: Any = batch
        for layer in layers:
            x = layer(x)
        own = model(**batch, use_cache=False).logits
        crossing = model(**batch, use_cache=True).logits
    assert torch.equal(x, own)
    assert float((crossing - own).abs().max()) > WRONG * float(own.abs().max())


@pytest.mark.parametrize("cuts", CUTS, ids=str)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_documents_across_cuts_match_hfs_whole_pass(impl, cuts):
    """Documents straddling the cuts: each segment's queries see their own document's earlier
    keys only, those of earlier segments included (the document ids come from the whole
    sequence's position ids, which travel with every segment)."""
    model, batch, labels = case(("packed", impl))
    assert against_hf(model, batch, labels, cuts) <= 1e-5


def test_packed_segments_without_the_whole_position_ids_are_refused():
    """A segment needs the position ids of the earlier tokens too (their documents)."""
    model, batch, _ = case(("packed", "sdpa"))
    layers = hf.causal_lm_layers(model, check=False)
    inputs = {
        "input_ids": batch["input_ids"][:, 5:12],
        "position_ids": batch["position_ids"][:, 5:12],
    }
    past = [[(torch.zeros(ROWS, 2, 5, 16), torch.zeros(ROWS, 2, 5, 16))]] * 2
    with (
        pytest.raises(ValueError, match=r"tokens \[5, 12\) needs the position ids of the whole"),
        segment_scope(layers, SegmentContext(5, past)),
    ):
        layers[1](layers[0](inputs))


def test_packed_segments_under_an_attention_without_mask_functions_are_refused():
    """The document mask goes into the mask the layers build from a mask function, which
    they do for sdpa and eager; another implementation (flex here, flash attention on a GPU)
    is refused in segments, naming the fix, rather than attending across documents."""
    model, batch, _ = case(("packed", "sdpa"))
    model.config._attn_implementation = "flex_attention"
    layers = hf.causal_lm_layers(model, check=False)
    with pytest.raises(ValueError, match=r"not 'flex_attention': build the model with attn_impl"):
        run_segments(layers, batch, (0, 12, 24), lambda o: o.sum())


# ---- sliding windows ----------------------------------------------------------------------

WINDOWS = [3, 9, 40]
"""Smaller than every segment of (0, 5, 12, 20, 24) but the first, spanning several
segments of (0, 1, 23, 24) and (0, 2, ..., 10, 24), and longer than the sequence."""
WINDOW_CUTS = [(0, 5, 12, 20, 24), (0, 1, 23, 24), (0, 2, 4, 6, 8, 10, 24)]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2", "gemma3"])
def test_sliding_windows_in_segments_match_hfs_whole_pass(family, window, padded):
    """A sliding-window layer's segment reads the earlier segments' keys from its first
    query's window on (none before): every window, smaller than a segment, spanning several,
    longer than the sequence, with left and right padding."""
    model, batch, labels = case(("window", family, window, padded))
    kinds = {b.attention_type for b in hf.causal_lm_layers(model, check=False)[1:-1]}
    assert "sliding_attention" in kinds
    rows = batch["attention_mask"].bool() if padded else None
    for cuts in WINDOW_CUTS:
        assert against_hf(model, batch, labels, cuts, rows) <= 1e-5


def test_a_window_reads_only_the_keys_it_sees(monkeypatch):
    """Under a window of 3 a segment's cache joins the 2 keys before it, not the whole past:
    per segment of (0, 5, 12, 20, 24) and layer, the past's length (none for the first
    segment), the segment's own keys and the joined keys the attention reads."""
    model = windowed("mistral", 3)
    layers = hf.causal_lm_layers(model, check=False)
    seen: list[tuple[int, int, int]] = []
    update = hf_layers._SegmentKV.update

    def spy(self, k, v, *args, **kwargs):
        joined, _ = update(self, k, v, *args, **kwargs)
        seen.append((sum(p.shape[-2] for p in self.past[0]), k.shape[-2], joined.shape[-2]))
        return joined, _

    monkeypatch.setattr(hf_layers._SegmentKV, "update", spy)
    run_segments(layers, {"input_ids": ids()}, (0, 5, 12, 20, 24), lambda o: o.sum())
    per_segment = [(0, 5, 5), (2, 7, 9), (2, 8, 10), (2, 4, 6)]
    assert seen == [s for s in per_segment for _ in range(2)]  # two layers


# ---- the pipeline -------------------------------------------------------------------------


def pipe_job(spec: tuple, kind: str, p: int, m: int, cuts: tuple[int, ...]) -> dict:
    rank = init_distributed(timeout_s=60).rank
    sched = generated(kind, p, m, segments=len(cuts) - 1)
    model, batch, labels = case(spec)
    layers = hf.causal_lm_layers(model, check=False)
    _, losses, grads = stage_step_grads(sched, list(layers), batch, labels, cuts, rank)
    torch.distributed.destroy_process_group()
    return {"losses": losses, "grads": grads}


@pytest.mark.bitwise
@pytest.mark.parametrize(
    ("spec", "kind", "cuts"),
    [
        (("packed", "sdpa"), "seq-zb", (0, 5, 12, 20, 24)),
        (("window", "mistral", 3, True), "seq1f1b", (0, 10, 15, 24)),
        (("window", "gemma2", 9, False), "seq-zb", (0, 2, 4, 24)),
    ],
    ids=["packed-llama", "mistral-window-3-padded", "gemma2-window-9"],
)
def test_the_pipeline_is_its_segment_reference_bitwise(spec, kind, cuts):
    m = 2
    results = launch(pipe_job, 2, spec, kind, 2, m, cuts, timeout=240)
    model, batch, labels = case(spec)
    layers = hf.causal_lm_layers(model, check=False)
    seg_losses, _ = segment_reference_step(
        layers, token_loss, batch, target=labels, microbatches=m, cuts=cuts, count_fn=count
    )
    seg_grads = {
        n: p.grad.clone()
        for n, p in nn.Sequential(*layers).named_parameters()
        if p.grad is not None
    }
    one_losses, one_grads = reference_step(
        layers, token_loss, batch, target=labels, microbatches=m, count_fn=count
    )
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == sorted(seg_grads)
    assert all(map(torch.equal, losses, seg_losses)), (losses, seg_losses)
    for name, g in grads.items():
        assert torch.equal(g, seg_grads[name]), name
    torch.testing.assert_close(sum(losses), sum(one_losses), rtol=BOUND[0], atol=BOUND[1])
    keys = tuple(str(i) for i in range(len(layers)))
    scale = max(float(g.abs().max()) for g in one_grads.values())
    for name, g in grads.items():
        expected = one_grads[model_name(name, keys, layers)]
        torch.testing.assert_close(g, expected, rtol=BOUND[0], atol=BOUND[1] * scale)


# ---- rotary embeddings whose frequencies depend on the length ------------------------------

ORIGINAL = 16
"""The length below which the length-dependent rotary embeddings do not scale."""


def phi3_longrope() -> nn.Module:
    """Phi-3 with ``longrope``: short factors within 16 tokens, long factors (1 to 8) beyond."""
    config = transformers.Phi3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 8,
            "long_factor": [1.0 + i for i in range(8)],
        },
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return built(config)


def llama_dynamic() -> nn.Module:
    """Llama with dynamic NTK scaling beyond max_position_embeddings = 16."""
    rope = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    return llama(max_position_embeddings=ORIGINAL, rope_parameters=rope)


ROPE_MODELS = {"longrope": phi3_longrope, "dynamic": llama_dynamic}


@pytest.mark.parametrize(
    ("rope", "length", "cuts", "given"),
    [
        ("longrope", 24, (0, 8, 24), False),  # segment 0 within 16 tokens, the sequence beyond
        ("longrope", 24, (0, 8, 24), True),
        ("dynamic", 24, (0, 12, 24), False),
        ("dynamic", 24, (0, 12, 24), True),
    ],
)
def test_length_dependent_rotary_cut_where_it_changes_the_result_is_refused(
    rope, length, cuts, given, monkeypatch
):
    """The rule, named with its fix, at the first segment that can see it (with the whole
    sequence's position ids given, the first segment); and the error it prevents: the same
    segments without the guard differ from HF's pass by more than WRONG."""
    model = ROPE_MODELS[rope]()
    tokens = ids(t=length)
    batch: dict[str, Any] = {"input_ids": tokens}
    if given:
        batch["position_ids"] = torch.arange(length).expand(ROWS, -1)
    layers = hf.causal_lm_layers(model)
    rule = {
        "longrope": rf"'longrope' .*first cut b1 > {ORIGINAL}\): cut so",
        "dynamic": rf"'dynamic' \(dynamic NTK\) .* every position is below {ORIGINAL}",
    }[rope]
    with pytest.raises(ValueError, match=rule) as refused:
        run_segments(layers, batch, cuts, lambda o: o.sum())
    first = (0, cuts[1]) if given else (cuts[1], cuts[2])
    assert f"tokens [{first[0]}, {first[1]})" in str(refused.value)
    monkeypatch.setattr(hf_layers, "_check_rope", lambda *a: None)
    with torch.no_grad():
        own = model(**batch, use_cache=False).logits
    run = run_segments(layers, batch, cuts, lambda o: o.sum())
    assert float((run.output - own).abs().max()) > WRONG * float(own.abs().max())


@pytest.mark.parametrize(
    ("rope", "length", "cuts"),
    [
        ("longrope", 24, (0, 17, 24)),  # every segment beyond 16 tokens: long factors
        ("longrope", 24, (0, 18, 20, 22, 24)),
        ("longrope", 16, (0, 5, 16)),  # the sequence within: short factors
        ("dynamic", 16, (0, 5, 9, 16)),  # no position reaches 16: no scaling
    ],
)
def test_length_dependent_rotary_cut_where_it_is_exact_matches_hfs_whole_pass(rope, length, cuts):
    model = ROPE_MODELS[rope]()
    tokens = ids(t=length)
    assert against_hf(model, {"input_ids": tokens}, labels_of(tokens), cuts) <= 1e-5
