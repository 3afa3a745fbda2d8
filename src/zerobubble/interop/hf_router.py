"""A mixture of experts' router loss across pipeline stages (imports ``transformers``).

With ``output_router_logits=True`` a Mixtral-style causal LM (Mixtral, Qwen3-MoE, ...)
adds ``router_aux_loss_coef`` times ``load_balancing_loss_func`` of every layer's router
logits to its loss. That function couples all layers: per expert, the fraction of top-k
assignments and the mean routing probability, both over every layer's tokens. It is
already written as per-layer sums normalised at the end, so the adapter carries those
sums in the boundary dict (:data:`RouterStats`): each MoE block adds its router's
assignment counts (no gradient), probability sums (differentiable: the router's weights
get the loss's gradient through them) and token count, with the very ops of Hugging
Face's loop, and the head computes the loss from the totals and adds it as the loss term
``"router_aux"`` (:func:`~zerobubble.runtime.loss_terms.add_loss_term`). The result is
bitwise the model's own ``aux_loss``, which :func:`~zerobubble.interop.hf.check_layers`
verifies.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "ROUTER_TERM",
    "RouterLoss",
    "RouterStats",
    "add_routing",
    "router_loss_of",
    "router_term",
]

ROUTER_TERM = "router_aux"
"""The loss term's name in :meth:`~zerobubble.pipeline.Pipeline.step`'s ``terms``."""

RouterStats = dict[str, Any]
"""``{"tokens": assignment counts per expert, "probs": routing probability sums per expert,
"rows": the token count}`` over the layers so far; ``rows`` is an int without a padding
mask, else a float tensor of the mask's sums (as Hugging Face's ``total_rows``)."""


@dataclass(frozen=True)
class RouterLoss:
    """What a model's router loss needs: how to find its routers, and the formula's constants."""

    router_class: type[nn.Module]
    """The class whose output ``index`` Hugging Face records as ``router_logits``."""
    index: int
    num_experts: int
    top_k: int
    coef: float


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model``'s forward adds (None if it adds none); ValueError if it adds
    one the adapter cannot carry."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    name = type(model).__name__
    module = sys.modules.get(type(model).__module__)
    recorder = getattr(model, "_can_record_outputs", {}).get("router_logits")
    constants = [getattr(model, a, None) for a in ("num_experts", "num_experts_per_tok")]
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    target = getattr(recorder, "target_class", None)
    if (
        getattr(module, "load_balancing_loss_func", None) is None
        or not isinstance(target, type)
        or not all(isinstance(c, int) for c in constants)
        or not isinstance(coef, int | float)
    ):
        raise ValueError(
            f"{name} is built with config.output_router_logits=True: its loss adds "
            f"router_aux_loss_coef={getattr(config, 'router_aux_loss_coef', None)} times the "
            "routers' load-balancing loss, which the adapter carries only for models that "
            "record router_logits and use load_balancing_loss_func (Mixtral, Qwen3-MoE); "
            "build the model with output_router_logits=False"
        )
    num_experts, top_k = constants
    assert isinstance(num_experts, int) and isinstance(top_k, int)
    return RouterLoss(target, int(getattr(recorder, "index", 0)), num_experts, top_k, float(coef))


def add_routing(
    stats: RouterStats | None, logits: Tensor, mask: Tensor | None, loss: RouterLoss
) -> RouterStats:
    """``stats`` plus one layer's router logits: one iteration of Hugging Face's
    ``load_balancing_loss_func`` loop (the first from its zeros), op for op."""
    device = logits.device
    e, k = loss.num_experts, loss.top_k
    if stats is None:
        zeros = torch.zeros(e, dtype=torch.float32, device=device)
        rows0: Any = 0 if mask is None else 0.0
        stats = {"tokens": zeros, "probs": zeros, "rows": rows0}
    histc_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    routing_weights = torch.nn.functional.softmax(logits, dim=-1)
    _, selected = torch.topk(routing_weights, k, dim=-1)
    if mask is None:
        if not isinstance(stats["rows"], int):
            raise ValueError("the router statistics switch from a padding mask to none mid-model")
        counts = torch.histc(selected.reshape(-1).to(histc_dtype), bins=e, min=0, max=e)
        probs = routing_weights.float().sum(dim=0)
        rows = stats["rows"] + routing_weights.shape[0]
    else:
        if mask.ndim != 2:
            raise ValueError(
                f"the router loss weighs tokens by the 2-D padding mask, got a mask of shape "
                f"{tuple(mask.shape)}; pass attention_mask as (batch, sequence)"
            )
        flat = mask.reshape(-1).to(device=device, dtype=torch.float32)
        counts = torch.zeros(e, dtype=torch.float32, device=device).scatter_add_(
            0, selected.reshape(-1), flat.repeat_interleave(k)
        )
        probs = (routing_weights.float() * flat.unsqueeze(-1)).sum(dim=0)
        rows = stats["rows"] + flat.sum()
    return {"tokens": stats["tokens"] + counts, "probs": stats["probs"] + probs, "rows": rows}


def router_term(stats: RouterStats, loss: RouterLoss) -> Tensor:
    """``router_aux_loss_coef`` times the load-balancing loss of the layers' totals."""
    rows = stats["rows"]
    total = float(rows) if isinstance(rows, int) else rows
    tokens_per_expert = stats["tokens"] / total
    router_prob_per_expert = stats["probs"] / total
    overall = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
    return loss.coef * (overall * loss.num_experts)
