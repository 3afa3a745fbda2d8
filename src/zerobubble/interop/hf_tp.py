"""Hugging Face's tensor-parallel plans in the runtime's terms: a ``transformers`` config's
``base_model_tp_plan`` (submodule patterns -> style strings) mapped onto one adapter layer as
the kinds of :mod:`~zerobubble.parallel.tp` (:data:`~zerobubble.parallel.tp.KINDS`), the plain
``{submodule name: kind}`` a layer's ``tp_kinds`` hook returns (docs/layer-contract.md).
The runtime reads kinds only; the strings of ``transformers`` stay here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from torch import nn

from zerobubble.parallel.tp import is_norm

__all__ = ["HF_STYLES", "hf_block_plan"]

HF_STYLES = (
    "colwise",
    "rowwise",
    "colwise_gather_output",
    "sequence_parallel",
    "replicated_with_grad_allreduce",
    "mla_kv_a_proj",
)
"""The ``base_model_tp_plan`` strings of ``transformers`` that :func:`hf_block_plan` maps
(``colwise_rep`` is read as ``colwise_gather_output``; ``replicated_with_grad_allreduce``,
Qwen3's per-head ``q_norm``/``k_norm`` on the local heads, as ``heads_norm``: the weight
replicated, its gradient summed over tp; ``mla_kv_a_proj``, DeepSeek's multi-head latent
attention, see :func:`_latent_attention`); any other raises ValueError."""

_KINDS = {
    **{k: k for k in HF_STYLES},
    "colwise_rep": "colwise_gather_output",
    "replicated_with_grad_allreduce": "heads_norm",
    "mla_kv_a_proj": "replicated_heads:1",
}


def hf_block_plan(
    base_model_tp_plan: Mapping[str, str], paths: Mapping[str, str], layer: nn.Module
) -> dict[str, str]:
    """Map a ``transformers`` config's ``base_model_tp_plan`` onto one adapter layer.

    ``base_model_tp_plan`` names submodules of the base model (``"layers.*.mlp.up_proj"``,
    ``*`` one name component) with a style string (:data:`HF_STYLES`); ``paths`` maps each
    attribute of the adapter layer to its path in the causal LM (``HFLayer._paths``, e.g.
    ``{"layer": "model.layers.3"}``). Returns ``{name in layer: style kind}`` for every
    submodule the plan names.
    """
    rules = []
    for fqn, kind in base_model_tp_plan.items():
        if kind not in _KINDS:
            raise ValueError(
                f"base_model_tp_plan[{fqn!r}] = {kind!r}: no mapping to a parallel style (the "
                f"default plan maps {', '.join(sorted(_KINDS))}); pass tp_plan= instead"
            )
        regex = r"[^.]+".join(re.escape(part) for part in f"model.{fqn}".split("*"))
        rules.append((re.compile(regex), _KINDS[kind], kind == "mla_kv_a_proj"))
    out: dict[str, str] = {}
    latent: dict[str, str] = {}  # attention (name in layer) -> its path in the model
    for attr, path in paths.items():
        for rest, _ in layer.get_submodule(attr).named_modules():
            full = f"{path}.{rest}" if rest else path
            name = f"{attr}.{rest}" if rest else attr
            for pattern, kind, mla in rules:
                if pattern.fullmatch(full):
                    out[name] = _checked(full, kind, layer, attr, rest)
                    if mla:
                        latent[name.rpartition(".")[0]] = full.rpartition(".")[0]
    for attention, full in latent.items():
        out |= _latent_attention(layer, attention, full, out)
    return out


_LATENT = {
    "q_a_proj": "replicated_heads:1",
    "q_a_layernorm": "heads_norm",
    "q_b_proj": "colwise_partial_grad",
    "kv_a_layernorm": "heads_norm",
    "kv_b_proj": "colwise_partial_grad",
}
"""Multi-head latent attention's modules around ``kv_a_proj_with_mqa`` (``mla_kv_a_proj``,
``replicated_heads:1``), which ``base_model_tp_plan`` leaves unnamed or names column-wise
on the whole input."""


def _latent_attention(
    layer: nn.Module, attention: str, full: str, kinds: Mapping[str, str]
) -> dict[str, str]:
    """The kinds of the multi-head latent attention ``attention`` (``full`` in the model),
    whose ``kv_a_proj_with_mqa`` the plan names ``mla_kv_a_proj``.

    The down projections (``kv_a_proj_with_mqa``: the compressed kv and the one rope key
    every head shares; ``q_a_proj``: the query latent) are replicated, ``replicated_heads:1``:
    every rank computes the latent whole, and as each rank's heads use it, its gradient is
    ``Partial``; the latents' norms likewise (``heads_norm``), and the up projections
    (``q_b_proj``, ``kv_b_proj``) shard the heads column-wise on that latent, leaving its
    gradient partial (``colwise_partial_grad``), so that the latent path adds no collective:
    the partial gradients meet the other projections' at the attention's input and are
    reduced there once. Without ``q_lora_rank`` the plan's ``q_proj`` (column-wise on the
    attention's input) stays. A submodule with parameters that none of this covers raises
    ValueError (it would hold a partial gradient as a whole one)."""
    attn = layer.get_submodule(attention)
    out = {
        f"{attention}.{sub}": kind
        for sub, kind in _LATENT.items()
        if isinstance(getattr(attn, sub, None), nn.Module)
    }
    planned = {**kinds, **out}
    for rest, m in attn.named_modules():
        name = f"{attention}.{rest}" if rest else attention
        if any(True for _ in m.parameters(recurse=False)) and name not in planned:
            raise ValueError(
                f"base_model_tp_plan names {full}.kv_a_proj_with_mqa 'mla_kv_a_proj', but "
                f"{full}.{rest} ({type(m).__name__}) is none of multi-head latent attention's "
                f"modules the default plan maps ({', '.join(_LATENT)} and the plan's "
                "own); pass tp_plan= instead"
            )
    for rest in ("kv_a_layernorm", "kv_b_proj"):
        if f"{attention}.{rest}" not in out:
            raise ValueError(
                f"base_model_tp_plan names {full}.kv_a_proj_with_mqa 'mla_kv_a_proj', but "
                f"{full} has no {rest}: not the multi-head latent attention the default plan "
                "maps; pass tp_plan= instead"
            )
    return out


def _checked(full: str, kind: str, layer: nn.Module, attr: str, rest: str) -> str:
    """``kind``, unless it is ``heads_norm`` on a module that is no norm: the kind reads its
    input as heads sharded over tp, right for a per-head norm only."""
    module = layer.get_submodule(f"{attr}.{rest}" if rest else attr)
    if kind == "heads_norm" and not is_norm(module):
        raise ValueError(
            f"base_model_tp_plan names {full} ({type(module).__name__}) "
            "'replicated_with_grad_allreduce', which the default plan maps for a norm over "
            "the local heads only (Qwen3's q_norm, k_norm); pass tp_plan= instead"
        )
    return kind
