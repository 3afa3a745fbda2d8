"""Segment schedules on the executor: P ranks (gloo) against one process.

Bitwise against :func:`unit_reference`: the whole (unsplit) model in one process doing
what the pipeline does per unit (segments forward in order, backward last first, each
loss a sum over the segment's tokens over the batch's count, parameter gradients added
in unit order). Against the whole sequence in one pass nothing is bitwise (shorter GEMMs
and softmax rows sum in another order, gradients over segments in another order; see
tests/test_kv_segments.py), so that comparison is held to float32 tolerances at the
values' scale.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import zerobubble
from generated import generated
from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.interop import hf
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.partition import build_stage_modules, model_name, stage_bounds
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.sequence.batch import segment_step
from zerobubble.runtime.sequence.kv import SegmentOf
from zerobubble.runtime.stage import StageChunk, StageChunkError
from zerobubble.runtime.step_batch import StepBatch
from zerobubble.trace.check import check_trace

IGNORE = -100
T = 16


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def model_and_batch(
    model: str, num_stages: int, m: int, dropout: float = 0.0
) -> tuple[list[nn.Module], Any, torch.Tensor]:
    """Our GPT or a tiny HF Llama (sdpa) of num_stages blocks, and 2m+1 rows; ``dropout``:
    every dropout's (the GPT's, the Llama's attention dropout).

    GPT: the last labels of every other row ignored (padding at the end). Llama: a padding
    mask (row 1 padded on the left, row 2 on the right), the labels shifted once for the
    whole sequence (position t scores label t+1; a loss that shifts inside each call would
    lose every segment's last target) and ignored where they or the position are padding.
    """
    gen = torch.Generator().manual_seed(7)
    n = 2 * m + 1
    if model == "gpt":
        cfg = GPTConfig(
            vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=num_stages, dropout=dropout
        )
        x = torch.randint(0, 17, (n, T), generator=gen)
        y = torch.randint(0, 17, (n, T), generator=gen)
        for row in range(0, n, 2):
            y[row, T - 1 - row % T :] = IGNORE
        return list(build_gpt(cfg)), x, y
    llama = hf.tiny_model(
        "hf-llama",
        attn_implementation="sdpa",
        num_hidden_layers=num_stages,
        tie_word_embeddings=False,
        attention_dropout=dropout,
    ).train()
    ids = torch.randint(3, 256, (n, T), generator=gen)
    mask = torch.ones(n, T, dtype=torch.long)
    mask[1, :5] = 0
    mask[2, 11:] = 0
    y = torch.full((n, T), IGNORE)
    y[:, :-1] = ids[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), IGNORE)
    return hf.causal_lm_layers(llama, check=False), {"input_ids": ids, "attention_mask": mask}, y


def unit_reference(
    layers: list[nn.Module],
    x: Any,
    y: torch.Tensor,
    m: int,
    cuts: tuple[int, ...],
    total: int | None = None,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The pipeline's arithmetic in one process (:func:`zerobubble.segment_reference_step`),
    the gradients under the layers' own names; ``total``: the count of every replica's
    batch (default: this batch's)."""
    counter = count if total is None else (lambda _: total)
    losses, _ = zerobubble.segment_reference_step(
        layers, token_loss, x, target=y, microbatches=m, cuts=cuts, count_fn=counter
    )
    model = nn.Sequential(*layers)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def split_rows(x: Any, m: int, j: int) -> Any:
    """Microbatch j of a tensor or a mapping of tensors, as the executor splits them."""
    if isinstance(x, dict):
        return {k: torch.tensor_split(v, m)[j] for k, v in x.items()}
    return torch.tensor_split(x, m)[j]


@functools.cache
def references(
    model: str, num_stages: int, m: int, cuts: tuple[int, ...]
) -> tuple[list, dict, list, dict]:
    """(unit losses, unit-order grads, one-pass losses, one-pass grads)."""
    layers, x, y = model_and_batch(model, num_stages, m)
    seg_losses, seg_grads = unit_reference(layers, x, y, m, cuts)
    one_losses, user_grads = reference_step(
        layers, token_loss, x, target=y, microbatches=m, count_fn=count
    )
    keys = tuple(str(i) for i in range(len(layers)))
    one_grads = {name: user_grads[model_name(name, keys, layers)] for name in seg_grads}
    return seg_losses, seg_grads, one_losses, one_grads


def stage_step_grads(
    sched: Any, layers: list[nn.Module], x: Any, y: torch.Tensor, cuts: tuple[int, ...], rank: int
) -> tuple[PipelineExecutor, list[torch.Tensor] | None, dict[str, torch.Tensor]]:
    """One step of this rank's stages with ``cuts``: the executor, its losses, and every
    gradient under the whole model's layer index (``"<layer>.<name>"``)."""
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(
        sched, stages, loss_fn=token_loss, count_fn=count, options=ExecutorOptions(cuts=cuts)
    )
    losses = pipe.step(x, target=y)
    return pipe, losses, layer_grads(pipe, len(layers))


def layer_grads(pipe: PipelineExecutor, num_layers: int) -> dict[str, torch.Tensor]:
    """This rank's gradients under the whole model's layer index (``"<layer>.<name>"``)."""
    bounds = stage_bounds(num_layers, pipe.schedule.num_stages)
    grads = {}
    for s, chunk in pipe.chunks.items():
        for name, param in chunk.module.named_parameters():
            local, rest = name.split(".", 1)
            grads[f"{bounds[s].start + int(local)}.{rest}"] = param.grad
    return grads


def seq_job(model: str, kind: str, p: int, m: int, k: int, cuts: tuple[int, ...]) -> dict:
    rank = init_distributed(timeout_s=60).rank
    sched = generated(kind, p, m, segments=k)
    layers, x, y = model_and_batch(model, sched.num_stages, m)
    pipe, losses, grads = stage_step_grads(sched, layers, x, y, cuts, rank)
    held = pipe.held_bytes()
    dist.destroy_process_group()
    return {"losses": losses, "grads": grads, "held": held, "events": list(pipe.trace.events)}


def check(results: list[dict], model: str, num_stages: int, m: int, cuts: tuple[int, ...]) -> None:
    seg_losses, seg_grads, one_losses, one_grads = references(model, num_stages, m, cuts)
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == sorted(seg_grads)
    assert all(r["held"] == 0 for r in results)
    k = len(cuts) - 1
    report = check_trace([e for r in results for e in r["events"]], segments=k)
    assert report.ok, report.first
    assert all(map(torch.equal, losses, seg_losses)), (losses, seg_losses)
    for name, g in grads.items():
        assert torch.equal(g, seg_grads[name]), name
    torch.testing.assert_close(sum(losses), sum(one_losses), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in one_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, one_grads[name], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.bitwise
@pytest.mark.parametrize(
    ("model", "kind", "p", "k", "cuts"),
    [
        ("gpt", "seq1f1b", 2, 2, (0, 9, 16)),
        ("gpt", "seq-zb", 2, 4, (0, 6, 10, 13, 16)),
        ("gpt", "seq1f1b", 3, 4, (0, 1, 2, 15, 16)),
        ("gpt", "seq-zb", 3, 2, (0, 12, 16)),
        ("llama", "seq-zb", 2, 2, (0, 10, 16)),
        ("llama", "seq1f1b", 3, 4, (0, 3, 7, 12, 16)),
        ("gpt", "seq-zbv", 2, 2, (0, 9, 16)),  # the V: two stages per rank
    ],
)
def test_segment_schedules_match_the_segments_of_one_process(model, kind, p, k, cuts):
    m = 3
    results = launch(seq_job, p, model, kind, p, m, k, cuts, timeout=240)
    check(results, model, generated(kind, p, m, segments=k).num_stages, m, cuts)


# ---- what a stage refuses ------------------------------------------------------------------


def _stage0() -> StageChunk:
    cfg = GPTConfig(vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=2)
    return StageChunk(nn.Sequential(*list(build_gpt(cfg))[:2]), 0, 2)


def test_a_stage_runs_a_sequence_forward_in_order_and_backward_last_first():
    chunk = _stage0()
    x = torch.randint(0, 17, (2, T), generator=torch.Generator().manual_seed(0))
    first, second = SegmentOf(0, 0, 2, 0), SegmentOf(0, 1, 2, 8)
    with pytest.raises(StageChunkError, match="segment 1 of microbatch 0 forwarded after 0 of"):
        chunk.forward(1, x[:, 8:], segment=second)
    y0 = chunk.forward(0, x[:, :8], segment=first)
    y1 = chunk.forward(1, x[:, 8:], segment=second)
    with pytest.raises(StageChunkError, match="backward of segment 0 of microbatch 0 before that"):
        chunk.backward_input(0, torch.ones_like(y0))
    chunk.backward_input(1, torch.ones_like(y1))
    chunk.backward_input(0, torch.ones_like(y0))
    chunk.backward_weight(1)
    chunk.backward_weight(0)
    assert chunk.pending() == {} and chunk.held_bytes() == 0


# (model, kind, k, cuts, recompute): P = 2, seq-zb (a stage per rank) and seq-zbv (the V, two
# stages per rank), k = 2..4, both modes on both models, dropout drawn in every stage
RECOMPUTED = [
    ("gpt", "seq-zb", 2, (0, 9, 16), "stage"),
    ("gpt", "seq-zb", 4, (0, 6, 10, 13, 16), "layers"),
    ("gpt", "seq-zbv", 3, (0, 5, 11, 16), "layers"),
    ("gpt", "seq-zbv", 4, (0, 1, 2, 15, 16), "stage"),
    ("llama", "seq-zb", 3, (0, 4, 10, 16), "layers"),
    ("llama", "seq-zbv", 2, (0, 10, 16), "stage"),
    ("llama", "seq-zbv", 4, (0, 3, 7, 12, 16), "layers"),
]
DROPOUT = 0.2


def recomputed_job(cases: list[tuple]) -> list[dict]:
    """Every case of :data:`RECOMPUTED` in one launch: this rank's losses and gradients."""
    rank = init_distributed(timeout_s=60).rank
    out = []
    for model, kind, k, cuts, recompute in cases:
        sched = generated(kind, 2, 3, segments=k)
        layers, x, y = model_and_batch(model, sched.num_stages, 3, DROPOUT)
        stages = build_stage_modules(layers, sched, rank)
        options = ExecutorOptions(cuts=cuts, recompute=recompute)
        pipe = PipelineExecutor(sched, stages, loss_fn=token_loss, count_fn=count, options=options)
        losses = pipe.step(x, target=y)
        out.append(
            {"losses": losses, "grads": layer_grads(pipe, len(layers)), "held": pipe.held_bytes()}
        )
    dist.destroy_process_group()
    return out


@pytest.mark.bitwise
def test_recomputed_segments_are_bitwise_the_one_reference():
    """Recompute ("stage" and "layers") on segment schedules: a checkpointed region's
    replay in B runs in its segment's scope over the past keys and values F read, so the
    losses and every gradient (the past keys' and values' included, through the earlier
    segments' backwards) are bitwise ``zerobubble.reference_step(cuts=...)``'s, dropout too."""
    results = launch(recomputed_job, 2, RECOMPUTED, timeout=240)
    for i, (model, kind, k, cuts, recompute) in enumerate(RECOMPUTED):
        case = (model, kind, k, recompute)
        num_stages = generated(kind, 2, 3, segments=k).num_stages
        layers, x, y = model_and_batch(model, num_stages, 3, DROPOUT)
        want_losses, want = zerobubble.reference_step(
            layers, token_loss, x, target=y, microbatches=3, cuts=cuts, count_fn=count,
            seed=0, num_stages=num_stages,
        )  # fmt: skip
        keys = tuple(str(j) for j in range(len(layers)))
        runs = [r[i] for r in results]
        assert all(r["held"] == 0 for r in runs), case
        losses = next(r["losses"] for r in runs if r["losses"] is not None)
        assert all(map(torch.equal, losses, want_losses)), case
        grads = {n: g for r in runs for n, g in r["grads"].items()}
        assert {model_name(n, keys, layers) for n in grads} == {
            n for n, g in want.items() if g is not None
        }, case
        bad = [n for n, g in grads.items() if not torch.equal(g, want[model_name(n, keys, layers)])]
        assert not bad, (case, bad)


def test_a_loss_that_shifts_labels_is_refused_with_segments():
    class Shifting:
        shifts_labels = True

        def __call__(self, out, labels, num_items):  # pragma: no cover - never called
            raise AssertionError

    sched = generated("seq-zb", 1, 2, segments=2)
    with pytest.raises(ValueError, match="shifts the labels inside each call"):
        PipelineExecutor(
            sched,
            {0: nn.Sequential(nn.Linear(2, 2))},
            loss_fn=Shifting(),
            count_fn=count,
            options=ExecutorOptions(cuts=(0, 8, 16)),
        )


def test_a_batch_of_another_length_is_refused_naming_both():
    batch = StepBatch(inputs=[((torch.zeros(1, 12, dtype=torch.long),), {})])
    with pytest.raises(
        ValueError, match=r"sequences of 12 tokens but the segment cuts \[0, 8, 16\]"
    ):
        segment_step(batch, (0, 8, 16))
    cut = segment_step(StepBatch(inputs=[((torch.arange(16)[None],), {})]), (0, 8, 16))
    assert cut.inputs is not None
    assert [a[0].tolist() for a, _ in cut.inputs] == [[list(range(8))], [list(range(8, 16))]]


def test_an_attention_layer_that_cannot_see_earlier_segments_is_refused():
    stage = nn.Sequential(nn.Embedding(17, 8), nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0))
    chunk = StageChunk(stage, 0, 2, split=False)
    with pytest.raises(ValueError, match=r"stage 0: attention layer 1.self_attn \(MultiheadAtt"):
        chunk.forward(0, torch.zeros(1, 8, dtype=torch.long), segment=SegmentOf(0, 0, 2, 0))


# ---- the optimizer's protocols -------------------------------------------------------------

MODES = {
    "sync": OptimConfig(max_norm=1.0),
    "cons": OptimConfig(mode="conservative", max_norm=1.0),
    "spec": OptimConfig(mode="speculative", max_norm=1.0),
}


def trained_job(kind: str, mode: str, p: int, k: int, cuts: tuple[int, ...]) -> tuple:
    """Four optimizer steps; a NaN in the last stage's gradient of unit 0 at step 1, which
    only the full gradient shows (speculation rolls back and the step is skipped)."""
    rank = init_distributed(timeout_s=60).rank
    sched = generated(kind, p, 3, segments=k)
    layers, x, y = model_and_batch("gpt", sched.num_stages, 3)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(
        sched, stages, loss_fn=token_loss, count_fn=count, options=ExecutorOptions(cuts=cuts)
    )
    params = [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]
    opt = torch.optim.AdamW(params, lr=0.02)
    faults = FaultPlan(grads=(GradFault(1, sched.num_stages - 1, mb=0),))
    trainer = PipelineTrainer(pipe, opt, MODES[mode], faults=faults)
    for _ in range(4):
        trainer.step(x, target=y)
    trainer.drain()
    out = [q.detach().clone() for q in params]
    dist.destroy_process_group()
    return out, pipe.replays


@pytest.mark.parametrize(("kind", "p", "k", "cuts"), [("seq-zb", 2, 2, (0, 9, 16))])
def test_post_validation_modes_train_segments_as_sync_does_bitwise(kind, p, k, cuts):
    runs = {mode: launch(trained_job, p, kind, mode, p, k, cuts, timeout=240) for mode in MODES}
    for mode in ("cons", "spec"):
        for rank in range(p):
            assert all(map(torch.equal, runs[mode][rank][0], runs["sync"][rank][0])), (mode, rank)
    assert runs["spec"][0][1] > 0  # the NaN made speculation replay


# ---- data parallel ---------------------------------------------------------------------------


def dp_job(kind: str, pp: int, dp: int, k: int, cuts: tuple[int, ...]) -> dict:
    """One step of a (pp, dp) mesh; replica r takes its share of the rows."""
    init_distributed(timeout_s=60)
    mesh = build_mesh(pp, dp)
    sched = generated(kind, pp, 3, segments=k)
    layers, x, y = model_and_batch("gpt", sched.num_stages, 6)
    part = slice(mesh.dp_rank * 7, (mesh.dp_rank + 1) * 7 - mesh.dp_rank)  # 7 and 6 rows
    pipe = zerobubble.Pipeline(
        layers, token_loss, sched, mesh=mesh, options=ExecutorOptions(cuts=cuts), count_fn=count
    )
    pipe.step(x[part], target=y[part])
    grads = {n: q.grad.clone() for n, q in pipe.named_parameters()}
    dist.destroy_process_group()
    return grads


def test_data_parallel_segment_pipelines_sum_the_replicas_bitwise():
    cuts = (0, 9, 16)
    results = launch(dp_job, 4, "seq-zb", 2, 2, 2, cuts, timeout=240)
    layers, x, y = model_and_batch("gpt", 2, 6)
    total = count(y)
    replicas = [
        unit_reference(copy.deepcopy(layers), x[rows], y[rows], 3, cuts, total)[1]
        for rows in (slice(0, 7), slice(7, 13))
    ]
    grads = {n: g for r in results for n, g in r.items()}
    assert sorted(grads) == sorted(replicas[0])
    for name, g in grads.items():
        assert torch.equal(g, replicas[0][name] + replicas[1][name]), name
    # the one reference composes the same: dp=2 x segments in one call
    _, composed = zerobubble.reference_step(
        copy.deepcopy(layers), token_loss, x, target=y, microbatches=3, dp=2, cuts=cuts,
        count_fn=count,
    )  # fmt: skip
    for name, g in grads.items():
        assert torch.equal(g, composed[name]), name


def tp_job(cuts: tuple[int, ...]) -> dict:
    """pp2 x tp2 seq-zb (k=2), with and without sequence parallelism: the pipeline's losses
    and gradients, and the one reference's (tp and segments composed) on the same batch."""
    init_distributed(timeout_s=60)
    out: dict = {}
    for sp in (False, True):
        mesh = build_mesh(2, tp=2, sequence_parallel=sp)
        sched = generated("seq-zb", 2, 3, segments=2)
        _, x, y = model_and_batch("gpt", sched.num_stages, 3)
        cfg = GPTConfig(vocab_size=18, max_seq_len=T, d_model=8, n_heads=2, n_layers=2)
        layers = list(build_gpt(cfg))  # a vocab tp divides (ids and labels < 17)
        options = ExecutorOptions(cuts=cuts)
        pipe = zerobubble.Pipeline(
            copy.deepcopy(layers), token_loss, sched, mesh=mesh, options=options, count_fn=count
        )
        losses = pipe.step(x, target=y)
        want_losses, want = zerobubble.reference_step(
            layers, token_loss, x, target=y, microbatches=3, cuts=cuts, tp_mesh=mesh.tp_mesh,
            sequence_parallel=sp, num_stages=sched.num_stages, count_fn=count,
        )  # fmt: skip
        got = {n: q.grad for n, q in pipe.named_parameters()}
        try:  # a cut tp does not divide
            zerobubble.Pipeline(
                layers, token_loss, sched, mesh=mesh, options=ExecutorOptions(cuts=(0, 7, 16)),
                count_fn=count,
            )  # fmt: skip
            refused = ""
        except ValueError as e:
            refused = str(e)
        out[sp] = {
            "refused": refused,
            "names": sorted(got),
            "bad": [n for n, g in got.items() if not same_shard(g, want[n])],
            "losses": None if losses is None else all(map(torch.equal, losses, want_losses)),
        }
    dist.destroy_process_group()
    return out


def same_shard(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same local shard in the same layout (or the same plain tensor)."""
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        return (
            isinstance(a, DTensor)
            and isinstance(b, DTensor)
            and a.placements == b.placements
            and torch.equal(a.to_local(), b.to_local())
        )
    return torch.equal(a, b)


def test_segments_with_tensor_parallelism_are_bitwise_the_one_reference():
    """pp2 x tp2, seq-zb at k=2 cut at 8 of 16 tokens (each segment a multiple of tp, as
    sequence parallelism needs): every rank's gradient shards and the last stage's losses
    equal :func:`zerobubble.reference_step` with ``tp_mesh`` and ``cuts`` bitwise. A cut at
    7 is refused with sequence parallelism, naming the cuts, and runs without it."""
    results = launch(tp_job, 4, (0, 8, 16), timeout=240)
    for rank, out in enumerate(results):
        for sp, r in out.items():
            assert r["names"] and r["bad"] == [], (rank, sp, r["bad"])
            assert r["losses"] is not False, (rank, sp)
            if sp:
                assert "cuts=[0, 7, 16]) with sequence parallelism over tp=2" in r["refused"]
                assert "must be a multiple of 2 (not [7])" in r["refused"], r["refused"]
            else:
                assert r["refused"] == "", r["refused"]
    assert sum(r[sp]["losses"] is True for r in results for sp in (False, True)) == 4


def test_check_trace_with_segments_names_a_segment_run_out_of_order():
    results = launch(seq_job, 2, "gpt", "seq1f1b", 2, 3, 2, (0, 9, 16), timeout=240)
    events = [e for r in results for e in r["events"]]
    assert check_trace(events, segments=2).ok

    # Swap the labels of microbatch 0's two segments everywhere (computes and messages):
    # every message still pairs up, but each stage now runs segment 1 before segment 0.
    def swap(e):
        mb = 1 - e.mb if e.mb in (0, 1) else e.mb
        msg = e.msg
        if msg is not None and msg[3] in (0, 1):
            msg = (*msg[:3], 1 - msg[3])
        return dataclasses.replace(e, mb=mb, msg=msg)

    swapped = [swap(e) for e in events]
    report = check_trace(swapped, segments=2)
    assert report.first is not None and report.first.check == "edge"
    assert "consumes the output of F(s0,mb0)" in str(report.first), report.first
    assert check_trace(swapped).ok  # without the segment count the order is not known


# ---- the cuts ------------------------------------------------------------------------------


def test_cuts_take_any_integers_and_name_what_is_not_one():
    import numpy as np

    from zerobubble.runtime.sequence.batch import check_cuts

    for cuts in (np.array([0, 9, 16]), [np.int64(0), np.int32(9), 16], torch.tensor([0, 9, 16])):
        taken = ExecutorOptions(cuts=cuts).cuts
        assert taken == (0, 9, 16) and all(type(b) is int for b in taken)
        assert check_cuts(cuts, 2) == (0, 9, 16)
    for bad, message in [
        ((0, 9.0, 16), r"cuts\[1\] is 9.0 \(float\), not a token position"),
        ((0, True, 16), r"cuts\[1\] is True, not a token position"),
        (8, "cuts must be a sequence of token positions, got int"),
    ]:
        with pytest.raises(ValueError, match=message):
            ExecutorOptions(cuts=bad)
    # numpy cuts run the segment reference as Python ints do, bitwise
    layers, x, y = model_and_batch("gpt", 2, 1)
    twin = copy.deepcopy(layers)
    plain = zerobubble.segment_reference_step(
        layers, token_loss, x, target=y, microbatches=1, cuts=(0, 9, 16), count_fn=count
    )
    numpy = zerobubble.segment_reference_step(
        twin, token_loss, x, target=y, microbatches=1, cuts=np.array([0, 9, 16]), count_fn=count
    )
    assert torch.equal(plain[0][0], numpy[0][0])


def test_cuts_given_to_a_schedule_without_segments_are_refused_naming_it():
    stages = {0: _stage0().module}
    with pytest.raises(
        ValueError,
        match=r"schedule '1f1b' runs whole sequences \(no segments\), but ExecutorOptions\(cuts="
        r"\[0, 8, 16\]\) was given and would be ignored: generate a segment schedule",
    ):
        PipelineExecutor(
            generated("1f1b", 1, 2),
            stages,
            loss_fn=token_loss,
            count_fn=count,
            options=ExecutorOptions(cuts=(0, 8, 16)),
        )
