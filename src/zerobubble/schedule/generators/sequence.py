"""Sequence-level pipelining (Seq1F1B): a microbatch's sequence streams through as k segments.

Each microbatch's sequence is cut into ``k`` segments (where:
:func:`~zerobubble.schedule.segments.balanced_cuts`); the pipeline's unit of work is one
segment, numbered ``u = mb * k + seg`` in an action's ``mb`` field
(:class:`~zerobubble.schedule.ir.Schedule`). Forwards go through the segments in order
(a segment reads the keys and values of the ones before it); backwards go in reverse (a
segment's backward sends gradients into those keys and values, which the earlier
segment's backward needs). Both orders are the dependency rule's
(:data:`~zerobubble.schedule.deps.RULES`).

Why it pays: the pipeline fills and drains in units of a segment, 1/k of a microbatch,
so at uniform costs the bubble shrinks k-fold, and device d holds ``P - d + k - 1``
segments in flight, ``(P - d + k - 1) / k`` microbatches' activations (plus the keys
and values the later segments read), where 1F1B holds ``P - d`` microbatches.
"""

from __future__ import annotations

from zerobubble.schedule.generators.classic import merge_1f1b
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.ir import Action, Op, Schedule


def check_segments(segments: int) -> int:
    if type(segments) is not int or segments < 1:
        raise ValueError(f"segments must be an integer >= 1, got {segments!r}")
    return segments


def forward_units(num_microbatches: int, segments: int) -> list[int]:
    """Units in forward order: microbatch by microbatch, each sequence from its start."""
    return list(range(num_microbatches * segments))


def backward_units(num_microbatches: int, segments: int) -> list[int]:
    """Units in backward order: microbatch by microbatch, each sequence from its end."""
    k = segments
    return [mb * k + (k - 1 - r) for mb in range(num_microbatches) for r in range(k)]


def seq1f1b(
    num_devices: int, num_microbatches: int, *, segments: int = 2, split_backward: bool = False
) -> Schedule:
    """Seq1F1B: 1F1B over segments, combined backward (BW) unless ``split_backward``.

    Device d warms up with ``P - 1 - d + k - 1`` forwards: the first backward of the
    last stage is the last segment of microbatch 0, after all k of its forwards. Any
    P, M, k >= 1; k = 1 is 1F1B. At uniform unit costs F = B = W = 1 the cost is
    ``3Mk + 3(P - 1)``: 1F1B's bubble in segments instead of microbatches.
    """
    p, m = check_counts(num_devices, num_microbatches)
    k = check_segments(segments)
    fwd_units, bwd_units = forward_units(m, k), backward_units(m, k)
    actions = []
    for d in range(p):
        warmup = min(p - 1 - d + k - 1, m * k)
        fwd = [Action(Op.F, d, u) for u in fwd_units]
        bwd = [(d, u) for u in bwd_units]
        actions.append(merge_1f1b(fwd, bwd, warmup, split_backward))
    return Schedule("seq1f1b", p, p, m, tuple(range(p)), tuple(map(tuple, actions)), k)


def seq_zb(num_devices: int, num_microbatches: int, *, segments: int = 2) -> Schedule:
    """ZB-H1 over segments: Seq1F1B's memory with the B/W split filling the drain.

    Device i repeats ZB-H1's triple: the next F, the B ``P - 1 - i + k - 1`` places
    behind it in backward order, the W ``P - 1 + k - 1`` places behind (so device i
    defers each W by i units after its B). At uniform unit costs F = B = W = 1 the
    cost is ``3Mk + P - 1`` once ``Mk >= P + k - 1``: ZB-H1's bubble in segments.
    """
    p, m = check_counts(num_devices, num_microbatches)
    k = check_segments(segments)
    units = m * k
    fwd_units, bwd_units = forward_units(m, k), backward_units(m, k)
    actions = []
    for i in range(p):
        lags = (
            (Op.F, 0, fwd_units),
            (Op.B, p - 1 - i + k - 1, bwd_units),
            (Op.W, p - 1 + k - 1, bwd_units),
        )
        acts = []
        for x in range(units + p - 1 + k - 1):
            for op, lag, order in lags:
                if 0 <= x - lag < units:
                    acts.append(Action(op, i, order[x - lag]))
        actions.append(tuple(acts))
    return Schedule("seq-zb", p, p, m, tuple(range(p)), tuple(actions), k)
