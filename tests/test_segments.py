"""Balanced sequence cuts: the min-max optimum (against brute force) and closed forms."""

from __future__ import annotations

import itertools
import math

import pytest

from zerobubble.schedule.segments import (
    SegmentCost,
    balanced_cuts,
    equal_token_cuts,
    imbalance,
    segment_costs,
)


def brute_force(length: int, k: int, cost: SegmentCost, g: int) -> float:
    """The smallest costliest segment over every way to cut at multiples of g."""
    inner = range(g, length, g)
    return min(
        max(segment_costs((0, *c, length), cost)) for c in itertools.combinations(inner, k - 1)
    )


@pytest.mark.parametrize("kernel", ["causal", "dense"])
@pytest.mark.parametrize(("linear", "attention"), [(1, 0), (0, 1), (5, 1), (1, 3)])
def test_balanced_cuts_are_the_min_max_optimum(kernel, linear, attention):
    cost = SegmentCost(linear, attention, kernel)
    for length, k, g in itertools.product((1, 2, 7, 13, 16), (1, 2, 3, 4), (1, 3)):
        if k > math.ceil(length / g):
            with pytest.raises(ValueError, match="leave some segment empty"):
                balanced_cuts(length, k, cost, g)
            continue
        cuts = balanced_cuts(length, k, cost, g)
        assert cuts[0] == 0 and cuts[-1] == length and len(cuts) == k + 1
        assert all(a < b for a, b in itertools.pairwise(cuts))
        assert all(c % g == 0 for c in cuts[:-1])
        assert max(segment_costs(cuts, cost)) == brute_force(length, k, cost, g), (length, k, g)


def test_closed_forms():
    # Attention only, two segments: causal pairs x(x+1)/2 = half of all, x ~ T/sqrt(2);
    # dense x*x = (T-x)*T, x = T(sqrt(5)-1)/2 (the golden section).
    assert balanced_cuts(1000, 2, SegmentCost(0, 1)) == (0, 707, 1000)
    assert balanced_cuts(1000, 2, SegmentCost(0, 1, "dense")) == (0, 618, 1000)
    # Linear only: equal token counts are optimal.
    assert max(segment_costs(balanced_cuts(4096, 4, SegmentCost(1, 0)), SegmentCost(1, 0))) == 1024
    assert equal_token_cuts(4096, 4) == (0, 1024, 2048, 3072, 4096)
    assert equal_token_cuts(10, 3) == (0, 3, 6, 10)
    assert equal_token_cuts(10, 3, granularity=4) == (0, 4, 8, 10)


def test_a_transformer_at_4k_tokens():
    """Width 64 (so attention outweighs the linear terms at long context), cuts at multiples
    of 64: equal token counts leave the last segment 1.63x the mean, balanced cuts 1.04x."""
    cost = SegmentCost.transformer(64, kernel="causal")
    assert (cost.linear, cost.attention) == (8 * 64 * 64 + 2 * 2 * 64 * 256, 4 * 64)
    equal, balanced = equal_token_cuts(4096, 4, 64), balanced_cuts(4096, 4, cost, 64)
    assert balanced == (0, 1920, 2816, 3520, 4096)
    assert round(imbalance(equal, cost), 3) == 1.631
    assert round(imbalance(balanced, cost), 3) == 1.036
    gated = SegmentCost.transformer(64, 172, gated=True, kernel="dense")
    assert gated.linear == 8 * 64 * 64 + 3 * 2 * 64 * 172


@pytest.mark.parametrize("kernel", ["causal", "dense"])
def test_fit_recovers_the_terms_of_exact_timings(kernel):
    truth = SegmentCost(3.0, 0.5, kernel)
    samples = [(s, e, truth.of(s, e)) for s, e in ((0, 64), (0, 256), (512, 768), (0, 1024))]
    got = SegmentCost.fit(samples, kernel)
    assert got.linear == pytest.approx(3.0, rel=1e-9)
    assert got.attention == pytest.approx(0.5, rel=1e-9)
    # Timings with no attention term: the unconstrained fit goes negative; refitted at 0.
    concave = [(0, 100, 100.0), (0, 200, 210.0), (0, 400, 380.0)]
    clamped = SegmentCost.fit(concave, kernel)
    assert clamped.attention == 0 and clamped.linear == pytest.approx(680 / 700, rel=1e-12)
    with pytest.raises(ValueError, match="cannot separate the linear from the attention"):
        SegmentCost.fit([(0, 64, 1.0)], kernel)
    with pytest.raises(ValueError, match="0 <= start < end"):
        SegmentCost.fit([(5, 5, 1.0), (0, 4, 1.0)], kernel)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: balanced_cuts(0, 1, SegmentCost(1, 1)), "length must be an integer >= 1"),
        (lambda: balanced_cuts(8, 0, SegmentCost(1, 1)), "segments must be an integer >= 1"),
        (lambda: balanced_cuts(8, 2, SegmentCost(1, 1), 0), "granularity must be"),
        (lambda: balanced_cuts(8, 3, SegmentCost(1, 1), 4), "use at most 2 segments"),
        (lambda: SegmentCost(-1, 1), r"SegmentCost.linear must be a finite number >= 0"),
        (lambda: SegmentCost(1, float("nan")), r"SegmentCost.attention must be"),
        (lambda: SegmentCost(0, 0), "all costs are 0"),
        (lambda: SegmentCost(1, 1, "flash"), "kernel must be 'causal' or 'dense'"),  # type: ignore[arg-type]
        (lambda: SegmentCost.transformer(0, kernel="causal"), "widths must be >= 1"),
    ],
)
def test_bad_input_is_a_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_among_optimal_cuts_the_nearest_equal_token_counts():
    """Without attention every equal-token cut is optimal and is the one returned (the
    furthest-reaching cuts would leave 7 tokens as 3, 3, 1); with it the optimum holds."""
    linear = SegmentCost(1, 0)
    for length, k, g in itertools.product(range(1, 40), (1, 2, 3, 5), (1, 4)):
        if k <= math.ceil(length / g):
            assert balanced_cuts(length, k, linear, g) == equal_token_cuts(length, k, g)
    cost = SegmentCost(2, 1)
    big = balanced_cuts(100_000, 8, cost, 128)
    assert round(imbalance(big, cost), 3) == 1.005  # the 128-token grid allows no better
    # Attention alone, 4 segments of a million tokens: x(x+1)/2 at a quarter of the total
    # each, within a token of T sqrt(i / 4).
    cuts = balanced_cuts(1_000_000, 4, SegmentCost(0, 1))
    assert all(abs(c - 1_000_000 * math.sqrt(i / 4)) <= 1 for i, c in enumerate(cuts))
