"""torch.compile on split stages: regions between split layers compiled, the split intact."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from test_chunk import assert_matches_reference, make_chunks, sequential_order
from test_split_coverage import VOCAB, T, _pipeline_model, _without_norm_rule
from zerobubble.models import gpt_loss
from zerobubble.runtime.compile import compile_between_splits
from zerobubble.runtime.split import SplitLinear, WeightGradStore, enable_bw_split
from zerobubble.schedule.generators import zb_h1, zbv


class _EagerLinear(nn.Linear):
    forward = torch.compiler.disable(nn.Linear.forward)


class _EagerEmbedding(nn.Embedding):
    forward = torch.compiler.disable(nn.Embedding.forward)


def _eager_like_split(ref: nn.Module) -> None:
    """Give ``ref``'s plain layers that the split replaces the same graph breaks.

    The reference is then "the same compiled blocks in one process": the regions
    between these layers compile to the same graphs as in the split model.
    """
    eager = {nn.Linear: _EagerLinear, nn.Embedding: _EagerEmbedding}
    for m in ref.modules():
        if type(m) in eager:
            m.__class__ = eager[type(m)]


def _compile_each(modules, backend: str) -> list[str]:
    return [n for m in modules for n in compile_between_splits(m, backend=backend)]


def _run(sched: str, kind: str, backend: str, amp: bool = False) -> None:
    torch._dynamo.reset()
    schedule = zb_h1(3, 4) if sched == "zb-h1" else zbv(2, 4)
    cuts = [0, 2, 4] if sched == "zb-h1" else [0, 1, 2, 4]
    model = _pipeline_model(kind)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(22)
    ids = torch.randint(0, VOCAB, (6, T + 1), generator=g)
    chunks = make_chunks(model, cuts, gpt_loss, placement=schedule.placement)
    _eager_like_split(ref)
    # Each child of the model, in both: the same regions (stage cuts fall between children).
    stage_children = [m for c in chunks for m in c.module]  # the split head is a chunk's child
    assert _compile_each(stage_children, backend) == [""] * (len(model) - 1)  # all but the head
    _compile_each(ref, backend)
    torch._dynamo.utils.counters.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        assert_matches_reference(
            model, ref, chunks, sequential_order(schedule), gpt_loss, ids[:, :-1], ids[:, 1:], 4
        )
    # Compiled regions ran, and every split layer broke its graph instead of being traced.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    assert not any(isinstance(m, SplitLinear) and m._compiled_call_impl for m in model.modules())
    # The split is intact: every block's matmuls still deferred their dW to W.
    assert all(c.split_share.fraction > 0.9 for c in chunks[1:-1])


@pytest.mark.parametrize(
    ("sched", "kind"), [("zb-h1", "gpt2"), ("zb-h1", "llama"), ("zbv", "gpt2")]
)
def test_compiled_blocks_under_split_schedules_match_compiled_reference_bitwise(
    sched: str, kind: str
) -> None:
    """A covering design with the two tests below, not the product of backend x schedule x
    model x precision: every (schedule, model) pair under aot_eager (zbv with Llama in
    bf16), inductor on the V placement with Llama."""
    _run(sched, kind, "aot_eager")


@pytest.mark.bitwise
def test_compiled_blocks_under_autocast_bf16_match_compiled_reference_bitwise() -> None:
    _run("zbv", "llama", "aot_eager", amp=True)


@pytest.mark.slow
def test_inductor_blocks_under_split_schedules_match_compiled_reference_bitwise() -> None:
    _run("zbv", "llama", "inductor")


def test_graph_split_modules_and_their_ancestors_stay_uncompiled() -> None:
    model = _pipeline_model("llama")
    enable_bw_split(model, WeightGradStore(), _without_norm_rule())  # norms: graph-level split
    names = compile_between_splits(model, backend="aot_eager")
    # Blocks hold graph-split norms: neither they nor the model are compiled; the
    # embedding module is; split layers need nothing (they stay eager anyway).
    assert names == ["0"]
    assert model[0]._compiled_call_impl is not None
    assert all(m._compiled_call_impl is None for m in model[1].modules())
    assert model._compiled_call_impl is None
