"""Sequence segments over earlier keys and values (``zerobubble.runtime.sequence.kv``).

``run_segments`` runs a stage's layers on k segments of the sequence by the executor's
protocol (forward in order with the earlier segments' keys and values as detached leaves,
backward in reverse with their accumulated gradients) and is compared with the whole
sequence in one pass, for our GPT and tiny Hugging Face Llama (sdpa and eager) and GPT-2
models, whole and as middle stages (hidden states in, so the input gradient is checked too).

What is bitwise: one segment, which issues the very ops of one pass on the same shapes.
With k > 1 nothing is bitwise by construction, the forward included: a segment's GEMMs
have fewer rows (``B * t`` instead of ``B * T``) and its attention rows fewer columns
(``end`` keys instead of ``T``, the rest masked), and a kernel's summation order depends
on the shape (a softmax row of 6 keys is summed in a vector tail, one of 16 in full
vectors; a linear layer on one token's rows rounds otherwise than on sixteen). The
parameter gradients also sum over segments in another order than over the sequence at
once, and the keys' and values' gradients over the later segments' query rows. On this
CPU the differences are a few ulps, so those tests use a tolerance of a few ulps at the
values' scale: float32 ``rtol=1e-5, atol=1e-6``, float64 ``rtol=1e-13, atol=1e-15``, with
``atol`` relative to the largest value of the output or of all the parameter gradients
(the worst case measured is about a quarter of it for float32, a third for float64, on
the default and on the Makefile's other kernel paths).
"""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from torch import nn

from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.runtime.sequence.check import check_segments
from zerobubble.runtime.sequence.kv import (
    SegmentAware,
    SegmentContext,
    run_segments,
    segment_inputs,
    segment_scope,
)

transformers = pytest.importorskip("transformers")

from zerobubble.interop import hf  # noqa: E402

B, T = 3, 16
CUTS = [(0, 8, 16), (0, 4, 8, 12, 16), (0, 5, 6, 16), (0, 1, 15, 16)]
TOLERANCE = {torch.float32: (1e-5, 1e-6), torch.float64: (1e-13, 1e-15)}
"""``(rtol, atol)`` per dtype; ``atol`` is relative to the largest value of the output, or of
all the parameter gradients (some are zero in exact arithmetic, e.g. a key bias's, and
rounding noise in both runs)."""
HF = ["llama-sdpa", "llama-eager", "gpt2-sdpa"]
INPUTS = [("gpt", False), ("gpt-stage", False)]  # our GPT takes no padding mask
INPUTS += [
    (f"{name}{stage}", padded)
    for name in HF
    for stage in ("", "-stage")
    for padded in (False, True)
]
INPUT_IDS = [f"{name}{'-padded' if padded else ''}" for name, padded in INPUTS]
# HF's eager attention takes its softmax in float32 whatever the dtype: no float64 eager.
DTYPED = [(*x, torch.float32) for x in INPUTS]
DTYPED += [(*x, torch.float64) for x in INPUTS if "eager" not in x[0]]
DTYPED_IDS = [f"{name}{'-padded' if padded else ''}-{str(d)[6:]}" for name, padded, d in DTYPED]


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def padding() -> torch.Tensor:
    """Row 1 left-padded, row 2 right-padded."""
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 11:] = 0
    return mask


@cache
def _hf_model(family: str, impl: str) -> nn.Module:
    """A two-block tiny model, dropout off (GPT-2's config has it)."""
    if family == "gpt2":
        fields = {"n_layer": 2, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    else:
        fields = {"num_hidden_layers": 2}
    return hf.tiny_model(f"hf-{family}", attn_implementation=impl, **fields).train()


def case(name: str, dtype: torch.dtype, padded: bool, position_ids: torch.Tensor | None = None):
    """``(layers, stage inputs, loss_fn, valid rows)`` of one model and input.

    A ``-stage`` case is the middle of the model (hidden states in and out, the loss a
    fixed projection of them); the others are whole models with their LM loss.
    """
    if name.startswith("gpt"):
        model = build_gpt(GPTConfig(max_seq_len=32, n_layers=2)).to(dtype)
        targets = ids(1)
        if name == "gpt":
            return list(model), ids(), lambda out: gpt_loss(out, targets), None
        layers = list(model)[1:3]
        with torch.no_grad():
            hidden = model[0](ids())
        return layers, hidden, _projection_loss(dtype), None
    family, impl = name.split("-")[:2]
    model = copy.deepcopy(_hf_model(family, impl)).to(dtype)
    layers = hf.causal_lm_layers(model, check=False)
    mask = padding() if padded else torch.ones(B, T, dtype=torch.long)
    rows = mask.bool() if padded else None
    # A left-padded row's pad queries see no key: eager attention then spreads them evenly
    # over every key of the mask's width, the future included, which no segment can
    # reproduce. Their logits carry nothing; leaving out the labels they predict (the
    # token after a pad) keeps them out of the loss, and the comparison skips their rows.
    labels = ids().masked_fill(mask == 0, -100)
    labels[:, 1:][mask[:, :-1] == 0] = -100
    batch = {"input_ids": ids(), "attention_mask": mask if padded else None}
    if position_ids is not None:
        batch["position_ids"] = position_ids
    if not name.endswith("-stage"):
        loss = hf.CausalLMLoss(model)
        return layers, batch, lambda out: loss(out, labels), rows
    with torch.no_grad():
        boundary = layers[0](batch)
    return layers[1:3], boundary, _projection_loss(dtype, rows), rows


def _projection_loss(dtype: torch.dtype, rows: torch.Tensor | None = None):
    weight = torch.randn(B, T, 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    if rows is not None:
        weight = weight * rows[..., None]
    return lambda out: (out * weight).sum()


def whole(layers, inputs, loss_fn):
    """One pass over the whole sequence: output, loss, parameter and input gradients."""
    leaf = None
    x = inputs
    if isinstance(x, torch.Tensor) and x.is_floating_point():
        x = leaf = x.detach().requires_grad_()
    elif isinstance(x, dict) and "hidden" in x:
        leaf = x["hidden"].detach().requires_grad_()
        x = {**x, "hidden": leaf}
    for layer in layers:
        x = layer(x)
    out = x["hidden"] if isinstance(x, dict) else x
    loss = loss_fn(out)
    loss.backward()
    grads = {
        f"{i}.{n}": p.grad.clone()
        for i, layer in enumerate(layers)
        for n, p in layer.named_parameters()
    }
    return out.detach(), loss.detach(), grads, None if leaf is None else leaf.grad


def compare(name, dtype, padded, cuts, check, position_ids=None):
    layers, inputs, loss_fn, rows = case(name, dtype, padded, position_ids)
    out, loss, grads, input_grad = whole(layers, inputs, loss_fn)
    for layer in layers:
        layer.zero_grad(set_to_none=True)
    run = run_segments(layers, inputs, cuts, loss_fn)
    if rows is not None:
        out, run_out = out[rows], run.output[rows]
    else:
        run_out = run.output
    check(run_out, out, out)
    check(run.loss, loss, loss)
    assert run.grads.keys() == grads.keys()
    scale = torch.stack([grad.abs().max() for grad in grads.values()]).max()
    for key, grad in grads.items():
        check(run.grads[key], grad, scale, msg=key)
    if input_grad is None:
        assert run.input_grad is None
    else:
        check(run.input_grad, input_grad, input_grad)


def _equal(actual, expected, scale, msg=""):
    assert torch.equal(actual, expected), msg


@pytest.mark.bitwise
@pytest.mark.kernels
@pytest.mark.parametrize(("name", "padded"), INPUTS, ids=INPUT_IDS)
def test_one_segment_is_the_whole_pass_bitwise(name, padded):
    """k=1 issues one pass's ops on one pass's shapes (the attention gets its own keys
    uncopied, the HF block an empty cache like the model's), so every bit agrees."""
    compare(name, torch.float32, padded, (0, T), _equal)


@pytest.mark.parametrize("cuts", CUTS, ids=str)
@pytest.mark.parametrize(("name", "padded", "dtype"), DTYPED, ids=DTYPED_IDS)
def test_segments_match_the_whole_pass(name, padded, dtype, cuts):
    """Outputs, loss, parameter and input gradients of k segments against one pass, within
    the module docstring's tolerance: the segments' kernels run on other shapes (so round
    otherwise, the forward too) and their gradients sum in another order."""
    compare(name, dtype, padded, cuts, _close(dtype))


def _close(dtype):
    rtol, atol = TOLERANCE[dtype]

    def close(actual, expected, scale, msg=""):
        torch.testing.assert_close(
            actual,
            expected,
            rtol=rtol,
            atol=atol * scale.abs().max().item(),
            msg=lambda m: f"{msg} {m}" if msg else m,
        )

    return close


@pytest.mark.parametrize("name", ["llama-sdpa", "gpt2-sdpa-stage"])
def test_given_position_ids_are_cut_with_the_segments(name):
    """The user's position ids (here starting at 3) go with their tokens, not offset again."""
    positions = torch.arange(3, 3 + T).unsqueeze(0)
    compare(name, torch.float64, True, (0, 5, 6, 16), _close(torch.float64), positions)


def test_gpt_segment_past_max_seq_len_names_the_limit():
    model = build_gpt(GPTConfig(max_seq_len=12, n_layers=1))
    with pytest.raises(ValueError, match=r"segment \[8, 14\) exceeds max_seq_len=12"):
        run_segments(model, torch.zeros(1, 14, dtype=torch.long), (0, 8, 14), lambda o: o.sum())
    stage = list(model)[1:2]  # an attention stage without the embedding checks it too
    past = [[(torch.zeros(1, 4, 8, 16), torch.zeros(1, 4, 8, 16))]]
    with (
        pytest.raises(ValueError, match=r"0\.attn: segment \[8, 14\) exceeds max_seq_len=12"),
        segment_scope(stage, SegmentContext(8, past)),
    ):
        stage[0](torch.zeros(1, 6, 64))


@pytest.mark.parametrize("name", ["gpt-stage", "llama-sdpa-stage"])
def test_a_past_of_the_wrong_length_names_the_layer(name):
    layers, inputs, _, _ = case(name, torch.float32, False)
    heads = 4 if name.startswith("gpt") else 2
    short = [[(torch.zeros(B, heads, 3, 16), torch.zeros(B, heads, 3, 16))]] * 2
    layer = "0.attn" if name.startswith("gpt") else "0"
    with (
        pytest.raises(
            ValueError,
            match=rf"{layer}: the past keys and values cover 3 and 3 tokens, but the segment "
            "starts at token 4",
        ),
        segment_scope(layers, SegmentContext(4, short)),
    ):
        layers[1](layers[0](segment_inputs(inputs, 4, 8)))


def test_the_past_needs_one_entry_per_attention_layer():
    layers, _, _, _ = case("gpt-stage", torch.float32, False)
    with (
        pytest.raises(ValueError, match="past has 1 entries, but the stage has 2 attention layers"),
        segment_scope(layers, SegmentContext(0, [[]])),
    ):
        pass


def test_the_scope_leaves_nothing_behind_even_on_an_exception():
    model = build_gpt(GPTConfig(max_seq_len=12, n_layers=2))
    aware = [m for m in model.modules() if isinstance(m, SegmentAware)]
    assert len(aware) == 3
    with pytest.raises(RuntimeError, match="inside"), segment_scope(model, SegmentContext(0)):
        assert all(m.segment_slot is not None for m in aware)
        raise RuntimeError("inside")
    assert all(m.segment_slot is None and "segment_slot" not in vars(m) for m in aware)
    reference = build_gpt(GPTConfig(max_seq_len=12, n_layers=2))
    x = torch.zeros(2, 12, dtype=torch.long)
    assert torch.equal(model(x), reference(x))


def test_a_mask_that_does_not_reach_the_segment_end_is_refused():
    layers, inputs, _, _ = case("llama-sdpa-stage", torch.float32, True)
    hidden = inputs["hidden"][:, 4:8]
    past = [[(torch.zeros(B, 2, 4, 16), torch.zeros(B, 2, 4, 16))]] * 2
    short = {**inputs, "hidden": hidden, "attention_mask": inputs["attention_mask"][:, 4:8]}
    with (
        pytest.raises(ValueError, match=r"^0: a segment ending at token 8 needs the 2-D padding"),
        segment_scope(layers, SegmentContext(4, past)),
    ):
        layers[0](short)
    with pytest.raises(ValueError, match="segments take a 2-D attention_mask"):
        segment_inputs({"attention_mask": torch.ones(B, 1, T, T)}, 4, 8)


def test_sliding_window_attention_runs_in_segments():
    """Sliding windows are no longer refused (tests/test_packed_segments.py holds them to
    Hugging Face's own pass): a window of 3 over cuts at 8."""
    model = hf.tiny_model("hf-mistral", num_hidden_layers=1, sliding_window=3)
    layers = hf.causal_lm_layers(model, check=False)
    run = run_segments(layers, ids(), (0, 8, 16), lambda o: o.sum())
    with torch.no_grad():
        whole = model(input_ids=ids()).logits
    torch.testing.assert_close(run.output, whole, rtol=1e-5, atol=1e-6)


class _PositionEmbedding(nn.Module):
    """Token and learned position embeddings, positions taken from the input's length: on
    a segment every token would get the position it has in the segment, a silent error."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, 64), nn.Embedding(T, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1]))


@pytest.mark.parametrize(
    ("name", "padded"),
    [("gpt", False), ("llama-sdpa", True), ("llama-eager", True), ("gpt2-sdpa", True)],
)
def test_check_segments_passes_the_segment_aware_models(name, padded):
    layers, inputs, _, _ = case(name, torch.float32, padded)
    for cuts in CUTS:
        check_segments(layers, inputs, cuts)


def test_check_segments_names_a_layer_that_reads_positions_from_the_length():
    layers, inputs, _, _ = case("gpt", torch.float32, False)
    torch.manual_seed(0)
    unaware = [_PositionEmbedding(), *layers[1:]]
    with pytest.raises(ValueError, match=r"layer 0 \(_PositionEmbedding\) computes other values"):
        check_segments(unaware, inputs, (0, 8, 16))
    with pytest.raises(ValueError, match="cuts must run from 0 to the sequence length 16"):
        check_segments(layers, inputs, (0, 8, 12))


def test_check_segments_runs_dropout_off_and_gives_the_mode_back():
    layers, inputs, _, _ = case("gpt", torch.float32, False)
    dropped = [layers[0], nn.Dropout(0.5), *layers[1:]]
    check_segments(dropped, inputs, (0, 8, 16))
    assert all(m.training for layer in dropped for m in layer.modules())
