"""Sequence segments on a stage: the keys and values a microbatch's segments share.

Under a segment schedule (``StageChunk.forward(..., segment=...)``) a stage's ops run on
units, one segment of a microbatch's sequence each. F, B and W do not change; what
changes is what the stage keeps between them: the earlier segments' keys and values
(read by a later segment's attention) and their gradients (summed over the later
segments' backwards, then fed to the earlier segment's B as extra roots). That is the
:class:`~zerobubble.runtime.extension.StageExtension` here; the protocol it follows is
:mod:`~zerobubble.runtime.sequence.kv`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from zerobubble.runtime.extension import Roots, StageChunkError, StageExtension, Unit
from zerobubble.runtime.sequence.kv import (
    KV,
    SegmentContext,
    SegmentOf,
    add_past_grads,
    flat_past,
    past_leaves,
    segment_scope,
    unaware_attention,
)

__all__ = ["SegmentExtension"]


@dataclass
class _Sequence:
    """What the segments of one microbatch share on a stage, between their ops."""

    forwarded: int = 0
    """How many of its segments ran their forward here."""
    kv: list[list[KV]] = field(default_factory=list)
    """Per segment forwarded so far, its keys and values per attention layer (aliases
    without a graph: the segment's own graph keeps the data anyway); dropped after the
    last segment's forward, the backwards' leaves keep what they need."""
    grads: dict[int, list[KV | None]] = field(default_factory=dict)
    """Per segment, the gradients of its keys and values summed over the later segments'
    backwards that ran so far (None for a layer none of them reached)."""
    next_backward: int = -1
    """The segment whose backward may run next (the last one first)."""


@dataclass
class _Kept:
    """What one segment's unit holds between its F and its B."""

    segment: SegmentOf
    past: list[Tensor]
    """The leaves standing for the earlier segments' keys and values (per layer, per
    earlier segment, ``k`` then ``v``); B hands their gradients back to those segments."""
    kv_roots: list[GradientEdge] = field(default_factory=list)
    """The segment's own keys and values, per attention layer ``k`` then ``v``: extra
    outputs whose gradients come from the later segments' backwards (none for the last)."""


class SegmentExtension(StageExtension):
    """The keys and values of a stage's segmented microbatches, kept between their units.

    Under activation recompute a checkpointed region takes its part of the context with it
    (:class:`~zerobubble.runtime.sequence.kv.RegionSegments`): its replay in B reads the
    same past and gives its own keys and values again, so F, B and this extension are the
    same with and without it.

    Args:
        module: The stage's layers (their segment-aware attention reads the context).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._sequences: dict[int, _Sequence] = {}
        """Per microbatch whose sequence runs in segments, what its segments share."""
        self._kept: dict[int, _Kept] = {}
        """Per unit between F and B, what its B needs."""
        self._context: SegmentContext | None = None
        """The context of the forward under way (taken by :meth:`keep`)."""
        self._unaware: str | None = None
        """An attention layer that cannot run segments ("" if none), found at the first."""

    def enter(self, unit: Unit) -> AbstractContextManager[object]:
        """The context of the segment's forward, installed on the stage's layers: one fresh
        leaf per earlier segment's keys and values per attention layer, so that each leaf's
        gradient is this segment's share for that earlier segment."""
        segment = unit.segment
        self._context = None
        if segment is None:
            return nullcontext()
        self._refuse(unit.stage)
        seq = self._sequences.setdefault(segment.microbatch, _Sequence())
        if seq.forwarded != segment.index:
            raise StageChunkError(
                unit.stage,
                unit.mb,
                f"segment {segment.index} of microbatch {segment.microbatch} forwarded after "
                f"{seq.forwarded} of its segments; the segments of a sequence go in order",
            )
        self._context = SegmentContext(segment.start, past_leaves(seq.kv))
        return segment_scope([self.module], self._context)

    def _refuse(self, stage: int) -> None:
        """Raise if this stage cannot run segments: an attention layer that would see only
        its own segment."""
        if self._unaware is None:  # once: the module's layers do not change
            self._unaware = unaware_attention(self.module) or ""
        if layer := self._unaware:
            raise ValueError(
                f"stage {stage}: attention layer {layer} would see only its own segment "
                "of the sequence, not the earlier ones; run it without segments, or make it "
                "segment-aware (zerobubble.runtime.sequence.kv.SegmentAware)"
            )

    def keep(self, unit: Unit, out: Any) -> bool:
        """Keep the segment's past leaves as inputs of its backward, and, for all but the
        last segment, its own keys and values (for the later segments, and as extra outputs
        of its backward)."""
        segment, context = unit.segment, self._context
        if segment is None or context is None:
            return False
        self._context = None
        kept = _Kept(segment, flat_past(context.past))
        own = context.new_kv()
        seq = self._sequences[segment.microbatch]
        seq.forwarded += 1
        if segment.index + 1 < segment.count:
            seq.kv.append([(k.detach(), v.detach()) for k, v in own])
            kept.kv_roots = [get_gradient_edge(t) for kv in own for t in kv]
        else:
            seq.kv.clear()  # no later segment reads them
            seq.next_backward = segment.index
        self._kept[unit.mb] = kept
        return True

    def backward(
        self, unit: Unit, roots: Roots, grads: list[Tensor] | None
    ) -> tuple[Roots, list[Tensor] | None, Sequence[Tensor]]:
        """The roots and gradients of a segment's backward: its outputs', then those of its
        own keys and values that a later segment's backward reached; the past leaves as
        extra inputs."""
        kept = self._kept[unit.mb]
        kv_grads = self._kv_grads(unit, kept)
        if not any(g is not None for g in kv_grads):
            return roots, grads, kept.past
        out_roots: Roots = list(roots)
        out = list(grads) if grads is not None else [torch.ones_like(r) for r in roots]  # type: ignore[arg-type]
        for edge, g in zip(kept.kv_roots, kv_grads, strict=True):
            if g is not None:
                out_roots.append(edge)
                out.append(g)
        return out_roots, out, kept.past

    def _kv_grads(self, unit: Unit, kept: _Kept) -> list[Tensor | None]:
        """The summed gradients of the segment's own keys and values, after checking that
        every later segment's backward ran."""
        segment = kept.segment
        seq = self._sequences[segment.microbatch]
        if seq.next_backward != segment.index:
            raise StageChunkError(
                unit.stage,
                unit.mb,
                f"backward of segment {segment.index} of microbatch {segment.microbatch} "
                f"before that of segment {seq.next_backward}; the segments of a sequence go "
                "backward last first",
            )
        held = seq.grads.pop(segment.index, None)
        if held is None:
            return [None] * len(kept.kv_roots)
        return [g for kv in held for g in (kv if kv is not None else (None, None))]

    def hand_back(self, unit: Unit, grads: Sequence[Tensor | None]) -> None:
        """Add the past leaves' gradients to the earlier segments' sums."""
        segment = self._kept.pop(unit.mb).segment
        seq = self._sequences[segment.microbatch]
        add_past_grads(seq.grads, grads, segment.index)
        seq.next_backward = segment.index - 1
        if segment.index == 0:
            del self._sequences[segment.microbatch]

    def held_tensors(self) -> Iterable[Tensor]:
        """The kept keys and values and their summed gradients."""
        for seq in self._sequences.values():
            yield from (t for kvs in seq.kv for kv in kvs for t in kv)
            yield from (
                t for sums in seq.grads.values() for kv in sums if kv is not None for t in kv
            )

    def discard(self) -> None:
        self._sequences.clear()
        self._kept.clear()
        self._context = None
