"""Operator-level split of backward into B (input gradient) and W (weight gradient).

A pipeline stage must send the gradient of its input upstream as early as
possible; the gradient of its own weights is only needed before the optimizer
step. For a linear layer ``Y = X Wᵀ + b`` the two are separate matrix products
(``dX = dY W`` and ``dW = dYᵀ X``), so :class:`SplitLinear` computes ``dX`` when
autograd reaches it (B) and hands ``dW``/``db`` to a :class:`WeightGradStore` as
deferred work that a later W op runs. :class:`SplitEmbedding` does the same
(its B is empty: token ids have no gradient).

Exactness: B and W call the very kernels PyTorch's autograd calls for
``F.linear`` / ``F.embedding`` (same folding of N-D inputs, same operand order
and layout-dependent formula, same bias reduction), so the gradients are
bitwise those of plain autograd. Gradients are added to ``.grad`` in
microbatch order, with plain autograd's arithmetic (first microbatch assigned,
later ones added), even when W ops run out of order.

Memory: after B only what W needs stays alive (each split layer's input and
output gradient); the rest of the microbatch's graph is freed by B.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

__all__ = [
    "GradList",
    "SplitEmbedding",
    "SplitLinear",
    "WeightGradStore",
    "enable_bw_split",
]

Key = tuple[int, int]
"""(chunk, microbatch)."""

GradList = list[tuple[Tensor, Tensor]]
"""``(parameter, gradient)`` pairs, in the order they were produced."""


@dataclass(frozen=True, slots=True)
class _Grad:
    """One parameter's gradient for one microbatch; ``owned`` if no one else holds it."""

    param: Tensor
    grad: Tensor
    owned: bool


@dataclass(frozen=True, slots=True)
class _Deferred:
    """One split layer's weight-gradient work for one microbatch."""

    compute: Callable[[], GradList]
    held: tuple[Tensor, ...]
    """The tensors ``compute`` keeps alive until it runs (for memory accounting)."""


class WeightGradStore:
    """Deferred weight-gradient work of one pipeline stage, keyed by (chunk, microbatch).

    Owned by one stage object and handed to its split layers at swap time; it
    holds no global state. The split layers learn which (chunk, microbatch) a
    backward belongs to only inside :meth:`capture`; outside it they compute
    full gradients immediately, like the layers they replace.

    Gradient order: every gradient a microbatch contributes (deferred weight
    gradients, and gradients produced during B that :meth:`add_grads` hands
    over) is added to ``.grad`` only once all earlier microbatches of the same
    chunk are added. A microbatch counts from :meth:`begin` (called at forward
    time by :class:`~zerobubble.runtime.chunk.StageChunk`, or implicitly by the
    first :meth:`capture`) until its gradients are added; "earlier" means a
    smaller microbatch index among those in flight. This gives microbatch order
    as long as a chunk forwards its microbatches in increasing order, which
    every schedule in this library does.
    """

    def __init__(self) -> None:
        self._key: Key | None = None
        self._state: dict[Key, str] = {}  # "open" -> "backward" -> "ready" -> (removed)
        self._work: dict[Key, list[_Deferred]] = {}
        self._early: dict[Key, GradList] = {}
        self._ready: dict[Key, list[_Grad]] = {}

    # ---- protocol -----------------------------------------------------------------------

    def begin(self, chunk: int, mb: int) -> None:
        """Register microbatch ``mb`` of ``chunk`` as in flight (at its forward)."""
        key = (chunk, mb)
        if key in self._state:
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb} is already in flight in this store; "
                "run its W before forwarding it again"
            )
        self._state[key] = "open"

    @contextmanager
    def capture(self, chunk: int, mb: int) -> Iterator[None]:
        """Attribute the weight-gradient work of backward calls inside to (chunk, mb)."""
        key = (chunk, mb)
        if self._key is not None:
            raise RuntimeError(
                f"capture({chunk}, {mb}) entered inside capture{self._key}; "
                "run one microbatch's backward at a time"
            )
        state = self._state.get(key)
        if state is None:
            self.begin(chunk, mb)
        elif state == "ready":
            raise RuntimeError(
                f"chunk {chunk}, microbatch {mb}: W already ran; its backward cannot run again"
            )
        self._key = key
        try:
            yield
        finally:
            self._key = None
            self._state[key] = "backward"

    @property
    def capturing(self) -> Key | None:
        """The (chunk, microbatch) of the current capture context, or None."""
        return self._key

    def defer(self, compute: Callable[[], GradList], held: Sequence[Tensor]) -> None:
        """Queue weight-gradient work for the microbatch being captured (split layers only)."""
        if self._key is None:
            raise RuntimeError("defer() called outside a capture context")
        self._work.setdefault(self._key, []).append(_Deferred(compute, tuple(held)))

    def add_grads(self, chunk: int, mb: int, grads: GradList) -> None:
        """Hand over gradients computed during B (parameters of unsplit modules)."""
        key = (chunk, mb)
        if self._state.get(key) not in ("open", "backward"):
            raise RuntimeError(
                f"add_grads for chunk {chunk}, microbatch {mb}, which is not in flight"
            )
        self._early.setdefault(key, []).extend(grads)

    def run(self, chunk: int, mb: int) -> None:
        """W: compute the deferred work of (chunk, mb) and accumulate in microbatch order."""
        key = (chunk, mb)
        state = self._state.get(key)
        if state != "backward":
            why = {
                None: "was never forwarded or its W already ran",
                "open": "has not run its backward (B) yet",
                "ready": "already ran W",
            }[state]
            raise RuntimeError(f"W of chunk {chunk}, microbatch {mb}: it {why}")
        # Gradients from B may alias tensors autograd handed elsewhere; the
        # split layers' own results are fresh tensors that .grad may adopt.
        grads = [_Grad(p, g, owned=False) for p, g in self._early.pop(key, [])]
        for item in self._work.pop(key, []):
            grads.extend(_Grad(p, g, owned=True) for p, g in item.compute())
        self._ready[key] = _sum_per_param(grads)
        self._state[key] = "ready"
        self._flush(chunk)

    def discard(self, chunk: int, mb: int) -> None:
        """Forget (chunk, mb) without touching ``.grad``: its work is being replayed."""
        key = (chunk, mb)
        for table in (self._state, self._work, self._early, self._ready):
            table.pop(key, None)

    # ---- inspection ---------------------------------------------------------------------

    def in_flight(self, chunk: int | None = None) -> dict[Key, str]:
        """Keys not yet accumulated and their state: open, backward (W pending) or ready."""
        return {k: s for k, s in self._state.items() if chunk is None or k[0] == chunk}

    def held_tensors(self, chunk: int | None = None) -> list[Tensor]:
        """Every tensor the store keeps alive for ``chunk`` (all chunks if None)."""
        out: list[Tensor] = []
        for key, items in self._work.items():
            if chunk is None or key[0] == chunk:
                out.extend(t for item in items for t in item.held)
        for key, grads in self._early.items():
            if chunk is None or key[0] == chunk:
                out.extend(g for _, g in grads)
        for key, ready in self._ready.items():
            if chunk is None or key[0] == chunk:
                out.extend(r.grad for r in ready)
        return out

    # ---- internals ----------------------------------------------------------------------

    def _flush(self, chunk: int) -> None:
        while True:
            mine = [mb for (c, mb) in self._state if c == chunk]
            if not mine:
                return
            first = (chunk, min(mine))
            if self._state[first] != "ready":
                return
            del self._state[first]
            for r in self._ready.pop(first):
                _accumulate(r)


def _sum_per_param(grads: list[_Grad]) -> list[_Grad]:
    """Sum contributions to the same parameter in arrival order, as autograd's input buffer does."""
    total: dict[int, _Grad] = {}
    for g in grads:
        prev = total.get(id(g.param))
        total[id(g.param)] = g if prev is None else _Grad(g.param, prev.grad + g.grad, True)
    return list(total.values())


def _accumulate(g: _Grad) -> None:
    """``.grad = g`` for the first microbatch, ``.grad += g`` after: AccumulateGrad's arithmetic.

    Like AccumulateGrad, the first gradient is adopted only if nobody else holds
    it and it has the parameter's strides; otherwise ``.grad`` gets a copy.
    """
    param, grad = g.param, g.grad
    with torch.no_grad():
        if param.grad is None:
            if not g.owned or grad.stride() != param.stride():
                grad = torch.empty_like(param).copy_(grad)
            param.grad = grad
        else:
            param.grad.add_(grad)


# ---- Linear -------------------------------------------------------------------------------


def _linear_operand(x: Tensor, in_features: int, has_bias: bool) -> Tensor:
    """The 2-D matrix ``F.linear`` actually multiplies, with autograd's layout.

    2-D inputs are used as they are (addmm/mm). A contiguous input with a bias
    is viewed as (N, in) and goes through addmm. Otherwise F.linear calls
    matmul, which unsqueezes 1-D inputs and reshapes (copying if needed) N-D ones.
    """
    if x.dim() == 2:
        return x
    if x.dim() == 1 and not (has_bias and x.is_contiguous()):
        return x.unsqueeze(0)
    return x.reshape(math.prod(x.shape[:-1]), in_features)


def _bias_via_addmm(x: Tensor) -> bool:
    """True where F.linear adds the bias inside addmm (else matmul, then an add)."""
    return x.dim() == 2 or x.is_contiguous()


def _grad_2d(gy: Tensor) -> Tensor:
    """The output gradient as the 2-D matrix the mm/addmm backward receives."""
    if gy.dim() == 2:
        return gy
    return gy.reshape(math.prod(gy.shape[:-1]), gy.shape[-1])


def _linear_input_grad(g2d: Tensor, weight: Tensor, x2d: Tensor, x: Tensor) -> Tensor:
    """dX, as autograd's mm_mat1_backward computes it (mat2 = weight.t())."""
    if x2d.stride(0) == 1 and x2d.stride(1) == x2d.size(0):
        gx2d = weight.t().mm(g2d.t()).t()  # column-major input: column-major gradient
    else:
        gx2d = g2d.mm(weight)
    return gx2d if x.dim() == 2 else gx2d.reshape(x.shape)


def _linear_weight_grad(g2d: Tensor, x2d: Tensor, weight: Tensor) -> Tensor:
    """dW, as mm_mat2_backward on mat2 = weight.t() followed by the transpose's backward."""
    if weight.stride(1) == 1 and weight.stride(0) == weight.size(1):
        return g2d.t().mm(x2d)  # weight.t() is column-major: (dYᵀX)ᵀᵀ
    return x2d.t().mm(g2d).t()


def _bias_grad(gsum: Tensor) -> Tensor:
    """db: the engine reduces the bias's incoming gradient with sum_to."""
    gb = gsum.sum_to_size((gsum.shape[-1],))
    return gb.clone() if gb.data_ptr() == gsum.data_ptr() else gb  # nothing reduced: a copy


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        store: WeightGradStore,
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the Parameter objects, to attribute gradients
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # The operands of the 2-D product, built once for B and W. The bias gets
        # addmm's 2-D gradient, or on the matmul-then-add path the N-D one.
        x2d = _linear_operand(x, w.size(1), bias is not None)
        g2d = _grad_2d(gy)
        gsum = g2d if _bias_via_addmm(x) else gy
        gx = _linear_input_grad(g2d, w, x2d, x) if need_x else None
        store: WeightGradStore = ctx.store
        if store.capturing is None:
            gw = _linear_weight_grad(g2d, x2d, w) if need_w else None
            return gx, gw, _bias_grad(gsum) if need_b else None, None

        # Keep only what W needs alive (a closure holds every name it mentions).
        w_operands = (x2d, g2d) if need_w else None
        b_operand = gsum if need_b else None

        def compute() -> GradList:
            grads: GradList = []
            if w_operands is not None:
                grads.append((weight, _linear_weight_grad(w_operands[1], w_operands[0], w)))
            if b_operand is not None:
                grads.append((bias, _bias_grad(b_operand)))
            return grads

        store.defer(compute, (*(w_operands or ()), *(() if b_operand is None else (b_operand,))))
        return gx, None, None, None


def _check_autocast(x: Tensor, what: str) -> None:
    if torch.is_autocast_enabled(x.device.type):
        raise RuntimeError(
            f"{what} does not support autocast: its deferred weight gradient would use the "
            "uncast operands. Cast the model (e.g. model.to(torch.bfloat16)) instead of "
            "running it under torch.autocast, or leave this module unsplit."
        )


class SplitLinear(nn.Module):
    """``nn.Linear`` whose backward defers the weight gradient to a store (B/W split).

    Reuses the original Parameter objects (optimizers and state_dict keys are
    unaffected). Inside ``store.capture(chunk, mb)`` its backward returns only
    the input gradient and queues ``dW``/``db`` for ``store.run(chunk, mb)``;
    outside it behaves exactly like ``nn.Linear``.
    """

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, store: WeightGradStore
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.store = store

    @classmethod
    def from_linear(cls, linear: nn.Linear, store: WeightGradStore) -> SplitLinear:
        return cls(linear.weight, linear.bias, store)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        wants = w.requires_grad or (b is not None and b.requires_grad)
        if not (torch.is_grad_enabled() and wants):
            return F.linear(x, w, b)  # no weight gradient to defer
        _check_autocast(x, "SplitLinear")
        return _SplitLinearFn.apply(x, w, b, self.store)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


# ---- Embedding ----------------------------------------------------------------------------


class _SplitEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        idx: Tensor,
        weight: Tensor,
        module: SplitEmbedding,
    ) -> Tensor:
        m = module
        out = F.embedding(idx, weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq)
        ctx.save_for_backward(idx)
        ctx.weight = weight
        ctx.num_weights = weight.size(0)
        # F.embedding passes -1 for "no padding index" to the kernel.
        ctx.padding_idx = -1 if m.padding_idx is None else m.padding_idx
        ctx.scale_grad_by_freq = m.scale_grad_by_freq
        ctx.store = m.store
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: Tensor):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        weight = ctx.weight
        args = (ctx.num_weights, ctx.padding_idx, ctx.scale_grad_by_freq)

        def compute() -> GradList:
            return [(weight, torch.ops.aten.embedding_dense_backward(gy, idx, *args))]

        store: WeightGradStore = ctx.store
        if store.capturing is None:
            return None, compute()[0][1], None
        store.defer(compute, (idx, gy))
        return None, None, None


class SplitEmbedding(nn.Module):
    """``nn.Embedding`` whose weight gradient is deferred to a store (B/W split).

    B has nothing to compute (indices have no gradient); W runs the dense
    embedding backward (padding_idx, scale_grad_by_freq and max_norm as in
    ``nn.Embedding``). ``sparse=True`` is rejected: a sparse gradient cannot be
    accumulated with dense autograd's arithmetic.
    """

    def __init__(self, embedding: nn.Embedding, store: WeightGradStore) -> None:
        super().__init__()
        if embedding.sparse:
            raise ValueError(
                "SplitEmbedding does not support nn.Embedding(sparse=True): the B/W split "
                "accumulates dense gradients. Use sparse=False, or keep this embedding "
                "out of enable_bw_split (e.g. wrap it in a subclass of nn.Embedding)."
            )
        self.num_embeddings = embedding.num_embeddings
        self.embedding_dim = embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.max_norm = embedding.max_norm
        self.norm_type = embedding.norm_type
        self.scale_grad_by_freq = embedding.scale_grad_by_freq
        self.weight = embedding.weight
        self.store = store

    def forward(self, idx: Tensor) -> Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.embedding(
                idx,
                self.weight,
                self.padding_idx,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
            )
        _check_autocast(self.weight, "SplitEmbedding")
        return _SplitEmbeddingFn.apply(idx, self.weight, self)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


# ---- swapping -----------------------------------------------------------------------------


def _split_of(module: nn.Module, store: WeightGradStore) -> nn.Module | None:
    # Exact types only: subclasses may override forward, and modules such as
    # nn.MultiheadAttention read their Linear's weights without calling it.
    if type(module) is nn.Linear:
        return SplitLinear.from_linear(module, store)
    if type(module) is nn.Embedding:
        return SplitEmbedding(module, store)
    if isinstance(module, SplitLinear | SplitEmbedding):
        module.store = store  # re-split: bind to the new store
    return None


def enable_bw_split(module: nn.Module, store: WeightGradStore) -> nn.Module:
    """Swap every ``nn.Linear`` / ``nn.Embedding`` in ``module`` for its split version, in place.

    The swapped layers keep the original Parameter objects and state_dict keys;
    a module shared at several places is replaced by one shared split module.
    Only modules of exactly these types are swapped (subclasses, and layers used
    through their weights rather than their forward, e.g. inside
    ``nn.MultiheadAttention``, are left alone); forward hooks registered on a
    swapped module are dropped.

    Parameters of all other modules (LayerNorm, attention internals, custom
    ops) keep plain autograd: their gradients are produced during B, not W.
    :class:`~zerobubble.runtime.chunk.StageChunk` still adds them to ``.grad``
    in microbatch order.

    Returns ``module``, or its split replacement if ``module`` itself is a
    Linear or Embedding.
    """
    replaced: dict[int, nn.Module] = {}

    def swap(m: nn.Module) -> nn.Module | None:
        if id(m) not in replaced:
            new = _split_of(m, store)
            replaced[id(m)] = new if new is not None else m
        new = replaced[id(m)]
        return None if new is m else new

    root = swap(module)
    if root is not None:
        return root
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = swap(child)
            if new is not None:
                parent._modules[name] = new
    return module
