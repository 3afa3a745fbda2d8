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
)
"""The ``base_model_tp_plan`` strings of ``transformers`` that :func:`hf_block_plan` maps
(``colwise_rep`` is read as ``colwise_gather_output``; ``replicated_with_grad_allreduce``,
Qwen3's per-head ``q_norm``/``k_norm`` on the local heads, as ``heads_norm``: the weight
replicated, its gradient summed over tp); any other raises ValueError."""

_KINDS = {
    **{k: k for k in HF_STYLES},
    "colwise_rep": "colwise_gather_output",
    "replicated_with_grad_allreduce": "heads_norm",
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
        if kind == "mla_kv_a_proj":
            raise ValueError(
                f"base_model_tp_plan[{fqn!r}] = 'mla_kv_a_proj': multi-head latent attention "
                "(DeepSeek-V3) is not mapped by the default plan (its latent kv projection is "
                "replicated and its kv_a_layernorm sees the whole latent); pass tp_plan= with "
                "a plan for its attention, or use tp=1"
            )
        if kind not in _KINDS:
            raise ValueError(
                f"base_model_tp_plan[{fqn!r}] = {kind!r}: no mapping to a parallel style (the "
                f"default plan maps {', '.join(sorted(_KINDS))}); pass tp_plan= instead"
            )
        regex = r"[^.]+".join(re.escape(part) for part in f"model.{fqn}".split("*"))
        rules.append((re.compile(regex), _KINDS[kind]))
    out: dict[str, str] = {}
    for attr, path in paths.items():
        for rest, _ in layer.get_submodule(attr).named_modules():
            full = f"{path}.{rest}" if rest else path
            for pattern, kind in rules:
                if pattern.fullmatch(full):
                    out[f"{attr}.{rest}" if rest else attr] = _checked(
                        full, kind, layer, attr, rest
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
