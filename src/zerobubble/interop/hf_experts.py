"""Hugging Face MoE experts (Mixtral, Qwen3-MoE) sharded over an ep group, as our MoE's are.

transformers 5 keeps a MoE block's experts in one module (``MixtralExperts``,
``Qwen3MoeExperts``) of two 3-D parameters, ``gate_up_proj`` ``(E, 2I, H)`` and
``down_proj`` ``(E, H, I)``, called as ``experts(hidden_states, top_k_index,
top_k_weights)`` by the block after its router. :func:`shard_hf_experts` replaces each
such module by a :class:`ShardedExperts` holding rank ``r``'s experts
``[r * E / ep, (r + 1) * E / ep)`` as local 3-D parameters of the **same names**
(``gate_up_proj`` ``(E / ep, 2I, H)``, ``down_proj`` ``(E / ep, H, I)``), marked with
:func:`~zerobubble.runtime.ep.mark_expert` (gradients summed over ``edp``; each tensor
its own run, so the norm layout of :mod:`~zerobubble.optim.ep_norms` counts every
row block once, ep rank 0's first: the unsharded tensor cut into its ep row blocks).

Its forward is our MoE's three phases with HF's per-expert math:

* dispatch: the (token, k) pairs sorted by expert, stable over HF's own visiting order
  (k position major, then token: ``torch.where(expert_mask[e])`` on the ``(k, N)``
  mask), so each expert sees its rows in HF's order; per-expert counts;
* exchange: counts, then rows, all-to-all to the experts' owners
  (:func:`~zerobubble.runtime.ep.exchange_counts`, :func:`~zerobubble.runtime.ep.all_to_all`,
  whose backward runs on :attr:`~zerobubble.runtime.ep.ExpertGroup.backward_group`);
  each local expert runs once on its rows of all sources concatenated in source-rank
  order (:func:`~zerobubble.models.moe.run_experts`) with HF's math
  ``linear(act(gate) * up, down_proj[e])``, ``gate, up = linear(x, gate_up_proj[e]).chunk(2)``;
  the reverse all-to-all brings the outputs back. With ``ep == 1`` nothing is sent;
* combine: each row times its routing weight, then one ``index_add_`` per hit expert in
  ascending expert order into zeros: HF's loop, op for op.

At ``ep == 1`` the module is therefore HF's eager experts (``experts_implementation=
"eager"``) bitwise, forward and every gradient: the same rows in the same order through
the same ops. transformers' default on this version, ``"grouped_mm"``, gives the same
forward bitwise and weight gradients within rounding (another backward kernel). With
``ep > 1`` an expert's matmuls see the rows of every source, so a replica's result is
HF's within rounding, not bitwise.

Only HF's eager expert math is reproduced: whatever ``config._experts_implementation``
says, a sharded block runs it. Expert modules of another layout (transposed, interleaved
gate/up, biases, a post-expert norm: the flags of HF's ``use_experts_implementation``)
are refused with a ValueError.
"""

from __future__ import annotations

import importlib
import sys
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from zerobubble.models.moe import dispatch_order, exchange_rows
from zerobubble.runtime.ep import ExpertGroup, mark_expert

if TYPE_CHECKING:
    from zerobubble.pipeline import Pipeline
    from zerobubble.runtime.mesh import PipelineMesh

__all__ = [
    "HF_EXPERT_CLASSES",
    "ShardedExperts",
    "expert_shard",
    "gather_hf_experts",
    "hf_expert_classes",
    "shard_hf_experts",
]

#: The HF expert modules :func:`shard_hf_experts` recognises (module, class name).
HF_EXPERT_CLASSES = (
    ("transformers.models.mixtral.modeling_mixtral", "MixtralExperts"),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeExperts"),
)

_SHARD_ATTR = "_zb_hf_expert_shard"


def hf_expert_classes() -> tuple[type[nn.Module], ...]:
    """The classes of :data:`HF_EXPERT_CLASSES` that import; none while ``transformers`` is
    not imported (a model holding HF modules has imported it: nothing else needs it)."""
    found: list[type[nn.Module]] = []
    if "transformers" not in sys.modules:
        return ()
    for module, name in HF_EXPERT_CLASSES:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def expert_shard(param: Tensor) -> tuple[int, int, int] | None:
    """``(start, stop, num_experts)``: the rows of the whole ``(E, ...)`` HF tensor that
    ``param`` (a :class:`ShardedExperts` parameter) holds; None for any other tensor."""
    shard = getattr(param, _SHARD_ATTR, None)
    return None if shard is None else (int(shard[0]), int(shard[1]), int(shard[2]))


class ShardedExperts(nn.Module):
    """A HF experts module's experts ``[r * E / ep, (r + 1) * E / ep)`` (see the module
    docstring); called as the HF module is, ``(hidden_states, top_k_index, top_k_weights)``.

    Args:
        experts: The whole HF experts module (``gate_up_proj``, ``down_proj``, ``act_fn``,
            ``num_experts``); its parameters are copied (sliced), not shared.
        ep: The ep group (``ExpertGroup()``: one rank, every expert).
        run: The :func:`~zerobubble.runtime.ep.mark_expert` run of ``gate_up_proj``;
            ``down_proj`` gets ``run + 1``.
    """

    act_fn: nn.Module

    def __init__(self, experts: nn.Module, ep: ExpertGroup, run: int = 0) -> None:
        super().__init__()
        hf: Any = experts  # HF's attributes, untyped
        num_experts = int(hf.num_experts)
        if num_experts % ep.size:
            raise ValueError(
                f"ep={ep.size} must divide the HF experts' num_experts={num_experts} "
                f"({type(experts).__name__}); choose ep among the divisors of the expert count"
            )
        layout = {
            "is_transposed": False,
            "is_concatenated": True,
            "has_bias": False,
            "has_gate": True,
            "has_post_expert_norm": False,
        }
        other = {k: getattr(hf, k) for k, v in layout.items() if getattr(hf, k, v) != v}
        if other:
            raise ValueError(
                f"{type(experts).__name__} has {other}: ShardedExperts reproduces HF's "
                f"concatenated [gate; up] layout without bias or post norm only ({layout})"
            )
        gate_up, down = hf.gate_up_proj, hf.down_proj
        for name, p in (("gate_up_proj", gate_up), ("down_proj", down)):
            if not isinstance(p, Tensor) or p.dim() != 3 or p.shape[0] != num_experts:
                raise ValueError(
                    f"{type(experts).__name__}.{name} is not a ({num_experts}, ., .) tensor: "
                    "already sharded, or not HF's layout"
                )
        self.num_experts, self.ep = num_experts, ep
        self.local = num_experts // ep.size
        self.start = ep.rank * self.local
        rows = slice(self.start, self.start + self.local)
        self.gate_up_proj = nn.Parameter(gate_up.detach()[rows].clone(), gate_up.requires_grad)
        self.down_proj = nn.Parameter(down.detach()[rows].clone(), down.requires_grad)
        self.act_fn = hf.act_fn
        for i, p in enumerate((self.gate_up_proj, self.down_proj)):
            mark_expert(p, run + i)
            setattr(p, _SHARD_ATTR, (self.start, self.start + self.local, num_experts))

    def extra_repr(self) -> str:
        stop = self.start + self.local
        return f"experts [{self.start}, {stop}) of {self.num_experts}, ep={self.ep.size}"

    def expert(self, local: int, x: Tensor) -> Tensor:
        """HF's math for local expert ``local`` on rows ``x``."""
        gate, up = F.linear(x, self.gate_up_proj[local]).chunk(2, dim=-1)
        return F.linear(self.act_fn(gate) * up, self.down_proj[local])

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        n = top_k_index.shape[0]
        # HF visits expert e's pairs k-position major, then token: sort the (k, N) layout.
        order, _, counts = dispatch_order(top_k_index.t(), self.num_experts)
        token, position = order % n, order // n
        out = self.exchange(hidden_states[token], counts)
        out = out * top_k_weights[token, position, None]
        final = torch.zeros_like(hidden_states)
        start = 0
        for c in counts.tolist():  # HF's loop: one index_add_ per hit expert, in order
            if c:
                stop = start + c
                final.index_add_(0, token[start:stop], out[start:stop].to(final.dtype))
                start = stop
        return final

    def exchange(self, rows: Tensor, counts: Tensor) -> Tensor:
        """Outputs of the rows' experts, in the rows' order (communicating over ep)."""
        experts = [(lambda x, i=i: self.expert(i, x)) for i in range(self.local)]
        return exchange_rows(experts, rows, counts, self.ep)


def shard_hf_experts(module: nn.Module, ep: ExpertGroup, first_run: int = 0) -> int:
    """Replace every HF experts module in ``module`` (:data:`HF_EXPERT_CLASSES`) by a
    :class:`ShardedExperts` over ``ep``; returns how many. Layer ``i``'s tensors get the
    runs ``first_run + 2i`` and ``first_run + 2i + 1``."""
    classes = hf_expert_classes()
    if not classes:
        return 0
    found = [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(m, classes) and not isinstance(m, ShardedExperts)
    ]
    for i, (name, m) in enumerate(found):
        if not name:
            raise ValueError("shard_hf_experts: pass the module holding the experts module")
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, ShardedExperts(m, ep, first_run + 2 * i))
    return len(found)


def gather_hf_experts(pipe: Pipeline, mesh: PipelineMesh) -> OrderedDict[str, Tensor]:
    """``pipe.state_dict()`` with every sharded HF experts tensor whole again, ``(E, ...)``:
    the ep ranks' row blocks concatenated in ep-rank order, so the entries are HF's own
    (``model.load_state_dict`` takes them). A collective over ``mesh.ep_group`` (every ep
    peer holds the same stages, so the same sharded names, in the same order)."""
    state = pipe.state_dict()
    if mesh.ep_group is None:
        return state
    shards = {n: expert_shard(p) for n, p in pipe.named_parameters()}
    for name, value in state.items():
        if shards.get(name) is None:
            continue
        blocks = [torch.empty_like(value) for _ in range(mesh.ep_size)]
        dist.all_gather(blocks, value.contiguous(), group=mesh.ep_group)
        state[name] = torch.cat(blocks)
    return state
