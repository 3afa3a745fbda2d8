"""What crosses a stage boundary: pytrees of tensors, and their layouts.

A stage takes and returns a tensor or a (nested) tuple, list or dict (str keys)
whose leaves are tensors, None, ints or bools. :func:`flatten` turns such a
value into its *layout* (a tuple of ints: the structure, the non-tensor leaves,
and per tensor its dtype, whether it carries a gradient and its shape) and its
tensor leaves; :func:`unflatten` is the inverse. A received value is rebuilt
from the layout alone, so shapes, dtypes, structure and the non-tensor leaves
may change from one message to the next: the executor sends a layout only when
it differs from the one the receiver expects (see :mod:`zerobubble.runtime.p2p.wire`).

Only floating tensors that require grad (flag set in the layout) get a gradient
sent back; integer and bool tensors, and float tensors that do not require
grad, travel forward only.

A tensor keeps its memory format across a boundary: one that is dense and
non-overlapping but whose strides are not the row-major ones (channels_last, a
transposed matrix) is sent with its strides and received with exactly those
strides (:func:`kept_strides`);
the layouts of the next stage's kernels, and so their results, are then the ones
the unpipelined model runs. Other tensors (row-major, or with gaps or overlaps)
arrive row-major.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.runtime.p2p.comm import DTYPES, TensorMeta, dtype_code, dtype_of

_TENSOR, _NONE, _INT, _BOOL, _TUPLE, _LIST, _DICT, _STRIDED = range(8)
_INT64 = (-(2**63), 2**63 - 1)

ALIGN = 64
"""Every tensor of a frame starts at a multiple of this many bytes (see :mod:`wire`)."""


class ShapeMismatchError(ValueError):
    """Two neighbouring stages disagree on the value between them.

    Attributes:
        src_stage, dst_stage: The producing and the consuming stage (``src_stage``
            is None when stage 0 cannot consume the input batch).
    """

    def __init__(self, src_stage: int | None, dst_stage: int, message: str) -> None:
        src = "input batch" if src_stage is None else f"stage {src_stage}"
        fix = (
            f"; stage {dst_stage}'s first layer must take what {src} gives: change that layer "
            "or the one before it, or cut elsewhere (Pipeline(boundaries=...))"
        )
        super().__init__(f"{src} -> stage {dst_stage}: {message}{fix}")
        self.src_stage = src_stage
        self.dst_stage = dst_stage


_LAYOUT_WORDS = re.compile(
    r"\b(shapes?|sizes?|dimensions?|dim|channels|dtypes?|scalar type|devices?)\b"
    r"|\bgot (a |an )?(Tensor|tuple|list|dict|None|NoneType|str|int|float|bool)\b",
    re.IGNORECASE,
)


def is_layout_error(error: BaseException) -> bool:
    """Whether ``error``, raised by a stage's forward, says its input has the wrong
    structure or layout: a missing key, index or attribute, an argument of the wrong
    kind, a torch error about shapes, sizes, dimensions, channels, dtypes or devices, or
    a layer's own check that "got" a value of the wrong Python type.
    Anything else (an in-place op refused, running out of memory, the user's own
    assertion, an attribute missing on a module rather than on the value) is the stage's
    own failure, not its neighbour's."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if _module_attribute_error(error):
        return False  # a layer lacks an attribute its code reads: the layer's own failure
    if isinstance(error, KeyError | IndexError | TypeError | AttributeError):
        return True
    return isinstance(error, RuntimeError | ValueError) and bool(_LAYOUT_WORDS.search(str(error)))


def _module_attribute_error(error: BaseException) -> bool:
    """Whether ``error`` is an attribute missing on a module (raised by a module's
    ``__getattr__``), not on the value the stage received."""
    if not isinstance(error, AttributeError):
        return False
    if isinstance(getattr(error, "obj", None), nn.Module):
        return True
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None or tb.tb_frame.f_code.co_name != "__getattr__":
        return False
    return isinstance(tb.tb_frame.f_locals.get("self"), nn.Module)


class BoundaryError(ValueError):
    """A value at a stage boundary cannot travel: names the stage, the side and the leaf.

    Attributes:
        where: E.g. ``"stage 1 output"``; ``path`` is the leaf inside it (``"['hidden'][0]"``).
    """

    def __init__(self, where: str, path: str, message: str) -> None:
        super().__init__(f"{where}{path}: {message}")
        self.where = where
        self.path = path


_LEAVES = "a tensor, None, an int or a bool, nested in tuples, lists or dicts with str keys"


def flatten(tree: Any, where: str) -> tuple[tuple[int, ...], list[Tensor]]:
    """``tree``'s layout and its tensor leaves in depth-first order.

    ``where`` (e.g. ``"stage 1 output"``) prefixes the :class:`BoundaryError` for a
    leaf that cannot travel (a str, a float, a tensor of an unsupported dtype...).
    """
    codes: list[int] = []
    tensors: list[Tensor] = []

    def walk(node: Any, path: str) -> None:
        if isinstance(node, Tensor):
            if node.dtype not in DTYPES:
                names = ", ".join(str(d).removeprefix("torch.") for d in DTYPES)
                raise BoundaryError(
                    where,
                    path,
                    f"a {str(node.dtype).removeprefix('torch.')} tensor cannot cross a stage "
                    f"boundary; expected one of {names} (cast it before the cut)",
                )
            grad = node.requires_grad and node.is_floating_point()
            strides = kept_strides(node)
            tag = _TENSOR if strides is None else _STRIDED
            codes.extend((tag, dtype_code(node.dtype), int(grad), node.dim(), *node.shape))
            codes.extend(strides or ())
            tensors.append(node)
        elif node is None:
            codes.append(_NONE)
        elif isinstance(node, bool):
            codes.extend((_BOOL, int(node)))
        elif type(node) is int:
            if not _INT64[0] <= node <= _INT64[1]:
                raise BoundaryError(
                    where,
                    path,
                    f"the int {node} does not fit in 64 bits; send it as a tensor or in parts",
                )
            codes.extend((_INT, node))
        elif type(node) in (tuple, list):
            codes.extend((_TUPLE if type(node) is tuple else _LIST, len(node)))
            for i, child in enumerate(node):
                walk(child, f"{path}[{i}]")
        elif type(node) is dict:
            codes.extend((_DICT, len(node)))
            for key, child in node.items():
                if not isinstance(key, str):
                    raise BoundaryError(
                        where,
                        path,
                        f"dict key {key!r} is not a str; expected {_LEAVES} (use str keys)",
                    )
                raw = key.encode()
                codes.extend((len(raw), *raw))
                walk(child, f"{path}[{key!r}]")
        else:
            raise BoundaryError(
                where,
                path,
                f"a {type(node).__name__} cannot cross a stage boundary; expected {_LEAVES}: "
                "make it one (a number as a tensor: torch.tensor(value)), or compute it in the "
                "stage that uses it",
            )

    walk(tree, "")
    return tuple(codes), tensors


def kept_strides(t: Tensor) -> tuple[int, ...] | None:
    """The strides ``t`` keeps across a boundary: its own when it is dense and
    non-overlapping but its strides are not the row-major ones (channels_last, a
    transpose), else None (it travels row-major). Dense: its elements fill ``numel``
    consecutive slots, whatever the order of its dimensions. The strides of size-1
    dimensions count too: a channels_last tensor of one channel is contiguous, yet kernels
    that pick a memory format from the strides read it as channels_last."""
    if t.numel() == 0 or t.stride() == _row_major(t.shape):
        return None
    expected = 1
    dims = zip(t.stride(), t.shape, strict=True)
    for stride, size in sorted((st, n) for st, n in dims if n != 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(t.stride())


def _row_major(shape: Sequence[int]) -> tuple[int, ...]:
    strides, n = [], 1
    for size in reversed(shape):
        strides.append(n)
        n *= size
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Layout:
    """A decoded layout: the tensors' metadata, which need a gradient, where they sit in
    a frame (byte offsets after the frame header), the frame's size, and the strides of
    the tensors that keep theirs (None: row-major)."""

    codes: tuple[int, ...]
    metas: tuple[TensorMeta, ...]
    grads: tuple[bool, ...]
    offsets: tuple[int, ...]
    nbytes: int
    strides: tuple[tuple[int, ...] | None, ...] = ()

    @classmethod
    def of(cls, codes: Sequence[int], header: int) -> Layout:
        """The layout of ``codes`` for frames with a ``header``-byte header."""
        metas, grads, offsets, strides = [], [], [], []
        end = header
        for leaf in _tensor_specs(codes):
            end = -(-end // ALIGN) * ALIGN
            metas.append(leaf.meta)
            grads.append(leaf.grad)
            strides.append(leaf.strides)
            offsets.append(end)
            end += math.prod(leaf.meta.shape) * leaf.meta.dtype.itemsize
        return cls(tuple(codes), tuple(metas), tuple(grads), tuple(offsets), end, tuple(strides))


def _tensor_specs(codes: Sequence[int]) -> list[_Leaf]:
    specs: list[_Leaf] = []
    _parse(codes, specs.append)
    return specs


def _parse(codes: Sequence[int], leaf: Callable[[_Leaf], Any]) -> Any:
    """The value a layout describes, with ``leaf(spec)`` for each tensor."""
    pos = 0

    def build() -> Any:
        nonlocal pos
        tag = codes[pos]
        if tag in (_TENSOR, _STRIDED):
            code, grad, ndim = codes[pos + 1 : pos + 4]
            shape = tuple(codes[pos + 4 : pos + 4 + ndim])
            pos += 4 + ndim
            strides = None
            if tag == _STRIDED:
                strides = tuple(codes[pos : pos + ndim])
                pos += ndim
            return leaf(_Leaf(TensorMeta(shape, dtype_of(code)), bool(grad), strides))
        if tag == _NONE:
            pos += 1
            return None
        value = codes[pos + 1]
        pos += 2
        if tag == _INT:
            return value
        if tag == _BOOL:
            return bool(value)
        if tag == _DICT:
            out = {}
            for _ in range(value):
                n = codes[pos]
                key = bytes(codes[pos + 1 : pos + 1 + n]).decode()
                pos += 1 + n
                out[key] = build()
            return out
        items = [build() for _ in range(value)]
        return tuple(items) if tag == _TUPLE else items

    return build()


def unflatten(codes: Sequence[int], leaves: Sequence[Any]) -> Any:
    """Inverse of :func:`flatten`: the value with ``leaves`` in the tensors' places."""
    it = iter(leaves)
    return _parse(codes, lambda spec: next(it))


def describe(codes: Sequence[int]) -> str:
    """A layout as text, e.g. ``{'hidden': [2, 5, 8] float32 (grad), 'mask': [2, 5] bool}``;
    a tensor that keeps its strides says them (``[2, 3, 4, 4] float32 strides (48, 1, 12, 3)``)."""
    return _render(_parse(codes, lambda spec: spec))


@dataclass(frozen=True)
class _Leaf:
    """One tensor of a layout: its metadata, whether it carries a gradient, and the
    strides it keeps (None: row-major)."""

    meta: TensorMeta
    grad: bool
    strides: tuple[int, ...] | None = None


def _render(node: Any) -> str:
    if isinstance(node, _Leaf):
        kept = "" if node.strides is None else f" strides {node.strides}"
        return f"{node.meta}{kept}{' (grad)' if node.grad else ''}"
    if isinstance(node, dict):
        return "{" + ", ".join(f"{k!r}: {_render(v)}" for k, v in node.items()) + "}"
    if isinstance(node, tuple):
        inner = ", ".join(map(_render, node))
        return f"({inner},)" if len(node) == 1 else f"({inner})"
    if isinstance(node, list):
        return "[" + ", ".join(map(_render, node)) + "]"
    return repr(node)


def tensor_leaves(tree: Any) -> list[Tensor]:
    """The tensors of a boundary value, depth-first (no checks: see :func:`flatten`)."""
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, tuple | list):
        return [t for child in tree for t in tensor_leaves(child)]
    if isinstance(tree, dict):
        return [t for child in tree.values() for t in tensor_leaves(child)]
    return []


def map_tensors(tree: Any, fn: Any) -> Any:
    """``tree`` with ``fn`` applied to every tensor leaf (containers rebuilt, same types)."""
    if isinstance(tree, Tensor):
        return fn(tree)
    if type(tree) in (tuple, list):
        return type(tree)(map_tensors(child, fn) for child in tree)
    if type(tree) is dict:
        return {k: map_tensors(v, fn) for k, v in tree.items()}
    return tree


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every tensor moved to ``device``."""
    return map_tensors(tree, lambda t: t.to(device))
