"""Per-layer profile, stage balancing and summary statistics (single process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerobubble.models import build_mlp, mlp_loss
from zerobubble.profile.balance import (
    balanced_boundaries,
    boundaries_of,
    imbalance,
    stage_costs,
)
from zerobubble.profile.layers import profile_layers
from zerobubble.profile.stats import OpStats
from zerobubble.runtime.partition import stage_bounds


def test_opstats_median_and_nearest_rank_p95():
    s = OpStats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.p95, s.n) == (3.0, 5.0, 5)
    assert OpStats.of(list(map(float, range(1, 21)))).p95 == 19.0  # ceil(0.95 * 20) = 19th
    assert OpStats.of([7.0]) == OpStats(7.0, 7.0, 1)
    with pytest.raises(ValueError, match="no samples"):
        OpStats.of([])


def test_layer_profile_measures_every_layer_and_leaves_the_model_alone():
    layers = list(build_mlp([8, 16, 16, 4], seed=0))
    before = [p.clone() for layer in layers for p in layer.parameters()]
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    prof = profile_layers(layers, mlp_loss, x, y, warmup=1, iters=3)
    assert prof.num_layers == 3
    assert all(s.n == 3 for col in (prof.f, prof.b, prof.w) for s in col)
    assert all(s.p95 >= s.median for col in (prof.f, prof.b, prof.w) for s in col)
    assert prof.costs() == [
        f.median + b.median + w.median for f, b, w in zip(prof.f, prof.b, prof.w, strict=True)
    ]
    # Every layer holds at least its input between F and B, and W needs part of it.
    assert prof.mem_b[0] >= 5 * 8 * 4 and prof.mem_b[1] >= 5 * 16 * 4
    assert all(0 < w <= b for w, b in zip(prof.mem_w, prof.mem_b, strict=True))
    assert type(layers[0][0]) is nn.Linear and type(layers[2]) is nn.Linear  # not split
    after = [p for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(after, before, strict=True))
    with pytest.raises(ValueError, match="warmup >= 0 and iters >= 1"):
        profile_layers(layers, mlp_loss, x, y, iters=0)


def test_one_equal_cut_rule_and_the_balanced_cut():
    assert boundaries_of(stage_bounds(9, 2)) == [0, 5, 9]
    assert boundaries_of(stage_bounds(10, 4)) == [0, 2, 5, 8, 10]  # interior stages first
    costs = [1.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 1.0, 1.0]  # embedding, 6 blocks, norm, head
    equal = boundaries_of(stage_bounds(len(costs), 2))
    assert stage_costs(costs, equal) == [17.0, 10.0]
    assert imbalance(stage_costs(costs, equal)) == pytest.approx(17 / 13.5)
    cut = balanced_boundaries(costs, 2)
    assert cut == [0, 4, 9] and stage_costs(costs, cut) == [13.0, 14.0]
    assert imbalance([2.0, 2.0]) == 1.0
