"""Shared test helpers."""

from __future__ import annotations

from fractions import Fraction

import pytest

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.ir import Schedule


def exact_costs(schedule: Schedule, F=1, B=1, W=1, comm=0, mem_w=Fraction(1, 2)) -> CostModel:
    """Per-device totals as Fractions, so simulated figures are exact."""
    return CostModel.from_device_totals(
        schedule.placement, Fraction(F), Fraction(B), Fraction(W), Fraction(comm), Fraction(mem_w)
    )


@pytest.fixture
def exact():
    return exact_costs
