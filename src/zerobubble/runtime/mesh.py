"""The job's parallel layout: one :class:`ParallelSpec`, checked once, and its device mesh.

Named dims ``pp`` (outermost) and ``dp``; how the dp replicas share a stage's
parameters (replicated with a gradient all-reduce, or sharded with FSDP2) is part
of the spec, not a separate flag. Expert, tensor and context parallelism would
enter the spec as dims of their own (``ep`` inside ``dp``, ``tp`` innermost).

A job of ``pp * dp`` ranks runs ``dp`` copies of one pipeline. Global rank
``pp_rank * dp + dp_rank`` (``pp`` outermost, as torchtitan lays it out): a
rank's data-parallel peers are its neighbours, which ``torchrun`` puts on the
same node, so the gradient all-reduce stays inside a node and only pipeline hops
cross nodes. The executor, the optimizer's norm messages and the tie groups run
on :attr:`PipelineMesh.pp_group`; the gradient reduction runs on
:attr:`PipelineMesh.dp_group`. A ``tp`` dim would go innermost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zerobubble.schedule.build import GradSync
from zerobubble.schedule.ir import Schedule

__all__ = ["ParallelSpec", "PipelineMesh", "build_mesh", "pipeline_group", "pipeline_ranks"]


@dataclass(frozen=True)
class ParallelSpec:
    """The job's parallel dimensions; invalid combinations are refused here, once."""

    pp: int
    """Pipeline ranks (devices of one schedule)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    fsdp: bool = False
    """Shard every stage's parameters, gradients and optimizer state over ``dp`` with FSDP2
    (:mod:`~zerobubble.runtime.fsdp`) instead of replicating them and all-reducing whole
    gradients. Needs ``dp >= 2``."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.dp < 1:
            raise ValueError(f"mesh sizes must be >= 1, got pp={self.pp}, dp={self.dp}")
        if self.fsdp and self.dp < 2:
            raise ValueError(
                f"fsdp=True shards over the mesh's dp dimension: it needs dp >= 2 (got "
                f"dp={self.dp}); build the mesh with dp >= 2 or leave fsdp off"
            )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp

    @property
    def grad_sync(self) -> GradSync:
        """How the program meets the other replicas' gradients (a pass of the builder)."""
        if self.dp == 1:
            return GradSync.NONE
        return GradSync.FSDP if self.fsdp else GradSync.REDUCE


@dataclass(frozen=True)
class PipelineMesh:
    """The job's DeviceMesh with named dims ("pp", "dp") and this rank's place in it.

    Attributes:
        mesh: The :class:`DeviceMesh` (shape ``(pp, dp)``, dim names ``("pp", "dp")``).
        pp_group: This rank's pipeline (size ``pp``); its rank ``d`` runs device ``d``.
        dp_group: This rank's data-parallel replicas (size ``dp``); None when ``dp == 1``.
        pp_rank, pp_size, dp_rank, dp_size: This rank's coordinates and the dim sizes.
        spec: The :class:`ParallelSpec` it was built from.
    """

    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    spec: ParallelSpec

    def with_fsdp(self, fsdp: bool = True) -> PipelineMesh:
        """The same mesh (same groups) with the dp replicas sharding, or not, their stages."""
        return replace(self, spec=replace(self.spec, fsdp=fsdp))

    def pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline (one list per dp replica, in pp order)."""
        return pipeline_ranks(self.pp_size, self.dp_size)


def pipeline_ranks(pp: int, dp: int) -> list[list[int]]:
    """Global ranks of each of the ``dp`` pipelines of a ``(pp, dp)`` mesh.

    Subgroups inside a pipeline (directed P2P lanes, tie groups) are made with
    ``dist.new_group``, which is collective over the default group: every rank
    creates the subgroups of every pipeline, in this order, and keeps its own.
    """
    return [[d * dp + j for d in range(pp)] for j in range(dp)]


def build_mesh(
    pp: int, dp: int = 1, *, fsdp: bool = False, device_type: str | None = None
) -> PipelineMesh:
    """Build the ``(pp, dp)`` mesh of :class:`ParallelSpec` ``(pp, dp, fsdp)`` over the
    default process group; collective.

    ``device_type`` defaults to that of the default group's backend (``"cpu"`` for
    gloo, the accelerator's type otherwise). Raises ValueError when the world size
    is not ``pp * dp``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call zerobubble.init_distributed() before "
            "build_mesh"
        )
    spec = ParallelSpec(pp, dp, fsdp)
    world = dist.get_world_size()
    if world != pp * dp:
        raise ValueError(
            f"the world has {world} ranks but the mesh pp={pp} x dp={dp} needs {pp * dp}; "
            f"launch pp*dp = {pp * dp} processes or change --pp/--dp"
        )
    if device_type is None:
        device_type = "cpu" if dist.get_backend() == "gloo" else _accelerator_type()
    mesh = init_device_mesh(device_type, (pp, dp), mesh_dim_names=("pp", "dp"))
    rank = dist.get_rank()
    return PipelineMesh(
        mesh=mesh,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp") if dp > 1 else None,
        pp_rank=rank // dp,
        pp_size=pp,
        dp_rank=rank % dp,
        dp_size=dp,
        spec=spec,
    )


def pipeline_group(
    schedule: Schedule, mesh: PipelineMesh | None, group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The process group ``schedule`` runs on, checked against ``mesh`` or ``group``.

    The one check of a pipeline's ranks: with a mesh, its ``pp`` dim (``group`` must be
    None or the mesh's); without, ``group`` (None: the world). Raises ValueError naming
    both sizes and the fix when they differ from the schedule's devices.
    """
    if mesh is not None:
        if group is not None and group is not mesh.pp_group:
            raise ValueError("pass either group= or mesh= (the pipeline runs on mesh.pp_group)")
        if mesh.pp_size != schedule.num_devices:
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_devices} devices but the mesh's "
                f"'pp' dim has {mesh.pp_size} ranks (mesh pp={mesh.pp_size} x "
                f"dp={mesh.dp_size}); build the mesh with pp={schedule.num_devices} or "
                f"generate the schedule for {mesh.pp_size} devices"
            )
        return mesh.pp_group
    world = dist.get_world_size(group)
    if world != schedule.num_devices:
        raise ValueError(
            f"schedule {schedule.name!r} needs {schedule.num_devices} ranks but the process "
            f"group has {world}; launch with -n {schedule.num_devices}"
        )
    return group


def _accelerator_type() -> str:
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"
