"""Exact-autograd B/W kernels: split versions of ``nn.Linear`` and ``nn.Embedding``.

For a linear layer ``Y = X Wᵀ + b`` the input and weight gradients are separate
matrix products (``dX = dY W`` and ``dW = dYᵀ X``), so B computes ``dX`` and the
:class:`~zerobubble.runtime.split.store.WeightGradStore` keeps ``X`` and ``dY``
for a later W that computes ``dW``/``db``. :class:`SplitEmbedding` does the same
(its B is empty: token ids have no gradient).

Exactness: B and W call the very kernels PyTorch's autograd calls for
``F.linear`` / ``F.embedding`` (same folding of N-D inputs, same operand order
and layout-dependent formula, same bias reduction), so the gradients are
bitwise those of plain autograd.

Memory: after B only what W needs stays alive (each split layer's input and
output gradient); the rest of the microbatch's graph is freed by B.

torch.compile: the split layers' forwards run compiler-disabled when traced, so
a compiled module breaks its graph at each split layer and the layer records
itself eagerly (a traced recording would run once, at compile time); the
regions in between are compiled (see :mod:`zerobubble.runtime.compile`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard, TypeVar, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.tensor import DTensor
from torch.nn.modules.conv import _ConvNd

from zerobubble.runtime.split.store import (
    Call,
    GradList,
    WeightGradFn,
    WeightGradStore,
    cast_back,
    output_node,
)

__all__ = [
    "CONV",
    "HF_CONV1D",
    "LAYER_NORM",
    "Kernel",
    "SplitEmbedding",
    "SplitLinear",
    "SplitOp",
    "conv_splittable",
    "is_hf_conv1d",
]


_M = TypeVar("_M", bound=nn.Module)


def _eager_under_compile(forward: Callable[[_M, Tensor], Tensor]) -> Callable[[_M, Tensor], Tensor]:
    """``forward``, run eagerly when a compiler traces it (a graph break, see the module
    docstring). The check costs a fraction of what ``torch.compiler.disable`` costs on every
    eager call (a few µs per layer and forward)."""
    eager = torch.compiler.disable(forward)

    @functools.wraps(forward)
    def run(self: _M, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling():
            return eager(self, x)
        return forward(self, x)

    return run


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


def _mm_mat2_grad(g: Tensor, mat1: Tensor, mat2: Tensor, of_transpose: bool = False) -> Tensor:
    """Gradient of ``mat2`` in ``mm(mat1, mat2)``, as autograd's mm_mat2_backward computes it:
    the weight gradient of transformers' Conv1D (mat2: its weight) and, with
    ``of_transpose`` (the gradient of ``mat2.t()``: the transposes cancel), of Linear (mat2:
    ``weight.t()``)."""
    if mat2.stride(0) == 1 and mat2.stride(1) == mat2.size(0):
        g_t = g.t().mm(mat1)  # column-major mat2: column-major gradient
        return g_t if of_transpose else g_t.t()
    g_m = mat1.t().mm(g)
    return g_m.t() if of_transpose else g_m


def _linear_weight_grad(g2d: Tensor, x2d: Tensor, weight: Tensor) -> Tensor:
    """dW, as mm_mat2_backward on mat2 = weight.t() followed by the transpose's backward."""
    return _mm_mat2_grad(g2d, x2d, weight.t(), of_transpose=True)


def _bias_grad(gsum: Tensor) -> Tensor:
    """db: the engine reduces the bias's incoming gradient with sum_to."""
    gb = gsum.sum_to_size((gsum.shape[-1],))
    return gb.clone() if gb.data_ptr() == gsum.data_ptr() else gb  # nothing reduced: a copy


def _alias(p: Tensor) -> Tensor:
    """A leaf sharing ``p``'s data and version counter, with ``p.requires_grad``.

    A recorded layer computes with such aliases of its parameters: the graph is
    exactly the one the parameters would build (PyTorch picks kernels and saved
    tensors by ``requires_grad``), but B, which asks only for the stage input,
    the parameters and the recorded outputs, never reaches the aliases. A layer
    keeps its aliases across microbatches (as autograd reuses a parameter's
    gradient accumulator) while :func:`_current` holds.
    """
    return p.detach().requires_grad_(p.requires_grad)


_FOLD_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0"})
_PRODUCTS = frozenset({"MmBackward0", "AddmmBackward0"})


def _product_node(y: Tensor) -> Node | GradientEdge:
    """Where the 2-D product inside ``F.linear`` receives its gradient, else ``y``'s node.

    ``F.linear`` on an N-D input multiplies a 2-D view and views the product
    back; that view's backward reshapes ``y``'s gradient to 2-D (copying it when
    it is not contiguous, e.g. behind a head transpose). Recording the product's
    node lets W take that very 2-D tensor instead of reshaping, and copying, again.
    """
    fn = y.grad_fn
    if fn is not None and type(fn).__name__ in _FOLD_VIEWS:
        node = fn.next_functions[0][0]
        if node is not None and type(node).__name__ in _PRODUCTS:
            return node
    return output_node(y)


def _current(alias: Tensor | None, p: Tensor) -> TypeGuard[Tensor]:
    """``alias`` still is :func:`_alias` of ``p`` (same memory, size, strides, requires_grad)."""
    return alias is not None and _same_memory(alias, p) and alias.requires_grad == p.requires_grad


def _same_memory(alias: Tensor, p: Tensor) -> bool:
    """``alias.is_set_to(p)``; for a DTensor (tensor parallelism, which has no sharding rule
    for ``is_set_to``) the same placements on the same mesh and the same local memory."""
    if not isinstance(p, DTensor):
        return alias.is_set_to(p)
    if not (isinstance(alias, DTensor) and alias.placements == p.placements):
        return False
    with torch.no_grad():
        return alias.device_mesh == p.device_mesh and alias.to_local().is_set_to(p.to_local())


def _linear_grads(
    weight: Tensor, bias: Tensor | None, need_w: bool, need_b: bool, x: Tensor, gy: Tensor
) -> GradList:
    """W of a recorded linear call: dW and db from its input and output gradient."""
    x2d = _linear_operand(x, weight.size(1), bias is not None)
    g2d = _grad_2d(gy)
    grads: GradList = []
    if need_w:
        grads.append((weight, _linear_weight_grad(g2d, x2d, weight)))
    if need_b:
        assert bias is not None
        grads.append((bias, _bias_grad(g2d if _bias_via_addmm(x) else gy)))
    return grads


_LINEAR_W = WeightGradFn(_linear_grads)
"""W of recorded linear calls."""


class _SplitLinearCtx(Protocol):
    """What autograd's ctx of :class:`_SplitLinearFn` carries from forward to backward."""

    params: tuple[Tensor, Tensor | None]
    bias_used: Tensor | None
    store: WeightGradStore
    saved_tensors: tuple[Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: Tensor | None) -> None: ...


class _SplitLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _SplitLinearCtx,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        store: WeightGradStore,
        params: tuple[Tensor, Tensor | None],
    ) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params = params  # the Parameter objects (not autocast's copies), for attribution
        ctx.bias_used = bias  # the operand that stood for the bias (autocast: its cast)
        ctx.store = store
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _SplitLinearCtx, gy: Tensor
    ) -> tuple[Tensor | None, Tensor | None, Tensor | None, None, None]:
        x, w = ctx.saved_tensors
        weight, bias = ctx.params
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        # The operands of the 2-D product, built once for B and W. The bias gets
        # addmm's 2-D gradient, or on the matmul-then-add path the N-D one.
        x2d = _linear_operand(x, w.size(1), bias is not None)
        g2d = _grad_2d(gy)
        gsum = g2d if _bias_via_addmm(x) else gy
        gx = _linear_input_grad(g2d, w, x2d, x) if need_x else None
        store = ctx.store
        if store.capturing is None:
            gw = _linear_weight_grad(g2d, x2d, w) if need_w else None
            return gx, gw, _bias_grad(gsum) if need_b else None, None, None

        # Keep only what W needs alive (a closure holds every name it mentions).
        w_operands = (x2d, g2d) if need_w else None
        b_operand = gsum if need_b else None

        b_used = ctx.bias_used

        def compute() -> GradList:
            grads: GradList = []
            if w_operands is not None:
                gw = _linear_weight_grad(w_operands[1], w_operands[0], w)
                grads.append((weight, cast_back(gw, w, weight)))  # autocast: as ToCopyBackward
            if b_operand is not None:
                assert bias is not None and b_used is not None
                grads.append((bias, cast_back(_bias_grad(b_operand), b_used, bias)))
            return grads

        store.defer(compute, (*(w_operands or ()), *(() if b_operand is None else (b_operand,))))
        return gx, None, None, None, None


Casts = dict[int, tuple[Tensor, Tensor]]
"""Autocast casts shared within one recorded forward: ``id(source) -> (source, cast)``."""


@overload
def _cast(t: Tensor, dtype: torch.dtype, casts: Casts | None = None) -> Tensor: ...
@overload
def _cast(t: Tensor | None, dtype: torch.dtype, casts: Casts | None = None) -> Tensor | None: ...
def _cast(t: Tensor | None, dtype: torch.dtype, casts: Casts | None = None) -> Tensor | None:
    """``t`` as autocast casts an operand: floating tensors other than float64, by ``.to``.

    With ``casts`` (a lower-precision op, see :func:`_shared_casts`), a float32 leaf that
    requires grad and is not a view is cast once and the cast is shared, as autocast's
    cast cache does: several layers fed by one such leaf (a stage input going straight
    into q, k and v) then sum their input gradients in the low precision at that one
    cast, before it casts the sum back, exactly as plain autograd does.
    """
    if t is None or not t.is_floating_point() or t.dtype == torch.float64:
        return t
    if casts is None or not (
        t.dtype == torch.float32 and t.requires_grad and t.is_leaf and not t._is_view()
    ):
        return t.to(dtype)
    hit = casts.get(id(t))
    if hit is None:
        hit = casts[id(t)] = (t, t.to(dtype))
    return hit[1]


def _shared_casts(store: WeightGradStore) -> Casts | None:
    """The store's casts of the forward being recorded, if autocast's cache is on."""
    return store.casts if torch.is_autocast_cache_enabled() else None


def _cast_linear_grads(
    weight: Tensor,
    bias: Tensor | None,
    need_w: bool,
    need_b: bool,
    x: Tensor,
    w_used: Tensor,
    b_used: Tensor | None,
    gy: Tensor,
) -> GradList:
    """W of a linear call recorded under autocast: the products on the cast operands; the
    store casts each gradient back to its parameter's dtype (after summing the uses of one
    cast), as the cast's ToCopyBackward does."""
    x2d = _linear_operand(x, w_used.size(1), bias is not None)
    g2d = _grad_2d(gy)
    grads: GradList = []
    if need_w:
        grads.append((weight, cast_back(_linear_weight_grad(g2d, x2d, w_used), w_used, weight)))
    if need_b:
        assert bias is not None and b_used is not None
        gb = _bias_grad(g2d if _bias_via_addmm(x) else gy)
        grads.append((bias, cast_back(gb, b_used, bias)))
    return grads


_CAST_LINEAR_W = WeightGradFn(_cast_linear_grads)
"""W of linear calls recorded under autocast."""


class _Wrapper(nn.Module):
    """A split layer that answers for the layer it replaced: an attribute it does not have
    itself (``stride``, ``kernel_size``, ``padding``, ``dilation``, ``in_channels``, a
    user's own) is read from that layer, kept as ``layer`` outside the module tree (its
    parameters are the split layer's). Model code that reads its layers' configuration
    (transformers' TF-style padding reads a conv's ``stride``) then works on split layers.
    Writes go the same way: setting an attribute that the split layer does not hold itself
    but the replaced layer does (``split.padding = (2, 2)``) sets it there, where the op
    reads it, rather than on a split layer that would ignore it."""

    def __setattr__(self, name: str, value: Any) -> None:
        layer = self.__dict__.get("layer")
        own = name in self.__dict__ or name in self._parameters or name in self._modules
        # public configuration only: __class__ (FSDP's swap), hooks and state stay ours
        if layer is not None and not own and not name.startswith("_") and hasattr(layer, name):
            setattr(layer, name, value)
            return
        super().__setattr__(name, value)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__.get("layer")
            if layer is None or name.startswith("__"):
                raise
        try:
            return getattr(layer, name)
        except AttributeError:
            raise AttributeError(
                f"{type(self).__name__!r} object (the split {type(layer).__name__}) has no "
                f"attribute {name!r}",
                name=name,
                obj=self,
            ) from None


class SplitLinear(_Wrapper):
    """``nn.Linear`` whose backward defers the weight gradient to a store (B/W split).

    Reuses the original Parameter objects (optimizers and state_dict keys are
    unaffected). Called inside ``store.record(chunk, mb)`` it records itself for
    ``store.backward(chunk, mb, ...)``; otherwise, inside ``store.capture(chunk,
    mb)`` its backward returns only the input gradient and queues ``dW``/``db``.
    Either way ``store.run(chunk, mb)`` adds them. Outside both it behaves
    exactly like ``nn.Linear``.
    """

    bias: nn.Parameter | None  # registered by register_parameter, which takes None

    def __init__(
        self, weight: nn.Parameter, bias: nn.Parameter | None, store: WeightGradStore
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight = weight
        self.register_parameter("bias", bias)
        self.store = store
        self._aliases: list[Tensor | None] = [None, None]  # of weight and bias (_alias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, store: WeightGradStore) -> SplitLinear:
        # nn.Linear's stub declares its weight a Tensor; it is the layer's Parameter
        split = cls(linear.weight, linear.bias, store)  # type: ignore[arg-type]
        split.__dict__["layer"] = linear  # not a submodule: answers for its attributes
        return split

    @_eager_under_compile
    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        need_w = w.requires_grad
        need_b = b is not None and b.requires_grad
        if not ((need_w or need_b) and torch.is_grad_enabled()):
            return F.linear(x, w, b)  # no weight gradient to defer
        if not need_w and x.dim() > 2 and not x.is_contiguous():
            # Only the bias to defer, on an input matmul cannot fold without a copy: for a
            # weight that needs no gradient matmul then multiplies batched (bmm), not on the
            # folded copy, so this split's input gradient would differ in the last bits. The
            # bias gradient, one sum, stays in B.
            return F.linear(x, w, b)
        calls = self.store.recording
        dev = x.device.type
        if calls is None:
            return self._captured(x, w, b, dev)
        lw, lb = aliases = self._aliases
        if not _current(lw, w):
            lw = aliases[0] = _alias(w)
        if b is not None and not _current(lb, b):
            lb = aliases[1] = _alias(b)
        if not (x.dim() <= 2 or x.is_contiguous()):
            # Captured, not recorded: matmul would fold this input into a copy, which W
            # needs and only the captured path keeps. On the aliases, so that under autocast
            # this call shares the one cast per weight with the recorded calls, as
            # autocast's cache shares it among all uses.
            return self._captured(x, lw, lb, dev)
        if not torch.is_autocast_enabled(dev):
            y = F.linear(x, lw, lb)
            calls.append(Call(x, _product_node(y), _LINEAR_W, (w, b, need_w, need_b, x)))
            return y
        # Autocast: cast as autocast would (the graph gets the same casts) and keep
        # the cast operands for W, so that W multiplies exactly what autograd would.
        dt, casts = torch.get_autocast_dtype(dev), _shared_casts(self.store)
        xc, wc, bc = _cast(x, dt, casts), _cast(lw, dt, casts), _cast(lb, dt, casts)
        with torch.autocast(dev, enabled=False):
            y = F.linear(xc, wc, bc)
        args = (w, b, need_w, need_b, xc, wc, bc)
        calls.append(Call(xc, _product_node(y), _CAST_LINEAR_W, args))
        return y

    def _captured(self, x: Tensor, w: Tensor, b: Tensor | None, dev: str) -> Tensor:
        """The call through :class:`_SplitLinearFn` on ``w``/``b`` (the parameters, or
        inside a recorded forward their aliases), whose backward defers dW/db when captured."""
        if not torch.is_autocast_enabled(dev):
            return _SplitLinearFn.apply(x, w, b, self.store, (self.weight, self.bias))
        dt, casts = torch.get_autocast_dtype(dev), _shared_casts(self.store)
        xc, wc, bc = _cast(x, dt, casts), _cast(w, dt, casts), _cast(b, dt, casts)
        with torch.autocast(dev, enabled=False):
            return _SplitLinearFn.apply(xc, wc, bc, self.store, (self.weight, self.bias))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


# ---- Embedding ----------------------------------------------------------------------------


class _SplitEmbeddingCtx(Protocol):
    """What autograd's ctx of :class:`_SplitEmbeddingFn` carries from forward to backward."""

    weight: Tensor
    args: tuple[int, int, bool]
    store: WeightGradStore
    saved_tensors: tuple[Tensor, ...]

    def save_for_backward(self, *tensors: Tensor | None) -> None: ...


class _SplitEmbeddingFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: _SplitEmbeddingCtx,
        idx: Tensor,
        weight: Tensor,
        module: SplitEmbedding,
    ) -> Tensor:
        m = module
        out = F.embedding(idx, weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq)
        ctx.save_for_backward(idx)
        ctx.weight = weight
        ctx.args = m.backward_args()
        ctx.store = m.store
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: _SplitEmbeddingCtx, gy: Tensor) -> tuple[None, Tensor | None, None]:
        (idx,) = ctx.saved_tensors
        weight, args = ctx.weight, ctx.args
        store = ctx.store
        if store.capturing is None:
            return None, _embedding_grad(idx, args, gy), None
        store.defer(lambda: [(weight, _embedding_grad(idx, args, gy))], (idx, gy))
        return None, None, None


def _embedding_grad(idx: Tensor, args: tuple[int, int, bool], gy: Tensor) -> Tensor:
    """W of an embedding call: the dense weight gradient, as ``F.embedding``'s backward."""
    return torch.ops.aten.embedding_dense_backward(gy, idx, *args)


def _embedding_grads(
    weight: Tensor, idx: Tensor, args: tuple[int, int, bool], gy: Tensor
) -> GradList:
    """W of a recorded embedding call (a :class:`~zerobubble.runtime.split.store.Call`)."""
    return [(weight, _embedding_grad(idx, args, gy))]


_EMBEDDING_W = WeightGradFn(_embedding_grads)
"""W of recorded embedding calls."""


class SplitEmbedding(_Wrapper):
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
        self.__dict__["layer"] = embedding  # not a submodule: answers for its attributes
        self.store = store
        self._aliases: list[Tensor | None] = [None]  # of the weight, see _alias

    @_eager_under_compile
    def forward(self, idx: Tensor) -> Tensor:
        w = self.weight
        if not (torch.is_grad_enabled() and w.requires_grad):
            return F.embedding(
                idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
            )
        calls = self.store.recording
        if calls is not None:
            aliases = self._aliases
            lw = aliases[0]
            if not _current(lw, w):
                lw = aliases[0] = _alias(w)
            y = F.embedding(
                idx,
                lw,
                self.padding_idx,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
            )
            calls.append(Call(idx, output_node(y), _EMBEDDING_W, (w, idx, self.backward_args())))
            return y
        return _SplitEmbeddingFn.apply(idx, w, self)

    def backward_args(self) -> tuple[int, int, bool]:
        """``embedding_dense_backward``'s trailing arguments (-1: no padding index)."""
        pad = -1 if self.padding_idx is None else self.padding_idx
        return self.num_embeddings, pad, self.scale_grad_by_freq

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"


# ---- one-op layers: Conv1D (transformers), Conv1d/2d/3d, LayerNorm, user rules -------------


@dataclass(frozen=True)
class Kernel:
    """How to split one layer type whose forward is one differentiable op.

    ``forward(module, x, params)`` runs the layer on ``params`` (leaf aliases of
    the parameters, in ``param_names`` order; None for an absent one) and
    returns ``(op_output, result, operands)``: the output of the op whose
    graph node takes the parameters (its gradient is what W receives), the
    layer's result (``op_output`` or a view of it), and what W needs besides
    that gradient. ``weight_grads(module, operands, params, need, gy)`` gets the
    same ``params`` the forward used (aliases, cast under autocast) and returns
    one gradient or None per parameter, in their dtype, computed as autograd's
    formula for that op computes it (``need[i]``: the parameter needs one); W
    casts it back to the parameter's dtype. W runs under ``torch.no_grad`` with
    autocast off. Exactness is the kernel's promise: test it bitwise against
    plain autograd.
    """

    forward: Callable[[nn.Module, Tensor, Sequence[Tensor | None]], tuple[Tensor, Tensor, tuple]]
    weight_grads: Callable[
        [nn.Module, tuple, Sequence[Tensor | None], Sequence[bool], Tensor],
        Sequence[Tensor | None],
    ]
    param_names: tuple[str, ...] = ("weight", "bias")
    autocast: str | Mapping[str, str] = "refuse"
    """What ``torch.autocast`` does to the op, per device type or for all: ``"lower"``
    (on autocast's lower-precision list, e.g. matmuls and convolutions: operands cast
    to the autocast dtype), ``"float32"`` (on its float32 list), ``"none"`` (on no
    list: operands as they come), ``"refuse"`` (unknown: raise)."""
    op_takes_input: bool = False
    """The op receives the layer's input itself (not a view or another op's result of it),
    so under autocast a grad-requiring float32 leaf input shares autocast's one cast with
    the other layers it feeds (as for ``F.conv2d``; not for transformers' Conv1D, whose
    ``addmm`` takes a view). Wrong here means input gradients that differ in the last bits."""

    def autocast_mode(self, device_type: str) -> str:
        mode = self.autocast
        return mode if isinstance(mode, str) else mode.get(device_type, "refuse")


def _op_grads(
    module: nn.Module,
    kernel: Kernel,
    operands: tuple,
    used: Sequence[Tensor | None],
    params: Sequence[Tensor | None],
    need: Sequence[bool],
    gy: Tensor,
) -> GradList:
    """W of a recorded :class:`SplitOp` call; ``used``: the (possibly autocast) operands
    that stood for ``params``; the store casts gradients back to each parameter's dtype, as
    the cast's ToCopyBackward does (:func:`~zerobubble.runtime.split.store.cast_back`)."""
    grads = kernel.weight_grads(module, operands, used, need, gy)
    return [
        (p, cast_back(g, u, p))
        for p, u, g, n in zip(params, used, grads, need, strict=True)
        if n and g is not None and p is not None and u is not None
    ]


_OP_W = WeightGradFn(_op_grads)
"""W of recorded :class:`SplitOp` calls."""


class SplitOp(_Wrapper):
    """A one-op layer whose weight gradients are deferred to a store, per a :class:`Kernel`.

    Registers the original layer's parameters under their own names (state_dict
    keys and Parameter objects unchanged) and keeps the layer itself, not as a
    submodule, for its configuration, which it exposes (``split.stride`` is the
    conv's). Inside ``store.record`` the op runs on leaf aliases of the parameters
    and its call is recorded; anywhere else the original layer runs, and its
    gradients are computed like plain autograd's.
    """

    layer: nn.Module  # set in __dict__, not as a submodule (see __init__)

    def __init__(self, module: nn.Module, kernel: Kernel, store: WeightGradStore) -> None:
        super().__init__()
        for name in kernel.param_names:
            self.register_parameter(name, getattr(module, name))
        self.__dict__["layer"] = module  # not a submodule: its parameters are ours
        self.kernel = kernel
        self.store = store
        self._aliases: list[Tensor | None] = [None] * len(kernel.param_names)

    @_eager_under_compile
    def forward(self, x: Tensor) -> Tensor:
        params = [getattr(self, n) for n in self.kernel.param_names]
        need = [p is not None and p.requires_grad for p in params]
        calls = self.store.recording
        if calls is None or not (any(need) and torch.is_grad_enabled()):
            return self.layer(x)
        aliases = self._aliases
        for i, p in enumerate(params):
            if p is not None and not _current(aliases[i], p):
                aliases[i] = _alias(p)
        used: Sequence[Tensor | None] = aliases
        dev = x.device.type
        if not torch.is_autocast_enabled(dev):
            out, y, operands = self.kernel.forward(self.layer, x, used)
        else:
            mode = self.kernel.autocast_mode(dev)
            if mode not in ("lower", "float32", "none"):
                raise RuntimeError(
                    f"split {type(self.layer).__name__} under torch.autocast on {dev}: its "
                    "Kernel does not say what autocast does to its op; set "
                    "Kernel(autocast='lower', 'float32' or 'none') as autocast's op lists "
                    "have it, or run without autocast"
                )
            if mode == "lower":  # autocast caches only lower-precision casts
                dt, casts = torch.get_autocast_dtype(dev), _shared_casts(self.store)
                x = _cast(x, dt, casts if self.kernel.op_takes_input else None)
                used = [_cast(a, dt, casts) for a in aliases]
            elif mode == "float32":
                x = _cast(x, torch.float32)
                used = [_cast(a, torch.float32) for a in aliases]
            with torch.autocast(dev, enabled=False):
                out, y, operands = self.kernel.forward(self.layer, x, used)
        held = operands[0] if len(operands) == 1 else operands
        args = (self.layer, self.kernel, operands, used, params, need)
        calls.append(Call(held, output_node(out), _OP_W, args))
        return y

    def extra_repr(self) -> str:
        return f"split {self.layer!r}"


def is_hf_conv1d(module: nn.Module) -> bool:
    """``transformers``' ``Conv1D``, recognised by its contract without importing transformers:
    class name, ``nf``, a 2-D ``weight`` of shape (in, nf), a ``bias`` of shape (nf,) or None."""
    if type(module).__name__ != "Conv1D":
        return False
    w, b, nf = (
        getattr(module, "weight", None),
        getattr(module, "bias", None),
        getattr(module, "nf", None),
    )
    return (
        isinstance(w, nn.Parameter)
        and w.dim() == 2
        and w.size(1) == nf
        and (b is None or (isinstance(b, nn.Parameter) and tuple(b.shape) == (nf,)))
        and set(module._parameters) <= {"weight", "bias"}
        and not module._modules
    )


def _hf_conv1d_forward(
    m: nn.Module, x: Tensor, params: Sequence[Tensor | None]
) -> tuple[Tensor, Tensor, tuple]:
    w, b = params
    assert w is not None
    x2 = x.view(-1, x.size(-1))
    out = torch.mm(x2, w) if b is None else torch.addmm(b, x2, w)
    return out, out.view((*x.size()[:-1], w.size(1))), (x2,)


def _hf_conv1d_grads(
    m: nn.Module,
    operands: tuple,
    params: Sequence[Tensor | None],
    need: Sequence[bool],
    gy: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    (x2,) = operands
    w = params[0]
    assert w is not None
    gw = _mm_mat2_grad(gy, x2, w) if need[0] else None
    return gw, _bias_grad(gy) if need[1] else None


HF_CONV1D = Kernel(_hf_conv1d_forward, _hf_conv1d_grads, autocast="lower")
"""transformers' ``Conv1D``: ``addmm(bias, x.view(-1, in), weight)`` with weight (in, out)."""


def conv_splittable(module: nn.Module) -> bool:
    """An exact ``nn.Conv1d/2d/3d`` with zero padding given explicitly.

    Left to the graph-level split: ``padding="same"``, and the other padding modes, whose
    ``F.pad`` runs before autocast's cast (a split op casts the layer's input, so the
    padding's backward would sum in the low precision).
    """
    return (
        type(module) in (nn.Conv1d, nn.Conv2d, nn.Conv3d)
        and module.padding_mode == "zeros"
        and not (isinstance(module.padding, str) and module.padding != "valid")
    )


def _conv_geometry(m: _ConvNd) -> tuple[tuple[int, ...], int]:
    """The padding the convolution op receives, and the number of spatial dimensions."""
    n = len(m.kernel_size)
    if isinstance(m.padding, str):  # "valid", the one string conv_splittable accepts
        return (0,) * n, n
    return tuple(m.padding), n


def _conv_forward(
    m: nn.Module, x: Tensor, params: Sequence[Tensor | None]
) -> tuple[Tensor, Tensor, tuple]:
    """``nn.ConvNd.forward``'s op, spelled out so that the convolution's input is at hand."""
    assert isinstance(m, _ConvNd)  # CONV splits only what conv_splittable accepts
    w, b = params
    assert w is not None
    pad, n = _conv_geometry(m)
    batched = x.dim() == n + 2
    xb = x if batched else x.unsqueeze(0)
    out = torch.convolution(xb, w, b, m.stride, pad, m.dilation, False, (0,) * n, m.groups)
    return out, out if batched else out.squeeze(0), (xb,)


def _conv_grads(
    m: nn.Module,
    operands: tuple,
    params: Sequence[Tensor | None],
    need: Sequence[bool],
    gy: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    assert isinstance(m, _ConvNd)
    (xb,) = operands
    w, b = params
    pad, n = _conv_geometry(m)
    bias_sizes = None if b is None else [b.size(0)]
    _, gw, gb = torch.ops.aten.convolution_backward(
        gy, xb, w, bias_sizes, m.stride, pad, m.dilation, False, [0] * n, m.groups,
        [False, need[0], b is not None and need[1]],
    )  # fmt: skip
    return gw, gb


CONV = Kernel(_conv_forward, _conv_grads, autocast="lower", op_takes_input=True)
"""``nn.Conv1d``/``nn.Conv2d``/``nn.Conv3d``: W is the weight half of convolution_backward."""


def _layer_norm_forward(
    m: nn.Module, x: Tensor, params: Sequence[Tensor | None]
) -> tuple[Tensor, Tensor, tuple]:
    assert isinstance(m, nn.LayerNorm)  # LAYER_NORM's rule splits only nn.LayerNorm
    w, b = params
    out, mean, rstd = torch.native_layer_norm(x, m.normalized_shape, w, b, m.eps)
    return out, out, (x, mean, rstd)


def _layer_norm_grads(
    m: nn.Module,
    operands: tuple,
    params: Sequence[Tensor | None],
    need: Sequence[bool],
    gy: Tensor,
) -> tuple[Tensor | None, Tensor | None]:
    assert isinstance(m, nn.LayerNorm)
    x, mean, rstd = operands
    w, b = params
    mask = [False, need[0], b is not None and need[1]]
    _, gw, gb = torch.ops.aten.native_layer_norm_backward(
        gy, x, m.normalized_shape, mean, rstd, w, b, mask
    )
    return gw, gb


LAYER_NORM = Kernel(
    _layer_norm_forward, _layer_norm_grads, autocast={"cpu": "none", "cuda": "float32"}
)
"""``nn.LayerNorm`` with an affine weight: W is the weight half of its backward."""
