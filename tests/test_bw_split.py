"""The B/W split reproduces plain autograd bit for bit and accumulates in microbatch order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

from zerobubble.runtime.split import (
    SplitEmbedding,
    SplitGrouped,
    SplitLinear,
    WeightGradStore,
    enable_bw_split,
    grouped_mm_supported,
)
from zerobubble.runtime.split.fallback import GraphSplit, install_graph_split
from zerobubble.runtime.split.store import WeightGradFn

pytestmark = [pytest.mark.bitwise, pytest.mark.kernels]  # kernels: rerun on other kernel paths


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _linear(in_f: int, out_f: int, bias: bool, seed: int = 0) -> nn.Linear:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Linear(in_f, out_f, bias=bias)


# Inputs covering every path F.linear takes: 2-D (addmm/mm, also column-major),
# contiguous N-D (flattened view), non-contiguous N-D (matmul fold with a copy),
# 1-D (unsqueezed).
INPUTS = {
    "2d": lambda g: torch.randn(12, 24, generator=g),
    "2d_column_major": lambda g: torch.randn(24, 12, generator=g).t(),
    "3d": lambda g: torch.randn(3, 5, 24, generator=g),
    "3d_transposed": lambda g: torch.randn(5, 3, 24, generator=g).transpose(0, 1),
    "3d_sliced": lambda g: torch.randn(3, 5, 30, generator=g)[:, :, :24],
    "4d": lambda g: torch.randn(2, 3, 4, 24, generator=g),
    "1d": lambda g: torch.randn(24, generator=g),
}


def _split_backward(
    store: WeightGradStore,
    layer: nn.Module,
    x: torch.Tensor,
    gy: torch.Tensor,
    mb: int,
    recorded: bool,
) -> torch.Tensor:
    """F then B of one microbatch through either protocol; returns the output.

    Recorded (StageChunk's protocol): forward inside ``record``, B through
    ``store.backward``, gradients of the other parameters handed to the store.
    """
    if recorded:
        with store.record(0, mb):
            y = layer(x)
        params = [p for p in layer.parameters() if p.requires_grad]
        inputs = ([x] if x.requires_grad else []) + params
        grads = store.backward(0, mb, y, gy, inputs)
        if x.requires_grad:
            x.grad, grads = grads[0], grads[1:]
        early = [(p, g) for p, g in zip(params, grads, strict=True) if g is not None]
        store.add_grads(0, mb, early)
        return y
    y = layer(x)  # plain forward, any backward inside capture()
    with store.capture(0, mb):
        y.backward(gy)
    return y


PROTOCOLS = pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "captured"])


@PROTOCOLS
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("shape", list(INPUTS))
def test_split_linear_matches_autograd_bitwise(shape: str, bias: bool, recorded: bool) -> None:
    g = _gen()
    x0 = INPUTS[shape](g)
    lin = _linear(24, 10, bias)
    ref = copy.deepcopy(lin)
    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    assert split.weight is lin.weight and split.bias is lin.bias
    gy = torch.randn(*x0.shape[:-1], 10, generator=g)

    x_ref = x0.detach().requires_grad_()
    y_ref = ref(x_ref)
    y_ref.backward(gy)

    if recorded:  # B returns the input gradient as torch.autograd.grad does
        x_ref.grad = torch.autograd.grad(ref(x_ref), x_ref, gy)[0]
    x = x0.detach().requires_grad_()
    y = _split_backward(store, split, x, gy, 0, recorded)
    assert torch.equal(y, y_ref)
    # B: only the input gradient, with autograd's layout.
    assert torch.equal(x.grad, x_ref.grad) and x.grad.stride() == x_ref.grad.stride()
    assert lin.weight.grad is None and (not bias or lin.bias.grad is None)
    # W: the weight and bias gradients.
    store.run(0, 0)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    if bias:
        assert torch.equal(lin.bias.grad, ref.bias.grad)
    assert store.in_flight() == {} and store.held_tensors() == []


def test_recorded_first_layer_input_without_gradient() -> None:
    # Stage 0 of an MLP: the input needs no gradient, only the weights do.
    lin = _linear(24, 10, True)
    ref = copy.deepcopy(lin)
    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    x = INPUTS["3d"](_gen())
    gy = torch.randn(3, 5, 10, generator=_gen(1))
    ref(x).backward(gy)
    _split_backward(store, split, x, gy, 0, recorded=True)
    assert lin.weight.grad is None and len(store.held_tensors()) == 2  # x and gy for W
    store.run(0, 0)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)


def test_recorded_layer_used_three_times_sums_in_autograds_order() -> None:
    # With three uses the order of the two additions shows in the bits.
    lin = _linear(6, 6, True)
    ref = copy.deepcopy(lin)
    x0 = torch.randn(4, 6, generator=_gen(7)) * 1e3
    gy = torch.randn(4, 6, generator=_gen(8))
    x_ref = x0.detach().requires_grad_()
    ref(ref(ref(x_ref))).backward(gy)
    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    x = x0.detach().requires_grad_()
    _split_backward(store, nn.Sequential(split, split, split), x, gy, 0, recorded=True)
    store.run(0, 0)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)


@pytest.mark.parametrize("shape", ["2d", "3d", "3d_transposed"])
def test_outside_capture_split_linear_gives_full_gradients_at_once(shape: str) -> None:
    g = _gen(1)
    x0 = INPUTS[shape](g)
    lin = _linear(24, 10, True)
    ref = copy.deepcopy(lin)
    split = SplitLinear.from_linear(lin, WeightGradStore())
    gy = torch.randn(*x0.shape[:-1], 10, generator=g)
    x_ref, x = x0.detach().requires_grad_(), x0.detach().requires_grad_()
    for _ in range(2):  # a second backward accumulates, as with nn.Linear
        ref(x_ref).backward(gy)
        split(x).backward(gy)
    for a, b in [(x, x_ref), (lin.weight, ref.weight), (lin.bias, ref.bias)]:
        assert torch.equal(a.grad, b.grad)


def test_frozen_weight_takes_the_plain_path() -> None:
    lin = _linear(4, 3, True)
    lin.weight.requires_grad_(False)
    lin.bias.requires_grad_(False)
    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    x = torch.randn(2, 4, requires_grad=True)
    with store.capture(0, 0):
        split(x).sum().backward()
    assert x.grad is not None and store.held_tensors() == []


def _order_sensitive_microbatches() -> tuple[nn.Linear, list[torch.Tensor], list[torch.Tensor]]:
    """A 1x1 linear whose per-microbatch weight gradients are 1e8, 1, -1e8.

    In float32, (1e8 + 1) - 1e8 = 0 but (-1e8 + 1e8) + 1 = 1, so the order
    of accumulation shows in the result.
    """
    lin = _linear(1, 1, True)
    xs = [torch.tensor([[1e8]]), torch.tensor([[1.0]]), torch.tensor([[-1e8]])]
    gys = [torch.ones(1, 1)] * 3
    return lin, xs, gys


@PROTOCOLS
def test_out_of_order_w_still_accumulates_in_microbatch_order(recorded: bool) -> None:
    lin, xs, gys = _order_sensitive_microbatches()
    ref = copy.deepcopy(lin)
    for x, gy in zip(xs, gys, strict=True):
        ref(x).backward(gy)
    assert ref.weight.grad.item() == 0.0  # in order: (1e8 + 1) - 1e8

    store = WeightGradStore()
    split = SplitLinear.from_linear(lin, store)
    for j, (x, gy) in enumerate(zip(xs, gys, strict=True)):
        _split_backward(store, split, x, gy, j, recorded)
    store.run(0, 2)  # held: microbatches 0 and 1 are not yet added
    assert lin.weight.grad is None
    assert store.in_flight() == {(0, 0): "backward", (0, 1): "backward", (0, 2): "ready"}
    store.run(0, 0)  # adds 0 only
    assert lin.weight.grad.item() == 1e8
    store.run(0, 1)  # adds 1, then the waiting 2
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)
    assert store.in_flight() == {}


def test_microbatch_order_is_per_chunk() -> None:
    a, xs, gys = _order_sensitive_microbatches()
    b = copy.deepcopy(a)
    store = WeightGradStore()
    sa, sb = SplitLinear.from_linear(a, store), SplitLinear.from_linear(b, store)
    for j in range(3):
        for chunk, layer in ((0, sa), (1, sb)):
            with store.capture(chunk, j):
                layer(xs[j]).backward(gys[j])
    for j in (0, 1, 2):
        store.run(1, j)  # chunk 1 in order: does not wait for chunk 0
    assert b.weight.grad.item() == 0.0 and a.weight.grad is None
    for j in (2, 1, 0):
        store.run(0, j)
    assert a.weight.grad.item() == 0.0


EMBEDDINGS = {
    "plain": {},
    "padding": {"padding_idx": 2},
    "scale_by_freq": {"scale_grad_by_freq": True},
    "max_norm": {"max_norm": 1.0},
}


@PROTOCOLS
@pytest.mark.parametrize("kwargs", list(EMBEDDINGS.values()), ids=list(EMBEDDINGS))
def test_split_embedding_matches_autograd_bitwise(kwargs: dict, recorded: bool) -> None:
    g = _gen(2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        emb = nn.Embedding(7, 5, **kwargs)
    ref = copy.deepcopy(emb)
    store = WeightGradStore()
    split = SplitEmbedding(emb, store)
    idx = torch.tensor([[0, 2, 2, 6], [1, 2, 0, 0]])  # repeats and the padding index
    gys = [torch.randn(2, 4, 5, generator=g) for _ in range(2)]
    for j, gy in enumerate(gys):
        y_ref = ref(idx)
        y_ref.backward(gy)
        y = _split_backward(store, split, idx, gy, j, recorded)
        assert torch.equal(y, y_ref)
    assert emb.weight.grad is None
    store.run(0, 1)
    store.run(0, 0)
    assert torch.equal(emb.weight.grad, ref.weight.grad)
    assert torch.equal(emb.weight, ref.weight)  # max_norm renormalised both alike


def test_sparse_embedding_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"sparse=True"):
        SplitEmbedding(nn.Embedding(4, 2, sparse=True), WeightGradStore())
    with pytest.raises(ValueError, match=r"sparse=True"):
        enable_bw_split(nn.Sequential(nn.Embedding(4, 2, sparse=True)), WeightGradStore())


class _Net(nn.Module):
    """Embedding, a Linear used twice, LayerNorm, a nested head, and an attention module."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.shared = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Sequential(nn.GELU(), nn.Linear(8, 3, bias=False))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.shared(self.emb(idx))
        h = self.norm(self.shared(h) + h)
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.head(h)


def _net() -> _Net:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return _Net()


def test_enable_bw_split_swaps_in_place_and_keeps_parameters() -> None:
    net = _net()
    params = dict(net.named_parameters())
    keys = list(net.state_dict())
    store = WeightGradStore()
    assert enable_bw_split(net, store) is net
    assert isinstance(net.emb, SplitEmbedding) and isinstance(net.shared, SplitLinear)
    assert isinstance(net.head[1], SplitLinear)
    # MultiheadAttention reads out_proj's weight directly: left alone.
    assert type(net.mha.out_proj) is not SplitLinear
    assert dict(net.named_parameters()) == params
    assert list(net.state_dict()) == keys
    store2 = WeightGradStore()
    enable_bw_split(net, store2)  # re-split rebinds to the new store
    assert net.shared.store is store2
    lone = nn.Linear(2, 2)
    swapped = enable_bw_split(lone, store)
    assert isinstance(swapped, SplitLinear) and swapped.weight is lone.weight


@PROTOCOLS
def test_unsplit_parameters_get_gradients_in_b_and_split_ones_in_w(recorded: bool) -> None:
    net = _net()
    ref = copy.deepcopy(net)
    store = WeightGradStore()
    enable_bw_split(net, store)
    g = _gen(4)
    idx = torch.randint(0, 11, (2, 5), generator=g)
    gy = torch.randn(2, 5, 3, generator=g)
    ref(idx).backward(gy)
    _split_backward(store, net, idx, gy, 0, recorded)
    split_names = {"emb.weight", "shared.weight", "shared.bias", "head.1.weight"}
    got = dict(net.named_parameters())
    want = dict(ref.named_parameters())
    for name in want:
        if name in split_names or recorded:  # recorded: B hands every gradient to the store
            assert got[name].grad is None, name
        else:  # LayerNorm and MultiheadAttention: exact, right after B
            assert torch.equal(got[name].grad, want[name].grad), name
    store.run(0, 0)
    for name in want:  # the Linear used twice sums both uses, as autograd does
        assert torch.equal(got[name].grad, want[name].grad), name


class _Reuse(nn.Module):
    """A Linear called twice and its weight also used directly: three contributions."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = _linear(6, 6, True, seed=9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.nn.functional.linear(torch.tanh(h), self.lin.weight) + self.lin(h * 1e3)


def test_recorded_weight_used_outside_its_layer_keeps_that_gradient() -> None:
    net, ref = _Reuse(), _Reuse()
    x0 = torch.randn(4, 6, generator=_gen(10))
    gy = torch.randn(4, 6, generator=_gen(11))
    x_ref = x0.detach().requires_grad_()
    ref(x_ref).backward(gy)
    store = WeightGradStore()
    enable_bw_split(net, store)
    x = x0.detach().requires_grad_()
    _split_backward(store, net, x, gy, 0, recorded=True)
    store.run(0, 0)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(net.lin.weight.grad, ref.lin.weight.grad)
    assert torch.equal(net.lin.bias.grad, ref.lin.bias.grad)


def test_unmodified_training_loop_is_unchanged() -> None:
    net, ref = _net(), _net()
    enable_bw_split(net, WeightGradStore())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (net, ref)]
    g = _gen(5)
    for _ in range(3):
        idx = torch.randint(0, 11, (2, 5), generator=g)
        for m, opt in zip((net, ref), opts, strict=True):
            opt.zero_grad()
            m(idx).square().mean().backward()
            opt.step()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@PROTOCOLS
def test_tied_weight_sums_both_uses_within_a_microbatch(recorded: bool) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(6)
        emb, head = nn.Embedding(9, 4), nn.Linear(4, 9, bias=False)
    head.weight = emb.weight
    net = nn.Sequential(emb, nn.Tanh(), head)
    ref = copy.deepcopy(net)
    store = WeightGradStore()
    enable_bw_split(net, store)
    assert net[0].weight is net[2].weight
    idx = torch.tensor([[1, 4, 4, 8]])
    gy = torch.randn(1, 4, 9, generator=_gen(12))
    for j in range(2):
        ref(idx).backward(gy)
        _split_backward(store, net, idx, gy, j, recorded)
    store.run(0, 1)
    store.run(0, 0)
    assert torch.equal(net[0].weight.grad, ref[0].weight.grad)


def test_store_rejects_misuse_with_clear_errors() -> None:
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match=r"chunk 0, microbatch 3: it was never forwarded"):
        store.run(0, 3)
    with pytest.raises(RuntimeError, match="outside a capture context"):
        store.defer(lambda: [], ())
    store.begin(0, 0)
    with pytest.raises(RuntimeError, match="has not run its backward"):
        store.run(0, 0)
    with pytest.raises(RuntimeError, match="already in flight"):
        store.begin(0, 0)
    with (
        store.capture(0, 0),
        pytest.raises(RuntimeError, match="inside capture"),
        store.capture(0, 1),
    ):
        pass  # pragma: no cover
    store.run(0, 0)
    with pytest.raises(RuntimeError, match="never forwarded or its W already ran"):
        store.run(0, 0)


def test_autocast_outside_record_matches_nn_linear() -> None:
    """Autocast used to be rejected; a split layer now runs it as nn.Linear does
    (recorded and captured paths under autocast: tests/test_split_coverage.py)."""
    lin = _linear(4, 4, True, seed=12)
    split = SplitLinear.from_linear(copy.deepcopy(lin), WeightGradStore())
    x = torch.randn(2, 4, generator=_gen(12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, want = split(x), lin(x)
    assert y.dtype == torch.bfloat16 and torch.equal(y, want)
    y.float().sum().backward()
    want.float().sum().backward()
    assert torch.equal(split.weight.grad, lin.weight.grad)
    assert torch.equal(split.bias.grad, lin.bias.grad)


def test_graph_split_is_found_through_its_hooks_and_writes_nothing_into_the_module() -> None:
    m = nn.LayerNorm(4)
    keys = set(m.__dict__)
    first, second = WeightGradStore(), WeightGradStore()
    install_graph_split(m, first)
    split = GraphSplit.of(m)
    assert split is not None and split.store is first
    assert set(m.__dict__) == keys
    install_graph_split(m, second)  # rebinds: no second pair of hooks
    assert GraphSplit.of(m) is split and split.store is second
    assert len(m._forward_pre_hooks) == len(m._forward_hooks) == 1
    twin = copy.deepcopy(m)
    assert GraphSplit.of(twin) not in (None, split)
    assert GraphSplit.of(nn.LayerNorm(4)) is None


def test_weight_grad_fn_takes_group_and_many_together() -> None:
    with pytest.raises(ValueError, match="give group and many together"):
        WeightGradFn(lambda gy: [], group=lambda args: None)


def test_a_swapped_layer_keeps_its_forward_hooks_in_order() -> None:
    """Tensor parallelism redistributes a layer's input and output in forward hooks: the
    split layer that replaces it must run them, in their order, with their kwargs flag."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    calls: list[str] = []

    def pre(m: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        calls.append("pre")
        return (args[0] * 2,)

    def pre_kw(
        m: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, object]
    ) -> tuple[tuple[Tensor, ...], dict[str, object]]:
        calls.append("pre_kw")
        return args, kwargs

    def post(m: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> Tensor:
        calls.append("post")
        return out + 1

    lin.register_forward_pre_hook(pre)
    lin.register_forward_pre_hook(pre_kw, with_kwargs=True)
    lin.register_forward_hook(post)
    x = torch.randn(5, 4)
    want = lin(x)
    root = nn.Sequential(lin)
    enable_bw_split(root, WeightGradStore())
    assert isinstance(root[0], SplitLinear)
    calls.clear()
    assert torch.equal(root(x), want)
    assert calls == ["pre", "pre_kw", "post"]


# ---- grouped linear (stacked expert weights, one grouped matmul) ------------------------------


class _Grouped(SplitGrouped):
    """One grouped linear over ``len(counts)`` groups: weight ``(E, out, in)`` (``(E, in,
    out)`` transposed), optional bias ``(E, out)``."""

    def __init__(self, groups: int, i: int, o: int, bias: bool, transposed: bool, dtype) -> None:
        super().__init__()
        g = _gen(1)
        shape = (groups, i, o) if transposed else (groups, o, i)
        self.w = nn.Parameter(torch.randn(shape, generator=g, dtype=dtype))
        self.b = nn.Parameter(torch.randn(groups, o, generator=g, dtype=dtype)) if bias else None
        self.transposed = transposed

    def forward(self, x: Tensor, counts: Tensor) -> Tensor:
        offs = counts.cumsum(0, dtype=torch.int32)
        if self.b is None:
            return self.grouped_linear(x, "w", offs, transposed=self.transposed)
        ids = torch.repeat_interleave(torch.arange(len(counts)), counts)
        return self.grouped_linear(x, "w", offs, "b", ids, transposed=self.transposed)


class _WithCounts(nn.Module):
    def __init__(self, grouped: _Grouped, counts: Tensor) -> None:
        super().__init__()
        self.grouped, self.counts = grouped, counts

    def forward(self, x: Tensor) -> Tensor:
        return self.grouped(x, self.counts)


GROUPED = {  # (rows per group, in, out, dtype): native where torch._grouped_mm takes them
    "uneven": ([50, 33, 0, 71], 8, 16, torch.float32),
    "empty_group": ([3, 0, 7], 32, 4, torch.float32),
    "no_rows": ([0, 0, 0], 8, 16, torch.float32),
    "loop_unaligned": ([5, 0, 9, 2], 6, 10, torch.float32),
    "loop_float64": ([5, 1, 0, 9], 8, 16, torch.float64),
    "bfloat16": ([4, 12, 0], 16, 8, torch.bfloat16),
}


@PROTOCOLS
@pytest.mark.parametrize("transposed", [False, True], ids=["stacked", "transposed"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("case", list(GROUPED))
def test_split_grouped_linear_matches_autograd_bitwise(
    case: str, bias: bool, transposed: bool, recorded: bool
) -> None:
    """B computes the input gradient, W the weight and bias gradients (kernel-level: no
    graph split, no second forward), bitwise plain autograd of the same module; groups
    without rows included, and the per-group loop where torch._grouped_mm refuses."""
    counts, i, o, dtype = GROUPED[case]
    rows = torch.tensor(counts)
    g = _gen(2)
    x0 = torch.randn(int(rows.sum()), i, generator=g, dtype=dtype)
    gy = torch.randn(len(x0), o, generator=g, dtype=dtype)
    ref = _Grouped(len(counts), i, o, bias, transposed, dtype)
    native = grouped_mm_supported(x0, ref.w)
    assert native == case.startswith(("uneven", "empty", "no_rows", "bfloat16")), case
    module = copy.deepcopy(ref)
    store = WeightGradStore()
    assert enable_bw_split(module, store) is module and module.store is store
    assert all(GraphSplit.of(m) is None for m in module.modules())
    x_ref = x0.clone().requires_grad_()
    y_ref = ref(x_ref, rows)
    y_ref.backward(gy)
    x = x0.clone().requires_grad_()
    y = _split_backward(store, _WithCounts(module, rows), x, gy, 0, recorded)
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)
    assert all(p.grad is None for p in module.parameters())  # deferred to W
    store.run(0, 0)
    for p, q in zip(module.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    assert store.in_flight() == {} and store.held_tensors() == []
