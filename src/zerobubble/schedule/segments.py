"""Where to cut a long sequence into segments of equal compute (sequence-level pipelining).

Seq1F1B-style pipelines stream a microbatch through the stages as ``k`` segments of its
sequence. Under causal attention the tokens late in the sequence cost more than the early
ones (a query attends to every key before it), so segments of equal token counts are not
equal work, and the pipeline runs at the pace of the costliest one. This module picks the
cut points that minimise the costliest segment, for a cost with a linear term (projections,
MLP, norms: the same for every token) and an attention term (per query-key pair):

* ``causal`` kernels (flash-style, masked blocks skipped): the token at position ``t``
  (0-based) meets ``t + 1`` keys, so segment ``[s, e)`` costs
  ``linear * (e - s) + attention * (e - s) * (e + s + 1) / 2``;
* ``dense`` kernels (eager attention, the mask applied to a full score matrix): the
  segment's queries meet every key up to its end, ``(e - s) * e`` pairs.

Both costs grow when a segment grows at either end, which is what makes the greedy
"extend each segment as far as a bound allows" exact for the min-max problem; the bound
is found by bisection. Torch-free.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from zerobubble.schedule.costs import CostModel

Attention = Literal["causal", "dense"]


@dataclass(frozen=True)
class SegmentCost:
    """The cost of a segment of a causal sequence, in any consistent unit (flops, ms).

    Attributes:
        linear: Cost per token of what every token pays alike (projections, MLP, norms).
        attention: Cost per query-key pair of attention (scores and the weighted sum).
        kernel: ``"causal"`` when attention skips the masked pairs, ``"dense"`` when it
            computes the full score matrix of the segment's queries against all keys so
            far (eager attention with a mask).
    """

    linear: float
    attention: float
    kernel: Attention = "causal"

    def __post_init__(self) -> None:
        for name in ("linear", "attention"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"SegmentCost.{name} must be a finite number >= 0, got {v!r}")
        if self.linear == 0 and self.attention == 0:
            raise ValueError("SegmentCost needs linear > 0 or attention > 0 (all costs are 0)")
        if self.kernel not in ("causal", "dense"):
            raise ValueError(f"SegmentCost.kernel must be 'causal' or 'dense', got {self.kernel!r}")

    @classmethod
    def transformer(
        cls, width: int, ffn_width: int | None = None, *, gated: bool = False, kernel: Attention
    ) -> SegmentCost:
        """A decoder layer's forward flops: the four width x width projections (2 flops a
        multiply-add) and the MLP's two matrices (three when ``gated``, as Llama's), per
        token; per query-key pair, the score and the weighted sum (2 flops each per
        channel). ``ffn_width`` defaults to 4 x ``width``. The backward scales both terms
        alike, so the cuts are the same for F and B."""
        if width < 1 or (ffn_width is not None and ffn_width < 1):
            raise ValueError(f"widths must be >= 1, got {width} and {ffn_width}")
        ffn = 4 * width if ffn_width is None else ffn_width
        mlp = (3 if gated else 2) * 2 * width * ffn
        return cls(linear=8 * width * width + mlp, attention=4 * width, kernel=kernel)

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, int, float]], kernel: Attention = "causal"
    ) -> SegmentCost:
        """The non-negative least-squares terms of measured ``(start, end, cost)`` segments
        (a profile's timings of one layer or stage on segments of a sequence).

        Both terms need two segments whose token counts and pair counts are not
        proportional (e.g. two lengths at position 0, or one length at two positions).
        """
        rows = []
        for start, end, cost in samples:
            if not (0 <= start < end) or not math.isfinite(cost) or cost < 0:
                raise ValueError(
                    f"a sample needs 0 <= start < end and a finite cost >= 0, got "
                    f"({start}, {end}, {cost})"
                )
            rows.append((float(end - start), _pairs(start, end, kernel), float(cost)))
        # The 2 x 2 normal equations; a negative term is refitted at zero.
        sxx = sum(n * n for n, _, _ in rows)
        sxy = sum(n * q for n, q, _ in rows)
        syy = sum(q * q for _, q, _ in rows)
        sxc = sum(n * c for n, _, c in rows)
        syc = sum(q * c for _, q, c in rows)
        det = sxx * syy - sxy * sxy
        if len(rows) < 2 or det <= 1e-12 * sxx * syy:
            raise ValueError(
                f"{len(rows)} samples cannot separate the linear from the attention term: "
                "measure at least two segment lengths from position 0 (or one length at two "
                "positions)"
            )
        linear = (syy * sxc - sxy * syc) / det
        attention = (sxx * syc - sxy * sxc) / det
        if linear < 0:
            linear, attention = 0.0, syc / syy
        elif attention < 0:
            linear, attention = sxc / sxx, 0.0
        return cls(linear=linear, attention=attention, kernel=kernel)

    def of(self, start: int, end: int) -> float:
        """The cost of the segment of positions ``[start, end)``."""
        return self.linear * (end - start) + self.attention * _pairs(start, end, self.kernel)


def _pairs(start: int, end: int, kernel: Attention) -> float:
    """The query-key pairs attention computes for the queries ``[start, end)``."""
    n = end - start
    return n * (end + start + 1) / 2 if kernel == "causal" else float(n * end)


def _positions(length: int, segments: int, granularity: int) -> list[int]:
    """The allowed cut positions: multiples of ``granularity``, and ``length`` itself."""
    for name, v in (("length", length), ("segments", segments), ("granularity", granularity)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    pos = [*range(0, length, granularity), length]
    if segments > len(pos) - 1:
        raise ValueError(
            f"{segments} segments of a {length}-token sequence cut at multiples of "
            f"{granularity} leave some segment empty; use at most {len(pos) - 1} segments "
            "or a finer granularity"
        )
    return pos


def equal_token_cuts(length: int, segments: int, granularity: int = 1) -> tuple[int, ...]:
    """Boundaries ``0 = b0 < ... < bk = length`` of segments of (nearly) equal token counts,
    the cuts that ignore attention's growth (a baseline for :func:`balanced_cuts`)."""
    pos = _positions(length, segments, granularity)
    n = len(pos) - 1
    return tuple(pos[(i * n) // segments] for i in range(segments + 1))


def balanced_cuts(
    length: int, segments: int, cost: SegmentCost, granularity: int = 1
) -> tuple[int, ...]:
    """Boundaries ``0 = b0 < ... < bk = length`` that minimise the costliest segment.

    Cuts fall on multiples of ``granularity`` (kernels prefer aligned lengths) or at
    ``length``; every segment is non-empty. Among the optimal cuts, these lie nearest
    equal token counts (without attention they are :func:`equal_token_cuts`).
    """
    pos = _positions(length, segments, granularity)
    n = len(pos) - 1

    def reach(i: int, bound: float, top: int = n) -> int:
        """The furthest j in (i, top] with cost(pos[i], pos[j]) <= bound (i if none is)."""
        start = pos[i]
        over = bisect.bisect_left(
            range(i + 1, top + 1), True, key=lambda j: cost.of(start, pos[j]) > bound
        )
        return i + over

    def fits(bound: float) -> bool:
        """``segments`` segments, each extended as far as ``bound`` allows, cover it all."""
        i = 0
        for _ in range(segments):
            i = reach(i, bound)
        return i == n

    lo, bound = 0.0, cost.of(0, length)  # one segment of everything fits
    while lo < (mid := (lo + bound) / 2) < bound:  # bisection to adjacent floats: the
        lo, bound = (lo, mid) if fits(mid) else (mid, bound)  # optimum is a segment's cost
    # Among the cuts within the optimum, each one (left to right) at its equal-token
    # position, clamped to its window: after the previous cut, at most as far as the
    # bound reaches, and no earlier than where the segments after it, packed from the end
    # (each as long as the bound allows), must begin. The window is never empty: a cut at
    # or after that earliest position leaves a suffix inside segments of the packing,
    # each within the bound, as is every single position (the optimum holds each one).
    earliest = [n] * (segments + 1)
    for i in range(segments - 1, 0, -1):
        earliest[i] = max(i, _first_start(cost, pos, earliest[i + 1], bound))
    cuts = [0]
    for i in range(1, segments):
        lo_i, hi_i = max(cuts[-1] + 1, earliest[i]), reach(cuts[-1], bound, n - segments + i)
        assert lo_i <= hi_i, "empty window: see the comment above"
        cuts.append(min(max((i * n) // segments, lo_i), hi_i))
    return tuple(pos[c] for c in (*cuts, n))


def _first_start(cost: SegmentCost, pos: list[int], j: int, bound: float) -> int:
    """The smallest i < j with cost(pos[i], pos[j]) <= bound (j - 1 if none is)."""
    i = bisect.bisect_left(range(j), True, key=lambda x: cost.of(pos[x], pos[j]) <= bound)
    return min(i, j - 1)


def segment_costs(cuts: tuple[int, ...], cost: SegmentCost) -> tuple[float, ...]:
    """The cost of each segment between consecutive ``cuts``."""
    return tuple(cost.of(s, e) for s, e in itertools.pairwise(cuts))


def imbalance(cuts: tuple[int, ...], cost: SegmentCost) -> float:
    """The costliest segment over the mean segment (1.0: perfectly balanced): the factor by
    which a pipeline paced by its costliest segment runs slower than by its mean."""
    costs = segment_costs(cuts, cost)
    return max(costs) * len(costs) / sum(costs)


def time_factors(cuts: tuple[int, ...], cost: SegmentCost) -> tuple[float, ...]:
    """Each segment's cost over the mean segment's: the
    :attr:`~zerobubble.schedule.costs.CostModel.segment_time` of a schedule cut at ``cuts``
    whose per-stage costs are those of a mean segment."""
    costs = segment_costs(cuts, cost)
    mean = sum(costs) / len(costs)
    return tuple(c / mean for c in costs)


@dataclass(frozen=True)
class SegmentMemory:
    """What a segment of a causal sequence holds on a layer or stage, in bytes.

    Attributes:
        linear: Saved bytes per token (projections, MLP, norms, its own keys and values).
        attention: Saved bytes per query-key pair (eager attention's probabilities).
        keys: Saved bytes per key the segment attends, ``[0, end)`` (a copy of the past
            and own keys and values that the attention keeps, as the Hugging Face blocks'
            cache concatenation; 0 where the past is read from the earlier segments').
        kv: One token's keys and values, the size of the gradient that the later
            segments sum into them (0 without attention).
        kernel: How the pairs are counted (:class:`SegmentCost`).
    """

    linear: float
    attention: float
    keys: float
    kv: float
    kernel: Attention = "dense"

    def __post_init__(self) -> None:
        for name in ("linear", "attention", "keys", "kv"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"SegmentMemory.{name} must be a finite number >= 0, got {v!r}")

    def of(self, start: int, end: int) -> float:
        """The bytes that the segment ``[start, end)`` saves."""
        return (
            self.linear * (end - start)
            + self.attention * _pairs(start, end, self.kernel)
            + self.keys * end
        )

    @classmethod
    def fit(
        cls, samples: Iterable[tuple[int, int, float]], kv: float, kernel: Attention
    ) -> SegmentMemory:
        """The non-negative least-squares terms of measured ``(start, end, bytes)`` spans
        (tokens, pairs and keys need three spans whose counts are independent, e.g. two
        lengths from position 0 and one late span); ``kv`` as measured."""
        rows = [((float(e - s), _pairs(s, e, kernel), float(e)), float(b)) for s, e, b in samples]
        best: tuple[float, tuple[float, float, float]] | None = None
        for used in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,)):
            terms = _least_squares(rows, used)
            if terms is None or min(terms) < 0:
                continue
            full = [0.0, 0.0, 0.0]
            for i, x in zip(used, terms, strict=True):
                full[i] = x
            err = sum((sum(a * x for a, x in zip(r, full, strict=True)) - b) ** 2 for r, b in rows)
            if best is None or err < best[0] * (1 - 1e-12):
                best = (err, (full[0], full[1], full[2]))
        if best is None:
            raise ValueError(f"cannot fit a segment memory to {len(rows)} spans")
        linear, attention, keys = best[1]
        return cls(linear, attention, keys, kv, kernel)

    @classmethod
    def total(cls, parts: Iterable[SegmentMemory]) -> SegmentMemory:
        """Layers' memories added up (a stage's), all counting pairs alike."""
        parts = list(parts)
        kernels = {m.kernel for m in parts}
        if len(kernels) > 1:
            raise ValueError(f"cannot add memories of kernels {sorted(kernels)}")
        return cls(
            sum(m.linear for m in parts),
            sum(m.attention for m in parts),
            sum(m.keys for m in parts),
            sum(m.kv for m in parts),
            kernels.pop() if kernels else "dense",
        )


def _least_squares(
    rows: list[tuple[tuple[float, float, float], float]], used: tuple[int, ...]
) -> list[float] | None:
    """The least-squares coefficients of the columns ``used`` (None if singular)."""
    n = len(used)
    a = [[sum(r[i] * r[j] for r, _ in rows) for j in used] for i in used]
    y = [sum(r[i] * b for r, b in rows) for i in used]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for c in range(n):  # Gaussian elimination with partial pivoting
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) <= 1e-12 * scale:
            return None
        a[c], a[p], y[c], y[p] = a[p], a[c], y[p], y[c]
        for r in range(c + 1, n):
            f = a[r][c] / a[c][c]
            a[r] = [x - f * z for x, z in zip(a[r], a[c], strict=True)]
            y[r] -= f * y[c]
    out = [0.0] * n
    for c in reversed(range(n)):
        out[c] = (y[c] - sum(a[c][j] * out[j] for j in range(c + 1, n))) / a[c][c]
    return out


def segment_model(
    costs: CostModel,
    cuts: tuple[int, ...],
    cost: SegmentCost,
    memory: Sequence[SegmentMemory] | None = None,
    bytes_per_unit: float | None = None,
) -> CostModel:
    """The cost model of a schedule that cuts every sequence at ``cuts``, from ``costs`` of
    whole microbatches: a mean segment's terms (:meth:`CostModel.per_segment`), each
    segment's compute scaled by its share of the work (:func:`time_factors`).

    With ``memory`` (one per virtual stage) a segment's memory on a stage is its share of
    the whole sequence's saved bytes there (:attr:`CostModel.stage_segment_memory`; under
    eager attention a segment's queries meet only the keys up to its end, so the segments
    together save less than one pass), and the sums of the earlier segments' key and value
    gradients are priced (:attr:`CostModel.kv_grad`): ``memory``'s bytes in ``costs``'
    units, ``bytes_per_unit`` bytes to a unit (a profile's models count bytes: 1), or,
    without it, scaled by ``mem_f`` over the whole pass's saved bytes. Under recompute
    ``mem_f`` is the checkpointed inputs, shared by the tokens, and a segment's F also
    keeps its own keys and values (the later segments read them) until its B: its ``mem_f``
    grows by them; neither they nor the sums can be scaled from the inputs, so they need
    ``bytes_per_unit``. Without ``memory`` each segment's memory is its share of the tokens
    and the sums are not priced."""
    k = len(cuts) - 1
    tokens = tuple(e - s for s, e in itertools.pairwise(cuts))
    mean = sum(tokens) / k
    share = tuple(n / mean for n in tokens)
    model = replace(
        costs.per_segment(k), segment_time=time_factors(cuts, cost), segment_memory=share
    )
    if memory is None:
        return model
    if len(memory) != costs.num_stages:
        raise ValueError(
            f"{len(memory)} segment memories for a cost model of {costs.num_stages} stages"
        )
    if costs.recompute and bytes_per_unit is None:
        raise ValueError(
            "segment_model: under recompute the key and value gradient sums cannot be scaled "
            "from mem_f (the checkpointed inputs); pass bytes_per_unit, the bytes of one unit "
            "of the cost model's memory (1 for a profile's model, which counts bytes)"
        )
    if bytes_per_unit is not None and not bytes_per_unit > 0:
        raise ValueError(f"segment_model: bytes_per_unit must be > 0, got {bytes_per_unit}")
    length = cuts[-1]
    rows, kv = [], []
    for m, mem_f in zip(memory, costs.mem_f, strict=True):
        whole = m.of(0, length)
        if bytes_per_unit is not None:
            kv.append(m.kv * mean / bytes_per_unit)
        else:
            kv.append(mem_f * m.kv * mean / whole if whole > 0 else 0.0)
        if whole <= 0 or costs.recompute:  # by the tokens
            rows.append(share)
        else:
            rows.append(tuple(k * m.of(s, e) / whole for s, e in itertools.pairwise(cuts)))
    if costs.recompute:  # F also keeps its own keys and values, until its B
        model = replace(model, mem_f=tuple(f + x for f, x in zip(model.mem_f, kv, strict=True)))
    return replace(model, stage_segment_memory=tuple(rows), kv_grad=tuple(kv), segment_tokens=share)
