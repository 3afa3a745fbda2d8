"""The small GPT and MLP: structure, determinism, causality, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from zerobubble.models import GPTConfig, build_gpt, build_mlp, gpt_loss, mlp_loss
from zerobubble.models.gpt import Block, GPTEmbedding

CFG = GPTConfig(vocab_size=40, max_seq_len=12, d_model=16, n_heads=4, n_layers=2, seed=3)


def _ids(b: int, t: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(seed))


def test_gpt_is_an_ordered_list_of_layers() -> None:
    model = build_gpt(CFG)
    assert isinstance(model, nn.Sequential) and len(model) == CFG.n_layers + 3
    assert isinstance(model[0], GPTEmbedding)
    assert all(isinstance(model[i], Block) for i in range(1, CFG.n_layers + 1))
    assert isinstance(model[-2], nn.LayerNorm)
    assert isinstance(model[-1], nn.Linear) and model[-1].bias is None
    logits = model(_ids(2, 7))
    assert logits.shape == (2, 7, CFG.vocab_size)
    # Small init: the initial loss is close to that of a uniform prediction.
    assert abs(gpt_loss(logits, _ids(2, 7, 1)).item() - math.log(CFG.vocab_size)) < 0.05


def test_gpt_init_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a, b = build_gpt(CFG), build_gpt(CFG)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    other = build_gpt(GPTConfig(**{**CFG.__dict__, "seed": 4}))
    assert not torch.equal(other[1].fc.weight, a[1].fc.weight)
    # Residual projections are initialised smaller (GPT-2 scaling); biases start at 0.
    assert a[1].proj.weight.std() < a[1].fc.weight.std()
    assert torch.equal(a[1].fc.bias, torch.zeros_like(a[1].fc.bias))


def test_gpt_is_causal_bitwise() -> None:
    model = build_gpt(CFG)
    ids = _ids(1, 10)
    changed = ids.clone()
    changed[0, 6:] = (changed[0, 6:] + 1) % CFG.vocab_size
    a, b = model(ids), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.equal(a[:, 6:], b[:, 6:])


def test_gpt_loss_is_token_mean_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    tgt = torch.tensor([[0, 4, 2], [1, 1, 3]])
    want = F.cross_entropy(logits.reshape(6, 5), tgt.reshape(6))
    assert torch.equal(gpt_loss(logits, tgt), want)


def test_tied_embeddings_share_one_parameter() -> None:
    tied = build_gpt(GPTConfig(**{**CFG.__dict__, "tie_embeddings": True}))
    assert tied[-1].weight is tied[0].tok.weight
    assert len(list(tied.parameters())) == len(list(build_gpt(CFG).parameters())) - 1


def test_gpt_config_and_input_errors() -> None:
    with pytest.raises(ValueError, match="d_model=10 is not divisible by n_heads=4"):
        GPTConfig(d_model=10, n_heads=4)
    with pytest.raises(ValueError, match="n_layers must be >= 1, got 0"):
        GPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="sequence length 13 exceeds max_seq_len=12"):
        build_gpt(CFG)(_ids(1, 13))


def test_mlp_layers_and_loss() -> None:
    model = build_mlp([3, 5, 2], seed=1)
    assert len(model) == 2
    assert isinstance(model[0], nn.Sequential) and isinstance(model[0][1], nn.Tanh)
    assert isinstance(model[1], nn.Linear)
    again = build_mlp([3, 5, 2], seed=1)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters(), strict=True)
    )
    out = model(torch.ones(4, 3))
    assert out.shape == (4, 2)
    assert torch.equal(mlp_loss(out, torch.zeros(4, 2)), out.square().mean())
    with pytest.raises(ValueError, match="needs >= 2 positive sizes"):
        build_mlp([3])
