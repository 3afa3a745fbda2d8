"""The job's device mesh: named dims ``pp`` (outermost) and ``dp``.

A job of ``pp * dp`` ranks runs ``dp`` copies of one pipeline. Global rank
``pp_rank * dp + dp_rank`` (``pp`` outermost, as torchtitan lays it out): a
rank's data-parallel peers are its neighbours, which ``torchrun`` puts on the
same node, so the gradient all-reduce stays inside a node and only pipeline hops
cross nodes. The executor, the optimizer's norm messages and the tie groups run
on :attr:`PipelineMesh.pp_group`; the gradient reduction runs on
:attr:`PipelineMesh.dp_group`. A ``tp`` dim would go innermost.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["PipelineMesh", "build_mesh", "pipeline_ranks"]


@dataclass(frozen=True)
class PipelineMesh:
    """The job's DeviceMesh with named dims ("pp", "dp") and this rank's place in it.

    Attributes:
        mesh: The :class:`DeviceMesh` (shape ``(pp, dp)``, dim names ``("pp", "dp")``).
        pp_group: This rank's pipeline (size ``pp``); its rank ``d`` runs device ``d``.
        dp_group: This rank's data-parallel replicas (size ``dp``); None when ``dp == 1``.
        pp_rank, pp_size, dp_rank, dp_size: This rank's coordinates and the dim sizes.
    """

    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int

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


def build_mesh(pp: int, dp: int = 1, *, device_type: str | None = None) -> PipelineMesh:
    """Build the ``(pp, dp)`` mesh over the default process group; collective.

    ``device_type`` defaults to that of the default group's backend (``"cpu"`` for
    gloo, the accelerator's type otherwise). Raises ValueError when the world size
    is not ``pp * dp``.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call zerobubble.init_distributed() before "
            "build_mesh"
        )
    if pp < 1 or dp < 1:
        raise ValueError(f"mesh sizes must be >= 1, got pp={pp}, dp={dp}")
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
    )


def _accelerator_type() -> str:
    import torch

    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"
