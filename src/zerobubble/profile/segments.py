"""Measured segment costs: where to cut a sequence, from the model as it runs here.

:class:`~zerobubble.schedule.segments.SegmentCost` prices a segment ``[s, e)`` of a
causal sequence as ``linear * (e - s) + attention * pairs``. The closed form
(:meth:`SegmentCost.transformer`) counts flops; what a machine pays per token and per
query-key pair differs (memory-bound softmax, small GEMMs, host work), so this times
the layers' forward on a few spans of a real batch, each with the keys and values of
the tokens before it (the segment-aware layers of :mod:`~zerobubble.runtime.sequence.kv`),
and fits the two terms (:meth:`SegmentCost.fit`). The backward scales both terms alike,
so the forward is enough to cut.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from zerobubble.runtime.sequence.kv import (
    SegmentAware,
    SegmentContext,
    past_leaves,
    segment_inputs,
    segment_scope,
    sequence_tensor,
)
from zerobubble.schedule.segments import Attention, SegmentCost, SegmentMemory

__all__ = [
    "default_spans",
    "past_of",
    "profile_segment_cost",
    "profile_segment_memory",
    "run_span",
    "span_memory",
]


def default_spans(length: int) -> list[tuple[int, int]]:
    """Two lengths from the start and one late span: enough to separate the two terms
    (their token and pair counts are not proportional) under either kernel."""
    if length < 4:
        raise ValueError(f"a sequence of {length} tokens is too short to profile segments (>= 4)")
    quarter, half = length // 4, length // 2
    return [(0, quarter), (0, half), (half, length)]


def past_of(layers: Sequence[nn.Module], inputs: Any, start: int) -> list[list[Any]] | None:
    """The keys and values of tokens ``[0, start)`` per attention layer, as one earlier
    segment (None for ``start == 0``). No gradients."""
    if start == 0:
        return None
    before = SegmentContext(0)
    with torch.no_grad(), segment_scope(layers, before):
        _chain(layers, segment_inputs(inputs, 0, start))
    return [[kv] for kv in before.new_kv()]


def run_span(
    layers: Sequence[nn.Module], inputs: Any, start: int, end: int, past: Any = None
) -> Any:
    """The layers' output for tokens ``[start, end)`` of ``inputs``, attending ``past``
    (:func:`past_of` ``start``, computed here if not given). No gradients."""
    if past is None:
        past = past_of(layers, inputs, start)
    with torch.no_grad(), segment_scope(layers, SegmentContext(start, past)):
        return _chain(layers, segment_inputs(inputs, start, end))


def profile_segment_cost(
    layers: Sequence[nn.Module],
    inputs: Any,
    *,
    kernel: Attention,
    spans: Sequence[tuple[int, int]] | None = None,
    warmup: int = 1,
    iters: int = 3,
) -> SegmentCost:
    """Fit a :class:`SegmentCost` to the median forward time (ms) of ``layers`` on each span.

    ``inputs`` are the first layer's inputs for whole sequences (a tensor, or a mapping
    such as a tokenizer's batch), the sequence on dim 1; ``kernel`` says how the
    attention counts pairs ("dense": eager attention, which scores every key and masks;
    "causal": a kernel that skips the masked pairs). Spans default to
    :func:`default_spans` of the sequence's length.
    """
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got {warmup} and {iters}")
    length = _length(inputs)
    spans = list(spans) if spans is not None else default_spans(length)
    for start, end in spans:
        if not 0 <= start < end <= length:
            raise ValueError(f"span [{start}, {end}) is not inside the sequence of {length}")
    samples = []
    for start, end in spans:
        past = past_of(layers, inputs, start)  # not timed: only the span is
        times = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            run_span(layers, inputs, start, end, past)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        samples.append((start, end, statistics.median(times)))
    return SegmentCost.fit(samples, kernel)


def span_memory(
    layers: Sequence[nn.Module], inputs: Any, start: int, end: int, past: Any = None
) -> list[tuple[int, int]]:
    """Per layer, what its forward on tokens ``[start, end)`` of ``inputs`` holds for the
    backward and the bytes of its own keys and values: the distinct storages the layer's
    graph saves first (a storage saved by two layers counts for the first), less the
    parameters, the buffers and the past's keys and values (the earlier segments', leaves
    here), as a stage's ``held_bytes`` counts them."""
    if past is None:
        past = past_of(layers, inputs, start)
    leaves = past_leaves([[layer[0] for layer in past]]) if past else None
    saved: list[list[Tensor]] = [[] for _ in layers]
    at = [0]

    def pack(t: Tensor) -> Tensor:
        saved[at[0]].append(t.detach())
        return t

    context = SegmentContext(start, leaves)
    x = segment_inputs(inputs, start, end)
    with torch.enable_grad(), saved_tensors_hooks(pack, _same), segment_scope(layers, context):
        for i, layer in enumerate(layers):
            at[0] = i
            x = layer(x)
    own = iter(context.new_kv())
    seen = {
        t.untyped_storage().data_ptr()
        for layer in layers
        for t in (*layer.parameters(), *layer.buffers())
    }
    seen |= {t.untyped_storage().data_ptr() for layer in leaves or [] for kv in layer for t in kv}
    out = []
    for layer, tensors in zip(layers, saved, strict=True):
        held = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                held += storage.nbytes()
        kv = sum(
            t.numel() * t.element_size() for _ in range(_attention_layers(layer)) for t in next(own)
        )
        out.append((held, kv))
    return out


def _attention_layers(layer: nn.Module) -> int:
    """How many attention layers with keys and values in the protocol ``layer`` holds."""
    return len({id(m) for m in layer.modules() if isinstance(m, SegmentAware) and m.holds_kv})


def profile_segment_memory(
    layers: Sequence[nn.Module],
    inputs: Any,
    *,
    kernel: Attention,
    spans: Sequence[tuple[int, int]] | None = None,
) -> tuple[SegmentMemory, ...]:
    """Per layer, a :class:`SegmentMemory` fitted to what its forward holds on each span
    (:func:`span_memory`; spans as :func:`profile_segment_cost`'s): saved bytes per token,
    per query-key pair and per key attended, and one token's keys and values. A stage's is
    their :meth:`~SegmentMemory.total`."""
    length = _length(inputs)
    spans = list(spans) if spans is not None else default_spans(length)
    measured = [span_memory(layers, inputs, start, end) for start, end in spans]
    out = []
    for i in range(len(layers)):
        samples = [(s, e, float(m[i][0])) for (s, e), m in zip(spans, measured, strict=True)]
        kv = max(m[i][1] / (e - s) for (s, e), m in zip(spans, measured, strict=True))
        out.append(SegmentMemory.fit(samples, kv, kernel))
    return tuple(out)


def _same(t: Tensor) -> Tensor:
    return t


def _chain(layers: Sequence[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _length(inputs: Any) -> int:
    x = sequence_tensor(inputs)
    if x.dim() < 2:
        raise ValueError(f"inputs must have a sequence dim (dim 1), got shape {tuple(x.shape)}")
    return int(x.shape[1])
