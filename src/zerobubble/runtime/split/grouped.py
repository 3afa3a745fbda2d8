"""Grouped linear layers with a kernel-level B/W split: one matmul over every group's rows.

A mixture of experts runs its local experts' rows, sorted by expert, through one grouped
matmul per projection, as transformers' ``grouped_mm`` experts do:
``torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)`` for a weight stack ``w`` of shape
``(E, out, in)`` (``torch._grouped_mm(x, w, offs=offs)`` in the transposed layout
``(E, in, out)``), ``offs`` the int32 cumulative row counts of the groups, then an optional
per-group bias added as ``out.add_(bias[ids])`` (``ids``: each row's group).

:class:`SplitGrouped` is the base of a module whose forward calls
:meth:`SplitGrouped.grouped_linear` on its own parameters.
:func:`~zerobubble.runtime.split.swap.enable_bw_split` binds it to the stage's store like
a split layer (so it gets no graph-level split, whose W would re-run the module's
forward); then:

* F, inside ``store.record``, runs the grouped matmul on leaf aliases of the parameters
  and records the call: its input rows, ``offs``, ``ids`` and the matmul's graph node,
  where the output's gradient arrives. B is autograd's own backward of that node, which
  computes only the input gradient (the aliases are no target of B).
* W computes the weight gradient from the kept input and the output gradient with the
  calls of autograd's derivative formula for ``_grouped_mm`` (``FunctionsManual.cpp``:
  the layout-dependent branch on the weight operand's strides), and the bias gradient as
  the indexing's backward does (``_index_put_impl_`` with accumulation into zeros). The
  gradients are therefore bitwise those of plain autograd, by construction.

Where ``torch._grouped_mm`` refuses the operands (:func:`grouped_mm_supported`: a dtype,
a device or a row stride it does not take) each group runs as one ``torch.mm`` instead, in
an autograd Function whose backward is written here; B and W of the split call the same
functions as that backward, so the loop is bitwise its own plain autograd, too.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from zerobubble.runtime.split.kernels import _alias, _current
from zerobubble.runtime.split.store import (
    Call,
    GradList,
    WeightGradFn,
    WeightGradStore,
    output_node,
)

__all__ = ["SplitGrouped", "grouped_linear", "grouped_mm_supported"]

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: Tensor, weight: Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes rows ``x`` ``(S, in)`` against ``weight`` (a
    ``(E, ., .)`` stack in either layout), forward and backward; else the per-group loop runs.

    Stated once, from what torch 2.13 refuses: float32, bfloat16 or float16 (both operands
    alike), on the CPU, or on CUDA in bfloat16 on compute capability 8.0 or newer (as
    transformers checks for torch >= 2.9); a contiguous ``x``; and every row stride of the
    operands and of their gradients a multiple of 16 bytes, i.e. both inner dimensions of
    the weight times the element size.
    """
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.dtype not in _GROUPED_DTYPES or x.dim() != 2 or weight.dim() != 3:
        return False
    dev = weight.device
    if dev.type == "cuda":
        if x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(dev) < (8, 0):
            return False
    elif dev.type != "cpu":
        return False
    size = x.element_size()
    return x.is_contiguous() and all(d * size % 16 == 0 for d in weight.shape[1:])


def _operand(weight: Tensor, transposed: bool) -> Tensor:
    """The matmul's second operand ``(E, in, out)``: the weight stack itself in the
    transposed layout, else its transpose (a view)."""
    return weight if transposed else weight.transpose(-2, -1)


def _column_major(t: Tensor) -> bool:
    """Column-major in the last two dimensions, as autograd's ``_grouped_mm`` formula tests."""
    return t.stride(-2) == 1 and t.stride(-1) == t.size(-2)


def _native_input_grad(gy: Tensor, x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
    """The input (``mat1``) gradient of ``_grouped_mm(x, mat2, offs)``, as autograd's formula."""
    if _column_major(x):
        return torch._grouped_mm(mat2, gy.transpose(-2, -1), offs=offs).transpose(-2, -1)
    return torch._grouped_mm(gy, mat2.transpose(-2, -1), offs=offs)


def _native_operand_grad(gy: Tensor, x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
    """The ``mat2`` gradient of ``_grouped_mm(x, mat2, offs)``, as autograd's formula."""
    if _column_major(mat2):
        return torch._grouped_mm(gy.transpose(-2, -1), x, offs=offs).transpose(-2, -1)
    return torch._grouped_mm(x.transpose(-2, -1), gy, offs=offs)


def _spans(offs: Tensor) -> list[tuple[int, int, int]]:
    """``(group, first row, end row)`` of every group that has rows."""
    out, start = [], 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out.append((g, start, end))
        start = end
    return out


def _loop_forward(x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
    """``_grouped_mm(x, mat2, offs)`` as one ``torch.mm`` per group."""
    out = x.new_empty((x.size(0), mat2.size(-1)))
    for g, a, b in _spans(offs):
        torch.mm(x[a:b], mat2[g], out=out[a:b])
    return out


def _loop_input_grad(gy: Tensor, x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
    gx = x.new_empty(x.shape)
    for g, a, b in _spans(offs):
        torch.mm(gy[a:b], mat2[g].t(), out=gx[a:b])
    return gx


def _loop_operand_grad(gy: Tensor, x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
    """``mat2``'s gradient (a group without rows: zeros)."""
    g2 = gy.new_zeros(mat2.shape)
    for g, a, b in _spans(offs):
        torch.mm(x[a:b].t(), gy[a:b], out=g2[g])
    return g2


def _input_grad(
    gy: Tensor, x: Tensor, weight: Tensor, offs: Tensor, transposed: bool, native: bool
) -> Tensor:
    mat2 = _operand(weight, transposed)
    return (_native_input_grad if native else _loop_input_grad)(gy, x, mat2, offs)


def _weight_grad(
    gy: Tensor, x: Tensor, weight: Tensor, offs: Tensor, transposed: bool, native: bool
) -> Tensor:
    """The weight stack's gradient: the matmul operand's, then (non-transposed layout) the
    transpose's backward, a transpose again."""
    grad = _native_operand_grad if native else _loop_operand_grad
    g = grad(gy, x, _operand(weight, transposed), offs)
    return g if transposed else g.transpose(-2, -1)


def _bias_grad(gy: Tensor, bias: Tensor, ids: Tensor) -> Tensor:
    """The bias gradient, as the backward of ``bias[ids]`` (``index_backward``) computes it."""
    zeros = gy.new_zeros(bias.shape)
    return torch.ops.aten._index_put_impl_(zeros, (ids,), gy, True, True)


def _matmul(x: Tensor, mat2: Tensor, offs: Tensor, native: bool) -> Tensor:
    return torch._grouped_mm(x, mat2, offs=offs) if native else _loop_forward(x, mat2, offs)


def grouped_linear(
    x: Tensor,
    weight: Tensor,
    offs: Tensor,
    bias: Tensor | None = None,
    ids: Tensor | None = None,
    *,
    transposed: bool = False,
) -> Tensor:
    """Rows ``x`` ``(S, in)`` of groups ending at ``offs`` (int32, cumulative) through their
    group's slice of ``weight`` (``(E, out, in)``; ``(E, in, out)`` if ``transposed``), plus
    ``bias[ids]`` (``bias`` ``(E, out)``, ``ids`` each row's group): plain autograd, one
    ``torch._grouped_mm`` where :func:`grouped_mm_supported`, else one mm per group."""
    x = x.to(weight.dtype)
    mat2 = _operand(weight, transposed)
    if grouped_mm_supported(x, weight):
        out = torch._grouped_mm(x, mat2, offs=offs)
    else:
        out = _LoopGrouped.apply(x, mat2, offs)
    if bias is not None:
        assert ids is not None
        out = out.add_(bias[ids])
    return out


class _LoopGrouped(torch.autograd.Function):
    """The per-group loop with its backward (both gradients, or only what is needed)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, mat2: Tensor, offs: Tensor) -> Tensor:
        ctx.save_for_backward(x, mat2, offs)
        return _loop_forward(x, mat2, offs)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, mat2, offs = ctx.saved_tensors
        need_x, need_w = ctx.needs_input_grad[:2]
        gx = _loop_input_grad(gy, x, mat2, offs) if need_x else None
        gw = _loop_operand_grad(gy, x, mat2, offs) if need_w else None
        return gx, gw, None


def _grouped_grads(
    weight: Tensor,
    bias: Tensor | None,
    need: tuple[bool, bool],
    transposed: bool,
    native: bool,
    x: Tensor,
    offs: Tensor,
    ids: Tensor | None,
    gy: Tensor,
) -> GradList:
    """W of a grouped linear call: the weight (and bias) gradient from its input and ``gy``."""
    grads: GradList = []
    if need[0]:
        grads.append((weight, _weight_grad(gy, x, weight, offs, transposed, native)))
    if need[1]:
        assert bias is not None and ids is not None
        grads.append((bias, _bias_grad(gy, bias, ids)))
    return grads


_GROUPED_W = WeightGradFn(_grouped_grads)
"""W of recorded grouped linear calls."""


class _CapturedGrouped(torch.autograd.Function):
    """A grouped linear call outside a recorded forward (the loop, or a replayed forward):
    its backward returns the input gradient and, inside ``store.capture``, defers the
    weight and bias gradients to the store."""

    @staticmethod
    def forward(
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        offs: Tensor,
        ids: Tensor | None,
        how: tuple[WeightGradStore, tuple[Tensor, Tensor | None], bool, bool],
    ) -> Tensor:
        transposed, native = how[2:]
        ctx.save_for_backward(x, weight, offs, ids)
        ctx.how = how
        out = _matmul(x, _operand(weight, transposed), offs, native)
        if bias is not None:
            assert ids is not None
            out.add_(bias[ids])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, gy: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, offs, ids = ctx.saved_tensors
        store, (w, b), transposed, native = ctx.how
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = _input_grad(gy, x, weight, offs, transposed, native) if need_x else None
        if store.capturing is None:
            gw = _weight_grad(gy, x, weight, offs, transposed, native) if need_w else None
            gb = _bias_grad(gy, b, ids) if need_b and b is not None and ids is not None else None
            return gx, gw, gb, None, None, None
        need = (need_w, need_b)

        def compute() -> GradList:
            return _grouped_grads(w, b, need, transposed, native, x, offs, ids, gy)

        store.defer(compute, (x, gy))
        return gx, None, None, None, None, None


class SplitGrouped(nn.Module):
    """Base of a module whose forward calls :meth:`grouped_linear` on its own 3-D weights.

    ``store`` is None until :func:`~zerobubble.runtime.split.swap.enable_bw_split` binds
    it (the module is then a split layer: its weight gradients wait for W, and it gets no
    graph-level split); until then, and outside a stage's forward, its calls are plain
    autograd (:func:`grouped_linear`).
    """

    def __init__(self) -> None:
        super().__init__()
        self.store: WeightGradStore | None = None
        self._aliases: dict[str, Tensor] = {}

    def grouped_linear(
        self,
        x: Tensor,
        weight: str,
        offs: Tensor,
        bias: str | None = None,
        ids: Tensor | None = None,
        *,
        transposed: bool = False,
    ) -> Tensor:
        """:func:`grouped_linear` on this module's parameters ``weight`` and ``bias`` (named),
        with the B/W split once a store is bound (see the module docstring)."""
        w = self._parameters[weight]
        b = None if bias is None else self._parameters[bias]
        assert w is not None
        need = (w.requires_grad, b is not None and b.requires_grad)
        store = self.store
        if store is None or not (any(need) and torch.is_grad_enabled()):
            return grouped_linear(x, w, offs, b, ids, transposed=transposed)
        x = x.to(w.dtype)
        native = grouped_mm_supported(x, w)
        calls = store.recording
        if calls is None or not native:
            how = (store, (w, b), transposed, native)
            out = _CapturedGrouped.apply(x, w, b, offs, ids, how)
            assert isinstance(out, Tensor)
            return out
        out = torch._grouped_mm(x, _operand(self._alias(weight, w), transposed), offs=offs)
        args = (w, b, need, transposed, native, x, offs, ids)
        calls.append(Call(x, output_node(out), _GROUPED_W, args))
        if b is not None and bias is not None:
            assert ids is not None
            out = out.add_(self._alias(bias, b)[ids])
        return out

    def _alias(self, name: str, p: Tensor) -> Tensor:
        alias = self._aliases.get(name)
        if not _current(alias, p):
            alias = self._aliases[name] = _alias(p)
        return alias
