"""A step's microbatches cut into sequence segments, the units of a segment schedule.

A schedule with k segments per microbatch (:attr:`~zerobubble.schedule.ir.Schedule.segments`)
runs unit ``u = j * k + i``: microbatch j's tokens ``[cuts[i], cuts[i + 1])``. Stage 0 gets
that slice of its inputs (:func:`~zerobubble.runtime.sequence.kv.segment_inputs`: dim 1 of
every tensor, a 2-D ``attention_mask`` up to the segment's end), the last stage the same
slice of the target. Each unit's loss is its tokens' share of the batch loss, which only a
loss normalised by a count of the whole batch gives (``count_fn``), so that is required.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from zerobubble.runtime.sequence.kv import SegmentOf, segment_inputs, token_cuts
from zerobubble.runtime.step_batch import StepBatch

__all__ = [
    "check_agreed_cuts",
    "check_cuts",
    "cut_value",
    "segment_of",
    "segment_step",
    "sequence_length",
]


def check_cuts(
    cuts: Sequence[int] | None, segments: int, schedule: str = "the schedule"
) -> tuple[int, ...] | None:
    """``cuts`` for ``segments`` segments: ``0 = b0 < b1 < ... < bk``, as a tuple of ints
    (numpy's integers taken); None for a schedule without segments, which refuses cuts
    rather than ignore them."""
    if segments == 1:
        if cuts is not None:
            raise ValueError(
                f"{schedule} runs whole sequences (no segments), but ExecutorOptions(cuts="
                f"{list(token_cuts(cuts))}) was given and would be ignored: generate a "
                "segment schedule to cut the sequences (e.g. generate('seq-zb', P, M, "
                "segments=k) with k + 1 cuts), or pass cuts=None"
            )
        return None
    if cuts is None:
        raise ValueError(
            f"the schedule cuts each sequence into {segments} segments: pass "
            "ExecutorOptions(cuts=...), the token boundaries 0 = b0 < ... < bk = T "
            "(zerobubble.schedule.segments.balanced_cuts for segments of equal work, "
            "equal_token_cuts for equal lengths)"
        )
    out = token_cuts(cuts)
    if len(out) != segments + 1 or out[0] != 0 or any(b <= a for a, b in itertools.pairwise(out)):
        raise ValueError(
            f"cuts={list(out)} must be {segments + 1} increasing token positions from 0 "
            f"(one segment between each two) for a schedule of {segments} segments"
        )
    return out


def segment_of(unit: int, cuts: tuple[int, ...]) -> SegmentOf:
    """Where ``unit`` sits: its microbatch, segment index, the segment count, first token."""
    k = len(cuts) - 1
    return SegmentOf(microbatch=unit // k, index=unit % k, count=k, start=cuts[unit % k])


def sequence_length(value: Any, what: str) -> int:
    """Dim 1 of the first tensor in ``value`` (depth-first), the sequence length; ``what``
    names ``value`` in the error when it holds none."""
    stack = [value]
    while stack:
        x = stack.pop(0)
        if isinstance(x, Tensor) and x.dim() >= 2:
            return int(x.shape[1])
        if isinstance(x, dict):
            stack = [*x.values(), *stack]
        elif isinstance(x, list | tuple):
            stack = [*x, *stack]
    raise ValueError(f"{what} holds no tensor with a sequence dim (dim 1) to cut into segments")


def cut_value(value: Any, start: int, end: int) -> Any:
    """Tokens ``[start, end)`` of a tensor, a mapping (:func:`segment_inputs`) or a tuple of
    them; anything else as is."""
    if isinstance(value, tuple):
        return tuple(cut_value(x, start, end) for x in value)
    if isinstance(value, Tensor | dict):
        return segment_inputs(value, start, end)
    return value


def segment_step(batch: StepBatch, cuts: tuple[int, ...]) -> StepBatch:
    """``batch``'s M microbatches as M * k units, cut at ``cuts``; a sequence whose length is
    not ``cuts[-1]`` is refused, naming both."""
    pairs = list(itertools.pairwise(cuts))
    out = StepBatch(scales=None, num_items=batch.num_items)
    if batch.inputs is not None:
        n = sequence_length(batch.inputs[0], "the input batch")
        _same_length(n, cuts, "the input batch")
        out.inputs = [
            (cut_value(args, s, e), segment_inputs(kwargs, s, e) if kwargs else kwargs)
            for args, kwargs in batch.inputs
            for s, e in pairs
        ]
    if batch.targets is not None:
        assert batch.scales is not None
        n = sequence_length(batch.targets[0], "target")
        _same_length(n, cuts, "target")
        out.targets = [cut_value(t, s, e) for t in batch.targets for s, e in pairs]
        out.scales = [x for x in batch.scales for _ in pairs]
    return out


def _same_length(n: int, cuts: tuple[int, ...], what: str) -> None:
    if n != cuts[-1]:
        raise ValueError(
            f"{what} has sequences of {n} tokens but the segment cuts {list(cuts)} cover "
            f"{cuts[-1]}; cut for this length (ExecutorOptions(cuts=...))"
        )


def check_agreed_cuts(
    got: Mapping[int, Any], cuts: tuple[int, ...], name: Callable[[int], str]
) -> None:
    """Raise every rank's refusal of its stages (so every rank raises it), then any rank
    whose cuts are not ``cuts``."""
    refused = [f"{name(r)}: {g['refused']}" for r, g in sorted(got.items()) if g["refused"]]
    if refused:
        raise ValueError("; ".join(refused))
    differ = {r: g["cuts"] for r, g in got.items() if tuple(g["cuts"]) != cuts}
    if differ:
        seen = "; ".join(f"{name(r)} cuts={list(c)}" for r, c in sorted(differ.items()))
        raise ValueError(
            f"{name(dist.get_rank())} cuts the sequences at {list(cuts)} but {seen}: every "
            "rank must pass the same ExecutorOptions(cuts=...) (a pipeline's ranks exchange "
            "each segment's boundary values, the replicas sum the same segments' gradients)"
        )
