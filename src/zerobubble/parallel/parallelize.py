"""The model-facing steps of the transform list, built once from the mesh: tp, then ep.

A stage module meets the parallel dimensions that change its parameters here, before the
pipeline's own steps (split, recompute, compile, FSDP: :mod:`~zerobubble.parallel.transforms`).
Each dimension is one step object, built from the mesh by :meth:`Parallelize.from_mesh`:

1. **tp** (:class:`TensorParallel`): the layers' ``tp_kinds`` (or a plan) turn their
   parameters into DTensors over the mesh's ``tp`` dim; with the default plans the loss
   stage's LM head leaves its logits sharded over the vocabulary where the loss takes them
   (loss parallel, :class:`~zerobubble.parallel.loss.LossParallel`);
2. **ep** (:class:`ExpertParallel`): every module's sharding hook ``shard_experts`` keeps this
   rank's experts of its ep group (:func:`~zerobubble.parallel.experts.shard_all_experts`);
3. **cp** (:class:`ContextParallel`): every context-aware module gets its cp rank's slot
   (:func:`~zerobubble.runtime.sequence.cp.context_parallel`: the chunk layout and the
   mesh's cp group), after a user's function too; a stage with an attention layer that is
   not context-aware is refused.

A user's ``parallelize_fn(stage, module, mesh) -> module`` replaces both steps for every
stage (as torchtitan's ``parallelize_fn`` does for a model part); what it returns is the
stage. The checks that keep a dimension from running silently as another (``ep > 1`` with
experts nobody sharded) run after either. A new dimension (context parallel, expert-tensor
parallel) is one more step class here and one more mesh dim.

A :class:`Parallelize` remembers what it returned per stage, so the executors a pipeline
makes for several schedules over the same stages (``Pipeline.with_schedule``) parallelize
each stage once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerobubble.parallel.ep import ExpertGroup, is_expert
from zerobubble.parallel.experts import shard_all_experts, unsharded_experts
from zerobubble.parallel.loss import LossParallel
from zerobubble.parallel.tied import TiedParam, tie_local_replicas
from zerobubble.parallel.tp import ShardedLogits, TPPlan, default_plan, parallelize_stage
from zerobubble.runtime.sequence.cp import ContextShards, ProcessExchange, context_parallel

if TYPE_CHECKING:
    from zerobubble.parallel.mesh import PipelineMesh

__all__ = [
    "ContextParallel",
    "ExpertParallel",
    "Parallelize",
    "ParallelizeFn",
    "StageNamer",
    "StagePlan",
    "TensorParallel",
]

StagePlan = TPPlan | Callable[[int, nn.Module], TPPlan] | None
"""A tensor-parallel plan for every stage (its submodule names are relative to the stage
module), a function ``(stage, stage module) -> plan``, or None: the default plan of each
stage module (:func:`~zerobubble.parallel.tp.parallelize_stage`)."""

ParallelizeFn = Callable[[int, nn.Module, "PipelineMesh"], nn.Module]
"""A user's ``(stage, module, mesh) -> module``: the stage parallelized by hand, replacing
the tp and ep steps (the pipeline's own split, recompute, compile and FSDP still follow)."""

StageNamer = Callable[[int, str, nn.Module], str]
"""``(stage, submodule name in the stage, stage module) -> the name a user knows``: how a
refusal names a submodule (the model's own names where the caller knows them)."""


def _stage_name(stage: int, name: str, module: nn.Module) -> str:
    return name


@dataclass(frozen=True)
class TensorParallel:
    """The "tp" step: which mesh, which plan."""

    mesh: DeviceMesh
    """The 1-D ``tp`` mesh (:attr:`~zerobubble.parallel.mesh.PipelineMesh.tp_mesh`)."""
    plan: StagePlan = None
    sequence_parallel: bool = False
    loss: LossParallel | None = None
    """Where the loss meets the logits (None: gathered); a plan of the user's says it
    itself, so ``loss_parallel=True`` is refused with one."""
    lanes: Mapping[int, DeviceMesh] = field(default_factory=dict)
    """A stage's own tp lane (:meth:`~zerobubble.parallel.mesh.PipelineMesh.with_tp_lanes`)
    where it is not :attr:`mesh`: under overlapped F&B pairs each stage of a rank has one."""

    def mesh_of(self, stage: int) -> DeviceMesh:
        """The tp mesh stage ``stage`` is parallelized over (its lane)."""
        return self.lanes.get(stage, self.mesh)

    def __post_init__(self) -> None:
        if self.loss is not None and self.loss.option and self.plan is not None:
            raise ValueError(
                "loss_parallel=True with tp_plan=: the plan says where the logits are (for loss "
                "parallel, the LM head ColwiseParallel(output_layouts=Shard(-1), "
                "use_local_output=False), as zerobubble.parallel.tp.ShardedLogits); leave "
                "loss_parallel at None"
            )

    def apply(self, stage: int, module: nn.Module) -> None:
        """Parallelize ``module`` (stage ``stage``) in place, unless it is already: a module
        with a DTensor parameter keeps its layout (its caller parallelized it)."""
        if any(isinstance(p, DTensor) for p in module.parameters()):
            return
        plan = self.plan(stage, module) if callable(self.plan) else self.plan
        if plan is None:
            plan = self.default(stage, module)
        parallelize_stage(
            module, self.mesh_of(stage), plan, stage=stage, sequence_parallel=self.sequence_parallel
        )

    def default(self, stage: int, module: nn.Module) -> TPPlan:
        """Stage ``stage``'s default plan, its LM head's logits sharded where :attr:`loss`
        says so; ValueError where ``loss_parallel=True`` and its last layer cannot."""
        sharded = self.loss is not None and self.loss.sharded(stage)
        plan = default_plan(
            module,
            self.mesh.size(),
            stage=stage,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=sharded,
        )
        required = sharded and self.loss is not None and self.loss.option
        if required and not any(isinstance(style, ShardedLogits) for style in plan.values()):
            name, last = list(module.named_children())[-1]
            raise ValueError(
                f"stage {stage}: loss_parallel=True, but its last layer {name} "
                f"({type(last).__name__}) does not leave the logits sharded over the "
                "vocabulary (an nn.Linear head does; a layer's tp_kinds gives its head "
                "layout.lm_head()). Fix: leave loss_parallel at None (the logits are then "
                "gathered) or False"
            )
        return plan


@dataclass(frozen=True)
class ExpertParallel:
    """The "ep" step: each stage's experts sharded over the rank's ep group, checked over the
    pipeline (a collective of its ``group``): ``ep > 1`` never runs as plain data
    parallelism."""

    experts: ExpertGroup
    group: dist.ProcessGroup | None
    """The pipeline's group: every rank of it takes part in the check."""
    name: StageNamer = _stage_name

    def shard(self, stages: Mapping[int, nn.Module]) -> None:
        """Shard every stage's experts (each module's hook, in module order), then
        :meth:`check`."""
        problems: list[str] = []
        sharded: dict[int, nn.Module] = {}
        for s, m in sorted(stages.items()):
            try:
                shard_all_experts(m, self.experts)
            except ValueError as e:
                problems.append(f"stage {s}: {e}")
                continue
            sharded[s] = m
        self.check(sharded, problems)

    def check(self, stages: Mapping[int, nn.Module], problems: list[str] | None = None) -> None:
        """Refuse, on every rank of the pipeline, a stage whose experts nothing sharded
        (named with its stage and its model name) and a pipeline with no experts at all
        (``problems``: what went wrong before, reported with them)."""
        problems = list(problems or [])
        for s, m in sorted(stages.items()):
            for name, left in unsharded_experts(m):
                problems.append(
                    f"stage {s}: {self.name(s, name, m)} ({type(left).__name__}) holds "
                    "experts in neither our MoE's nor transformers' experts layout "
                    "(use_experts_implementation), so ep cannot shard them; build the mesh with "
                    "ep=1 (experts then stay whole, their gradients dp-reduced) or shard them by "
                    "hand (a layer's sharding hook shard_experts: docs/layer-contract.md)"
                )
        held = sum(is_expert(p) for m in stages.values() for p in m.parameters())
        found: list[tuple[list[str], int] | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(found, (problems, held), group=self.group)
        everyone = [p for f in found if f is not None for p in f[0]]
        if everyone:
            raise ValueError(f"ep={self.experts.size}: " + "; ".join(everyone))
        if not sum(f[1] for f in found if f is not None):
            raise ValueError(
                f"ep={self.experts.size} but no stage of the model holds experts to shard (our "
                "MoE layers or transformers' experts modules): expert parallelism would run as "
                "plain data parallelism. Fix: build the mesh with ep=1"
            )


@dataclass
class Parallelize:
    """The model-facing steps for every stage of a rank, in order (see the module docstring).

    Build it with :meth:`from_mesh`; :meth:`apply` is idempotent per stage.
    """

    mesh: PipelineMesh | None = None
    tp: TensorParallel | None = None
    ep: ExpertParallel | None = None
    fn: ParallelizeFn | None = None
    """A user's override of the tp and ep steps."""
    ties: Sequence[TiedParam] = ()
    """Parameters tied across stages: after tp (or ``fn``) made each stage's replica a
    DTensor of its own, the stages of one rank share one replica's memory again."""
    cp: ContextParallel | None = None
    """The cp step (None: no context parallelism)."""
    done: dict[int, nn.Module] = field(default_factory=dict)
    """What :meth:`apply` returned per stage (the stages parallelized so far)."""

    @classmethod
    def from_mesh(
        cls,
        mesh: PipelineMesh | None,
        *,
        tp_plan: StagePlan = None,
        fn: ParallelizeFn | None = None,
        loss: LossParallel | None = None,
        group: dist.ProcessGroup | None = None,
        timeout_s: float | None = None,
        name: StageNamer = _stage_name,
        ties: Sequence[TiedParam] = (),
        lanes: Mapping[int, int] | None = None,
    ) -> Parallelize:
        """The steps ``mesh`` asks for: tp where it has a ``tp`` dim (with ``tp_plan`` and
        ``loss``, the loss stage's :class:`~zerobubble.parallel.loss.LossParallel`), ep where
        ``ep > 1`` (checked over the pipeline ``group``); ``fn`` replaces both.

        ``lanes``: each stage's tp lane (:func:`~zerobubble.parallel.mesh.stage_lanes`);
        with tp, the lanes beyond 0 are made here (collective) and each stage is
        parallelized over its own, ``fn`` given a mesh whose ``tp_mesh`` is the stage's."""
        if loss is not None and loss.option and (mesh is None or mesh.tp_mesh is None):
            raise ValueError(
                "loss_parallel=True but the mesh has no tensor parallelism (tp=1): the logits "
                "are whole; build the mesh with tp >= 2, or leave loss_parallel at None"
            )
        if loss is not None and loss.option and fn is not None:
            raise ValueError(
                "loss_parallel=True with parallelize_fn: the function lays out the LM head "
                "itself; leave loss_parallel at None"
            )
        if (mesh is None or mesh.tp_mesh is None) and tp_plan is not None:
            raise ValueError(
                "tp_plan is given but the mesh has no tensor parallelism (tp=1): build the "
                "mesh with build_mesh(..., tp=2 or more), or drop tp_plan"
            )
        if fn is not None and mesh is None:
            raise ValueError(
                "parallelize_fn is given without a mesh: it receives the mesh, so pass "
                "mesh=build_mesh(...)"
            )
        if fn is not None and tp_plan is not None:
            raise ValueError(
                "pass either parallelize_fn (which parallelizes each stage itself) or tp_plan "
                "(the plan of the default tp step), not both"
            )
        if mesh is None:
            return cls()
        tp = None
        if mesh.tp_mesh is not None:
            lanes = lanes or {}
            mesh.with_tp_lanes(1 + max(lanes.values(), default=0))
            own: dict[int, DeviceMesh] = {}
            for s, k in lanes.items():
                lane = mesh.tp_lane(k)
                if k and lane is not None:
                    own[s] = lane
            tp = TensorParallel(mesh.tp_mesh, tp_plan, mesh.spec.sequence_parallel, loss, own)
        ep = None
        if mesh.ep_size > 1:
            ep = ExpertParallel(ExpertGroup.of(mesh, timeout_s), group, name)
        cp = None
        if mesh.cp_size > 1:
            assert mesh.cp_group is not None
            cp = ContextParallel(ContextShards(mesh.cp_size, mesh.cp_rank), mesh.cp_group)
        return cls(mesh, tp, ep, fn, ties, cp=cp)

    def stage_mesh(self, stage: int) -> PipelineMesh:
        """The mesh as stage ``stage`` sees it: its ``tp_mesh`` the stage's tp lane."""
        assert self.mesh is not None
        if self.tp is None or stage not in self.tp.lanes:
            return self.mesh
        return replace(self.mesh, tp_mesh=self.tp.lanes[stage])

    def apply(self, modules: Mapping[int, nn.Module]) -> dict[int, nn.Module]:
        """Every stage of ``modules`` parallelized (the ones seen before as they were)."""
        fresh = {s: m for s, m in modules.items() if s not in self.done}
        if fresh and self.fn is not None:
            assert self.mesh is not None  # from_mesh refuses fn without a mesh
            for s, m in sorted(fresh.items()):
                out = self.fn(s, m, self.stage_mesh(s))
                if not isinstance(out, nn.Module):
                    raise ValueError(
                        f"parallelize_fn returned {type(out).__name__} for stage {s}: it must "
                        "return the stage's module (the one it was given, or its replacement)"
                    )
                fresh[s] = out
        elif fresh and self.tp is not None:
            for s, m in sorted(fresh.items()):
                self.tp.apply(s, m)
        if fresh and self.ties and (self.fn is not None or self.tp is not None):
            tie_local_replicas(fresh, self.ties)
        # A collective over the pipeline: every rank has fresh stages at its first executor
        # and none at a later one (Pipeline.with_schedule), so all ranks take part or none.
        if self.ep is not None and fresh:
            if self.fn is None:
                self.ep.shard(fresh)
            else:
                self.ep.check(fresh)
        if self.cp is not None:
            for s, m in sorted(fresh.items()):
                self.cp.apply(s, m)
        self.done.update(fresh)
        return {s: self.done[s] for s in modules}


@dataclass(frozen=True)
class ContextParallel:
    """The cp step: this rank's place in the sequence layout and the cp group."""

    shards: ContextShards
    group: dist.ProcessGroup

    def apply(self, stage: int, module: nn.Module) -> None:
        context_parallel(module, self.shards, ProcessExchange(self.group), stage)
