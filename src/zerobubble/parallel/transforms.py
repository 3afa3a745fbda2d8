"""The one place a rank's stage modules become :class:`StageChunk` objects, transformed.

Each stage module goes through the same steps, in one fixed order (as torchtitan's
``parallelize`` applies its transforms to each model part):

1. **the model's dimensions** (:class:`~zerobubble.parallel.parallelize.Parallelize`, built
   from the mesh): tp (the layers' parameters become DTensors over the mesh's ``tp`` dim),
   then ep (each rank keeps its experts), or a user's ``parallelize_fn`` instead of both.
   First, so that the split layers take over the parallelized layers' parameters and
   hooks, and W computes the local shards' gradients;
2. **split**: the B/W split swaps the layers a rule matches for split layers and gives
   the rest the graph-level split (:func:`~zerobubble.runtime.split.enable_bw_split`);
3. **recompute**: activation checkpointing of the stage or of its layers
   (:mod:`~zerobubble.runtime.recompute`), around the split layers, whose W it leaves
   as it is;
4. **compile**: ``torch.compile`` of the regions between split layers
   (:func:`~zerobubble.runtime.compile.compile_between_splits`). After the split, so
   that it sees which layers are split and keeps them (and graph-split modules) eager:
   compiled first, a layer's weight gradient would be computed in B inside the compiled
   graph's one backward node;
5. **FSDP** over all this rank's chunks (:class:`~zerobubble.parallel.fsdp.ShardedStages`;
   with ep, the experts over ``edp`` first, then the rest over ``dp``). Last, so that it
   shards the parameters the split layers hold and the chunks see.

Steps 2 and 3 run inside :class:`StageChunk` (they need its store and stage index);
:func:`prepare_chunks` is the caller that decides them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from zerobubble.parallel.fsdp import ShardedStages
from zerobubble.parallel.parallelize import Parallelize
from zerobubble.runtime.compile import compile_between_splits
from zerobubble.runtime.p2p.comm import RankName, plain_name
from zerobubble.runtime.recompute import Recompute, recompute_plan
from zerobubble.runtime.split import SplitRules
from zerobubble.runtime.stage import LossFn, StageChunk

__all__ = ["ChunkTransforms", "prepare_chunks"]


@dataclass(frozen=True)
class ChunkTransforms:
    """What :func:`prepare_chunks` does to one stage module (order: see the module docstring)."""

    split: bool = True
    """B/W split of the backward: W computes the weight gradients after B. A schedule
    that runs a separate W for the stage needs it; with False, B computes every
    gradient and W only adds them to ``.grad``."""
    split_rules: SplitRules | None = None
    """The rules deciding each layer's split (the defaults if None); unused without split."""
    recompute: Recompute = "none"
    """Activation checkpointing: "none", "stage", "layers" or a predicate
    ``(layer name, module) -> bool`` (see :class:`StageChunk`)."""
    compile: str | None = None
    """A ``torch.compile`` backend ("inductor", "aot_eager", ...) for the regions between
    split layers, or None for no compilation. Not with "layers" recompute (refused)."""
    track_memory: bool = True
    """Count what each microbatch's graph saves (:meth:`StageChunk.held_bytes`); costs a
    Python call per saved tensor in F and B."""

    def __post_init__(self) -> None:
        plan = recompute_plan(self.recompute)  # a bad setting fails here, not at the first F
        if self.compile is not None and plan.mode == "layers":
            raise ValueError(
                f"compile={self.compile!r} with recompute={self.recompute!r}: B recomputes a "
                "checkpointed layer's forward eagerly, outside its compiled code, so its "
                "gradients would round differently from what the compiled forward implies; "
                "use recompute='stage' or 'none' with compile"
            )


def _compile(chunk: StageChunk, backend: str) -> None:
    """Compile ``chunk``'s module around its split layers, each direct child on its own.

    Per child (a block, as torchtitan compiles per block): stage cuts fall between
    children, so the compiled regions, and with them the rounding, do not depend on
    where the pipeline cuts the model, and identical blocks share one compiled code. A
    module without children is considered whole.
    """
    children = list(chunk.module.children()) or [chunk.module]
    for child in children:
        compile_between_splits(child, backend=backend)


def prepare_chunks(
    modules: Mapping[int, nn.Module | StageChunk],
    num_stages: int,
    *,
    loss_fn: LossFn | None,
    transforms: Mapping[int, ChunkTransforms],
    fsdp_mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    device: torch.device | str | None = None,
    timeout_s: float = 60.0,
    parallelize: Parallelize | None = None,
    name: RankName = plain_name,
) -> tuple[dict[int, StageChunk], ShardedStages | None]:
    """This rank's stages as chunks with their transforms applied, in the documented order.

    Args:
        modules: ``stage -> module`` of this rank; a ready :class:`StageChunk` has had its
            tensor parallelism, split and recompute decided by whoever built it and only
            gets compile and FSDP.
        num_stages: Virtual stages of the whole pipeline.
        loss_fn: The loss, given to the last stage only (required if this rank holds it).
        transforms: ``stage -> ChunkTransforms``, one per stage in ``modules``.
        fsdp_mesh: The ``dp`` dimension to shard every chunk over (FSDP2), or None.
        expert_mesh: With ``fsdp_mesh`` and expert parallelism, the ``edp`` dimension the
            experts are sharded over instead (:class:`~zerobubble.parallel.fsdp.ShardedStages`).
        device, timeout_s, name: For :class:`~zerobubble.parallel.fsdp.ShardedStages`.
        parallelize: The model-facing steps (tp, ep, or a user's function) of every module
            that is not a ready chunk (None: none).

    Returns the chunks by stage and, with ``fsdp_mesh``, their sharding.
    """
    if transforms.keys() != modules.keys():
        raise ValueError(
            f"transforms are given for stages {sorted(transforms)} but the modules are "
            f"stages {sorted(modules)}: give one ChunkTransforms per stage"
        )
    raw = {s: m for s, m in modules.items() if not isinstance(m, StageChunk)}
    if parallelize is not None:
        raw = parallelize.apply(raw)
    chunks: dict[int, StageChunk] = {}
    for s, m in sorted({**modules, **raw}.items()):
        t = transforms[s]
        last = s == num_stages - 1
        if isinstance(m, StageChunk):
            _check_ready(m, s, num_stages, t)
            chunk = m
        else:
            chunk = StageChunk(  # split, then recompute
                m,
                s,
                num_stages,
                loss_fn=loss_fn if last else None,
                split=t.split,
                split_rules=t.split_rules,
                track_memory=t.track_memory,
                recompute=t.recompute,
            )
        if t.compile is not None:
            _compile(chunk, t.compile)
        chunks[s] = chunk
    if fsdp_mesh is None:
        return chunks, None
    sharding = ShardedStages(
        chunks, fsdp_mesh, device=device, timeout_s=timeout_s, name=name, expert_mesh=expert_mesh
    )
    if parallelize is not None:
        sharding.share_replicas(parallelize.ties)
    return chunks, sharding


def _check_ready(chunk: StageChunk, s: int, num_stages: int, t: ChunkTransforms) -> None:
    """A ready chunk must be the stage it is given for, and count memory if asked to."""
    if chunk.stage != s or chunk.num_stages != num_stages:
        raise ValueError(
            f"the StageChunk given for stage {s} is stage {chunk.stage} of "
            f"{chunk.num_stages}; the pipeline has {num_stages} stages"
        )
    if t.track_memory and not chunk.track_memory:
        raise ValueError(
            f"the StageChunk given for stage {s} has track_memory=False, but its transforms "
            "ask for track_memory (a traced executor records held bytes): build it with "
            "track_memory=True, or pass ExecutorOptions(trace=False)"
        )
