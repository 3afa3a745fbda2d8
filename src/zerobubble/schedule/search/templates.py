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

from collections.abc import Iterator
from itertools import pairwise

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
    g = num_devices if group is None else group
    rows = _device_rounds(num_devices, num_microbatches, chunks, g)
    return _member(rows, num_devices, num_microbatches, chunks, g, slope, extra, lagged)


def _device_rounds(
    num_devices: int, num_microbatches: int, chunks: int, group: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """Each device's F, B and W (the W of each B, in the B's order) in rounds of ``group``
    (the same for every member)."""
    P, M, S = num_devices, num_microbatches, chunks * num_devices
    w_shift = S * M  # index of W(s, j) = index of B(s, j) + S*M
    out = []
    for d in range(P):
        held = [c * P + d for c in range(chunks)]
        bwd = _rounds(held[::-1], M, group, 1, S)
        out.append((_rounds(held, M, group, 0, S), bwd, [x + w_shift for x in bwd]))
    return out


def _member(
    rows: list[tuple[list[int], list[int], list[int]]],
    num_devices: int,
    num_microbatches: int,
    chunks: int,
    group: int,
    slope: int,
    extra: int,
    lagged: bool,
) -> tuple[tuple[int, ...], ...]:
    """The member for ``(slope, extra, lagged)`` from each device's rounds."""
    P, v = num_devices, chunks
    orders = []
    for d, (fwd, bwd, wgt) in enumerate(rows):
        warm = min(len(fwd), max(1, (v - 1) * group + P - 1 - slope * d + extra))
        orders.append(_interleave(fwd, bwd, wgt, warm, d if lagged else 0))
    return tuple(orders)


def _interleave(
    fwd: list[int], bwd: list[int], wgt: list[int], warm: int, lag: int
) -> tuple[int, ...]:
    """``warm`` F, then per B: the B, the W of the B ``lag`` places back (``wgt``: the W of
    each B), the next F; then the Ws still pending. Written segment by segment with strided
    slices (each segment has the same shape of step throughout): members hold millions of
    actions.
    """
    nb, rest = len(bwd), len(fwd) - warm  # rest < nb: there are as many F as B
    out = fwd[:warm]
    cuts = sorted({0, min(lag, nb), rest, nb})
    for a, b in pairwise(cuts):
        has_w, has_f = a >= lag, a < rest
        size = 1 + has_w + has_f
        seg = [0] * ((b - a) * size)
        seg[0::size] = bwd[a:b]
        if has_w:
            seg[1::size] = wgt[a - lag : b - lag]
        if has_f:
            seg[size - 1 :: size] = fwd[warm + a : warm + b]
        out += seg
    out += wgt[max(0, nb - lag) :]
    return tuple(out)


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
) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every distinct member of the family for P, M and ``chunks`` >= 1 (as index orders).

    Made one at a time, and earlier members are remembered by hash and remade to be
    compared on a match: at P=64, M=512 a member holds 400k actions and a search that
    prunes them needs only one at once.
    """
    P, M, v = num_devices, num_microbatches, chunks
    seen: dict[int, list[tuple[int, int, int, bool]]] = {}
    # One chunk: the round size does not matter. Smaller rounds need less warm-up
    # memory: under a tight limit only they fit.
    groups = sorted({P, (P + 1) // 2, 1} if v > 1 else {1}, reverse=True)
    for group in groups:
        rows = _device_rounds(P, M, v, group)
        for slope, extra, lagged in VARIANTS:
            orders = _member(rows, P, M, v, group, slope, extra, lagged)
            twins = seen.setdefault(hash(orders), [])
            if not any(
                orders == interleaved_orders(P, M, v, slope=a, extra=b, lagged=c, group=g)
                for g, a, b, c in twins
            ):
                twins.append((group, slope, extra, lagged))
                yield orders
