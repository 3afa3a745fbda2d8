"""prepare_chunks: split, recompute, compile, then FSDP, in that order, per chunk.

FSDP needs a process group; its wiring is covered by test_fsdp.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from test_chunk import assert_matches_reference, sequential_order
from test_compile import _compile_each, _eager_like_split
from test_split_coverage import VOCAB, T, _pipeline_model, _without_norm_rule
from zerobubble.models import gpt_loss
from zerobubble.parallel.transforms import ChunkTransforms, prepare_chunks
from zerobubble.runtime.split import SplitEmbedding, SplitLinear, SplitOp
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.generators import zbv

_SPLIT = (SplitLinear, SplitEmbedding, SplitOp)


def _stages(model: nn.Sequential, cuts: list[int]) -> dict[int, nn.Module]:
    bounds = [*cuts, len(model)]
    return {s: model[bounds[s] : bounds[s + 1]] for s in range(len(cuts))}


@pytest.mark.parametrize("recompute", ["none", "stage"])
def test_split_then_compile_keeps_split_layers_eager_and_matches_compiled_reference_bitwise(
    recompute: str,
) -> None:
    torch._dynamo.reset()
    schedule, cuts = zbv(2, 4), [0, 1, 2, 4]
    model = _pipeline_model("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (6, T + 1), generator=torch.Generator().manual_seed(22))
    t = ChunkTransforms(recompute=recompute, compile="aot_eager")
    chunks, sharding = prepare_chunks(
        _stages(model, cuts), len(cuts), loss_fn=gpt_loss, transforms=dict.fromkeys(range(4), t)
    )
    assert sharding is None
    # test_compile's reference: the plain model with the same regions compiled per block.
    _eager_like_split(ref)
    _compile_each(ref, "aot_eager")
    torch._dynamo.utils.counters.clear()
    order = sequential_order(schedule)
    ordered = [chunks[s] for s in range(4)]
    assert_matches_reference(model, ref, ordered, order, gpt_loss, ids[:, :-1], ids[:, 1:], 4)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    split_layers = [m for c in ordered for m in c.module.modules() if isinstance(m, _SPLIT)]
    # Split first: the head and every block's matmuls are split layers, and compile, which
    # came after, left each of them eager; every other child of a stage is compiled.
    assert len(split_layers) == 2 + 3 * 7 + 1  # token and position tables, blocks, head
    assert all(m._compiled_call_impl is None for m in split_layers)
    children = [m for c in ordered for m in c.module.children()]
    assert [m._compiled_call_impl is not None for m in children] == [
        not isinstance(m, _SPLIT) for m in children
    ]
    assert all(c.split_share is not None and c.split_share.fraction > 0.9 for c in ordered[1:-1])
    assert [c.recompute for c in ordered] == [recompute] * 4


def test_compile_sees_the_graph_level_split_it_comes_after() -> None:
    # Norms on the graph-level split: had compile run first, it would have compiled the
    # blocks whole (nothing to avoid yet) and traced the split's hooks once.
    model = _pipeline_model("llama")
    t = ChunkTransforms(split_rules=_without_norm_rule(), compile="aot_eager")
    chunks, _ = prepare_chunks(
        _stages(model, [0, 2]), 2, loss_fn=gpt_loss, transforms=dict.fromkeys(range(2), t)
    )
    first = chunks[0].module
    assert first[0]._compiled_call_impl is not None  # the embeddings hold no graph split
    assert all(m._compiled_call_impl is None for m in first[1].modules())  # a block
    assert chunks[1].module[-2]._compiled_call_impl is None  # the final norm, graph-split


def test_unsplit_chunk_compiles_each_child_and_loss_goes_to_the_last_stage_only() -> None:
    model = _pipeline_model("llama")
    t = ChunkTransforms(split=False, compile="aot_eager", track_memory=False)
    chunks, _ = prepare_chunks(
        _stages(model, [0, 3]), 2, loss_fn=gpt_loss, transforms=dict.fromkeys(range(2), t)
    )
    assert [c.loss_fn for c in chunks.values()] == [None, gpt_loss]
    assert [c.split_share for c in chunks.values()] == [None, None]
    assert not any(isinstance(m, _SPLIT) for c in chunks.values() for m in c.module.modules())
    assert all(m._compiled_call_impl is not None for c in chunks.values() for m in c.module)
    assert not any(c.track_memory for c in chunks.values())


def test_a_ready_chunk_is_only_compiled_and_checked() -> None:
    model = _pipeline_model("gpt2")
    ready = StageChunk(model[:2], 0, 2, recompute="layers")
    chunks, _ = prepare_chunks(
        {0: ready}, 2, loss_fn=None, transforms={0: ChunkTransforms(compile="aot_eager")}
    )
    assert chunks[0] is ready and ready.recomputed_layers == ["0", "1"]
    assert ready.module[0]._compiled_call_impl is not None
    with pytest.raises(ValueError, match="is stage 0 of 2; the pipeline has 3 stages"):
        prepare_chunks({0: ready}, 3, loss_fn=None, transforms={0: ChunkTransforms()})
    quiet = StageChunk(model[2:4], 1, 2, loss_fn=gpt_loss, track_memory=False)
    with pytest.raises(ValueError, match="has track_memory=False"):
        prepare_chunks({1: quiet}, 2, loss_fn=gpt_loss, transforms={1: ChunkTransforms()})


def test_transforms_are_checked_up_front() -> None:
    with pytest.raises(ValueError, match="recompute='all' is not one of"):
        ChunkTransforms(recompute="all")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"recompute='layers'.*use recompute='stage'"):
        ChunkTransforms(recompute="layers", compile="inductor")
    with pytest.raises(ValueError, match=r"stages \[0, 1\] but the modules are stages \[0\]"):
        prepare_chunks(
            {0: nn.Linear(2, 2)},
            1,
            loss_fn=gpt_loss,
            transforms=dict.fromkeys(range(2), ChunkTransforms()),
        )
