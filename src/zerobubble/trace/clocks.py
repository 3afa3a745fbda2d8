"""Align the clocks of traced ranks using the messages between them.

Each rank's trace times are exact on its own clock, but the ranks' epochs
(taken after a barrier) can differ by milliseconds on a loaded machine. The
messages bound the difference: a message from ``a`` to ``b`` cannot return
from ``b``'s wait before ``a`` started sending it, so with ``d = offset[b] -
offset[a]`` (add ``offset[r]`` to rank ``r``'s times to reach the common
frame)::

    send_start_a - wait_end_b  <=  d  <=  wait_end_a' - send_start_b'   (for b -> a messages)

The offset chosen for a pair is the middle of that interval (0 when it
contains no finite bound). An empty interval means the times contradict
causality, whatever the offsets: :func:`pair_bounds` exposes the messages
that define each bound so a checker can name them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.trace.format import EventOp, TraceEvent


@dataclass(frozen=True)
class Bound:
    """The tightest constraint on ``offset[b] - offset[a]`` from one direction.

    Attributes:
        value: The bound (ns).
        send: The send event defining it.
        wait: The matching wait_recv event.
    """

    value: int
    send: TraceEvent
    wait: TraceEvent


def pair_bounds(
    events: Sequence[TraceEvent],
) -> dict[tuple[int, int], tuple[Bound | None, Bound | None]]:
    """For each rank pair ``a < b``: (lower, upper) bound on ``offset[b] - offset[a]``."""
    sends = {(e.iteration, e.msg): e for e in events if e.op is EventOp.SEND}
    out: dict[tuple[int, int], list[Bound | None]] = {}
    for w in events:
        if w.op is not EventOp.WAIT_RECV:
            continue
        s = sends.get((w.iteration, w.msg))
        if s is None or s.rank == w.rank:
            continue
        a, b = sorted((s.rank, w.rank))
        lo_hi = out.setdefault((a, b), [None, None])
        if s.rank == a:  # a -> b: d >= send_a - wait_b
            cand = Bound(s.start_ns - w.end_ns, s, w)
            if lo_hi[0] is None or cand.value > lo_hi[0].value:
                lo_hi[0] = cand
        else:  # b -> a: d <= wait_a - send_b
            cand = Bound(w.end_ns - s.start_ns, s, w)
            if lo_hi[1] is None or cand.value < lo_hi[1].value:
                lo_hi[1] = cand
    return {k: (v[0], v[1]) for k, v in out.items()}


def clock_offsets(events: Sequence[TraceEvent]) -> dict[int, int]:
    """Nanoseconds to add to each rank's times to put all ranks on one clock.

    The lowest rank keeps its clock; others follow along the message pairs
    (breadth first). Ranks with no messages to the others keep offset 0.
    """
    ranks = sorted({e.rank for e in events})
    bounds = pair_bounds(events)
    step: dict[tuple[int, int], int] = {}
    for (a, b), (lo, hi) in bounds.items():
        if lo is not None and hi is not None:
            d = (lo.value + hi.value) // 2
        elif lo is not None:
            d = max(lo.value, 0)
        else:
            d = min(hi.value, 0) if hi is not None else 0
        step[a, b], step[b, a] = d, -d
    offsets: dict[int, int] = {}
    for root in ranks:
        if root in offsets:
            continue
        offsets[root] = 0
        queue = deque([root])
        while queue:
            a = queue.popleft()
            for (x, b), d in sorted(step.items()):
                if x == a and b not in offsets:
                    offsets[b] = offsets[a] + d
                    queue.append(b)
    return offsets
