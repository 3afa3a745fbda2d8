"""Tensor parallelism inside a pipeline stage, on PyTorch's DTensor (``parallelize_module``).

A stage module is parallelized over the mesh's ``tp`` dim before the B/W split swaps its
layers (the split layers keep the parallel styles' input and output hooks), so the split
layers compute on DTensors: B's all-reduce or reduce-scatter of the input gradient runs
inside the parallel style's redistribution, on the critical path, and W multiplies the
local shards only.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

__all__ = ["TPPlan", "parallelize_stage"]

TPPlan = Mapping[str, ParallelStyle]
"""``parallelize_module``'s plan: submodule name (relative to the stage module, ``*``
wildcards allowed) -> parallel style."""


def parallelize_stage(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    plan: TPPlan | None = None,
    *,
    stage: int,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Apply ``plan`` (None: the default plan of ``module``) to stage ``stage``'s
    ``module`` over ``tp_mesh``, in place; returns the module."""
    if plan is None:
        raise ValueError(f"stage {stage}: no default tensor-parallel plan yet; pass tp_plan=")
    return parallelize_module(module, tp_mesh, dict(plan))
