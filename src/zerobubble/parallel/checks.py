"""What a pipeline's dimensions and options may combine: checked before its stages are
built (:func:`check_job`: the :mod:`~zerobubble.composition` table, the cuts sequence
parallelism can shard) and after (:func:`check_pairs`: each overlapped pair's two stages on
groups of their own)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from zerobubble import composition
from zerobubble.parallel.mesh import PipelineMesh
from zerobubble.runtime.options import ExecutorOptions
from zerobubble.runtime.overlap import OverlapFn, in_sequence
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.ir import Schedule

__all__ = ["check_job", "check_pairs", "features", "pair_runner"]


def check_job(
    schedule: Schedule,
    opts: ExecutorOptions,
    mesh: PipelineMesh | None,
    cuts: Sequence[int] | None,
) -> None:
    """Refuse, before any stage is built, a combination the composition table refuses and
    cuts that sequence parallelism cannot shard."""
    if cuts is not None:
        _check_segment_shards(cuts, mesh)
    composition.check(features(schedule, opts, mesh), f"schedule {schedule.name!r}")


def pair_runner(opts: ExecutorOptions, mesh: PipelineMesh | None) -> OverlapFn | None:
    """How the executor runs an overlapped pair: the user's hook, else both halves at once
    (None), except under tp with recompute, where :func:`~zerobubble.runtime.overlap.in_sequence`
    runs them one after the other (a drawing replay and the paired forward could wait on
    each other across tp ranks)."""
    if opts.overlap_fn is not None:
        return opts.overlap_fn
    if mesh is not None and mesh.tp_size > 1 and opts.recompute != "none":
        return in_sequence
    return None


def check_pairs(
    schedule: Schedule,
    chunks: Mapping[int, StageChunk],
    mesh: PipelineMesh | None,
    group: dist.ProcessGroup | None,
) -> None:
    """Refuse, once the stages are built, what would share a process group between the two
    halves of an overlapped pair (collective over the pipeline's ``group``)."""
    if not schedule.overlaps:
        return
    _check_lanes(schedule, chunks, mesh, group)


def features(schedule: Schedule, opts: ExecutorOptions, mesh: PipelineMesh | None) -> set[str]:
    """The :mod:`~zerobubble.composition` features of a pipeline (the model's ties and random
    ops left out: the table refuses no combination of them)."""
    on = {
        "overlap": bool(schedule.overlaps),
        "segments": schedule.segments > 1,
        "recompute": opts.recompute != "none",
    }
    return {f for f, yes in on.items() if yes} | (set() if mesh is None else mesh.spec.features)


def _check_lanes(
    schedule: Schedule,
    chunks: Mapping[int, StageChunk],
    mesh: PipelineMesh | None,
    group: dist.ProcessGroup | None,
) -> None:
    """Refuse, on every rank of the pipeline (a collective of its ``group``), an overlapped
    pair whose two stages run collectives on one process group (other than FSDP's dp group,
    whose collectives run outside the pairs): the two threads could issue them in different
    orders on the group's ranks. A stage's groups are those of its DTensor parameters'
    meshes; each stage of a rank has its own tp lane unless its caller parallelized it
    otherwise (a ``parallelize_fn`` that ignores the stage's ``mesh.tp_mesh``, or stages
    parallelized for a schedule without pairs)."""
    dp = None if mesh is None or mesh.dp_group is None else mesh.dp_group.group_name
    groups: dict[int, set[str]] = {}
    for s, chunk in chunks.items():
        names: set[str] = set()
        for p in chunk.module.parameters():
            if isinstance(p, DTensor):
                m = p.device_mesh
                names.update(m.get_group(i).group_name for i in range(m.ndim))
        groups[s] = names - {dp}
    rank = dist.get_rank(group)
    mine = [
        f"rank {rank} overlaps {f} with {b}, but stages {f.stage} and {b.stage} run their "
        "DTensor collectives on one process group"
        for f, b in schedule.overlaps
        if f.stage in groups and b.stage in groups and groups[f.stage] & groups[b.stage]
    ]
    found: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(found, mine, group=group)
    problems = [p for f in found if f is not None for p in f]
    if problems:
        raise ValueError(
            f"schedule {schedule.name!r} runs the halves of its F&B pairs at once, where the "
            "tp ranks could order two halves' collectives on one group differently: "
            + "; ".join(problems)
            + ". Parallelize each stage over its own tp lane (the mesh a parallelize_fn is "
            "given for a stage: its tp_mesh), or build this schedule's Pipeline first "
            "(stages parallelized for a schedule without pairs share one)"
        )


def _check_segment_shards(cuts: Sequence[int], mesh: PipelineMesh | None) -> None:
    """Refuse, as sequence parallelism shards each segment evenly over tp, cuts (the
    sequence length, the last, included) that leave a segment tp does not divide, naming
    the cuts rather than a segment's length, which the user never chose."""
    tp = 1 if mesh is None or not mesh.spec.sequence_parallel else mesh.tp_size
    odd = [c for c in cuts[1:] if c % tp]
    if odd:
        raise ValueError(
            f"ExecutorOptions(cuts={list(cuts)}) with sequence parallelism over tp={tp}: "
            f"every segment's tokens are sharded evenly over the tp ranks, so every cut "
            f"must be a multiple of {tp} (not {odd}); cut at multiples of {tp}, e.g. "
            f"balanced_cuts(...) rounded, and pad sequences to a multiple of {tp} tokens"
        )
