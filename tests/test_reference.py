"""The one reference (:func:`zerobubble.reference_step`): the job's dimensions as options,
each composition equal bitwise to the single-dimension reference it replaces; what has no
ground truth yet is refused by name. Its agreement with pipelines: test_seq_runtime (dp x
segments), test_tp (dp x tp), and every test that calls ``zerobubble.reference_step``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import zerobubble
from zerobubble.models import build_mlp, build_moe_mlp, mlp_loss
from zerobubble.reference.ep import ep_reference_step
from zerobubble.reference.step import dp_reference_step
from zerobubble.reference.step import reference_step as plain_step

G = torch.Generator().manual_seed(3)
X, Y = torch.randn(13, 6, generator=G), torch.randn(13, 3, generator=G)  # 13 rows: 7 + 6


def mlp() -> nn.Sequential:
    return build_mlp((6, 8, 8, 3), seed=0)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    assert a.keys() == b.keys() and a
    return [n for n in a if not torch.equal(a[n], b[n])]


def test_no_option_is_the_plain_reference():
    want_losses, want = plain_step(mlp(), mlp_loss, X, target=Y, microbatches=3)
    model = mlp()
    losses, got = zerobubble.reference_step(model, mlp_loss, X, target=Y, microbatches=3)
    assert all(map(torch.equal, losses, want_losses)) and not same(got, want)
    assert all(torch.equal(p.grad, got[n]) for n, p in model.named_parameters())


def test_dp_sums_the_replicas_normalised_by_the_global_batch():
    parts = [(X[:7], Y[:7]), (X[7:], Y[7:])]  # tensor_split's cut of 13 rows
    per_replica, want = dp_reference_step(mlp(), mlp_loss, parts, 3)
    model = mlp()
    losses, got = zerobubble.reference_step(model, mlp_loss, X, target=Y, microbatches=3, dp=2)
    assert all(map(torch.equal, losses, per_replica[0] + per_replica[1]))  # replica-major
    assert not same(got, want)
    assert all(torch.equal(p.grad, got[n]) for n, p in model.named_parameters())


def test_ep_runs_the_replicas_together():
    def moe() -> nn.Sequential:
        return build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, seed=0)

    x, y = torch.randn(8, 3, 6, generator=G), torch.randn(8, 3, 3, generator=G)
    per_replica, want = ep_reference_step(moe(), mlp_loss, [(x[:4], y[:4]), (x[4:], y[4:])], 2, 2)
    losses, got = zerobubble.reference_step(
        moe(), mlp_loss, x, target=y, microbatches=2, dp=2, ep=2
    )
    assert all(map(torch.equal, losses, per_replica[0] + per_replica[1])) and not same(got, want)


class Scaled(nn.Module):
    """A first layer of two inputs: ``lin(x) * scale`` (``scale`` a keyword, or baked in)."""

    def __init__(self, lin: nn.Linear, scale: torch.Tensor | None = None) -> None:
        super().__init__()
        self.lin, self.scale = lin, scale

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.lin(x) * (self.scale if scale is None else scale)


def test_ep_with_a_seed_runs_the_single_replica_reference_per_replica_in_threads():
    """With a seed (random ops) the replicas run as threads taking turns, each the
    single-replica reference seeded per stage: on a model that draws nothing, bitwise the
    layer-by-layer ep reference; the caller's generator state is left as it was."""

    def moe() -> nn.Sequential:
        return build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, seed=0)

    x, y = torch.randn(8, 3, 6, generator=G), torch.randn(8, 3, 3, generator=G)
    per_replica, want = ep_reference_step(moe(), mlp_loss, [(x[:4], y[:4]), (x[4:], y[4:])], 2, 2)
    before = torch.get_rng_state()
    for _ in range(3):
        losses, got = zerobubble.reference_step(
            moe(), mlp_loss, x, target=y, microbatches=2, dp=2, ep=2, seed=0, num_stages=2
        )
        assert all(map(torch.equal, losses, per_replica[0] + per_replica[1]))
        assert not same(got, want)
    assert torch.equal(torch.get_rng_state(), before)


def test_ep_takes_a_first_layer_of_several_inputs_as_a_stage_does():
    """With ep, a keyword input goes to the first layer as the pipeline's first stage
    passes it: the same as a model with that input baked into the layer, bitwise."""

    def moe(scale: torch.Tensor | None) -> nn.Sequential:
        model = build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, seed=0)
        first = next(i for i, m in enumerate(model) if isinstance(m, nn.Linear))
        layers = list(model)
        layers[first] = Scaled(layers[first], scale)
        return nn.Sequential(*layers)

    x, y = torch.randn(8, 3, 6, generator=G), torch.randn(8, 3, 3, generator=G)
    scale = torch.full((1, 1, 8), 0.5)  # dim 0 is not the batch: every microbatch gets it
    baked_losses, baked = zerobubble.reference_step(
        moe(scale), mlp_loss, x, target=y, microbatches=2, dp=2, ep=2
    )
    losses, got = zerobubble.reference_step(
        moe(None), mlp_loss, x, target=y, microbatches=2, dp=2, ep=2, scale=scale
    )
    assert all(map(torch.equal, losses, baked_losses)) and not same(got, baked)


def test_what_has_no_ground_truth_is_refused_by_name():
    def call(**options):
        return zerobubble.reference_step(mlp(), mlp_loss, X, target=Y, microbatches=3, **options)

    with pytest.raises(ValueError, match=r"dp=3 and ep=2: both >= 1, and ep must divide dp"):
        call(dp=3, ep=2)
    with pytest.raises(ValueError, match="a batch of 13 rows cannot feed dp=14 replicas"):
        call(dp=14)


def test_the_layers_keep_their_parameters_and_get_the_summed_gradients():
    model = mlp()
    before = copy.deepcopy(model.state_dict())
    zerobubble.reference_step(model, mlp_loss, X, target=Y, microbatches=3, dp=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
