"""Summary statistics of repeated timings: median and 95th percentile.

Profiles report the median (robust to the odd pre-empted sample on a shared
machine) as the cost a planner uses, and the p95 so a user can see how noisy
the measurement was.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class OpStats:
    """Median, 95th percentile (nearest rank) and count of a list of samples."""

    median: float
    p95: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> OpStats:
        if not samples:
            raise ValueError("no samples to summarise; run at least one measured iteration")
        ordered = sorted(samples)
        rank = max(math.ceil(0.95 * len(ordered)), 1)  # nearest-rank percentile
        return cls(float(statistics.median(ordered)), float(ordered[rank - 1]), len(ordered))

    def to_dict(self) -> dict[str, float | int]:
        return {"median": self.median, "p95": self.p95, "n": self.n}
