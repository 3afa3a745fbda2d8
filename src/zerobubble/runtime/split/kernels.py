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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from zerobubble.runtime.split.store import GradList, WeightGradStore, output_node

__all__ = ["SplitEmbedding", "SplitLinear"]


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


def _current(alias: Tensor | None, p: Tensor) -> bool:
    """``alias`` still is :func:`_alias` of ``p`` (same memory, size, strides, requires_grad)."""
    return alias is not None and alias.is_set_to(p) and alias.requires_grad == p.requires_grad


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
        grads.append((bias, _bias_grad(g2d if _bias_via_addmm(x) else gy)))
    return grads


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


def _autocast_error(what: str) -> RuntimeError:
    return RuntimeError(
        f"{what} does not support autocast: its deferred weight gradient would use the "
        "uncast operands. Cast the model (e.g. model.to(torch.bfloat16)) instead of "
        "running it under torch.autocast, or leave this module unsplit."
    )


def _check_autocast(x: Tensor, what: str) -> None:
    if torch.is_autocast_enabled(x.device.type):
        raise _autocast_error(what)


class SplitLinear(nn.Module):
    """``nn.Linear`` whose backward defers the weight gradient to a store (B/W split).

    Reuses the original Parameter objects (optimizers and state_dict keys are
    unaffected). Called inside ``store.record(chunk, mb)`` it records itself for
    ``store.backward(chunk, mb, ...)``; otherwise, inside ``store.capture(chunk,
    mb)`` its backward returns only the input gradient and queues ``dW``/``db``.
    Either way ``store.run(chunk, mb)`` adds them. Outside both it behaves
    exactly like ``nn.Linear``.
    """

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
        return cls(linear.weight, linear.bias, store)

    def forward(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        need_w = w.requires_grad
        need_b = b is not None and b.requires_grad
        if not ((need_w or need_b) and torch.is_grad_enabled()):
            return F.linear(x, w, b)  # no weight gradient to defer
        calls = self.store.recording
        # Recorded unless matmul would fold a non-contiguous N-D input into a copy:
        # W would then need that copy, which only the captured path keeps.
        if calls is None or not (x.dim() <= 2 or x.is_contiguous()):
            _check_autocast(x, "SplitLinear")
            return _SplitLinearFn.apply(x, w, b, self.store)
        lw, lb = aliases = self._aliases
        if not _current(lw, w):
            lw = aliases[0] = _alias(w)
        if b is not None and not _current(lb, b):
            lb = aliases[1] = _alias(b)
        y = F.linear(x, lw, lb)
        if not (x.dtype == y.dtype == w.dtype):  # only autocast gets F.linear there
            raise _autocast_error("SplitLinear")
        calls.append((x, output_node(y), _linear_grads, (w, b, need_w, need_b, x)))
        return y

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
        ctx.args = m.backward_args()
        ctx.store = m.store
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, gy: Tensor):  # type: ignore[override]
        (idx,) = ctx.saved_tensors
        weight, args = ctx.weight, ctx.args
        store: WeightGradStore = ctx.store
        if store.capturing is None:
            return None, _embedding_grads(weight, idx, args, gy)[0][1], None
        store.defer(lambda: _embedding_grads(weight, idx, args, gy), (idx, gy))
        return None, None, None


def _embedding_grads(
    weight: Tensor, idx: Tensor, args: tuple[int, int, bool], gy: Tensor
) -> GradList:
    """W of an embedding call: the dense weight gradient, as ``F.embedding``'s backward."""
    return [(weight, torch.ops.aten.embedding_dense_backward(gy, idx, *args))]


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
        self._aliases: list[Tensor | None] = [None]  # of the weight, see _alias

    def forward(self, idx: Tensor) -> Tensor:
        w = self.weight
        if not (torch.is_grad_enabled() and w.requires_grad):
            return F.embedding(
                idx, w, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq
            )
        _check_autocast(w, "SplitEmbedding")
        calls = self.store.recording
        if calls is not None:
            aliases = self._aliases
            if not _current(aliases[0], w):
                aliases[0] = _alias(w)
            y = F.embedding(
                idx,
                aliases[0],
                self.padding_idx,
                self.max_norm,
                self.norm_type,
                self.scale_grad_by_freq,
            )
            calls.append((idx, output_node(y), _embedding_grads, (w, idx, self.backward_args())))
            return y
        return _SplitEmbeddingFn.apply(idx, w, self)

    def backward_args(self) -> tuple[int, int, bool]:
        """``embedding_dense_backward``'s trailing arguments (-1: no padding index)."""
        pad = -1 if self.padding_idx is None else self.padding_idx
        return self.num_embeddings, pad, self.scale_grad_by_freq

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}"
