"""The share of weight-gradient work a split defers to W is measured, shown, and warned about."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.models import build_mlp, mlp_loss
from zerobubble.profile.layers import LayerProfile, profile_layers
from zerobubble.profile.stats import OpStats
from zerobubble.runtime.split import (
    SplitShareWarning,
    WeightGradStore,
    enable_bw_split,
    split_share,
)
from zerobubble.runtime.stage import StageChunk


class _BigOwnWeight(nn.Module):
    """A model holding a large matrix itself next to a small Linear: the matrix stays in B."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Parameter(torch.randn(32, 32))  # 1024 elements
        self.small = nn.Linear(32, 4)  # 132 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.small(F.linear(x, self.big))


def test_split_share_counts_parameter_elements_exactly() -> None:
    mlp = enable_bw_split(build_mlp([8, 16, 4], seed=0), WeightGradStore())
    assert split_share(mlp).fraction == 1.0
    net = enable_bw_split(_BigOwnWeight(), WeightGradStore())
    share = split_share(net)
    assert (share.deferred, share.total) == (132, 1156)
    assert share.unsplit == (("_BigOwnWeight", "_BigOwnWeight", 1024),)
    ln = enable_bw_split(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), WeightGradStore())
    assert split_share(ln).unsplit == (("1", "LayerNorm", 8),)
    assert split_share(ln).fraction == 20 / 28


def test_a_stage_deferring_less_than_half_warns_once_naming_the_modules_and_the_fix() -> None:
    with pytest.warns(SplitShareWarning) as record:
        chunk = StageChunk(_BigOwnWeight(), 1, 3)
    assert len(record) == 1
    message = str(record[0].message)
    assert "stage 1: only 11% of the weight-gradient work" in message
    assert "Not split: _BigOwnWeight (_BigOwnWeight)" in message
    assert "with_rule" in message and "1f1b" in message
    assert chunk.split_share is not None and chunk.split_share.deferred == 132
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        StageChunk(build_mlp([8, 16, 4], seed=0), 1, 3)  # fully split: silent
        StageChunk(_BigOwnWeight(), 1, 3, split=False)  # unsplit on purpose: silent


class _Recurrent(nn.Module):
    """An LSTM (graph-level split) whose call returns three differentiable outputs, before a
    small Linear: the LSTM's split falls back to B at the first forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 8, batch_first=True)  # 576 elements
        self.out = nn.Linear(8, 8)  # 72 elements

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, (h, c) = self.lstm(x)
        return self.out(y) + (h + c).transpose(0, 1)


def test_a_graph_split_that_falls_back_to_b_is_counted_and_warned_at_its_first_forward() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk = StageChunk(_Recurrent(), 1, 3)  # every module deferrable, as far as is known
    assert chunk.split_share is not None and chunk.split_share.fraction == 1.0
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    with pytest.warns(UserWarning) as record:
        y = chunk.forward(0, x)
    assert len(record) == 1
    message = str(record[0].message)
    assert "stage 1: only 11% of the weight-gradient work" in message
    assert "Not split: lstm (LSTM) (the graph-level split of lstm fell back to B" in message
    share = chunk.split_share
    assert (share.deferred, share.total, share.several_outputs) == (72, 648, ("lstm",))
    chunk.backward_input(0, torch.ones_like(y))
    chunk.backward_weight(0)
    assert all(p.grad is not None for p in chunk.module.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunk.forward(1, x)  # once per chunk


def test_the_layer_profile_does_not_warn_about_a_layer_with_nothing_to_split() -> None:
    """A layer profiled alone is not a pipeline stage: a norm there defers nothing, and the
    stage warning would name a "stage" the user never made."""
    layers = [nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        profile_layers(layers, F.mse_loss, torch.randn(5, 8), torch.randn(5, 4), iters=1)
    with pytest.warns(SplitShareWarning, match="stage 1: only 0% of the weight-gradient"):
        StageChunk(nn.LayerNorm(8), 1, 3)


def test_layer_profile_reports_the_deferred_shares() -> None:
    layers = [
        nn.Linear(8, 16),
        nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)),
        nn.Linear(16, 4),
    ]
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    prof = profile_layers(layers, mlp_loss, x, y, warmup=1, iters=2)
    assert prof.w_share == (1.0, 272 / 304, 1.0)
    assert all(0.0 <= s <= 1.0 for s in prof.w_time_share)
    row = prof.to_dict()
    assert row["W_param_share"] == [1.0, 272 / 304, 1.0]
    assert len(row["W_time_share"]) == 3


def test_stage_w_share_sums_layers_by_elements_and_time() -> None:
    ops = tuple(OpStats.of([t]) for t in (2.0, 1.0, 4.0))
    lp = LayerProfile(
        f=ops,
        b=ops,
        w=tuple(OpStats.of([t]) for t in (3.0, 0.5, 1.0)),
        mem_b=(0, 0, 0),
        mem_w=(0, 0, 0),
        w_share=(1.0, 0.0, 0.5),
        w_time_share=(1.0, 0.0, 0.25),
        params=(100, 300, 600),
        w_grad_ms=(4.0, 2.0, 4.0),
    )
    # Layers 1-2: (0 + 300) / 900 elements; W 1.0 (layer 1 defers nothing) over 6.0 ms.
    assert lp.stage_w_share(1, 3) == (300 / 900, 1.0 / 6.0)
    assert lp.stage_w_share(0, 1) == (1.0, 0.75)
    assert lp.stage_w_share(0, 3) == ((100 + 300) / 1000, 4.0 / 10.0)
