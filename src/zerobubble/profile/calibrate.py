"""The latency a run pays per cross-device dependency, fitted to whole measured steps.

The profile measures each message's latency (from the producing op's end to the
waiting receiver's return) and reports its median, robust to the odd late sample.
But a step waits on a *chain* of messages, and the chain's expected length is a sum
of means, not of medians: on a shared CPU a receiver's rank is now and then not
running when its message lands (a latency of 0.77 ms median had a p95 of 1.76 ms on
the demo), and 1F1B, whose critical path crosses devices twice per microbatch, pays
every such delay. So the job also fits one latency to the steps it measured while
profiling: the value under which the simulated steps of the profiled schedules
(1F1B and ZB-H1) come closest to their measured medians, in least squares. Their
op costs are the profile's, so the fit only prices what the simulator does not see
of a message: a late wake-up, posting and matching the receive, the Python around
it. It is bounded by ``[0, MAX_FACTOR x`` the measured median ``]`` (at least
``MIN_BOUND_MS``), so one wild step cannot make it absurd.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["MAX_FACTOR", "MIN_BOUND_MS", "fit_latency"]

MAX_FACTOR = 20.0
"""The fit's upper bound as a multiple of the measured median latency."""
MIN_BOUND_MS = 1.0
"""The fit's upper bound is at least this (ms), for a median near 0."""

_GRID = 64
_REFINE = 60


def fit_latency(
    predict: Callable[[float], Sequence[float]],
    measured: Sequence[float],
    median_ms: float,
) -> float:
    """The latency ``L`` (ms) in ``[0, max(MAX_FACTOR * median_ms, MIN_BOUND_MS)]`` that
    minimises ``sum_i (predict(L)[i] - measured[i]) ** 2``.

    ``predict(L)`` gives each profiled schedule's predicted step at latency ``L`` (a
    simulated makespan: continuous, piecewise linear and non-decreasing in ``L``), and
    ``measured`` the same schedules' measured medians. A grid brackets the best value,
    golden-section search refines it within the bracket; ties go to the smaller ``L``.
    """
    if len(measured) == 0:
        raise ValueError("fit_latency needs at least one measured step time")
    if not median_ms >= 0:
        raise ValueError(f"median_ms must be >= 0, got {median_ms}")
    top = max(MAX_FACTOR * median_ms, MIN_BOUND_MS)

    def error(latency: float) -> float:
        got = predict(latency)
        if len(got) != len(measured):
            raise ValueError(f"predict gave {len(got)} step times for {len(measured)} measured")
        return sum((p - m) ** 2 for p, m in zip(got, measured, strict=True))

    grid = [top * i / _GRID for i in range(_GRID + 1)]
    errors = [error(x) for x in grid]
    best = min(range(len(grid)), key=lambda i: (errors[i], i))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, _GRID)]
    ratio = (5**0.5 - 1) / 2
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    ea, eb = error(a), error(b)
    for _ in range(_REFINE):
        if ea <= eb:
            hi, b, eb = b, a, ea
            a = hi - ratio * (hi - lo)
            ea = error(a)
        else:
            lo, a, ea = a, b, eb
            b = lo + ratio * (hi - lo)
            eb = error(b)
    candidates = [(errors[best], grid[best]), (ea, a), (eb, b)]
    return min(candidates)[1]
