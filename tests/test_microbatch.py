"""Microbatch splitting, loss scaling and the single-process reference step."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from zerobubble.models import build_mlp, mlp_loss
from zerobubble.reference.step import reference_step
from zerobubble.runtime.microbatch import loss_scales, split_batch


def test_split_batch_follows_tensor_split() -> None:
    x = torch.arange(16).reshape(8, 2)
    parts = split_batch(x, 3)
    assert [len(p) for p in parts] == [3, 3, 2]
    assert torch.equal(torch.cat(parts), x)
    assert [len(p) for p in split_batch(x, 8)] == [1] * 8


def test_split_batch_errors_name_both_numbers() -> None:
    with pytest.raises(ValueError, match="batch of 3 samples into 4 microbatches"):
        split_batch(torch.zeros(3, 2), 4)
    with pytest.raises(ValueError, match="must be >= 1, got 0"):
        split_batch(torch.zeros(3), 0)
    with pytest.raises(ValueError, match="0-dim"):
        split_batch(torch.tensor(1.0), 1)


def test_loss_scales_are_sample_fractions() -> None:
    assert loss_scales([3, 3, 2]) == [0.375, 0.375, 0.25]
    assert loss_scales([5]) == [1.0]
    with pytest.raises(ValueError, match="at least one"):
        loss_scales([])
    with pytest.raises(ValueError, match=r"sizes must be >= 1, got \[2, 0\]"):
        loss_scales([2, 0])


def test_scaled_microbatch_losses_give_the_full_batch_gradient() -> None:
    # Mathematical identity (rounding aside): sum_j n_j/N * mean_j = mean.
    model = build_mlp([4, 6, 2], seed=0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(7, 4, generator=g), torch.randn(7, 2, generator=g)
    ref = copy.deepcopy(model)
    losses, grads = reference_step(model, mlp_loss, x, y, 3)
    full = mlp_loss(ref(x), y)
    full.backward()
    scales = loss_scales([3, 2, 2])
    assert torch.allclose(sum(s * loss for s, loss in zip(scales, losses, strict=True)), full)
    for name, p in ref.named_parameters():
        assert torch.allclose(grads[name], p.grad, atol=1e-6)


def test_reference_step_is_plain_autograd_in_microbatch_order() -> None:
    model = build_mlp([4, 6, 2], seed=1)
    manual = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)  # stale gradients are cleared, not added to
    losses, grads = reference_step(list(model), mlp_loss, x, y, 2)
    want = []
    for xj, yj, s in zip(x.tensor_split(2), y.tensor_split(2), [0.6, 0.4], strict=True):
        loss = mlp_loss(manual(xj), yj)
        (loss * s).backward()
        want.append(loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(losses, want, strict=True))
    assert grads.keys() == dict(manual.named_parameters()).keys()
    for name, p in manual.named_parameters():
        assert torch.equal(grads[name], p.grad)
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())


def test_reference_step_rejects_mismatched_batches() -> None:
    model = build_mlp([2, 1])
    with pytest.raises(ValueError, match=r"target has shape \(3, 1\) and x \(4, 2\)"):
        reference_step(model, mlp_loss, torch.zeros(4, 2), torch.zeros(3, 1), 2)


class MappingFirst(nn.Module):
    """A first layer that takes a mapping and a keyword, and names its state itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch: dict, *, bias: torch.Tensor) -> torch.Tensor:
        return self.lin(batch["x"]) * batch["scale"] + bias

    def source_name(self, name: str) -> str:
        return f"encoder.{name}"


def test_reference_step_takes_the_batch_as_pipeline_step_and_gives_the_users_names() -> None:
    torch.manual_seed(0)
    layers = [MappingFirst(), nn.Linear(2, 2)]
    manual = copy.deepcopy(layers)
    x, y, bias = torch.randn(5, 4), torch.randn(5, 2), torch.randn(2)  # bias: not the batch
    batch = {"x": x, "scale": 2.0}
    losses, grads = reference_step(layers, mlp_loss, batch, target=y, microbatches=2, bias=bias)
    want = []
    for xj, yj, s in zip(x.tensor_split(2), y.tensor_split(2), [0.6, 0.4], strict=True):
        loss = mlp_loss(manual[1](manual[0]({"x": xj, "scale": 2.0}, bias=bias)), yj)
        (loss * s).backward()
        want.append(loss.detach())
    assert all(torch.equal(a, b) for a, b in zip(losses, want, strict=True))
    names = ["encoder.lin.weight", "encoder.lin.bias", "1.weight", "1.bias"]
    assert list(grads) == names
    params = [*manual[0].parameters(), *manual[1].parameters()]
    assert all(torch.equal(grads[n], p.grad) for n, p in zip(names, params, strict=True))


def test_reference_step_without_a_target_says_how_to_call_it() -> None:
    model = build_mlp([2, 1])
    with pytest.raises(ValueError, match=r"target=\.\.\., microbatches=M.*target= is missing"):
        reference_step(model, mlp_loss, {"x": torch.zeros(4, 2)}, microbatches=2)
    with pytest.raises(ValueError, match=r"target has a batch of 3 and the inputs one of 4"):
        reference_step(model, mlp_loss, x=torch.zeros(4, 2), target=torch.zeros(3), microbatches=2)
