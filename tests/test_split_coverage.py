"""Every new B/W split (Conv1D, Conv1d/2d, LayerNorm, user kernels, the graph-level fallback)
is bitwise plain autograd, in fp32 and under autocast bf16 on CPU, and defers W's work."""

from __future__ import annotations

import copy
import sys
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.runtime.split import (
    Kernel,
    SplitLinear,
    SplitOp,
    SplitRules,
    WeightGradStore,
    enable_bw_split,
    is_split,
    unsplit_modules,
)

pytestmark = [pytest.mark.bitwise, pytest.mark.kernels]  # kernels: rerun on other kernel paths


class Conv1D(nn.Module):
    """The contract of transformers' Conv1D: weight (in, out), addmm(bias, x.view(-1, in), w)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class ScaleShift(nn.Module):
    """A parameterised module no rule knows (an RMSNorm-like mix of its input, its own
    statistics and two parameter vectors): gets the graph-level fallback."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.shift = nn.Parameter(torch.linspace(-0.2, 0.2, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.scale + self.shift * x.mean(-1, keepdim=True)


def _seeded(make, seed: int = 0):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _autocast(on: bool, cache: bool = True):
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache) if on else nullcontext()


def _check(
    net: nn.Module,
    x: torch.Tensor,
    rules: SplitRules | None = None,
    amp: bool = False,
    cache: bool = True,
):
    """Recorded F and B, then W, on a split copy of ``net``; compares input and parameter
    gradients bitwise with plain autograd (under the same autocast, with its cast cache on
    or off). Returns the split net."""
    ref = copy.deepcopy(net)
    xr = x.detach().requires_grad_(x.is_floating_point())
    with _autocast(amp, cache):
        yr = ref(xr)
    gy = torch.randn(yr.shape, generator=torch.Generator().manual_seed(5)).to(yr.dtype)
    yr.backward(gy)
    store = WeightGradStore()
    split = enable_bw_split(net, store, rules)
    assert is_split(split)
    xs = x.detach().requires_grad_(x.is_floating_point())
    with store.record(0, 0), _autocast(amp, cache):
        y = split(xs)
    assert torch.equal(y, yr)
    params = [p for p in split.parameters() if p.requires_grad]
    ins = [xs] if xs.requires_grad else []
    grads = store.backward(0, 0, y, gy, ins, params)
    if ins:
        assert torch.equal(grads[0], xr.grad)  # B: the input gradient
    assert all(p.grad is None for p in params)  # nothing added before W
    assert store.held_tensors(0)
    store.run(0, 0)
    for (name, p), (_, q) in zip(split.named_parameters(), ref.named_parameters(), strict=True):
        if q.grad is None:  # a frozen parameter
            assert p.grad is None, name
            continue
        assert p.grad is not None and p.grad.dtype == q.grad.dtype, name
        assert torch.equal(p.grad, q.grad), name
    assert store.held_tensors() == [] and store.in_flight() == {}
    return split


AMP = pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast_bf16"])
DIMS = pytest.mark.parametrize("dims", [2, 3], ids=["2d", "3d"])


@AMP
@DIMS
def test_hf_conv1d_is_split_exactly(dims: int, amp: bool) -> None:
    net = _seeded(lambda: nn.Sequential(Conv1D(12, 8), nn.GELU(), Conv1D(8, 12)))
    x = torch.randn((6, 8) if dims == 2 else (2, 3, 8), generator=torch.Generator().manual_seed(1))
    split = _check(net, x, amp=amp)
    assert isinstance(split[0], SplitOp) and isinstance(split[2], SplitOp)


@AMP
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_conv1d_is_split_exactly(batched: bool, bias: bool, amp: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv1d(3, 5, 3, padding=1, bias=bias),
            nn.Tanh(),
            nn.Conv1d(5, 4, 2, stride=2, dilation=1, bias=bias, padding_mode="reflect", padding=1),
        )

    shape = (2, 3, 10) if batched else (3, 10)
    split = _check(
        _seeded(make), torch.randn(shape, generator=torch.Generator().manual_seed(2)), amp=amp
    )
    # Zero padding gets the kernel; reflect padding the graph-level split (its F.pad runs
    # before autocast's cast), deferred all the same.
    assert isinstance(split[0], SplitOp) and not isinstance(split[2], SplitOp)
    assert unsplit_modules(split) == []


class LinearFanOut(nn.Module):
    """Its input goes straight into q, k and v projections (and a Conv1D, which casts a view
    of it apart): under autocast the Linears share one cast of a leaf input, as autocast's
    cast cache has it, and sum their input gradients in bf16 before it casts them back."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.c = Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x) * self.k(x) + self.v(x) + self.c(x)


class ConvFanOut(nn.Module):
    """A conv and its shortcut conv on one input (a ResNet block), and a circular-padded conv
    (graph-level split: its F.pad comes before autocast's cast)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(c, c, 3, padding=1)
        self.shortcut = nn.Conv1d(c, c, 1, bias=False)
        self.pad = nn.Conv1d(c, c, 3, padding=1, padding_mode="circular")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.shortcut(x) + self.pad(x)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_leaf_input_feeding_several_split_layers_under_autocast(batched: bool) -> None:
    g = torch.Generator().manual_seed(14)
    lead = (2,) if batched else ()
    x = torch.randn(*lead, 5, 6, generator=g)
    split = _check(_seeded(lambda: LinearFanOut(6)), x, amp=True)
    assert all(isinstance(getattr(split, n), SplitLinear) for n in "qkv")
    split = _check(_seeded(lambda: ConvFanOut(3)), torch.randn(*lead, 3, 7, generator=g), amp=True)
    assert isinstance(split.conv, SplitOp) and isinstance(split.shortcut, SplitOp)
    assert unsplit_modules(split) == []


class Reused(nn.Module):
    """A Linear called twice and a Conv1D called three times in a forward; the Linear's
    second call gets a non-contiguous input, which takes the captured path, not the
    recorded one (see docs/runtime.md for three or more uses across both paths)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.conv1d = Conv1D(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(self.lin(x).tanh().transpose(0, 1)).transpose(0, 1).contiguous()
        return self.conv1d(self.conv1d(self.conv1d(h).sin()).cos())


class _OwnWeights(nn.Module):
    """Parameters used through functional calls, so no kernel applies: the graph-level
    split (with dropout inside, replayed in W from each call's RNG state)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) * 0.3)
        self.b = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(F.linear(x, self.w, self.b).tanh(), 0.25)


class _CalledThrice(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.own = _OwnWeights(d)
        self.out = nn.Linear(d, d)  # a split layer: the graph split sits on `own` alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.own(self.own(self.own(x)) + x))


@pytest.mark.parametrize(
    "amp,cache", [(False, True), (True, True), (True, False)], ids=["fp32", "bf16", "bf16_nocache"]
)
def test_a_graph_split_module_called_three_times_recomputes_its_calls_together(amp, cache) -> None:
    """W recomputes the calls of one graph-split module together, under one autocast
    context: each weight is cast once for all of them, as in the forward, and autograd sums
    the three calls' gradients there. Two microbatches, bitwise against plain autograd."""
    net = _seeded(lambda: _CalledThrice(6))
    ref = copy.deepcopy(net)
    g = torch.Generator().manual_seed(18)
    x, gy = torch.randn(4, 3, 6, generator=g), torch.randn(4, 3, 6, generator=g)
    store = WeightGradStore()
    split = enable_bw_split(net, store)
    assert unsplit_modules(split) == [] and isinstance(split.out, SplitLinear)
    params = [p for p in split.parameters() if p.requires_grad]
    for mb in range(2):
        torch.manual_seed(100 + mb)
        xr = x.detach().requires_grad_(True)
        with _autocast(amp, cache):
            yr = ref(xr)
        yr.backward(gy.to(yr.dtype))
        torch.manual_seed(100 + mb)
        xs = x.detach().requires_grad_(True)
        with store.record(0, mb), _autocast(amp, cache):
            y = split(xs)
        assert torch.equal(y, yr)
        (gx,) = store.backward(0, mb, y, gy.to(y.dtype), [xs], params)
        assert torch.equal(gx, xr.grad)
    for mb in range(2):
        store.run(0, mb)
    for (name, p), (_, q) in zip(split.named_parameters(), ref.named_parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


class FrozenWeight(nn.Module):
    """A Linear whose weight is frozen but whose bias trains, on a transposed 3-D input: for
    such a weight matmul does not fold the input into a copy but multiplies batched."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.lin.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.transpose(0, 1)
        return (z * 1.5 + self.lin(z)).transpose(0, 1)


@AMP
def test_frozen_weight_with_a_trainable_bias_on_an_unfoldable_input(amp: bool) -> None:
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(17))
    split = _check(_seeded(lambda: FrozenWeight(6)), x, amp=amp)
    assert isinstance(split.lin, SplitLinear)


@pytest.mark.parametrize("cache", [True, False], ids=["cast_cache", "no_cast_cache"])
def test_a_layer_used_several_times_under_autocast(cache: bool) -> None:
    """Autocast casts a weight once per forward when its cache is on: the uses' gradients
    are summed in bf16 at that one cast and the sum cast back (W does the same); with the
    cache off each use has its own cast and the sums are in fp32."""
    x = torch.randn(4, 3, 6, generator=torch.Generator().manual_seed(16))
    split = _check(_seeded(lambda: Reused(6)), x, amp=True, cache=cache)
    assert isinstance(split.lin, SplitLinear) and isinstance(split.conv1d, SplitOp)


@AMP
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_conv2d_is_split_exactly(batched: bool, bias: bool, amp: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1, bias=bias),
            nn.ReLU(),
            nn.Conv2d(4, 4, 3, groups=2, stride=2, bias=bias, padding="valid"),
        )

    shape = (2, 2, 7, 7) if batched else (2, 7, 7)
    _check(_seeded(make), torch.randn(shape, generator=torch.Generator().manual_seed(3)), amp=amp)


@AMP
@DIMS
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm_opt_in_is_split_exactly(dims: int, bias: bool, amp: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, bias=bias), nn.Linear(8, 8))

    x = torch.randn((5, 8) if dims == 2 else (2, 5, 8), generator=torch.Generator().manual_seed(4))
    split = _check(_seeded(make), x, SplitRules.default().with_layer_norm(), amp=amp)
    assert isinstance(split[1], SplitOp)
    # By default a norm stays on plain autograd: its gradient arrives with B.
    plain = enable_bw_split(_seeded(make), WeightGradStore())
    assert isinstance(plain[1], nn.LayerNorm)
    assert [n for n, _ in unsplit_modules(plain)] == ["1"]


@AMP
@DIMS
def test_graph_level_fallback_defers_any_module_exactly(dims: int, amp: bool) -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 8), ScaleShift(8), nn.Linear(8, 8), ScaleShift(8))

    x = torch.randn((5, 8) if dims == 2 else (2, 5, 8), generator=torch.Generator().manual_seed(6))
    split = _check(_seeded(make), x, amp=amp)
    assert unsplit_modules(split) == []
    assert isinstance(split[1], ScaleShift)  # not swapped: hooks only, keys unchanged


def test_fallback_covers_attention_and_a_first_stage_without_input_gradient() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(11, 8)
            self.mix = ScaleShift(8)
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 3)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.mix(self.tok(idx))
            return self.head(h + self.mha(h, h, h, need_weights=False)[0])

    idx = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(7))
    split = _check(_seeded(Net), idx)
    assert unsplit_modules(split) == []


def test_fallback_off_and_plain_use_outside_record() -> None:
    net = _seeded(lambda: nn.Sequential(nn.Linear(8, 8), ScaleShift(8)))
    ref = copy.deepcopy(net)
    enable_bw_split(net, WeightGradStore(), fallback=False)
    assert [n for n, _ in unsplit_modules(net)] == ["1"]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(8))
    net(x).sum().backward()  # outside record: behaves like the original
    ref(x).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


class Scaled(nn.Module):
    """A user layer: y = x * weight (elementwise), with its own split rule."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 2.0, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def _scaled_forward(m, x, params):
    (w,) = params
    out = x * w
    return out, out, (x,)


def _scaled_grads(m, operands, params, need, gy):
    (x,) = operands
    # MulBackward0 for the weight: grad * x, reduced to the weight's shape.
    return ((gy * x).sum_to_size(params[0].shape) if need[0] else None,)


def test_user_registered_rule_is_used_and_exact() -> None:
    kernel = Kernel(_scaled_forward, _scaled_grads, param_names=("weight",), autocast="refuse")
    rules = SplitRules.default().with_rule(Scaled, kernel)
    net = _seeded(lambda: nn.Sequential(nn.Linear(6, 6), Scaled(6), nn.Linear(6, 2)))
    x = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(9))
    split = _check(net, x, rules)
    assert isinstance(split[1], SplitOp) and split[1].kernel is kernel
    assert list(split.state_dict()) == ["0.weight", "0.bias", "1.weight", "2.weight", "2.bias"]
    store = split[1].store
    with pytest.raises(RuntimeError, match="set Kernel"), store.record(0, 1), _autocast(True):
        split(x)


@AMP
def test_split_linear_under_autocast_both_paths(amp: bool) -> None:
    """Recorded and captured (a non-contiguous 3-D input) SplitLinear under autocast."""
    lin = _seeded(lambda: nn.Linear(8, 6))
    g = torch.Generator().manual_seed(10)
    for x in (torch.randn(2, 3, 8, generator=g), torch.randn(3, 2, 8, generator=g).transpose(0, 1)):
        ref = copy.deepcopy(lin)
        store = WeightGradStore()
        split = SplitLinear.from_linear(copy.deepcopy(lin), store)
        xr, xs = (x.detach().requires_grad_() for _ in range(2))
        with _autocast(amp):
            yr = ref(xr)
        gy = torch.randn(yr.shape, generator=g).to(yr.dtype)
        yr.backward(gy)
        with store.record(0, 0), _autocast(amp):
            y = split(xs)
        (gx,) = store.backward(0, 0, y, gy, [xs], [split.weight, split.bias])
        assert torch.equal(gx, xr.grad) and split.weight.grad is None
        store.run(0, 0)
        assert torch.equal(split.weight.grad, ref.weight.grad)
        assert torch.equal(split.bias.grad, ref.bias.grad)


def test_w_inside_an_autocast_region_is_not_recast() -> None:
    """W multiplies the operands its forward kept, whatever autocast state it runs in."""
    lin = _seeded(lambda: nn.Linear(8, 6))
    ref = copy.deepcopy(lin)
    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(13))
    with store.record(0, 0):
        y = split(x)
    gy = torch.ones_like(y)
    store.backward(0, 0, y, gy, [], [split.weight, split.bias])
    with _autocast(True):
        store.run(0, 0)
    ref(x).backward(gy)
    assert split.weight.grad.dtype == torch.float32
    assert torch.equal(split.weight.grad, ref.weight.grad)


def test_conv_same_padding_and_subclasses_get_the_fallback() -> None:
    class MyConv(nn.Conv1d):
        pass

    net = _seeded(lambda: nn.Sequential(nn.Conv1d(2, 2, 3, padding="same"), MyConv(2, 2, 1)))
    split = enable_bw_split(net, WeightGradStore())
    assert not isinstance(split[0], SplitOp) and not isinstance(split[1], SplitOp)
    assert unsplit_modules(split) == []  # both under the graph-level split
    x = torch.randn(1, 2, 6, generator=torch.Generator().manual_seed(11))
    _check(_seeded(lambda: nn.Sequential(nn.Conv1d(2, 2, 3, padding="same"), MyConv(2, 2, 1))), x)


def test_functional_linear_reference_sanity() -> None:
    """The local Conv1D is the transpose of a Linear (the contract the rule relies on)."""
    c = _seeded(lambda: Conv1D(4, 3))
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(12))
    assert torch.allclose(c(x), F.linear(x, c.weight.t(), c.bias))


# ---- whole pipelines: GPT-2 (Conv1D) and Llama layers, P >= 3 and V-shaped ------------------

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_bw_split import GPT2Block, LlamaBlock  # noqa: E402

from test_chunk import assert_matches_reference, make_chunks, sequential_order  # noqa: E402
from zerobubble.models import gpt_loss  # noqa: E402
from zerobubble.schedule.generators import zb_h1, zbv  # noqa: E402

VOCAB, D, T = 32, 16, 6


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(T, D)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.size(1)))


class _Twice(nn.Module):
    """One block applied twice (ALBERT's cross-layer sharing): every weight of the block is
    used by two split calls in the same forward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(self.block(x))


def _pipeline_model(kind: str) -> nn.Sequential:
    def make() -> nn.Sequential:
        # The Llama blocks have grouped-query attention: 2 query heads share 1 key/value head.
        blocks: list[nn.Module] = [
            GPT2Block(D, 2) if kind == "gpt2" else LlamaBlock(D, 2, 3 * D, n_kv_heads=1)
            for _ in range(3)
        ]
        if kind == "shared":
            blocks = [_Twice(b) for b in blocks]
        return nn.Sequential(_Embed(), *blocks, nn.LayerNorm(D), nn.Linear(D, VOCAB))

    return _seeded(make, seed=21)


def _without_norm_rule() -> SplitRules:
    """The default rules minus "norms stay in B": norms then get the graph-level split."""
    return SplitRules(tuple(r for r in SplitRules.default().rules if r.split is not None))


@AMP
@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-fallback", "shared"])
@pytest.mark.parametrize("sched", ["zb-h1", "zbv"])
def test_pipelines_of_hf_like_blocks_match_reference_bitwise(
    sched: str, kind: str, amp: bool
) -> None:
    schedule = zb_h1(3, 4) if sched == "zb-h1" else zbv(2, 4)
    cuts = [0, 2, 4] if sched == "zb-h1" else [0, 1, 2, 4]
    model = _pipeline_model("llama" if kind == "llama-fallback" else kind)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(22)
    ids = torch.randint(0, VOCAB, (6, T + 1), generator=g)
    chunks = make_chunks(model, cuts, gpt_loss, placement=schedule.placement)
    if kind == "llama-fallback":  # re-split the same stages with the norms deferred too
        rules = _without_norm_rule()
        for c in chunks:
            enable_bw_split(c.module, c.store, rules)
    kept = {type(m).__name__ for c in chunks[1:-1] for _, m in unsplit_modules(c.module)}
    # Middle stages hold blocks only: every parameter but the norms' (kept in B) is deferred.
    want = {"gpt2": {"LayerNorm"}, "llama": {"RMSNorm"}, "llama-fallback": set()}
    assert kept == {**want, "shared": {"RMSNorm"}}[kind]
    with _autocast(amp):
        assert_matches_reference(
            model, ref, chunks, sequential_order(schedule), gpt_loss, ids[:, :-1], ids[:, 1:], 4
        )


def test_fallback_restores_parameters_when_the_forward_raises() -> None:
    class Fails(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    net = nn.Sequential(nn.Linear(3, 3), Fails())
    store = WeightGradStore()
    enable_bw_split(net, store)
    weight = net[1].weight
    with pytest.raises(ValueError, match="boom"), store.record(0, 0):
        net(torch.randn(2, 3))
    assert net[1]._parameters["weight"] is weight and store.in_flight() == {}


def test_bench_model_width_rows_are_the_models_blocks() -> None:
    """bench_bw_split's goal rows: GPT-2 small's block and SmolLM2-360M's grouped-query
    Llama layers, at T=1024, with autocast off and on; the goal check is exact at its bounds."""
    from bench_bw_split import _meets_goals, workloads

    rows = workloads(quick=False, widths="model")
    assert [(w.width, w.amp, tuple(w.x.shape)) for w in rows] == [
        ("model", False, (1, 1024, 768)),
        ("model", True, (1, 1024, 768)),
        ("model", False, (1, 1024, 960)),
        ("model", True, (1, 1024, 960)),
    ]
    gpt2, llama = rows[0].module, rows[2].module
    assert tuple(gpt2.c_attn.weight.shape) == (768, 2304) and gpt2.n_heads == 12
    assert (llama.n_heads, llama.n_kv_heads) == (15, 5)
    assert tuple(llama.k.weight.shape) == (320, 960) and tuple(llama.up.weight.shape) == (2560, 960)
    ok = {"time_ratio": 1.05, "memory_ratio": 0.6, "w_time_share": 0.9}
    assert _meets_goals(ok) and _meets_goals({**ok, "w_time_share": None})
    assert not _meets_goals({**ok, "time_ratio": 1.051})
    assert not _meets_goals({**ok, "memory_ratio": 0.601})
    assert not _meets_goals({**ok, "w_time_share": 0.899})
