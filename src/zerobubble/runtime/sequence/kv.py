"""Attention over earlier segments' keys and values (Seq1F1B-style sequence segments).

A microbatch's sequence is cut at ``0 = b0 < b1 < ... < bk = T`` and the segments run
through a stage one after another. On a stage, segment ``i``'s causal attention needs the
keys and values of segments ``< i`` of the same microbatch, and its backward sends
gradients into them. The protocol, per stage call:

* forward of segment ``i``: the segment's input (tokens ``[b_i, b_{i+1})``) plus a
  :class:`SegmentContext` with its ``start`` and, per attention layer of the stage, the
  ``past``: the earlier segments' keys and values as **detached leaves with
  ``requires_grad``**. It returns the output, and the context's :attr:`~SegmentContext.new`
  holds each attention layer's own keys and values: tensors of this segment's graph, that
  is extra outputs of the stage.
* backward of segment ``i`` (segments in reverse order): the output's gradient plus, per
  attention layer, the gradients of its own keys and values accumulated from the later
  segments' backwards (none for the last segment). It gives the gradient of the input, of
  each past leaf (added into that earlier segment's accumulators) and of the parameters.

The past of a layer is one leaf per earlier segment, not one concatenated tensor. A leaf
is then ``new.detach()`` of that segment: an alias of keys and values its own graph keeps
anyway, so a waiting segment holds no copy of the past (a concatenated leaf would be one
more ``O(start)`` copy per layer, alive from the forward to the backward), and its
gradient arrives already split by segment: it goes into that segment's accumulator as is,
with no lengths to track.

Layers take part by deriving from :class:`SegmentAware`; :func:`segment_scope` installs
the context on them for one call and removes it afterwards, even on an exception, so
nothing lives on the modules (or anywhere else) between calls. :func:`run_segments` is
the reference driver the tests compare with the whole sequence in one pass.

An attention layer joins the pieces with its own keys and values for its kernel, and the
kernel's backward needs the joined tensors: saved as they are, each segment would keep a
copy of everything before it (``O(end)`` per layer, ``(k + 1) / 2`` times the sequence's
keys and values over ``k`` segments). :func:`joined_kv` joins them and, for the kernel's
duration, has autograd save the joined tensors as their pieces (which the earlier
segments' graphs and the leaves keep anyway), joining them again when the backward reads
them: the same values in the same layout, so the backward computes what it would have.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = [
    "KV",
    "RegionSegments",
    "SegmentAware",
    "SegmentContext",
    "SegmentOf",
    "SegmentRun",
    "SegmentSlot",
    "add_past_grads",
    "cut_pairs",
    "flat_past",
    "joined_kv",
    "past_leaves",
    "run_segments",
    "saving_joined",
    "segment_inputs",
    "segment_scope",
    "sequence_tensor",
    "token_cuts",
    "unaware_attention",
]

KV = tuple[Tensor, Tensor]
"""Keys and values of one segment for one layer, the sequence on dim -2."""


@dataclass(frozen=True)
class SegmentOf:
    """Where a unit of a segment schedule sits: microbatch ``microbatch``'s segment ``index``
    of ``count``, whose first token is ``start`` (what a stage needs to run it)."""

    microbatch: int
    index: int
    count: int
    start: int

    def __post_init__(self) -> None:
        if not (0 <= self.index < self.count and self.microbatch >= 0 and self.start >= 0):
            raise ValueError(f"not a segment: {self}")
        if (self.index == 0) != (self.start == 0):
            raise ValueError(f"segment {self.index} cannot start at token {self.start}")


@dataclass
class SegmentContext:
    """One segment's place in the sequence, for one call of a stage.

    ``past[j]`` is the ``j``-th attention layer's keys and values of the earlier segments,
    one ``(k, v)`` per segment in sequence order (empty for the first segment); ``None``
    for no past at all. After the call :attr:`new` holds, per attention layer, the
    segment's own ``(k, v)``.
    """

    start: int
    past: Sequence[Sequence[KV]] | None = None
    new: list[KV | None] = field(default_factory=list, init=False)
    shared: dict[Any, Any] = field(default_factory=dict, init=False)
    """What the stage's layers compute alike in this call, computed by the first that needs
    it (the Hugging Face blocks' causal mask: one tensor for the stage, not one per layer,
    so the saved graphs share it)."""

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"a segment's start must be >= 0, got {self.start}")
        if self.start > 0 and self.past is None:
            raise ValueError(
                f"a segment starting at token {self.start} needs the past keys and values"
            )

    def new_kv(self) -> list[KV]:
        """The segment's own keys and values per attention layer, all of them recorded."""
        missing = [i for i, kv in enumerate(self.new) if kv is None]
        if missing:
            raise ValueError(
                f"attention layers {missing} of the stage did not run in this segment's call"
            )
        return [kv for kv in self.new if kv is not None]


@dataclass(frozen=True)
class SegmentSlot:
    """What one module sees of the context: its index among the stage's attention layers."""

    context: SegmentContext
    index: int
    """Position among the stage's attention layers; -1 for a module that holds none."""
    name: str
    """The module's name in the stage (``"<layer>.<path>"``), for messages."""

    @property
    def start(self) -> int:
        return self.context.start

    def past(self) -> tuple[list[Tensor], list[Tensor]]:
        """This layer's earlier keys and values (lists in sequence order), checked to cover
        exactly the tokens before ``start``."""
        past = self.context.past
        pieces = [] if past is None else list(past[self.index])
        keys = [k for k, _ in pieces]
        values = [v for _, v in pieces]
        k_len = sum(k.shape[-2] for k in keys)
        v_len = sum(v.shape[-2] for v in values)
        if k_len != self.start or v_len != self.start:
            raise ValueError(
                f"{self.name}: the past keys and values cover {k_len} and {v_len} tokens, but "
                f"the segment starts at token {self.start}"
            )
        return keys, values

    def record(self, k: Tensor, v: Tensor) -> None:
        """Hand back this layer's own keys and values (part of the segment's graph)."""
        if self.context.new[self.index] is not None:
            raise ValueError(f"{self.name} ran twice in one segment's call")
        self.context.new[self.index] = (k, v)


class SegmentAware:
    """Mixin of a module that reads a :class:`SegmentSlot` while a scope is installed.

    ``holds_kv`` says whether the module is an attention layer with keys and values in the
    protocol (else it only reads ``start``, e.g. for positions). Outside a scope
    ``segment_slot`` is the class's ``None`` and the module runs as it always does.
    """

    holds_kv: ClassVar[bool] = False
    segment_slot: SegmentSlot | None = None


def unaware_attention(module: nn.Module, aware: type = SegmentAware) -> str | None:
    """The name of an attention layer of ``module`` that would not see the rest of the
    sequence (no ``aware`` module that holds keys and values holds it: :class:`SegmentAware`
    for segments, the context-parallel :class:`~zerobubble.runtime.sequence.cp.ContextAware`
    for cp chunks), or None.

    A heuristic, to refuse the likely silent error: ``nn.MultiheadAttention`` and modules
    whose class name ends in ``Attention`` count as attention."""
    covered: list[str] = []
    for name, m in module.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        if isinstance(m, aware) and getattr(m, "holds_kv", False):
            covered.append(name)
            continue
        if isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention"):
            return f"{name or '(the stage)'} ({type(m).__name__})"
    return None


def _segment_aware(layers: Sequence[nn.Module]) -> list[tuple[str, SegmentAware]]:
    """The segment-aware modules of ``layers``, each once, named ``"<layer>.<path>"``, in the
    order that numbers the attention layers (``layers``, then their ``named_modules``)."""
    found: list[tuple[str, SegmentAware]] = []
    seen: set[int] = set()
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            if isinstance(module, SegmentAware) and id(module) not in seen:
                seen.add(id(module))
                found.append((f"{i}.{name}" if name else str(i), module))
    return found


@contextmanager
def _installed(
    found: Sequence[tuple[str, SegmentAware]], context: SegmentContext
) -> Iterator[None]:
    """``context`` on the modules of ``found`` (attention layers numbered in their order) for
    the block; ``context.past`` must have one entry per attention layer."""
    n_kv = sum(module.holds_kv for _, module in found)
    if context.past is not None and len(context.past) != n_kv:
        raise ValueError(
            f"the segment's past has {len(context.past)} entries, but the stage has {n_kv} "
            "attention layers"
        )
    context.new = [None] * n_kv
    installed: list[SegmentAware] = []
    try:
        index = 0
        for name, module in found:
            if module.segment_slot is not None:
                raise ValueError(f"{name} is already in a segment scope")
            module.segment_slot = SegmentSlot(context, index if module.holds_kv else -1, name)
            installed.append(module)
            index += module.holds_kv
        yield
    finally:
        for module in installed:
            del module.segment_slot  # back to the class's None


@contextmanager
def segment_scope(layers: Sequence[nn.Module], context: SegmentContext) -> Iterator[SegmentContext]:
    """Install ``context`` on the segment-aware modules of ``layers`` for the block.

    Attention layers are numbered in the order ``layers`` and their ``named_modules``
    list them; ``context.past`` must have one entry per attention layer.
    """
    with _installed(_segment_aware(layers), context):
        yield context


class RegionSegments:
    """A checkpointed region's part in the segment scope its forward runs in (activation
    recompute, :mod:`~zerobubble.runtime.recompute`).

    The region's forward reads the past keys and values of its attention layers and
    writes their own ones to the scope; its recomputation in B runs after the scope is gone.
    So the region takes the past leaves as extra inputs (their gradients flow back through
    it) and gives the own keys and values as extra outputs (the later segments' gradients
    flow into it), and the recomputation runs in a scope of the same start over the
    recomputation's past leaves, whose own keys and values are its extra outputs: the
    replay computes what F computed, and its backward what F's graph would have.
    """

    def __init__(self, found: list[tuple[str, SegmentAware]], context: SegmentContext) -> None:
        self.found = found
        self.context = context
        self._kv = [
            m.segment_slot.index for _, m in found if m.segment_slot is not None and m.holds_kv
        ]
        """The scope's index of each attention layer of the region, in the region's order."""
        past = context.past
        self._pieces = 0 if past is None or not self._kv else len(past[self._kv[0]])
        """How many earlier segments' keys and values each attention layer reads."""

    @classmethod
    def of(cls, module: nn.Module) -> RegionSegments | None:
        """``module``'s part in the segment scope installed on it, or None (none is)."""
        aware = [m for _, m in _segment_aware([module])]
        slots = [m.segment_slot for m in aware if m.segment_slot is not None]
        if not slots:
            return None
        if len(slots) != len(aware) or len({id(s.context) for s in slots}) != 1:
            raise ValueError(
                f"{slots[0].name}: the segment-aware layers of one checkpointed region are "
                "not all in one segment scope"
            )
        found = [(slot.name, m) for slot, m in zip(slots, aware, strict=True)]
        return cls(found, slots[0].context)

    def inputs(self) -> list[Tensor]:
        """The past leaves the region's attention layers read (per layer, per earlier
        segment, ``k`` then ``v``)."""
        past = self.context.past
        return [] if past is None else [t for i in self._kv for kv in past[i] for t in kv]

    def outputs(self) -> list[Tensor]:
        """F's own keys and values of the region's attention layers (``k`` then ``v`` each)."""
        return _flat_new(self.context, self._kv, self.found)

    def adopt(self, tensors: Sequence[Tensor]) -> None:
        """Put the region's outputs standing for :meth:`outputs` in the scope in their place."""
        it = iter(tensors)
        for i in self._kv:
            self.context.new[i] = (next(it), next(it))

    @contextmanager
    def replay(self, inputs: Sequence[Tensor]) -> Iterator[Callable[[], list[Tensor]]]:
        """Inside: the region's modules in a scope of F's start over ``inputs`` (the
        recomputation's past leaves, ordered as :meth:`inputs`); yields what gives the
        recomputed own keys and values (ordered as :meth:`outputs`) after the call."""
        n = self._pieces
        it = iter(inputs)
        past = None
        if self.context.past is not None:
            past = [[(next(it), next(it)) for _ in range(n)] for _ in self._kv]
        context = SegmentContext(self.context.start, past)
        local = list(range(len(self._kv)))
        with _installed(self.found, context):
            yield lambda: _flat_new(context, local, self.found)


def _flat_new(
    context: SegmentContext, indices: Sequence[int], found: Sequence[tuple[str, SegmentAware]]
) -> list[Tensor]:
    """The own keys and values at ``indices`` of ``context`` (``k`` then ``v`` each)."""
    out: list[Tensor] = []
    for i in indices:
        kv = context.new[i]
        if kv is None:
            names = [name for name, m in found if m.holds_kv]
            raise ValueError(
                f"{names[len(out) // 2]} did not run in this segment's call of its "
                "checkpointed region"
            )
        out += kv
    return out


@dataclass(frozen=True)
class _Joined:
    """A saved view of a joined tensor, kept as the pieces it was joined from."""

    pieces: tuple[Any, ...]
    """Each piece as the enclosing saved-tensor hooks packed it."""
    dim: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _storage(t: Tensor) -> int | None:
    """The address of ``t``'s storage (None for a wrapper subclass, which has none)."""
    if is_traceable_wrapper_subclass(t):
        return None
    return t.untyped_storage().data_ptr()


def _same(t: Any) -> Any:
    return t


@contextmanager
def joined_kv(pieces: Sequence[Sequence[Tensor]], dim: int = -2) -> Iterator[list[Tensor]]:
    """Yield each list of ``pieces`` concatenated on ``dim``; inside, autograd saves any
    view of a concatenation as its pieces (each through the hooks installed outside, such
    as a stage's memory tracking) and concatenates them again in the backward.

    Run the ops that read the joined tensors inside, the rest outside: their backward then
    keeps no ``O(length)`` copy per segment, only the pieces. The rebuilt tensor has the
    values and layout of the forward's (the same ``cat`` of the same pieces), so the
    backward is the one autograd would have run on the copy.
    """
    with saving_joined() as join:
        yield [join(group, dim) for group in pieces]


@contextmanager
def saving_joined() -> Iterator[Callable[[Sequence[Tensor], int], Tensor]]:
    """Yield ``join(pieces, dim)``, :func:`joined_kv`'s concatenation for code that joins
    inside a call it does not own (a Hugging Face attention's cache ``update``): until the
    context ends, autograd saves any view of a joined tensor as its pieces. The joined
    tensors are held until then, so that no other tensor takes their storage's address."""
    joins: dict[int | None, tuple[Tensor, tuple[Tensor, ...], int]] = {}
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (_same, _same)

    def join(pieces: Sequence[Tensor], dim: int) -> Tensor:
        joined = torch.cat(list(pieces), dim=dim)
        key = _storage(joined)
        if key is not None:  # a wrapper subclass is saved as it is
            joins[key] = (joined, tuple(pieces), dim)
        return joined

    def pack(t: Tensor) -> Any:
        found = joins.get(_storage(t))
        if found is None or found[0].dtype != t.dtype:
            return outer_pack(t)
        # detached: a piece may be this very graph's output (no cycle through the graph)
        kept = tuple(outer_pack(p.detach()) for p in found[1])
        return _Joined(kept, found[2], tuple(t.shape), t.stride(), int(t.storage_offset()))

    def unpack(x: Any) -> Tensor:
        if not isinstance(x, _Joined):
            return outer_unpack(x)
        whole = torch.cat([outer_unpack(p) for p in x.pieces], dim=x.dim)
        return whole.as_strided(x.size, x.stride, x.offset)

    with saved_tensors_hooks(pack, unpack):
        yield join


def segment_inputs(inputs: Any, start: int, end: int) -> Any:
    """A stage's inputs for tokens ``[start, end)`` from those of the whole sequence.

    A tensor (token ids or hidden states, the sequence on dim 1) is sliced; in a mapping
    (a tokenizer's batch, the HF adapter's boundary) so are all tensors but two: the 2-D
    ``attention_mask`` keeps the columns of every key the segment attends, ``[0, end)``,
    and ``position_ids`` stay whole (a segment-aware layer takes its queries' positions
    from columns ``[start, end)``, and from the rest what depends on the whole sequence:
    the documents of a packed batch, whose positions restart at 0, and the length that
    some rotary embeddings scale by). A 4-D mask is refused: it would need rows and
    columns cut alike.
    """
    if isinstance(inputs, Tensor):
        return inputs[:, start:end]
    if not isinstance(inputs, Mapping):
        raise ValueError(
            f"segment inputs must be a tensor or a mapping of tensors, got {type(inputs).__name__}"
        )
    out = {}
    for key, value in inputs.items():
        if key == "attention_mask" and isinstance(value, Tensor):
            if value.ndim != 2:
                raise ValueError(
                    f"segments take a 2-D attention_mask (batch, sequence), got shape "
                    f"{tuple(value.shape)}"
                )
            out[key] = value[:, :end]
        elif key == "position_ids":
            out[key] = value
        elif isinstance(value, Tensor):
            out[key] = value[:, start:end]
        else:
            out[key] = value
    return out


@dataclass
class SegmentRun:
    """What :func:`run_segments` returns."""

    loss: Tensor
    output: Tensor
    """The segments' outputs concatenated on the sequence dim (detached)."""
    grads: dict[str, Tensor | None]
    """Each parameter's ``.grad`` after the backward, named ``"<layer>.<name>"``."""
    input_grad: Tensor | None
    """Gradient of the floating-point input (hidden states), ``None`` for token ids."""


def sequence_tensor(x: Any) -> Tensor:
    """The sequence tensor of a stage's input or output: itself, or a mapping's ``hidden``
    (the HF adapter's boundary) or ``input_ids`` (a tokenizer's batch)."""
    if isinstance(x, Mapping):
        x = x.get("hidden", x.get("input_ids"))
    if not isinstance(x, Tensor):
        raise ValueError(
            f"expected a tensor or a mapping with 'hidden' or 'input_ids', got {type(x).__name__}"
        )
    return x


def _as_leaf(inputs: Any) -> tuple[Any, Tensor | None]:
    """The inputs with their floating-point tensor replaced by a fresh leaf (as a stage
    receives activations), and that leaf."""
    x = sequence_tensor(inputs)
    if not x.is_floating_point():
        return inputs, None
    leaf = x.detach().requires_grad_()
    if isinstance(inputs, Mapping):
        return {**inputs, "hidden": leaf}, leaf
    return leaf, leaf


def _call(layers: Sequence[nn.Module], inputs: Any) -> Any:
    x = layers[0](inputs)
    for layer in layers[1:]:
        x = layer(x)
    return x


def token_cuts(cuts: Any) -> tuple[int, ...]:
    """``cuts`` as a tuple of Python ints: any integer type is taken (numpy's and torch's
    integers, through ``__index__``); a float, a bool or anything else is refused, naming it
    (their order is checked where the segment count is known)."""
    if isinstance(cuts, str | bytes) or not isinstance(cuts, Sequence | Iterator):
        try:
            cuts = list(cuts)
        except TypeError:
            raise ValueError(
                f"cuts must be a sequence of token positions, got {type(cuts).__name__}"
            ) from None
    out = []
    for i, b in enumerate(cuts):
        if isinstance(b, bool):
            raise ValueError(f"cuts[{i}] is {b!r}, not a token position (an integer)")
        try:
            out.append(operator.index(b))
        except TypeError:
            raise ValueError(
                f"cuts[{i}] is {b!r} ({type(b).__name__}), not a token position: cuts are "
                "integers (Python's, numpy's or a torch integer scalar)"
            ) from None
    return tuple(out)


def cut_pairs(cuts: Sequence[int], length: int) -> list[tuple[int, int]]:
    """The segments ``[(b0, b1), (b1, b2), ...]`` of ``cuts``, checked to run from 0 to the
    sequence ``length`` strictly increasing."""
    cuts = token_cuts(cuts)
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != length:
        raise ValueError(f"cuts must run from 0 to the sequence length {length}, got {list(cuts)}")
    pairs = list(itertools.pairwise(cuts))
    if any(end <= start for start, end in pairs):
        raise ValueError(f"cuts must be strictly increasing, got {list(cuts)}")
    return pairs


def past_leaves(earlier: Sequence[Sequence[KV]]) -> list[list[KV]] | None:
    """The past of the segment after ``earlier`` (per earlier segment, its keys and values
    per attention layer): per attention layer, each earlier segment's ``(k, v)`` as fresh
    leaves that require grad, so each leaf's gradient is the new segment's share for that
    segment. None for the first segment."""
    if not earlier:
        return None
    return [
        [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in layer]
        for layer in zip(*earlier, strict=True)
    ]


def flat_past(past: Sequence[Sequence[KV]] | None) -> list[Tensor]:
    """A past's leaves in one list: per attention layer, per earlier segment, ``k`` then ``v``
    (the order :func:`add_past_grads` reads their gradients in)."""
    return [t for layer in past or [] for kv in layer for t in kv]


def add_past_grads(
    sums: dict[int, list[KV | None]], grads: Sequence[Tensor | None], segment: int
) -> None:
    """Add the gradients of segment ``segment``'s past leaves (ordered as :func:`flat_past`)
    to each earlier segment's running sums, ``sums[s][layer]``: ``held + new``, in the order
    the later segments' backwards run; a leaf no backward reached adds nothing."""
    if segment == 0:
        return
    layers = len(grads) // (2 * segment)
    for j in range(layers):
        for s in range(segment):
            at = 2 * (j * segment + s)
            gk, gv = grads[at], grads[at + 1]
            if gk is None or gv is None:
                continue
            held = sums.setdefault(s, [None] * layers)
            kv = held[j]
            held[j] = (gk, gv) if kv is None else (kv[0] + gk, kv[1] + gv)


def run_segments(
    layers: Sequence[nn.Module],
    batch_inputs: Any,
    cuts: Sequence[int],
    loss_fn: Any,
) -> SegmentRun:
    """Forward every segment in order, then backward them in reverse, by the protocol.

    ``batch_inputs`` are the stage's inputs for the whole sequence (see
    :func:`segment_inputs`); ``cuts`` the boundaries ``0 = b0 < ... < bk = T``;
    ``loss_fn`` maps the concatenated outputs to a scalar. The loss is taken once on the
    concatenation, so any loss over the whole sequence (a token mean, an ignore index)
    means what it means in one pass; its gradient is then split by segment, as a last
    stage's loss per segment would give it. Parameter gradients accumulate in ``.grad``
    as ``loss.backward()`` would.
    """
    length = sequence_tensor(batch_inputs).shape[1]
    pairs = cut_pairs(cuts, length)
    leaves: list[Tensor | None] = []
    outputs: list[Tensor] = []
    contexts: list[SegmentContext] = []
    for start, end in pairs:
        inputs, leaf = _as_leaf(segment_inputs(batch_inputs, start, end))
        context = SegmentContext(start, past_leaves([c.new_kv() for c in contexts]))
        with segment_scope(layers, context):
            outputs.append(sequence_tensor(_call(layers, inputs)))
        leaves.append(leaf)
        contexts.append(context)

    whole = torch.cat([out.detach() for out in outputs], dim=1).requires_grad_()
    loss = loss_fn(whole)
    (output_grad,) = torch.autograd.grad(loss, whole)
    output_grads = output_grad.split([end - start for start, end in pairs], dim=1)

    # acc[i][j]: the gradient of segment i's own keys and values in attention layer j, summed
    # over the later segments' backwards as they run.
    acc: dict[int, list[KV | None]] = {}
    for i in reversed(range(len(pairs))):
        tensors, tensor_grads = [outputs[i]], [output_grads[i]]
        for kv, kv_grad in zip(contexts[i].new_kv(), acc.get(i, []), strict=False):
            if kv_grad is not None:
                tensors.extend(kv)
                tensor_grads.extend(kv_grad)
        torch.autograd.backward(tensors, tensor_grads)
        add_past_grads(acc, [t.grad for t in flat_past(contexts[i].past)], i)

    input_grads = [
        torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
        for leaf in leaves
        if leaf is not None
    ]
    input_grad = torch.cat(input_grads, dim=1) if input_grads else None
    grads = {
        f"{i}.{name}": p.grad
        for i, layer in enumerate(layers)
        for name, p in layer.named_parameters()
    }
    return SegmentRun(loss.detach(), whole.detach(), grads, input_grad)
