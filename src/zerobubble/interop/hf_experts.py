"""Hugging Face MoE experts sharded over an ep group, as our MoE's are: every family whose
experts follow transformers' experts contract.

transformers 5 builds a MoE block's experts as one module of stacked per-expert tensors,
decorated with ``transformers.integrations.moe.use_experts_implementation``, which sets five
layout flags on it (``is_concatenated``, ``is_transposed``, ``has_bias``, ``has_gate``,
``has_post_expert_norm``) and dispatches its forward by ``config._experts_implementation``
(default ``"grouped_mm"``: ``grouped_mm_experts_forward``). The block calls it as
``experts(hidden_states, top_k_index, top_k_weights)`` after its router. That contract
(:func:`is_hf_experts`: the five flags), not a class list, is what
:func:`shard_hf_experts` recognises: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GPT-OSS,
PhiMoE, FlexOlmo, GLM4-MoE and the rest of the ~70 families built so. It replaces each such
module by a :class:`ShardedExperts` holding rank ``r``'s rows ``[r * E / ep, (r + 1) * E /
ep)`` of every per-expert tensor (the ``gate_up_proj`` or ``up_proj`` and ``down_proj``
stacks, and their ``*_bias``) as local parameters of the **same names**, each marked with
:func:`~zerobubble.parallel.shards.mark_expert` as its own run with its rows of the whole
tensor (gradients summed over ``edp``; the norm layout of :mod:`~zerobubble.optim.ep_norms`
counts every row block once, ep rank 0's first: the unsharded tensor cut into its ep row
blocks; the pipeline's state dict and the checkpoints read the rows: :func:`expert_shard`).

The pipeline reaches this module through the layer contract: every layer of the adapter
(:class:`~zerobubble.interop.hf_layers.HFLayer`) has the sharding hook ``shard_experts``,
which calls :func:`shard_layer_experts` on itself.

Its forward is ``grouped_mm_experts_forward`` with our exchange in the middle:

* dispatch: the (token, k) pairs sorted by expert with HF's own ``torch.sort`` of the
  flattened ``top_k_index`` (so each expert sees its rows in HF's order), the rows
  gathered, per-expert counts;
* exchange: counts, then rows, all-to-all to the experts' owners
  (:func:`~zerobubble.parallel.experts.exchange_grouped`); the local experts run on their rows
  of all sources, regrouped expert-major in source-rank order
  (:func:`~zerobubble.parallel.experts.run_grouped`), as **one grouped matmul per projection**
  (:meth:`~zerobubble.runtime.split.grouped.SplitGrouped.grouped_linear`:
  ``torch._grouped_mm`` with the int32 cumulative row counts, the layout per
  ``is_transposed``, ``bias[ids]`` added in place per ``has_bias``), the class's own
  ``_apply_gate`` between them (GPT-OSS's interleaved, clamped gate included) or its
  ``act_fn`` without a gate; the reverse all-to-all brings the outputs back. With
  ``ep == 1`` nothing is sent;
* combine: the post-expert norm (``has_post_expert_norm``; row-wise, so on the source
  rank, its weights dense), each row times its routing weight, HF's inverse permutation and
  its sum over the k picks.

At ``ep == 1`` the module is therefore HF's ``"grouped_mm"`` experts bitwise, forward and
every gradient: the same rows in the same order through the same ops. Against HF's eager
loop (``experts_implementation="eager"``) it agrees within rounding (another kernel, and
another row order per expert). With ``ep > 1`` an expert's matmul sees the rows of every
source, so a replica's result is HF's within rounding, not bitwise.

B/W split: :class:`ShardedExperts` is a :class:`~zerobubble.runtime.split.grouped.SplitGrouped`
module, so the split defers its weight gradients with a kernel-level split of the grouped
matmul (no graph-level split: W does not re-run the forward, whose all-to-alls would be
issued again from W).

Refused (ValueError naming the class, what is missing and the fix): an experts module whose
forward is not the one the decorator dispatches (a subclass overriding it, e.g. Ergo's
per-expert norm), a parameter, buffer or submodule with parameters the contract does not
have, a tensor that is not ``(E, ...)``, an ``ep`` that does not divide ``E``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zerobubble.parallel.ep import ExpertGroup
from zerobubble.parallel.experts import (
    exchange_grouped,
    expert_shard,
    run_grouped,
    unsharded_experts,
)
from zerobubble.parallel.shards import global_view, mark_expert
from zerobubble.runtime.split.grouped import SplitGrouped

if TYPE_CHECKING:
    from zerobubble.parallel.mesh import PipelineMesh
    from zerobubble.pipeline import Pipeline

__all__ = [
    "LAYOUT_FLAGS",
    "ShardedExperts",
    "expert_shard",
    "gather_hf_experts",
    "is_hf_experts",
    "shard_hf_experts",
    "shard_layer_experts",
    "unsharded_experts",
]

#: The layout flags ``use_experts_implementation`` sets on an experts module.
LAYOUT_FLAGS = ("is_concatenated", "is_transposed", "has_bias", "has_gate", "has_post_expert_norm")


def is_hf_experts(module: nn.Module) -> bool:
    """Whether ``module`` carries transformers' experts contract: the five
    :data:`LAYOUT_FLAGS` that ``use_experts_implementation`` sets (a :class:`ShardedExperts`
    does not: it is sharded already)."""
    return not isinstance(module, ShardedExperts) and all(
        isinstance(getattr(module, f, None), bool) for f in LAYOUT_FLAGS
    )


def _refuse(name: str, what: str) -> ValueError:
    return ValueError(
        f"{name} {what}, so ShardedExperts cannot reproduce it; build the mesh with ep=1 "
        "(its experts then stay whole and dp-reduced) or give the family transformers' "
        "experts layout (use_experts_implementation)"
    )


def _tensors(experts: nn.Module, flags: dict[str, bool]) -> list[str]:
    """The per-expert tensors the flags call for, in the order transformers declares them."""
    first = "gate_up_proj" if flags["has_gate"] else "up_proj"
    names = [first, "down_proj"]
    if flags["has_bias"]:
        names += [f"{first}_bias", "down_proj_bias"]
    declared = list(experts._parameters)
    return sorted(names, key=lambda n: declared.index(n) if n in declared else len(declared))


def _checked_layout(experts: nn.Module, ep: ExpertGroup) -> tuple[dict[str, bool], int, list[str]]:
    """The HF experts module's layout flags, expert count and per-expert tensor names, after
    refusing what :class:`ShardedExperts` cannot reproduce (a missing flag, an overridden
    forward, an expert count ``ep`` does not divide, tensors, buffers or submodules the
    layout does not name) with a message that says so."""
    cls = type(experts).__name__
    hf: Any = experts  # HF's attributes, untyped
    flags = {f: getattr(hf, f, None) for f in LAYOUT_FLAGS}
    missing = [f for f, v in flags.items() if not isinstance(v, bool)]
    if missing:
        raise _refuse(cls, f"lacks the layout flags {missing} of transformers' experts")
    layout: dict[str, bool] = {f: bool(v) for f, v in flags.items()}
    forward = getattr(type(experts), "forward", None)
    if getattr(forward, "__wrapped__", None) is None:
        raise _refuse(
            cls,
            "overrides the forward that use_experts_implementation dispatches (its own "
            "math around the experts)",
        )
    num_experts = getattr(hf, "num_experts", None)
    if not isinstance(num_experts, int):
        raise _refuse(cls, "has no integer num_experts (transformers' grouped_mm reads it)")
    if num_experts % ep.size:
        raise ValueError(
            f"ep={ep.size} must divide the HF experts' num_experts={num_experts} "
            f"({cls}); choose ep among the divisors of the expert count"
        )
    names = _tensors(experts, layout)
    own = [n for n, p in experts._parameters.items() if p is not None]
    for n in own:
        if n not in names:
            raise _refuse(cls, f"has the parameter {n!r}, which {layout} does not name")
    for n in names:
        if n not in own:
            raise _refuse(cls, f"has no {n!r}, which {layout} calls for")
        p = experts._parameters[n]
        assert p is not None
        dims = 2 if n.endswith("_bias") else 3
        if p.dim() != dims or p.shape[0] != num_experts:
            raise ValueError(
                f"{cls}.{n} is not a ({num_experts}, {', '.join('.' * (dims - 1))}) tensor: "
                "already sharded, or not HF's layout"
            )
    if experts._buffers:
        raise _refuse(cls, f"has the buffers {sorted(experts._buffers)}")
    norm = experts._modules.get("post_expert_norm")
    if layout["has_post_expert_norm"] and norm is None:
        raise _refuse(cls, "has has_post_expert_norm=True but no post_expert_norm module")
    for n, m in experts._modules.items():
        if m is not None and n != "post_expert_norm" and any(True for _ in m.parameters()):
            raise _refuse(cls, f"has the submodule {n!r} with parameters")
    act_fn = getattr(hf, "act_fn", None)
    if not layout["has_gate"] and not callable(act_fn):
        raise _refuse(cls, "has has_gate=False but no act_fn")
    return layout, num_experts, names


class ShardedExperts(SplitGrouped):
    """A HF experts module's experts ``[r * E / ep, (r + 1) * E / ep)`` (see the module
    docstring); called as the HF module is, ``(hidden_states, top_k_index, top_k_weights)``.

    Args:
        experts: The whole HF experts module (:func:`is_hf_experts`); its per-expert tensors
            are copied (sliced), not shared, and so is its post-expert norm.
        ep: The ep group (``ExpertGroup()``: one rank, every expert).
        run: The :func:`~zerobubble.parallel.ep.mark_expert` run of the first tensor; the
            next ones get ``run + 1``, ... (:attr:`runs` in all).
    """

    def __init__(self, experts: nn.Module, ep: ExpertGroup | None = None, run: int = 0) -> None:
        super().__init__()
        ep = ExpertGroup() if ep is None else ep
        layout, num_experts, names = _checked_layout(experts, ep)
        hf: Any = experts  # HF's attributes, untyped
        act_fn = getattr(hf, "act_fn", None)
        norm = experts._modules.get("post_expert_norm")
        self.num_experts, self.ep, self.runs = num_experts, ep, len(names)
        self.local = num_experts // ep.size
        self.start = ep.rank * self.local
        self.is_transposed, self.has_bias = layout["is_transposed"], layout["has_bias"]
        self.has_gate, self.has_post_expert_norm = (
            layout["has_gate"],
            layout["has_post_expert_norm"],
        )
        self.first = "gate_up_proj" if self.has_gate else "up_proj"
        rows = slice(self.start, self.start + self.local)
        for i, n in enumerate(names):
            whole = experts._parameters[n]
            assert whole is not None
            p = nn.Parameter(whole.detach()[rows].clone(), whole.requires_grad)
            mark_expert(p, run + i, (self.start, self.start + self.local, num_experts))
            self.register_parameter(n, p)
        if isinstance(act_fn, nn.Module):
            self.act_fn = act_fn
        if norm is not None and self.has_post_expert_norm:
            self.post_expert_norm: nn.Module = copy.deepcopy(norm)
        # The class's own gate (``_apply_gate``, GPT-OSS's interleaved clamp among them) on a
        # copy of the module without its tensors: what the gate reads (alpha, limit, act_fn).
        gate = copy.copy(experts)
        gate.__dict__.update(
            _parameters={},
            _buffers={},
            _modules={k: m for k, m in experts._modules.items() if k != "post_expert_norm"},
        )
        self.__dict__["_hf"] = gate  # not a submodule: it holds nothing to train or save

    def extra_repr(self) -> str:
        stop = self.start + self.local
        return f"experts [{self.start}, {stop}) of {self.num_experts}, ep={self.ep.size}"

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        # grouped_mm_experts_forward, op for op, with the exchange around the expert math
        num_top_k = top_k_index.size(-1)
        num_tokens = hidden_states.size(0)
        hidden_dim = hidden_states.size(-1)
        sample_weights = top_k_weights.reshape(-1)
        expert_ids = top_k_index.reshape(-1)
        expert_ids_g, perm = torch.sort(expert_ids)
        rows = hidden_states[perm // num_top_k]
        sample_weights_g = sample_weights[perm]
        counts = torch.bincount(expert_ids_g, minlength=self.num_experts)
        out = exchange_grouped(self._run, rows, counts, self.ep)
        if self.has_post_expert_norm:
            out = self.post_expert_norm(out)
        weighted = out * sample_weights_g.unsqueeze(-1)
        inv_perm = torch.empty_like(perm)
        inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
        weighted = weighted[inv_perm]
        final = weighted.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        return final.to(hidden_states.dtype)

    def _run(self, rows: Tensor, counts: Tensor) -> Tensor:
        """The local experts on the received rows (``counts``: ``(sources, E / ep)``)."""
        return run_grouped(self.local_experts, rows, counts)

    def local_experts(self, x: Tensor, counts: Tensor) -> Tensor:
        """The local experts' math on rows ``x`` grouped by local expert (``counts`` each):
        one grouped matmul per projection, the class's gate or activation between them."""
        offs = counts.cumsum(0, dtype=torch.int32)
        ids = None
        if self.has_bias:
            local = torch.arange(self.local, device=counts.device)
            ids = torch.repeat_interleave(local, counts).to(x.device)
        bias = f"{self.first}_bias" if self.has_bias else None
        h = self.grouped_linear(x, self.first, offs, bias, ids, transposed=self.is_transposed)
        hf: Any = self.__dict__["_hf"]
        h = hf._apply_gate(h) if self.has_gate else hf.act_fn(h)
        bias = "down_proj_bias" if self.has_bias else None
        return self.grouped_linear(h, "down_proj", offs, bias, ids, transposed=self.is_transposed)


def shard_hf_experts(module: nn.Module, ep: ExpertGroup, first_run: int = 0) -> int:
    """Replace every HF experts module in ``module`` (:func:`is_hf_experts`) by a
    :class:`ShardedExperts` over ``ep``; returns how many. Their tensors get the runs
    ``first_run``, ``first_run + 1``, ... in module order. A module the contract names but
    :class:`ShardedExperts` cannot reproduce is refused (ValueError naming it)."""
    return _shard(module, ep, first_run, str)[0]


def shard_layer_experts(
    module: nn.Module, ep: ExpertGroup, first_run: int, name: Callable[[str], str] = str
) -> int:
    """:func:`shard_hf_experts` as the layer contract's sharding hook
    (:class:`~zerobubble.parallel.experts.ShardsExperts`) does it: returns the runs used, and
    a refusal names the module by ``name(its name in module)``, e.g. the model's name."""
    return _shard(module, ep, first_run, name)[1]


def _shard(
    module: nn.Module, ep: ExpertGroup, first_run: int, name_of: Callable[[str], str]
) -> tuple[int, int]:
    """Shard ``module``'s HF experts modules: how many, and the runs they used."""
    found = [(name, m) for name, m in module.named_modules() if is_hf_experts(m)]
    run = first_run
    for name, m in found:
        if not name:
            raise ValueError("shard_hf_experts: pass the module holding the experts module")
        try:
            sharded = ShardedExperts(m, ep, run)
        except ValueError as e:
            raise ValueError(f"{name_of(name)}: {e}") from None
        run += sharded.runs
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, sharded)
    return len(found), run - first_run


def gather_hf_experts(pipe: Pipeline, mesh: PipelineMesh) -> OrderedDict[str, Tensor]:
    """``pipe.state_dict()`` with every sharded HF experts tensor whole again, ``(E, ...)``:
    the ep ranks' row blocks concatenated in ep-rank order, so the entries are HF's own
    (``model.load_state_dict`` takes them). A collective over ``mesh.ep_group`` (every ep
    peer holds the same stages, so the same sharded names, in the same order)."""
    state = pipe.state_dict()
    if mesh.ep_mesh is None:
        return state
    params = dict(pipe.named_parameters())
    for name, value in state.items():
        if name in params and expert_shard(params[name]) is not None:
            whole = global_view(value, mesh.ep_mesh["ep"], like=params[name], name=repr(name))
            state[name] = cast(DTensor, whole).full_tensor()
    return state
