"""Handcrafted families of interleaved zero-bubble orders, seeds for the search.

The list scheduler decides every step from the present; on looped placements
with comm latency its first-come choices starve the later chunks, and local
search cannot reach the interleaved 1F1B shape from there. These templates
are that shape with the backward split, as a small family the search simulates
and polishes:

* F in rounds: ``P`` microbatches of chunk 0, then of chunk 1, ..., then the
  next ``P`` microbatches; B in the same rounds with the chunks reversed;
* device d runs ``warmup_d`` F before its first B, then repeats (B, W of the
  oldest B while more than ``lag_d`` Ws are pending, F), then drains B and W.

``warmup_d = (v - 1) P + P - 1 - slope * d + extra`` and ``lag_d = d`` or 0 over a
few ``slope`` / ``extra`` values: a larger warm-up fills the pipeline sooner and
needs more memory, a lag lets a W wait for a gap. Members that break the memory
limit or deadlock are dropped by the caller, so the family only has to contain
good orders, not only valid ones.
"""

from __future__ import annotations

from collections import deque

from zerobubble.schedule.ir import Schedule, looped_placement
from zerobubble.schedule.search.graph import ActionGraph

#: (slope, extra, lagged) for each family member (times each round size).
VARIANTS: tuple[tuple[int, int, bool], ...] = tuple(
    (slope, extra, lagged)
    for slope in (1, 2)
    for extra in (-2, -1, 0, 1, 2)
    for lagged in (True, False)
)


def _rounds(stages: list[int], m: int, group: int, op: int, num_stages: int) -> list[int]:
    """ActionGraph indices of ``op`` (0 F, 1 B) in rounds of ``group`` microbatches."""
    out: list[int] = []
    for g in range(0, m, group):
        for s in stages:
            base = (op * num_stages + s) * m
            out.extend(range(base + g, base + min(m, g + group)))
    return out


def interleaved_orders(
    num_devices: int,
    num_microbatches: int,
    chunks: int,
    *,
    slope: int,
    extra: int,
    lagged: bool,
    group: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """One member of the family on the looped placement (stage s on device s % P), as
    per-device orders of ActionGraph indices (``(k * S + s) * M + j``, k = 0, 1, 2 for F, B, W).
    """
    P, M, v = num_devices, num_microbatches, chunks
    g = P if group is None else group
    S = v * P
    w_shift = S * M  # index of W(s, j) = index of B(s, j) + S*M
    orders = []
    for d in range(P):
        held = [c * P + d for c in range(v)]
        fwd = _rounds(held, M, g, 0, S)
        bwd = _rounds(held[::-1], M, g, 1, S)
        warm = min(len(fwd), max(1, (v - 1) * g + P - 1 - slope * d + extra))
        lag = d if lagged else 0
        out = fwd[:warm]
        nxt = warm
        pending: deque[int] = deque()
        for b in bwd:
            out.append(b)
            pending.append(b + w_shift)
            while len(pending) > lag:
                out.append(pending.popleft())
            if nxt < len(fwd):
                out.append(fwd[nxt])
                nxt += 1
        out.extend(pending)
        orders.append(tuple(out))
    return tuple(orders)


def interleaved_zb(
    num_devices: int,
    num_microbatches: int,
    chunks: int,
    *,
    slope: int,
    extra: int,
    lagged: bool,
) -> Schedule:
    """:func:`interleaved_orders` as a Schedule."""
    placement = looped_placement(num_devices, chunks)
    graph = ActionGraph(placement, num_microbatches)
    orders = interleaved_orders(
        num_devices, num_microbatches, chunks, slope=slope, extra=extra, lagged=lagged
    )
    return Schedule(
        "interleaved-zb",
        num_devices,
        len(placement),
        num_microbatches,
        placement,
        tuple(tuple(graph.actions[i] for i in o) for o in orders),
    )


def interleaved_family(
    num_devices: int, num_microbatches: int, chunks: int
) -> list[tuple[tuple[int, ...], ...]]:
    """Every distinct member of the family for P, M and ``chunks`` >= 1 (as index orders)."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    out = []
    # One chunk: the round size does not matter. Smaller rounds need less warm-up
    # memory: under a tight limit only they fit.
    groups = sorted({num_devices, (num_devices + 1) // 2, 1} if chunks > 1 else {1}, reverse=True)
    for group in groups:
        for slope, extra, lagged in VARIANTS:
            orders = interleaved_orders(
                num_devices,
                num_microbatches,
                chunks,
                slope=slope,
                extra=extra,
                lagged=lagged,
                group=group,
            )
            if orders not in seen:
                seen.add(orders)
                out.append(orders)
    return out
