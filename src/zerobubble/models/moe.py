"""A small dropless mixture-of-experts block, with experts shardable over an ep group.

:class:`MoE` routes each token to its ``top_k`` experts (router ``Linear(dim, E)``,
softmax, top-k, optionally renormalised as Mixtral does). Dropless: every (token, k)
pair is computed, whatever the load. Its forward is three phases, so that the
all-to-all can later be overlapped and so that
:func:`~zerobubble.reference.ep.ep_reference_step` can play every ep rank
in one process with the very same ops:

* :meth:`ExpertLayer.dispatch`: route; the (token, k) rows sorted by expert
  (stable) and the per-expert counts;
* :meth:`MoE.exchange`: counts, then rows, all-to-all to the experts' owners
  (:mod:`~zerobubble.parallel.ep`); :func:`run_experts` on the received rows (rows
  from source rank 0 first, then rank 1, ...; each local expert's rows concatenated
  in that order); the reverse all-to-all. With ``ep == 1`` no communication;
* :meth:`ExpertLayer.combine`: unsort, weight by the routing probabilities, sum.

The phases' contract (:class:`ExpertLayer`) and the exchange (:func:`exchange_rows`,
:func:`run_experts`, ...) are the runtime's (:mod:`~zerobubble.parallel.experts`, imported
here under the same names), so that the runtime imports no model.

Experts are :class:`Expert` MLPs of ``nn.Linear`` layers, so the B/W split defers
their weight gradients to W like any other weight. A model is built whole (all
experts, identical on every rank); on a mesh with ``ep > 1``
:class:`~zerobubble.pipeline.Pipeline` calls every MoE's hook
:meth:`MoE.shard_experts` in its stages (:func:`shard_experts` does it for a module), which
keeps a rank's experts ``[r * E / ep, (r + 1) * E / ep)``, named by their global index,
and marks them for the expert gradient reduction.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerobubble.models.gpt import CausalSelfAttention, GPTConfig, GPTEmbedding, _init
from zerobubble.parallel.ep import ExpertGroup, mark_expert
from zerobubble.parallel.experts import (
    ExpertLayer,
    dispatch_order,
    exchange_grouped,
    exchange_rows,
    run_experts,
    run_grouped,
)
from zerobubble.parallel.tp import LayerLayout, dropout_kinds
from zerobubble.runtime.loss_terms import add_loss_term

__all__ = [
    "Expert",
    "ExpertLayer",
    "MoE",
    "MoEBlock",
    "MoEGPTBlock",
    "build_moe_gpt",
    "build_moe_mlp",
    "dispatch_order",
    "exchange_grouped",
    "exchange_rows",
    "run_experts",
    "run_grouped",
    "shard_experts",
]


class Expert(nn.Module):
    """A SwiGLU MLP, ``w2(silu(w1 x) * w3 x)`` (Mixtral's expert), of bias-free Linears."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(ExpertLayer):
    """Dropless top-k mixture of :class:`Expert` s; input ``(..., dim)``.

    Args:
        dim, hidden: Model and expert hidden widths.
        num_experts: ``E``, experts of the whole layer (over all ep ranks).
        top_k: Experts per token.
        normalize: Renormalise the top-k probabilities to sum to 1 (Mixtral).
        balance: Coefficient of the layer's load-balancing loss, added as the loss term
            ``"router_balance"`` (:func:`~zerobubble.runtime.loss_terms.add_loss_term`):
            ``E * sum_e f_e * P_e`` over this layer's tokens (Switch Transformer's), with
            ``f_e`` the share of (token, k) picks that chose expert ``e`` (no gradient) and
            ``P_e`` the mean router probability of ``e``. 0: no term.
        z_loss: Coefficient of ST-MoE's router z-loss, added as the loss term
            ``"router_z"``: ``z_loss`` times the mean over this layer's tokens of
            ``logsumexp(router logits) ** 2`` (it keeps the logits small). 0: no term.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        normalize: bool = True,
        balance: float = 0.0,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if not balance >= 0:
            raise ValueError(f"balance={balance} must be >= 0 (0: no load-balancing term)")
        if not z_loss >= 0:
            raise ValueError(f"z_loss={z_loss} must be >= 0 (0: no router z-loss term)")
        self.num_experts, self.top_k, self.normalize = num_experts, top_k, normalize
        self.balance, self.z_loss = balance, z_loss
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(dim, hidden) for e in range(num_experts)})
        self.ep = ExpertGroup()

    @property
    def moe(self) -> MoE:  # a MoE is its own expert layer
        return self

    def shard(self, ep: ExpertGroup, run: int = 0) -> None:
        """Keep this rank's experts ``[r * E / ep, (r + 1) * E / ep)`` and mark them."""
        if self.num_experts % ep.size:
            raise ValueError(
                f"ep={ep.size} must divide num_experts={self.num_experts}; choose ep among "
                "the divisors of the expert count"
            )
        if len(self.experts) != self.num_experts:
            raise ValueError("MoE.shard: the experts are already sharded")
        local = self.num_experts // ep.size
        keep = range(ep.rank * local, (ep.rank + 1) * local)
        self.experts = nn.ModuleDict({str(e): self.experts[str(e)] for e in keep})
        self.ep = ep
        for p in self.experts.parameters():
            mark_expert(p, run)

    def shard_experts(self, ep: ExpertGroup, first_run: int) -> int:
        """The layer contract's sharding hook
        (:class:`~zerobubble.parallel.experts.ShardsExperts`): :meth:`shard` with run
        ``first_run``; one run used."""
        self.shard(ep, first_run)
        return 1

    def route(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Routing weights and chosen experts, both ``(N, k)``."""
        return self.select(self.router(tokens).softmax(-1))

    def select(self, probs: Tensor) -> tuple[Tensor, Tensor]:
        """The top-k of routing probabilities ``(N, E)``: weights (renormalised with
        ``normalize``) and chosen experts, both ``(N, k)``."""
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen

    def dispatch(self, x: Tensor) -> tuple[Any, Tensor, Tensor]:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens)
        probs = logits.softmax(-1)
        weights, chosen = self.select(probs)
        order, token_of, counts = dispatch_order(chosen, self.num_experts)
        if self.balance:
            share = counts.to(probs.dtype) / chosen.numel()
            term = (share * probs.mean(0)).sum() * (self.balance * self.num_experts)
            add_loss_term(self, "router_balance", term)
        if self.z_loss:
            z = torch.logsumexp(logits, dim=-1).square().mean() * self.z_loss
            add_loss_term(self, "router_z", z)
        return (x.shape, weights, order), tokens[token_of], counts

    def exchange(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Outputs of the rows' experts, in the rows' order (communicating over ep)."""
        return exchange_rows(list(self.experts.values()), rows, counts, self.ep)

    def combine(self, ctx: Any, out: Tensor) -> Tensor:
        shape, weights, order = ctx
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order), device=order.device)
        pairs = out[inverse].view(weights.shape[0], self.top_k, -1)
        return (pairs * weights.unsqueeze(-1)).sum(1).view(shape)


class MoEBlock(ExpertLayer):
    """``x + moe(norm(x))``, a pre-norm residual MoE block."""

    moe: MoE

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int,
        *,
        balance: float = 0.0,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k, balance=balance, z_loss=z_loss)

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism: the block left whole on every tp rank (``whole_sequence``), its
        experts replicated over tp."""
        return {"": "whole_sequence"}

    def dispatch(self, x: Tensor) -> tuple[Any, Tensor, Tensor]:
        ctx, rows, counts = self.moe.dispatch(self.norm(x))
        return (x, ctx), rows, counts

    def combine(self, ctx: Any, out: Tensor) -> Tensor:
        x, inner = ctx
        return x + self.moe.combine(inner, out)


class MoEGPTBlock(ExpertLayer):
    """A GPT block whose MLP is a :class:`MoE`: ``x + attn(ln1(x))``, then ``+ moe(ln2(.))``."""

    moe: MoE

    def __init__(
        self,
        cfg: GPTConfig,
        num_experts: int,
        top_k: int,
        *,
        balance: float = 0.0,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.moe = MoE(d, cfg.mlp_ratio * d, num_experts, top_k, balance=balance, z_loss=z_loss)

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`): the block left whole on every
        tp rank (``whole_sequence``: with sequence parallelism it gathers the sequence and
        hands on its shard), its experts replicated over tp (a ``ReplicatedExpertsWarning``
        says so), its attention computed alike on every rank, so its dropouts draw from the
        shared stream."""
        drops = {"attn.attn_drop": False, "attn.resid_drop": False}
        return {"": "whole_sequence"} | dropout_kinds(self, drops)

    def dispatch(self, x: Tensor) -> tuple[Any, Tensor, Tensor]:
        x = x + self.attn(self.ln1(x))
        ctx, rows, counts = self.moe.dispatch(self.ln2(x))
        return (x, ctx), rows, counts

    def combine(self, ctx: Any, out: Tensor) -> Tensor:
        x, inner = ctx
        return x + self.moe.combine(inner, out)


def build_moe_gpt(
    cfg: GPTConfig, *, num_experts: int, top_k: int, balance: float = 0.0, z_loss: float = 0.0
) -> nn.Sequential:
    """:func:`~zerobubble.models.gpt.build_gpt`'s model with :class:`MoEGPTBlock` s:
    ``[GPTEmbedding, MoEGPTBlock x n_layers, LayerNorm, Linear head]``, initialised as
    it is (seeded by ``cfg.seed``), the head tied to the token embedding with
    ``cfg.tie_embeddings``. ``balance``, ``z_loss``: each MoE's load-balancing and router
    z-loss terms (:class:`MoE`)."""
    with torch.random.fork_rng(devices=[]):
        embedding = GPTEmbedding(cfg)
        blocks = [
            MoEGPTBlock(cfg, num_experts, top_k, balance=balance, z_loss=z_loss)
            for _ in range(cfg.n_layers)
        ]
        norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        model = nn.Sequential(embedding, *blocks, norm, head)
        _init(model, cfg)
    if cfg.tie_embeddings:
        head.weight = embedding.tok.weight
    return model


def shard_experts(module: nn.Module, ep: ExpertGroup) -> int:
    """Shard every :class:`MoE` in ``module`` over ``ep`` (see :meth:`MoE.shard`); returns
    how many. Each layer's experts are marked with their own run."""
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    for run, m in enumerate(layers):
        m.shard(ep, run)
    return len(layers)


def build_moe_mlp(
    sizes: tuple[int, int, int],
    *,
    hidden: int,
    num_experts: int,
    top_k: int,
    blocks: int,
    seed: int = 0,
    balance: float = 0.0,
    z_loss: float = 0.0,
) -> nn.Sequential:
    """``Linear(sizes[0], dim)``, ``blocks`` :class:`MoEBlock` s, ``Linear(dim, sizes[2])``
    with ``dim = sizes[1]``: a tiny MoE model for tests. Parameters come from ``seed``;
    the global RNG is left untouched. ``balance``, ``z_loss``: each MoE's load-balancing
    and router z-loss terms."""
    d_in, dim, d_out = sizes
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layers: list[nn.Module] = [nn.Linear(d_in, dim)]
        layers += [
            MoEBlock(dim, hidden, num_experts, top_k, balance=balance, z_loss=z_loss)
            for _ in range(blocks)
        ]
        layers.append(nn.Linear(dim, d_out))
    return nn.Sequential(*layers)
