"""FSDP2 on stage chunks: parameters, gradients and optimizer state sharded over ``dp``.

Each of this rank's stage chunks is wrapped with
:func:`torch.distributed.fsdp.fully_shard` over the mesh's ``dp`` dimension
(after the B/W split swapped its layers, so FSDP manages the split layers'
parameters). FSDP's own hooks still fire inside autograd, but they are told
never to reduce or reshard (``set_requires_gradient_sync(False)``,
``set_reshard_after_backward(False)``, ``reshard_after_forward=False``): the
split's W runs outside autograd's backward, after FSDP's post-backward hooks
would have reduced an incomplete gradient. Instead two instructions that
:func:`~zerobubble.program.passes.sharding.insert_sharding` places in the rank's
program drive FSDP explicitly:

* ``unshard(s)`` before stage ``s``'s first F of the step: FSDP's ``unshard()``
  all-gathers the parameters; the chunk's split layers and B then see the
  gathered parameters (and W adds its weight gradients to their ``.grad``).
* ``reduce_scatter(s)`` after its last W (or BW): FSDP's post-backward of each
  parameter group, with gradient sync and resharding switched on for that one
  call, reduce-scatters the gathered gradients (a plain sum: the loss is
  normalised over the global batch) into the sharded parameters' DTensor
  ``.grad`` and frees the gathered parameters.

Reshard policy: gathered from the first F to the last W of the step. Zero-bubble
schedules run W late, so resharding between F and B would gather every
parameter up to three times a step; the price is one gathered copy per stage
during the step. Between steps only the shards are held, and the optimizer
(built over :meth:`~zerobubble.pipeline.Pipeline.parameters`, the sharded
DTensors) keeps sharded state.

Parameters tied across stages (:mod:`~zerobubble.parallel.tied`): each holder stage's
replica is sharded alike (one shape, the one dp mesh, ``Shard(0)``), so the tie's
reduction adds the holder stages' reduce-scattered local shards elementwise, at the
iteration's tail after every ``reduce_scatter``: each shard of a sum is the sum of the
shards, exact. Where one rank holds two replicas (a V placement), FSDP would give each its
own sharded copy; :meth:`ShardedStages.share_replicas` points the later replicas' shards at
the first one's memory again, so the optimizer, which steps only the first, steps them all.

The gradient norm spans dp x pp: :meth:`ShardedStages.combine_norms` turns the
norms of the local shards into the norm of each whole gradient (an all-reduce of
``|shard|^p`` over dp), which then enters the pipeline's norm vector like any
other.

With tensor parallelism (a ``("pp", "dp", "tp")`` mesh) the stages' parameters are
tp DTensors already (the "tp" transform step runs first); FSDP2 shards them over the dp
dim of the same root mesh into ``("dp", "tp")`` DTensors, and reduces a gradient over
tp to its tp layout before the reduce-scatter over dp. A combined norm is then this tp
rank's part, which the trainer marks partial over tp where the gradient is tp-sharded
(:meth:`~zerobubble.optim.norms.ParamLayout.fill`).

With expert parallelism (``ep > 1``) the experts are nested as torchtitan nests them: each
stage's expert modules (the largest submodules whose parameters are all expert shards,
:func:`~zerobubble.parallel.shards.is_expert`: our ``MoE``'s ``experts``, a Hugging Face
``ShardedExperts``) are ``fully_shard``ed first over the ``edp`` mesh (the replicas holding
the same experts, ``dp / ep`` ranks; their gradients are summed there), then the layers and
the stage over ``dp`` without them. With ``edp == 1`` the experts stay plain tensors (FSDP
ignores them): no other rank holds them, so their gradients need no reduction. The sharded
expert parameters keep their shard record (FSDP makes new parameter objects), and
:meth:`ShardedStages.combine_norms` combines an expert shard's norm over ``edp``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from zerobubble.parallel.shards import expert_shard_of, is_expert, mark_expert
from zerobubble.parallel.tied import TiedParam
from zerobubble.program.instructions import ShardAction, ShardOp
from zerobubble.runtime.p2p.comm import P2P, RankName, plain_name, set_timeout
from zerobubble.runtime.stage import StageChunk

__all__ = ["ShardedStages"]


class ShardedStages:
    """This rank's stage chunks, sharded with FSDP2 over a 1-D ``dp`` mesh.

    Args:
        chunks: ``stage -> StageChunk`` of this rank (their modules are wrapped in place).
        dp_mesh: The data-parallel dimension of the job's mesh (``mesh.mesh["dp"]``).
        device: Where the stages live (default: CPU); the norm all-reduce runs there.
        timeout_s: Bound on every collective over dp: the norm all-reduce's wait, and
            FSDP's own all-gathers and reduce-scatters, which run inside torch, through the
            dp group's transport timeout (set to it here).
        name: How a message names a rank that never arrived (its mesh coordinates).
        expert_mesh: With expert parallelism, the 1-D ``edp`` mesh (``mesh.ep_mesh["edp"]``:
            the replicas holding this rank's experts) the expert modules are sharded over
            (of size 1: left unsharded); None without ep (nothing is treated as experts).

    Attributes:
        modules: ``stage -> FSDPModule`` (the chunks' modules).
        units: ``stage -> FSDPModule`` of each expert module (sharded over ``edp``), each
            layer holding other parameters, then the stage.
        dp_mesh: The dp mesh (whose dim leads the sharded parameters' meshes).
        dp_size: Replicas sharing each parameter.
        expert_mesh: The edp mesh where it shards the experts (None: no expert is sharded).
    """

    def __init__(
        self,
        chunks: Mapping[int, StageChunk],
        dp_mesh: DeviceMesh,
        *,
        device: torch.device | str | None = None,
        timeout_s: float = 60.0,
        name: RankName = plain_name,
        expert_mesh: DeviceMesh | None = None,
    ) -> None:
        if dp_mesh.ndim != 1:
            raise ValueError(
                f"FSDP shards over one mesh dimension, got a {dp_mesh.ndim}-D mesh "
                f"{dp_mesh.mesh_dim_names}: pass mesh.mesh['dp']"
            )
        self.chunks = dict(chunks)
        self.dp_mesh = dp_mesh
        self.dp_size = dp_mesh.size()
        self.expert_mesh = (
            expert_mesh if expert_mesh is not None and expert_mesh.size() > 1 else None
        )
        self.modules: dict[int, FSDPModule] = {}
        self.units: dict[int, list[FSDPModule]] = {}
        for s, chunk in sorted(self.chunks.items()):
            if not any(p.requires_grad for p in chunk.module.parameters()):
                raise ValueError(
                    f"stage {s} has no trainable parameters: there is nothing for FSDP to "
                    "shard; leave fsdp off or give the stage parameters"
                )
            experts = [] if expert_mesh is None else _expert_modules(s, chunk.module)
            # The experts first, over edp (or left out: edp == 1), as torchtitan nests them;
            # then one unit per layer and the stage (whatever parameters remain) over dp:
            # the gather and reduce-scatter buffers are a layer's, not the stage's.
            edp_mesh = self.expert_mesh
            units = [] if edp_mesh is None else [self._wrap(m, edp_mesh) for m in experts]
            ignored = None
            if experts and edp_mesh is None:
                ignored = {p for m in experts for p in m.parameters()}
            layers = [
                c
                for c in chunk.module.children()
                if all(c is not m for m in experts) and any(True for _ in c.parameters())
            ]
            units += [self._wrap(c, dp_mesh, ignored) for c in layers]
            self.modules[s] = self._wrap(chunk.module, dp_mesh, ignored)
            self.units[s] = [*units, self.modules[s]]
        group = dp_mesh.get_group()
        self.device = torch.device(device or "cpu")
        self.timeout_s = timeout_s
        self._p2p = P2P(group, self.device, timeout_s, dim="dp", name=name)
        set_timeout(group, timedelta(seconds=timeout_s))
        self._expert_p2p = None
        if self.expert_mesh is not None:
            edp = self.expert_mesh.get_group()
            self._expert_p2p = P2P(edp, self.device, timeout_s, dim="edp", name=name)
            set_timeout(edp, timedelta(seconds=timeout_s))

    def share_replicas(self, ties: Sequence[TiedParam]) -> None:
        """Give the replicas of each tie on this rank's stages one sharded memory: the
        later stages' FSDP parameters read (all-gather) and hold the first stage's padded
        shard, as :func:`~zerobubble.parallel.tied.tie_local_replicas` shares whole tensors.

        Every replica is sharded alike (one shape, mesh and placement), so the padded
        shards have one size; FSDP's lazy initialisation keeps a shard whose storage is
        already its own (``reset_sharded_param``), so the sharing survives it.
        """
        for tie in ties:
            here = [s for s in tie.stages if s in self.chunks]
            if len(here) < 2:
                continue
            first = self._fsdp_param(here[0], tie.local[here[0]][0])
            for s in here[1:]:
                later = self._fsdp_param(s, tie.local[s][0])
                if later.padded_sharded_param_size != first.padded_sharded_param_size:
                    raise ValueError(
                        f"tied parameter {tie.name!r}: FSDP shards stage {here[0]}'s replica "
                        f"to {tuple(first.padded_sharded_param_size)} but stage {s}'s to "
                        f"{tuple(later.padded_sharded_param_size)}; every replica of a tie "
                        "must have one shape and layout"
                    )
                later._sharded_param_data = first._sharded_param_data
                later.sharded_param._local_tensor = first.sharded_param._local_tensor

    def _fsdp_param(self, stage: int, name: str) -> Any:
        """FSDP's record of stage ``stage``'s sharded parameter ``name``."""
        param = self.chunks[stage].module.get_parameter(name)
        for m in self.units[stage]:
            for group in m._get_fsdp_state()._fsdp_param_groups:
                for fp in group.fsdp_params:
                    if fp.sharded_param is param:
                        return fp
        raise ValueError(f"stage {stage}: FSDP does not manage parameter {name!r}")

    @staticmethod
    def _wrap(
        module: nn.Module, mesh: DeviceMesh, ignored: set[nn.Parameter] | None = None
    ) -> FSDPModule:
        # A container without a forward (our MoE's ModuleDict of experts) is one unit of
        # its children: FSDP takes a list of modules as one parameter group.
        container = type(module).forward is nn.Module.forward
        parts = [c for c in module.children() if any(True for _ in c.parameters())]
        marks = {n: expert_shard_of(p) for n, p in module.named_parameters()}
        if container:
            fully_shard(parts, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
            m = cast(FSDPModule, parts[0])
        else:
            m = fully_shard(module, mesh=mesh, reshard_after_forward=False, ignored_params=ignored)
        for n, p in module.named_parameters():  # FSDP made new parameter objects
            shard = marks.get(n)
            if shard is not None and not is_expert(p):
                mark_expert(p, shard.run, shard.rows)
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
        m.set_gradient_divide_factor(1.0)  # a sum: the loss is normalised globally
        m.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        return m

    @property
    def meshes(self) -> tuple[DeviceMesh, ...]:
        """The meshes it shards parameters over: dp, and the experts' edp if it shards them."""
        return (self.dp_mesh,) if self.expert_mesh is None else (self.dp_mesh, self.expert_mesh)

    def run(self, action: ShardAction) -> None:
        """Carry out one instruction of
        :func:`~zerobubble.program.passes.sharding.insert_sharding`."""
        p2p = self._p2p
        with p2p.arrivals.watch(
            p2p.group,
            lambda: f"{action} (FSDP's collectives over dim 'dp')",
            timeout_s=self.timeout_s,
        ):
            self._run(action)

    def _run(self, action: ShardAction) -> None:
        units, chunk = self.units[action.stage], self.chunks[action.stage]
        if action.op is ShardOp.UNSHARD:
            for m in units:
                m.unshard()
        else:
            for m in reversed(units):  # backward order, as FSDP's own post-backward runs
                for group in m._get_fsdp_state()._fsdp_param_groups:
                    group.reduce_grads = group.reshard_after_backward = True
                    try:
                        group.post_backward()
                        group.finalize_backward()
                    finally:
                        group.reduce_grads = group.reshard_after_backward = False
            # Release the reduce-scatter inputs FSDP keeps for overlap (its root's
            # end-of-backward callback does the same); the reduction has completed.
            ctx = self.modules[action.stage]._get_fsdp_state()._comm_ctx
            for rs in ctx.reduce_scatter_states:
                if rs.event is not None:
                    torch.accelerator.current_stream().wait_event(rs.event)
            ctx.reduce_scatter_states.clear()
        chunk.refresh_parameters()

    def combine_norms(
        self, local: Sequence[Tensor], norm_type: float, grads: Sequence[Tensor] = ()
    ) -> list[Tensor]:
        """The norms of whole gradients from the norms of this replica's shards (collective
        over dp: every replica passes its shards' norms of the same parameters).

        With ``grads`` (the gradients ``local`` are the norms of, in order) an expert
        gradient's norm is combined over the replicas holding its expert instead (``edp``,
        collective there), and a plain one (an expert FSDP left unsharded) is whole already.
        """
        if not local:
            return []
        where = [self._dim_of(g) for g in grads] if grads else ["dp"] * len(local)
        out = list(local)
        for dim, p2p in (("dp", self._p2p), ("edp", self._expert_p2p)):
            index = [i for i, d in enumerate(where) if d == dim]
            if index:
                assert p2p is not None  # an edp-sharded gradient exists only with its mesh
                combined = _combine(p2p, [local[i] for i in index], norm_type, dim)
                for i, n in zip(index, combined, strict=True):
                    out[i] = n
        return out

    def _dim_of(self, grad: Tensor) -> str | None:
        """Where a gradient's shards lie: "dp", "edp", or None (a whole tensor)."""
        if not isinstance(grad, DTensor):
            return None
        if self.expert_mesh is not None and grad.device_mesh == self.expert_mesh:
            return "edp"
        return "dp"


def _combine(p2p: P2P, local: Sequence[Tensor], norm_type: float, dim: str) -> list[Tensor]:
    """The norms over ``p2p``'s group of the shards whose norms are ``local``."""
    t = torch.stack([n.detach().to(p2p.device, torch.float64) for n in local])
    p = float(norm_type)
    if math.isinf(p):  # max (or min) over the replicas: gathered and reduced here, exact
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(p2p.group))]
        what = f"all-gather of the gradient-shard norms over {dim}"
        work = dist.all_gather(parts, t, group=p2p.group, async_op=True)
        assert work is not None
        p2p.wait_collective(work, what)
        both = torch.stack(parts)
        return list((both.amax(0) if p > 0 else both.amin(0)).unbind())
    if p != 0:  # the 0-"norm" counts non-zeros: the counts add up
        t = t.pow(p)
    p2p.all_reduce(t, f"all-reduce of the gradient-shard norms over {dim}")
    return list((t.pow(1.0 / p) if p != 0 else t).unbind())


def _expert_modules(stage: int, module: nn.Module) -> list[nn.Module]:
    """The largest submodules of ``module`` whose parameters are all expert shards, in
    module order; refuses an expert parameter that no such module holds (FSDP shards a
    module's parameters together, and experts shard over another group than the rest)."""
    found: list[nn.Module] = []
    inside: set[str] = set()
    for name, m in module.named_modules():
        if any(name == f or name.startswith(f + ".") for f in inside if f):
            continue
        params = list(m.parameters())
        if params and all(is_expert(p) for p in params):
            if type(m).forward is nn.Module.forward and any(
                True for _ in m.parameters(recurse=False)
            ):
                raise ValueError(
                    f"stage {stage}: the experts container {name!r} "
                    f"({type(m).__name__}) holds parameters of its own and has no forward, "
                    "which FSDP cannot shard as a unit: keep the experts' parameters in "
                    "modules with a forward, or leave fsdp off"
                )
            found.append(m)
            inside.add(name)
            if not name:
                raise ValueError(
                    f"stage {stage} holds nothing but expert parameters: FSDP over dp would "
                    "have no stage unit; put a dense layer in the stage or leave fsdp off"
                )
    held = {id(p) for m in found for p in m.parameters()}
    for name, p in module.named_parameters():
        if is_expert(p) and id(p) not in held:
            raise ValueError(
                f"stage {stage}: expert parameter {name!r} shares its module with parameters "
                "that are not experts, so FSDP cannot shard it over the experts' edp group "
                "apart from them: keep a MoE layer's experts in a submodule of their own "
                "(as MoE.experts and transformers' experts modules are), or leave fsdp off"
            )
    return found
