"""W does no work that the fused backward does not: no second copy of an output gradient."""

from __future__ import annotations

import copy
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from zerobubble.runtime.split import WeightGradStore, enable_bw_split


class _OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside the context, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _Heads(nn.Module):
    """q/k/v projections viewed as heads and transposed, as attention does: the gradient
    reaching each projection's output is not contiguous."""

    def __init__(self, d: int, bias: bool) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(d, d, bias=bias) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        x = torch.tanh(x)  # not the leaf input: autocast caches the cast of a leaf
        q, k, v = (p(x).view(b, t, 2, d // 2).transpose(1, 2) for p in (self.q, self.k, self.v))
        return (q @ k.transpose(-2, -1)).softmax(-1) @ v


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "autocast_bf16"])
def test_w_takes_the_product_gradient_without_copying(bias: bool, amp: bool) -> None:
    torch.manual_seed(0)
    net = _Heads(8, bias)
    ref = copy.deepcopy(net)
    x = torch.randn(3, 5, 8)
    ctx = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if amp else nullcontext
    xr = x.clone().requires_grad_(True)
    with ctx():
        yr = ref(xr)
    gy = torch.randn(yr.shape, generator=torch.Generator().manual_seed(1)).to(yr.dtype)
    yr.backward(gy)

    store = WeightGradStore()
    split = enable_bw_split(net, store)
    xs = x.clone().requires_grad_(True)
    with store.record(0, 0), ctx():
        y = split(xs)
    (gx,) = store.backward(0, 0, y, gy, [xs], list(split.parameters()))
    assert torch.equal(gx, xr.grad)
    # Each projection keeps the 2-D gradient its product received, as its backward saw it.
    grads_2d = [t for t in store.held_tensors(0) if t.dim() == 2 and t.shape == (15, 8)]
    assert len(grads_2d) == 3 and all(t.is_contiguous() for t in grads_2d)
    counter = _OpCounter()
    with counter:
        store.run(0, 0)
    assert counter.ops["clone"] == 0 and counter.ops["copy_"] == 0, counter.ops
    assert counter.ops["mm"] == 3  # one dW product per projection, nothing else multiplied
    for (name, p), (_, q) in zip(split.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
