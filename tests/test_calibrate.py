"""The latency fitted to whole measured steps (``zerobubble.profile.calibrate``)."""

from __future__ import annotations

import pytest

from zerobubble.profile.calibrate import MAX_FACTOR, MIN_BOUND_MS, fit_latency
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate


def steps_at(latency: float) -> list[float]:
    """1F1B's and ZB-H1's simulated steps at P=3, M=6 under uneven costs and ``latency``."""
    costs = CostModel.per_stage(f=[2.0, 3.0, 2.5], b=[2.5, 3.5, 3.0], w=[1.0, 1.5, 1.2])
    with_latency = CostModel(**{**costs.__dict__, "comm": latency})
    return [float(simulate(generate(k, 3, 6), with_latency).makespan) for k in ("1f1b", "zb-h1")]


@pytest.mark.parametrize("true", [0.0, 0.3, 1.7, 4.0])
def test_the_fit_recovers_the_latency_the_steps_were_simulated_with(true):
    assert fit_latency(steps_at, steps_at(true), 0.5) == pytest.approx(true, abs=1e-6)


def test_a_line_per_schedule_is_fitted_in_least_squares():
    # predicted 10 + 2L and 20 + 4L against 15 and 28: minimise (2L - 5)^2 + (4L - 8)^2,
    # 4(2L - 5) + 8(4L - 8) = 0, L = 84 / 40.
    fitted = fit_latency(lambda x: [10 + 2 * x, 20 + 4 * x], [15, 28], 1.0)
    assert fitted == pytest.approx(84 / 40, abs=1e-6)


def test_the_fit_stays_within_its_bounds():
    assert fit_latency(lambda x: [x], [1e6], 0.5) == pytest.approx(MAX_FACTOR * 0.5)
    assert fit_latency(lambda x: [x], [1e6], 0.0) == pytest.approx(MIN_BOUND_MS)
    assert fit_latency(lambda x: [10 + x], [3.0], 0.5) == 0.0  # faster than any latency
    # an insensitive step ties everywhere: the smallest latency
    assert fit_latency(lambda x: [7.0], [9.0], 0.5) == 0.0


def test_bad_calls_are_refused():
    with pytest.raises(ValueError, match="at least one measured step"):
        fit_latency(lambda x: [], [], 1.0)
    with pytest.raises(ValueError, match="median_ms must be >= 0"):
        fit_latency(lambda x: [x], [1.0], -1.0)
    with pytest.raises(ValueError, match="predict gave 1 step times for 2 measured"):
        fit_latency(lambda x: [x], [1.0, 2.0], 1.0)
