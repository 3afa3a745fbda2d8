"""Pipeline-parallel training for PyTorch with zero-bubble schedules.

The public API, all importable from ``zerobubble``:

* schedules (no torch): :class:`Schedule`, :class:`Action`, :class:`Op`,
  :func:`generate` (every kind in :data:`GENERATORS`), :func:`validate` (raises
  :class:`ScheduleError`), :func:`simulate` (a :class:`SimResult`) under a
  :class:`CostModel`, :func:`load_schedule` / :func:`save_schedule`; for sequence
  segments (``generate("seq-zb", P, M, segments=k)``), where to cut a sequence:
  :func:`balanced_cuts` (segments of equal :class:`SegmentCost`) or :func:`equal_token_cuts`,
  passed to the executor as ``ExecutorOptions(cuts=...)``;
* running them, one process per device: :class:`Pipeline` (layers + loss ->
  this rank's stages, trained step by step), or its parts
  :func:`build_stage_modules` / :func:`stage_bounds`, :class:`PipelineExecutor`
  with :class:`ExecutorOptions`, and :func:`reference_step`, the single-process
  result a pipeline reproduces bitwise, with the job's dimensions as options (``dp``,
  ``ep``, ``cuts``, ``tp_mesh``, ``seed``, loss terms); the single-dimension references
  it composes stay as :func:`segment_reference_step`, :func:`tp_reference_step` and
  :func:`ep_reference_step`;
* optimizer semantics: :class:`PipelineTrainer` under an :class:`OptimConfig`
  (:class:`StepMode`, :class:`Rollback`), :func:`save_checkpoint` /
  :func:`load_checkpoint`;
* small models to try it on: :mod:`zerobubble.models` (a GPT, an MLP, the stdlib corpus);
* processes: :func:`init_distributed` (inside each rank) and :func:`launch_local`
  (``launch_local(fn, P, *args)`` runs ``fn`` as P local ranks; for scripts use
  ``python -m zerobubble.launch -n P script.py`` or ``torchrun``); :func:`build_mesh`
  (a :class:`PipelineMesh` of ``pp`` x ``dp`` (x ``tp``) ranks for ``Pipeline(mesh=...)``;
  with ``tp``, :func:`tp_reference_step` is what a pipeline reproduces bitwise);
* mixtures of experts: :func:`add_loss_term` (a layer's loss term, e.g. a router loss,
  trained and reported wherever its stage is; :func:`collect_loss_terms` outside a
  pipeline), :class:`ExpertGroup` (experts sharded over ``build_mesh(..., ep=)``) and
  :func:`ep_reference_step` (its single-process result); overlapped F&B pairs
  (``generate("dualpipev", P, M, overlap=True)``) run both halves at once, or by a hook
  given an :class:`OverlapPair`; a layer with collectives in both directions gives them
  :class:`LaneGroups`.

Names are imported on first use, so ``import zerobubble`` and the schedule names
do not import torch (the torch-free command-line paths stay fast).
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("zerobubble")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

if TYPE_CHECKING:
    from zerobubble import models
    from zerobubble.executor import ExecutorOptions, PipelineExecutor
    from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
    from zerobubble.optim.config import OptimConfig, Rollback, StepMode
    from zerobubble.optim.trainer import PipelineTrainer
    from zerobubble.parallel.mesh import PipelineMesh, build_mesh
    from zerobubble.parallel.partition import build_stage_modules, stage_bounds
    from zerobubble.pipeline import Pipeline
    from zerobubble.reference.compose import reference_step
    from zerobubble.reference.step import segment_reference_step
    from zerobubble.runtime.launcher import DistInfo, init_distributed
    from zerobubble.runtime.launcher import launch as launch_local
    from zerobubble.schedule.costs import CostModel
    from zerobubble.schedule.errors import ScheduleError
    from zerobubble.schedule.formats import load_schedule, save_schedule
    from zerobubble.schedule.generators import GENERATORS, generate
    from zerobubble.schedule.ir import Action, Op, Schedule
    from zerobubble.schedule.segments import SegmentCost, balanced_cuts, equal_token_cuts
    from zerobubble.schedule.simulate import SimResult, simulate
    from zerobubble.schedule.validate import validate

_WHERE: dict[str, tuple[str, str | None]] = {
    # schedule layer (torch-free)
    "Action": ("zerobubble.schedule.ir", "Action"),
    "CostModel": ("zerobubble.schedule.costs", "CostModel"),
    "GENERATORS": ("zerobubble.schedule.generators", "GENERATORS"),
    "Op": ("zerobubble.schedule.ir", "Op"),
    "Schedule": ("zerobubble.schedule.ir", "Schedule"),
    "ScheduleError": ("zerobubble.schedule.errors", "ScheduleError"),
    "SegmentCost": ("zerobubble.schedule.segments", "SegmentCost"),
    "SimResult": ("zerobubble.schedule.simulate", "SimResult"),
    "balanced_cuts": ("zerobubble.schedule.segments", "balanced_cuts"),
    "equal_token_cuts": ("zerobubble.schedule.segments", "equal_token_cuts"),
    "generate": ("zerobubble.schedule.generators", "generate"),
    "load_schedule": ("zerobubble.schedule.formats", "load_schedule"),
    "save_schedule": ("zerobubble.schedule.formats", "save_schedule"),
    "simulate": ("zerobubble.schedule.simulate", "simulate"),
    "validate": ("zerobubble.schedule.validate", "validate"),
    # processes (the launcher imports torch only inside init_distributed)
    "DistInfo": ("zerobubble.runtime.launcher", "DistInfo"),
    "init_distributed": ("zerobubble.runtime.launcher", "init_distributed"),
    "launch_local": ("zerobubble.runtime.launcher", "launch"),
    # torch-backed
    "ExecutorOptions": ("zerobubble.executor", "ExecutorOptions"),
    "ExpertGroup": ("zerobubble.parallel.ep", "ExpertGroup"),
    "LaneGroups": ("zerobubble.runtime.overlap", "LaneGroups"),
    "OverlapPair": ("zerobubble.runtime.overlap", "OverlapPair"),
    "add_loss_term": ("zerobubble.runtime.loss_terms", "add_loss_term"),
    "collect_loss_terms": ("zerobubble.runtime.loss_terms", "collect_loss_terms"),
    "ep_reference_step": ("zerobubble.reference.ep", "ep_reference_step"),
    "tp_reference_step": ("zerobubble.reference.tp", "tp_reference_step"),
    "OptimConfig": ("zerobubble.optim.config", "OptimConfig"),
    "Pipeline": ("zerobubble.pipeline", "Pipeline"),
    "PipelineExecutor": ("zerobubble.executor", "PipelineExecutor"),
    "PipelineMesh": ("zerobubble.parallel.mesh", "PipelineMesh"),
    "PipelineTrainer": ("zerobubble.optim.trainer", "PipelineTrainer"),
    "Rollback": ("zerobubble.optim.config", "Rollback"),
    "StepMode": ("zerobubble.optim.config", "StepMode"),
    "build_mesh": ("zerobubble.parallel.mesh", "build_mesh"),
    "build_stage_modules": ("zerobubble.parallel.partition", "build_stage_modules"),
    "load_checkpoint": ("zerobubble.optim.checkpoint", "load_checkpoint"),
    "models": ("zerobubble.models", None),
    "reference_step": ("zerobubble.reference.compose", "reference_step"),
    "save_checkpoint": ("zerobubble.optim.checkpoint", "save_checkpoint"),
    "segment_reference_step": ("zerobubble.reference.step", "segment_reference_step"),
    "stage_bounds": ("zerobubble.parallel.partition", "stage_bounds"),
}

__all__ = [
    "GENERATORS",
    "Action",
    "CostModel",
    "DistInfo",
    "ExecutorOptions",
    "ExpertGroup",
    "LaneGroups",
    "Op",
    "OptimConfig",
    "OverlapPair",
    "Pipeline",
    "PipelineExecutor",
    "PipelineMesh",
    "PipelineTrainer",
    "Rollback",
    "Schedule",
    "ScheduleError",
    "SegmentCost",
    "SimResult",
    "StepMode",
    "add_loss_term",
    "balanced_cuts",
    "build_mesh",
    "build_stage_modules",
    "collect_loss_terms",
    "ep_reference_step",
    "equal_token_cuts",
    "generate",
    "init_distributed",
    "launch_local",
    "load_checkpoint",
    "load_schedule",
    "models",
    "reference_step",
    "save_checkpoint",
    "save_schedule",
    "segment_reference_step",
    "simulate",
    "stage_bounds",
    "tp_reference_step",
    "validate",
]


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562); Python caches the module itself."""
    if name not in _WHERE:
        raise AttributeError(f"module 'zerobubble' has no attribute {name!r}")
    module, attr = _WHERE[name]
    found = importlib.import_module(module)
    return found if attr is None else getattr(found, attr)


def __dir__() -> list[str]:
    return list(__all__)
