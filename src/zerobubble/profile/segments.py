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
from torch import nn

from zerobubble.runtime.sequence.kv import (
    SegmentContext,
    segment_inputs,
    segment_scope,
    sequence_tensor,
)
from zerobubble.schedule.segments import Attention, SegmentCost

__all__ = ["default_spans", "past_of", "profile_segment_cost", "run_span"]


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


def _chain(layers: Sequence[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _length(inputs: Any) -> int:
    x = sequence_tensor(inputs)
    if x.dim() < 2:
        raise ValueError(f"inputs must have a sequence dim (dim 1), got shape {tuple(x.shape)}")
    return int(x.shape[1])
