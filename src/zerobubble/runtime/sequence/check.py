"""Refuse layers that compute something else on a segment than on the whole sequence.

A segment schedule runs each layer on tokens ``[start, end)`` with the earlier segments'
keys and values (:mod:`~zerobubble.runtime.sequence.kv`). Attention layers that ignore the
protocol are refused by name (:func:`~zerobubble.runtime.sequence.kv.unaware_attention`),
but a layer can also read the *position* of a token, e.g. a learned position embedding
indexed by ``arange(T)`` or a rotary table computed from the input's length: on a
segment it would give token ``start`` the position 0, a silent error. No type check can
see that, so :func:`check_segments` runs the model both ways, without gradients, and
names the first layer whose output differs by more than float32's reordering can explain
(shorter GEMMs and softmax rows round differently: about 1e-6 of the values' scale).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.runtime.sequence.kv import (
    SegmentContext,
    cut_pairs,
    past_leaves,
    segment_inputs,
    segment_scope,
    sequence_tensor,
)

__all__ = ["SEGMENT_RTOL", "check_segments"]

SEGMENT_RTOL = 1e-3
"""Largest difference allowed, relative to the largest value of the layer's output:
float32's reordering gives about 1e-6; a wrong position gives order 1."""


def check_segments(
    layers: Sequence[nn.Module], inputs: Any, cuts: Sequence[int], *, rtol: float = SEGMENT_RTOL
) -> None:
    """Raise ``ValueError`` naming the first of ``layers`` whose output on the segments cut
    at ``cuts`` (concatenated) differs from its output on the whole sequence.

    ``inputs`` are the first layer's inputs for whole sequences (a tensor, or a mapping
    such as a tokenizer's batch), the sequence on dim 1. Positions a 2-D
    ``attention_mask`` marks as padding are not compared (their values are unused). Each
    layer is compared on the same inputs both ways (the whole run's), so an error is
    blamed on the layer that makes it, not on the ones after it. The layers run in eval
    mode (dropout would draw differently on a segment) and get their mode back.
    """
    pairs = cut_pairs(cuts, int(sequence_tensor(inputs).shape[1]))
    mask = inputs.get("attention_mask") if isinstance(inputs, Mapping) else None
    x = inputs
    with torch.no_grad(), _eval(layers):
        for index, layer in enumerate(layers):
            whole = layer(x)
            pieces: list[Tensor] = []
            contexts: list[SegmentContext] = []
            for start, end in pairs:
                context = SegmentContext(start, past_leaves([c.new_kv() for c in contexts]))
                with segment_scope([layer], context):
                    pieces.append(sequence_tensor(layer(segment_inputs(x, start, end))))
                contexts.append(context)
            _compare(index, layer, sequence_tensor(whole), torch.cat(pieces, dim=1), mask, rtol)
            x = whole


@contextmanager
def _eval(layers: Sequence[nn.Module]) -> Iterator[None]:
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    try:
        for layer in layers:
            layer.eval()
        yield
    finally:
        for m, training in modes:
            m.training = training


def _compare(
    index: int, layer: nn.Module, whole: Tensor, cut: Tensor, mask: Any, rtol: float
) -> None:
    if not whole.is_floating_point():
        return
    keep = torch.ones(whole.shape[:2], dtype=torch.bool)
    if isinstance(mask, Tensor) and mask.dim() == 2 and mask.shape == keep.shape:
        keep = mask.bool()
    a, b = whole[keep].double(), cut[keep].double()
    scale = float(a.abs().max()) if a.numel() else 0.0
    worst = float((a - b).abs().max()) if a.numel() else 0.0
    if worst > rtol * scale:
        raise ValueError(
            f"layer {index} ({type(layer).__name__}) computes other values on sequence "
            f"segments than on the whole sequence (largest difference {worst:.3g}, at values "
            f"up to {scale:.3g}): a layer that reads token positions must take them from the "
            "segment's start (derive from zerobubble.runtime.sequence.kv.SegmentAware), or "
            "train it without segments"
        )
