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

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

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
            n = end - start
            pairs = n * (end + start + 1) / 2 if kernel == "causal" else n * end
            rows.append((float(n), float(pairs), float(cost)))
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
        n = end - start
        pairs = n * (end + start + 1) / 2 if self.kernel == "causal" else n * end
        return self.linear * n + self.attention * pairs


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

    def reach(i: int, bound: float) -> int:
        """The furthest j > i with cost(pos[i], pos[j]) <= bound (i + 1 if none is)."""
        lo, hi = i + 1, n
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost.of(pos[i], pos[mid]) <= bound:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def greedy(bound: float) -> list[int] | None:
        """The furthest-reaching cuts within ``bound`` (indices into ``pos``), or None if
        ``segments`` segments cannot cover the sequence within it."""
        cuts = [0]
        while cuts[-1] < n:
            if len(cuts) > segments:
                return None
            j = reach(cuts[-1], bound)
            if cost.of(pos[cuts[-1]], pos[j]) > bound:
                return None
            cuts.append(j)
        return cuts

    lo, hi = 0.0, cost.of(0, length)
    best = greedy(hi)
    assert best is not None  # one segment of everything always fits
    while True:  # bisection down to adjacent floats: the optimum is one segment's cost
        mid = (lo + hi) / 2
        if not lo < mid < hi:
            break
        got = greedy(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    while len(best) - 1 < segments:  # fewer segments fit: split one (costs only drop)
        widest = max(range(len(best) - 1), key=lambda t: best[t + 1] - best[t])
        best.insert(widest + 1, best[widest] + 1)
    even = _nearest_even(pos, segments, cost, hi)
    return tuple(pos[j] for j in (even or best))


def _nearest_even(
    pos: list[int], segments: int, cost: SegmentCost, bound: float
) -> list[int] | None:
    """Cuts (indices into ``pos``) within ``bound`` that lie as near equal token counts as
    it allows, or None should the window argument below fail (never seen in 20,000 random
    cases; the caller then keeps the furthest-reaching cuts, as good for the costliest
    segment).

    Each cut, left to right, goes to its equal-token position, clamped to the window where
    the segment before it stays within ``bound`` and what remains still fits: no earlier
    than where ``segments - i`` segments, packed from the end, must begin.
    """
    n = len(pos) - 1
    earliest = [0] * (segments + 1)
    earliest[segments] = j = n
    for i in range(segments - 1, 0, -1):  # the latest cuts' earliest positions, from the end
        lo, hi = 0, j - 1
        while lo < hi:  # the smallest start whose segment up to j is within bound
            mid = (lo + hi) // 2
            if cost.of(pos[mid], pos[j]) <= bound:
                hi = mid
            else:
                lo = mid + 1
        j = lo
        earliest[i] = max(j, i)
    cuts = [0]
    for i in range(1, segments):
        start, lo, top = pos[cuts[-1]], max(cuts[-1] + 1, earliest[i]), n - (segments - i)
        if lo > top or cost.of(start, pos[lo]) > bound:
            return None
        hi = lo
        while hi < top:  # the furthest end within bound, up to top
            mid = (hi + top + 1) // 2
            if cost.of(start, pos[mid]) <= bound:
                hi = mid
            else:
                top = mid - 1
        cuts.append(min(max((i * n) // segments, lo), hi))
    cuts.append(n)
    ok = all(cost.of(pos[a], pos[b]) <= bound for a, b in itertools.pairwise(cuts))
    return cuts if ok else None


def segment_costs(cuts: tuple[int, ...], cost: SegmentCost) -> tuple[float, ...]:
    """The cost of each segment between consecutive ``cuts``."""
    return tuple(cost.of(s, e) for s, e in itertools.pairwise(cuts))


def imbalance(cuts: tuple[int, ...], cost: SegmentCost) -> float:
    """The costliest segment over the mean segment (1.0: perfectly balanced): the factor by
    which a pipeline paced by its costliest segment runs slower than by its mean."""
    costs = segment_costs(cuts, cost)
    return max(costs) * len(costs) / sum(costs)
