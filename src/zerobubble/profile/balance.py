"""Stage balancing: cut an ordered list of layers so that per-stage time is even.

Equal layer counts (:func:`zerobubble.parallel.partition.stage_bounds`) are a
poor proxy when the first stage carries the embedding and the last the LM head
and loss. Given measured per-layer costs,
:func:`balanced_boundaries` finds the contiguous cut that minimises the most
expensive stage (exact dynamic programme; O(S·L²), instant for hundreds of
layers), breaking ties towards the smallest second-largest stage so that
the result is deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate, pairwise


def stage_costs(layer_costs: Sequence[float], boundaries: Sequence[int]) -> list[float]:
    """Cost of each stage; ``boundaries`` = [0, b1, ..., L] (stage s = layers b_s .. b_{s+1}-1)."""
    prefix = [0.0, *accumulate(layer_costs)]
    return [prefix[b] - prefix[a] for a, b in pairwise(boundaries)]


def boundaries_of(bounds: Sequence[range]) -> list[int]:
    """Cut points ``[0, b1, ..., L]`` of stage layer ranges (e.g. from
    :func:`zerobubble.parallel.partition.stage_bounds`, the one equal-count rule)."""
    return [bounds[0].start, *(r.stop for r in bounds)]


def imbalance(stage_times: Sequence[float]) -> float:
    """max / mean of per-stage times: 1.0 is perfectly balanced."""
    mean = sum(stage_times) / len(stage_times)
    return max(stage_times) / mean if mean > 0 else 1.0


def balanced_boundaries(layer_costs: Sequence[float], num_stages: int) -> list[int]:
    """Contiguous cut of the layers into ``num_stages`` non-empty stages minimising the max."""
    n = len(layer_costs)
    _check(n, num_stages)
    if any(c < 0 for c in layer_costs):
        raise ValueError("layer costs must be >= 0")
    prefix = [0.0, *accumulate(float(c) for c in layer_costs)]
    inf = float("inf")
    # best[s][i]: (max, sum of squares) of the best cut of layers[:i] into s stages.
    best = [[(inf, inf)] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = (0.0, 0.0)
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for k in range(s - 1, i):
                prev = best[s - 1][k]
                if prev[0] == inf:
                    continue
                c = prefix[i] - prefix[k]
                cand = (max(prev[0], c), prev[1] + c * c)
                if cand < best[s][i]:
                    best[s][i] = cand
                    cut[s][i] = k
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def _check(num_layers: int, num_stages: int) -> None:
    if num_stages < 1:
        raise ValueError(f"need at least one stage, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(
            f"cannot cut {num_layers} layers into {num_stages} non-empty stages; "
            "use fewer stages (devices x chunks) or a deeper model"
        )
