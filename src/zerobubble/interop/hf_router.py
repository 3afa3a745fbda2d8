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

Two router options of the adapter live here too, neither of them the model's own: the
router z-loss (ST-MoE's, :func:`router_z_term`, the term ``"router_z"``) of any router
whose logits the model records, and DeepSeek-V3's bias balancing
(:class:`BiasBalance`: the step's expert loads move each router's
``e_score_correction_bias``, which Hugging Face keeps but never updates).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "BIAS",
    "ROUTER_TERM",
    "Z_TERM",
    "BiasBalance",
    "RouterLoss",
    "RouterStats",
    "Routers",
    "add_routing",
    "family",
    "router_loss_of",
    "router_term",
    "router_z_term",
    "routers_of",
]

ROUTER_TERM = "router_aux"
"""The loss term's name in :meth:`~zerobubble.pipeline.Pipeline.step`'s ``terms``."""

Z_TERM = "router_z"
"""The router z-loss's term name (``causal_lm_layers(..., router_z_loss=)``)."""

BIAS = "e_score_correction_bias"
"""The buffer of a bias-balanced router (DeepSeek-V3's ``DeepseekV3TopkRouter``...)."""

RouterStats = dict[str, Any]
"""``{"tokens": assignment counts per expert, "probs": routing probability sums per expert,
"rows": the token count}`` over the layers so far; ``rows`` is an int without a padding
mask, else a float tensor of the mask's sums (as Hugging Face's ``total_rows``)."""


@dataclass(frozen=True)
class Routers:
    """Where a model's routers are: the class whose output ``index`` (the logits) Hugging
    Face records as ``router_logits``."""

    router_class: type[nn.Module]
    index: int


@dataclass(frozen=True)
class RouterLoss:
    """What a model's router loss needs: how to find its routers, and the formula's constants."""

    router_class: type[nn.Module]
    """The class whose output ``index`` Hugging Face records as ``router_logits``."""
    index: int
    num_experts: int
    top_k: int
    coef: float


def family(model: nn.Module) -> str:
    """``"MixtralForCausalLM (mixtral)"``: the class and its config's model type, for messages."""
    return f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})"


def routers_of(model: nn.Module) -> Routers | None:
    """The routers ``model`` records logits of (its own ``_can_record_outputs`` or its base
    model's: Llama4 records them on the text model only), or None."""
    for owner in (model, getattr(model, "model", None)):
        recorders = getattr(owner, "_can_record_outputs", None) or {}
        recorder = recorders.get("router_logits") if isinstance(recorders, dict) else None
        target = getattr(recorder, "target_class", None)
        if isinstance(target, type) and issubclass(target, nn.Module):
            return Routers(target, int(getattr(recorder, "index", 0)))
    return None


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model``'s forward adds (None if it adds none); ValueError if it is
    built to return router logits but adds no loss, or adds one the adapter cannot carry."""
    config = model.config
    if not getattr(config, "output_router_logits", False):
        return None
    name = family(model)
    module = sys.modules.get(type(model).__module__)
    if getattr(module, "load_balancing_loss_func", None) is None:
        biased = any(BIAS in m._buffers for m in model.modules())
        also = (
            " (its routers balance by a bias, not a loss: causal_lm_layers(model, "
            "bias_update=rate) updates it from each step's expert loads)"
            if biased
            else ""
        )
        raise ValueError(
            f"{name} is built with config.output_router_logits=True, but its loss adds no "
            "auxiliary router loss: the flag only makes its forward return the routers' "
            "logits, which the adapter's layers do not pass on; build the model with "
            f"output_router_logits=False{also}"
        )
    routers = routers_of(model)
    constants = [getattr(model, a, None) for a in ("num_experts", "num_experts_per_tok")]
    coef = getattr(model, "router_aux_loss_coef", getattr(config, "router_aux_loss_coef", None))
    if (
        routers is None
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
    return RouterLoss(routers.router_class, routers.index, num_experts, top_k, float(coef))


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


def _token_mask(mask: Tensor | None, what: str) -> Tensor | None:
    if mask is not None and mask.ndim != 2:
        raise ValueError(
            f"{what} weighs tokens by the 2-D padding mask, got a mask of shape "
            f"{tuple(mask.shape)}; pass attention_mask as (batch, sequence)"
        )
    return None if mask is None else mask.reshape(-1)


def router_z_term(logits: Tensor, mask: Tensor | None, coef: float) -> Tensor:
    """ST-MoE's router z-loss of one router call: ``coef`` times the mean over the tokens
    (the real ones, with a padding mask) of ``logsumexp(logits) ** 2``."""
    z = torch.logsumexp(logits.float(), dim=-1).square()
    flat = _token_mask(mask, "the router z-loss")
    if flat is None:
        return z.mean() * coef
    weights = flat.to(device=z.device, dtype=z.dtype)
    return (z * weights).sum() / weights.sum() * coef


class BiasBalance:
    """DeepSeek-V3's auxiliary-loss-free balancing of one router: after each applied
    optimizer step, ``bias_e += rate * sign(mean load - load_e)``, the loads being the
    step's (token, k) assignments to each expert over all microbatches and dp replicas.

    It counts the chosen experts of the forwards that record a graph (a training forward,
    or the recomputation of a checkpointed one, never both), so that each microbatch counts
    once; an evaluation under ``torch.no_grad`` counts nothing.
    """

    def __init__(self, num_experts: int, rate: float, name: str) -> None:
        if not rate > 0:
            raise ValueError(f"bias_update={rate} must be > 0 (the bias moves by it per step)")
        self.num_experts, self.rate = num_experts, rate
        self.name = name
        """The router, for messages (``"decoder layer 1's DeepseekV3TopkRouter"``)."""
        self.loads: Tensor | None = None
        """This step's assignments per expert, on this rank (int64)."""
        self.pending: Tensor | None = None
        """The last step's loads summed over dp, until its optimizer step is committed."""

    def count(self, chosen: Tensor) -> None:
        """Add one router call's chosen experts ``(tokens, k)`` (an integer tensor)."""
        e = self.num_experts
        if chosen.is_floating_point() or chosen.ndim != 2:
            raise ValueError(
                f"{self.name}: the bias update counts the chosen experts, a (tokens, k) integer "
                f"tensor the router returns last (as DeepSeek-V3's); it returned {chosen.dtype} "
                f"of shape {tuple(chosen.shape)} last: build the layers without bias_update"
            )
        counts = torch.bincount(chosen.reshape(-1), minlength=e)
        self.loads = counts if self.loads is None else self.loads + counts

    def begin(self) -> None:
        self.loads = None

    def end(self, reduce: Callable[[Tensor], Tensor]) -> None:
        loads = self.loads
        if loads is None:  # no forward of this step recorded a graph here
            loads = torch.zeros(self.num_experts, dtype=torch.int64)
        self.pending, self.loads = reduce(loads), None

    def commit(self, bias: Tensor, applied: bool) -> None:
        """Move ``bias`` (in place) by the pending loads if the step was ``applied``."""
        loads, self.pending = self.pending, None
        if not applied or loads is None:
            return
        loads = loads.to(torch.int64).cpu()
        direction = torch.sign(loads.sum() - self.num_experts * loads)  # sign(mean - load)
        with torch.no_grad():
            bias.add_(direction.to(device=bias.device, dtype=bias.dtype), alpha=self.rate)
