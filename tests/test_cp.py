"""Context parallelism (pp x cp, gloo): bitwise ``zerobubble.reference_step(cp=...)``.

Every case runs through ``zerobubble.Pipeline`` (its tie reduction called after the step).
One launch of pp=2 x cp=2 (4 ranks) runs our GPT (with dropout, seeded: the all-gather;
without, its LM head tied to the embedding: the ring; under zbv with the stage recomputed
in B; under the segment schedules, each segment sharded over the cp ranks, the ring or the
gathers carrying the earlier segments' keys) and a tiny HF Llama (4 query heads over 2
key/value heads) whose decoder blocks run the ring (sdpa under zb-h1, eager under zbv: the
V, two stages per rank) or, with attention dropout (seeded), the all-gather; every rank's
losses and every gradient after the cp reduction are ``torch.equal`` the composed
reference's, which plays the cp ranks in threads (:mod:`zerobubble.reference.cp`). Against
the model run whole on one process (plain autograd) the cases without dropout agree within
float32 rounding at the values' scale. A second launch (8 ranks) adds dp=2 (two of the
cases), cp=4 (the GPT's gathers, its ring over segments and the sdpa Llama's ring) and
tensor parallelism: pp=2 x cp=2 x tp=2, two cases without and two with sequence
parallelism, and pp=1 x dp=2 x cp=2 x tp=2 with it, each rank's local shards
``torch.equal`` the composed reference run on the same ranks (``reference_step(cp=2,
cp_group=, tp_mesh=)``: each process plays its own cp rank over the mesh's cp group), whose
gradients gathered whole are the whole model's within float32 rounding. In one process:
Qwen3 (q_norm, k_norm) under the ring within rounding of the whole model; the ring's blocks
save no tensor of the whole sequence's length (the gather's do); what the ring cannot
honour (soft cap, sinks, sliding window, output_attentions) is refused.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch import nn
from torch.distributed.tensor import DTensor

import zerobubble
from generated import generated
from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.interop import hf
from zerobubble.interop.hf_layers import DecoderBlock
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.optim.checkpoint import save_checkpoint
from zerobubble.parallel.ep import LocalGroup, Turns
from zerobubble.parallel.mesh import ParallelSpec, build_mesh
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.reference.ep import TurnTaking
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.sequence.cp import (
    ContextShards,
    ContextSlot,
    context_parallel,
    ring_attention,
    shard_batch,
)

IGNORE = -100
T = 16
M = 2
CASES = [  # pp=2 x cp=2; under zbv and seq-zbv recompute="stage"
    ("gpt", "zb-h1"),  # attention dropout: the all-gather
    ("gpt-ring", "zbv"),  # no dropout: the ring
    ("llama-sdpa", "zb-h1"),  # the ring, grouped kv heads repeated to the query heads
    ("llama-eager", "zbv"),
    ("llama-dropout", "zb-h1"),  # sdpa with attention dropout: the all-gather
    ("gpt-ring", "seq-zb"),  # segments: the ring carries the earlier segments' keys
    ("gpt-ring", "seq-zbv"),  # three uneven segments, recomputed
    ("gpt", "seq-zbv"),  # segments with attention dropout: the earlier segments gathered
]
DROPOUT = ("gpt", "llama-dropout")  # seeded draws: bitwise the reference, not the whole model
SEGMENTS = {"seq-zb": (0, 8, T), "seq-zbv": (0, 4, 8, T)}
"""The cuts of each segment schedule (every segment a multiple of 2 * cp tokens)."""
CUTS = ExecutorOptions(cuts=(0, 6, T))  # segment 0 has 6 tokens: refused at cp=2
WITH_DP = [("gpt-ring", "zbv"), ("llama-sdpa", "zb-h1")]  # pp=2 x dp=2 x cp=2
CP4 = [("gpt", "zbv"), ("gpt-ring", "seq-zb"), ("llama-sdpa", "zbv")]  # pp=2 x cp=4
PP4 = [("gpt-ring", "seq-zbv"), ("llama-eager", "zbv")]  # pp=4 x cp=2: P >= 3 on the V
TP_LAYOUTS = [  # (model, kind, pp, dp, sequence parallel): cp=2 x tp=2
    ("gpt-ring", "zbv", 2, 1, False),
    ("llama-sdpa", "zb-h1", 2, 1, False),
    ("gpt", "zb-h1", 2, 1, True),
    ("llama-eager", "zbv", 2, 1, True),
    ("gpt-ring", "zb-h1", 1, 2, True),  # pp=1 x dp=2: the reference's dp sums
]


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def model_and_batch(model: str, layers: int, rows: int) -> tuple[list[nn.Module], Any, Any]:
    """Our GPT (dropout 0.1; "gpt-ring" none) or a tiny HF Llama of ``layers`` blocks, and
    ``rows`` rows of T tokens (some labels ignored; the Llama's shifted once for the whole
    sequence)."""
    gen = torch.Generator().manual_seed(3)
    if model.startswith("gpt"):
        ring = model == "gpt-ring"
        cfg = GPTConfig(
            vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=layers,
            dropout=0.0 if ring else 0.1, tie_embeddings=ring,
        )  # fmt: skip
        x = torch.randint(0, 17, (rows, T), generator=gen)
        y = torch.randint(0, 17, (rows, T), generator=gen)
        y[0, -3:] = IGNORE
        return list(build_gpt(cfg)), x, y
    attn = model.split("-")[1]
    llama = hf.tiny_model(
        "hf-llama",
        attn_implementation="sdpa" if attn == "dropout" else attn,
        attention_dropout=0.1 if attn == "dropout" else 0.0,
        num_hidden_layers=layers,
        tie_word_embeddings=False,
    ).train()
    ids = torch.randint(3, 256, (rows, T), generator=gen)
    y = torch.full((rows, T), IGNORE)
    y[:, :-1] = ids[:, 1:]
    return hf.causal_lm_layers(llama, check=False), {"input_ids": ids}, y


def cp_job(world: int) -> dict:
    """pp=2 x cp=2 on 4 ranks; pp=2 x dp=2 x cp=2, pp=2 x cp=4, pp=4 x cp=2, then pp=2 x
    cp=2 x tp=2 without and with sequence parallelism on 8."""
    init_distributed(timeout_s=60)
    out: dict[str, Any] = {}
    layouts = [(2, 1, 2, CASES)] if world == 4 else [(2, 2, 2, WITH_DP), (2, 1, 4, CP4)]
    layouts += [] if world == 4 else [(4, 1, 2, PP4)]
    for pp, dp, cp, cases in layouts:
        mesh = build_mesh(pp, dp, cp=cp)
        for model, kind in cases:
            out[model, kind, pp, dp, cp] = run_case(mesh, model, kind)
            out[model, kind, pp, dp, cp]["at"] = (mesh.dp_rank * cp + mesh.cp_rank) * M
    if world == 8:
        meshes: dict[tuple[int, int, bool], Any] = {}
        for model, kind, pp, dp, sp in TP_LAYOUTS:  # each mesh built once, in list order
            if (pp, dp, sp) not in meshes:
                meshes[pp, dp, sp] = build_mesh(pp, dp, cp=2, tp=2, sequence_parallel=sp)
            out[model, kind, pp, dp, sp] = run_tp_case(meshes[pp, dp, sp], model, kind)
        out["refused_tp"] = reference_refusals(meshes[2, 1, False])
    if world == 4:
        out["refused"] = refusals(mesh)
    dist.destroy_process_group()
    return out


def schedule(kind: str, pp: int = 2) -> Any:
    """``kind`` at P=pp, M=2 (a segment kind cut at :data:`SEGMENTS`)."""
    cuts = SEGMENTS.get(kind)
    if cuts is None:
        return generated(kind, pp, M)
    return generated(kind, pp, M, segments=len(cuts) - 1)


def run_case(mesh: Any, model: str, kind: str) -> dict:
    """One step of ``model`` under ``kind`` on ``mesh``: this rank's losses and gradients."""
    pipe, losses = pipeline_step(mesh, model, kind)
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    blocks = [m for c in pipe.executor.chunks.values() for m in c.module.modules()
              if isinstance(m, DecoderBlock)]  # fmt: skip
    rings = {b.runs_ring for b in blocks}  # the HF blocks: all ring, or all gather
    return {"losses": losses, "grads": grads, "held": pipe.executor.held_bytes(), "rings": rings}


def pipeline_step(mesh: Any, model: str, kind: str) -> tuple[zerobubble.Pipeline, Any]:
    """The pipeline of ``model`` under ``kind`` on ``mesh`` after one step, and its losses."""
    dp = mesh.dp_size
    sched = schedule(kind, mesh.pp_size)
    layers, x, y = model_and_batch(model, sched.num_stages, M * dp)
    recompute = "stage" if kind.endswith("zbv") else "none"
    pipe = zerobubble.Pipeline(
        layers, token_loss, sched, mesh=mesh, count_fn=count,
        options=ExecutorOptions(seed=5, recompute=recompute, cuts=SEGMENTS.get(kind)),
    )  # fmt: skip
    # every rank passes its dp part of whole sequences; the executor takes its chunks
    part = torch.tensor_split(torch.arange(M * dp), dp)[mesh.dp_rank]
    xs = x[part] if isinstance(x, torch.Tensor) else {k: v[part] for k, v in x.items()}
    losses = pipe.step(xs, target=y[part])
    pipe.tied.reduce(0)  # the tie's stage gradients summed (a trainer's step does it)
    return pipe, losses


def local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if isinstance(g, DTensor) else g


def run_tp_case(mesh: Any, model: str, kind: str) -> dict:
    """One step under tp and cp, and the composed reference on the same ranks (collective
    over their tp mesh and cp group): the names whose local shards differ, whether this
    rank's losses are the reference's, and the reference gathered whole."""
    pipe, losses = pipeline_step(mesh, model, kind)
    num_stages, dp = generated(kind, mesh.pp_size, M).num_stages, mesh.dp_size
    layers, x, y = model_and_batch(model, num_stages, M * dp)
    want_losses, want = zerobubble.reference_step(
        layers, token_loss, x, target=y, microbatches=M, count_fn=count, num_stages=num_stages,
        dp=dp, cp=2, cp_group=mesh.cp_group, tp_mesh=mesh.tp_mesh,
        sequence_parallel=mesh.spec.sequence_parallel, seed=5,
    )  # fmt: skip
    mine = dict(pipe.named_parameters())
    bad = [n for n, p in sorted(mine.items()) if not torch.equal(local(p.grad), local(want[n]))]
    same = None
    if losses is not None:
        at = (mesh.dp_rank * 2 + mesh.cp_rank) * M
        same = all(map(torch.equal, losses, want_losses[at : at + M]))
    whole = {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in sorted(want.items())}
    return {"names": sorted(mine), "bad": bad, "losses": same, "want": (want_losses, whole)}


def refusals(mesh: Any) -> list[str]:
    """What the executor and the checkpoints refuse, before any collective, on every rank."""
    gpt, _, _ = model_and_batch("gpt", 2, M)
    llama, _, _ = model_and_batch("llama-sdpa", 1, M)  # one stage's block: every rank raises
    seq = generated("seq-zb", 2, M, segments=2)
    refused = []
    for layers, sched, kw in [
        (gpt, generated("zb-h1", 2, M), {}),  # no count_fn
        (gpt, seq, {"count_fn": count, "options": CUTS}),  # a segment of 6 tokens
        (llama, seq, {"count_fn": count, "options": ExecutorOptions(cuts=SEGMENTS["seq-zb"])}),
        (
            gpt,
            generated("zb-h1", 2, M),
            {"loss_fn": hf.CausalLMLoss(hf.tiny_model("hf-llama", num_hidden_layers=1))},
        ),
    ]:
        try:
            stages = build_stage_modules(layers, sched, mesh.pp_rank)
            PipelineExecutor(sched, stages, **{"loss_fn": token_loss, **kw}, mesh=mesh)
        except ValueError as e:
            refused.append(str(e))
    try:  # refused before the trainer is read
        save_checkpoint(None, "unused", mesh=mesh)  # type: ignore[arg-type]
    except ValueError as e:
        refused.append(str(e))
    return refused


def reference_refusals(mesh: Any) -> list[str]:
    """What ``reference_step`` refuses under tp with cp, before any collective: no cp group,
    and a cp group of another size than ``cp``."""
    layers, x, y = model_and_batch("gpt-ring", 2, M)
    kw = {"target": y, "microbatches": M, "count_fn": count, "tp_mesh": mesh.tp_mesh}
    refused = []
    for cp, group in ((2, None), (4, mesh.cp_group)):
        try:
            zerobubble.reference_step(layers, token_loss, x, cp=cp, cp_group=group, **kw)
        except ValueError as e:
            refused.append(str(e))
    return refused


@functools.cache
def reference(
    model: str, kind: str, dp: int, cp: int, pp: int = 2
) -> tuple[list, dict, list, dict]:
    """(composed reference losses and grads, whole-model losses and grads)."""
    num_stages = schedule(kind, pp).num_stages
    layers, x, y = model_and_batch(model, num_stages, M * dp)
    kw = {"target": y, "microbatches": M, "count_fn": count, "num_stages": num_stages}
    cuts = SEGMENTS.get(kind)
    losses, grads = zerobubble.reference_step(
        layers, token_loss, x, dp=dp, cp=cp, seed=5, cuts=cuts, **kw
    )
    for m in layers:  # the model run whole: dropout off, so the bound holds
        m.eval()
    whole, whole_grads = zerobubble.reference_step(layers, token_loss, x, **kw)
    return losses, grads, whole, whole_grads  # under the user's names, as the Pipeline's


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {world: launch(cp_job, world, world, timeout=240) for world in (4, 8)}


LAYOUTS = (  # (model, kind, pp, dp, cp)
    [(*c, 2, 1, 2) for c in CASES] + [(*c, 2, 2, 2) for c in WITH_DP]
    + [(*c, 2, 1, 4) for c in CP4] + [(*c, 4, 1, 2) for c in PP4]
)  # fmt: skip


@pytest.mark.bitwise
@pytest.mark.parametrize(("model", "kind", "pp", "dp", "cp"), LAYOUTS)
def test_pp_cp_matches_the_composed_reference(results, model, kind, pp, dp, cp):
    losses, grads, _, _ = reference(model, kind, dp, cp, pp)
    got: dict[str, torch.Tensor] = {}
    rings: set[bool] = set()  # whether the HF blocks ran the ring (some ranks hold none)
    for r in results[pp * dp * cp]:
        run = r[model, kind, pp, dp, cp]
        assert run["held"] == 0
        rings |= run["rings"]
        if run["losses"] is not None:  # the last stage's ranks: this cp rank's shares
            at = run["at"]
            assert all(map(torch.equal, run["losses"], losses[at : at + M]))
        for name, g in run["grads"].items():  # every cp and dp rank holds the sums
            assert torch.equal(g, grads[name]), name
            got[name] = g
    assert sorted(got) == sorted(grads)
    llama_ring = model.startswith("llama") and model not in DROPOUT
    assert rings == (set() if model.startswith("gpt") else {llama_ring})


@pytest.mark.parametrize(
    ("model", "kind", "pp", "dp", "cp"), [c for c in LAYOUTS if c[0] not in DROPOUT]
)
def test_pp_cp_is_the_whole_model_within_rounding(model, kind, pp, dp, cp):
    """Without dropout (the Llama, the GPT's ring), the ranks' shares sum to the whole
    batch's loss and every gradient is within float32 rounding at the largest gradient's
    scale."""
    losses, grads, whole, whole_grads = reference(model, kind, dp, cp, pp)
    torch.testing.assert_close(sum(losses), sum(whole), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, whole_grads[name], rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.bitwise
@pytest.mark.parametrize(("model", "kind", "pp", "dp", "sp"), TP_LAYOUTS)
def test_pp_cp_tp_matches_the_composed_reference(results, model, kind, pp, dp, sp):
    """pp=2 x cp=2 x tp=2: every rank's local shards and losses are the reference's, every
    parameter on some rank; the reference's gradients (gathered whole) and losses the same
    on every rank."""
    names: set[str] = set()
    for r in results[8]:
        run = r[model, kind, pp, dp, sp]
        assert run["names"] and not run["bad"], run["bad"]
        assert run["losses"] is not False
        names.update(run["names"])
        losses, grads = run["want"]
        first_losses, first = results[8][0][model, kind, pp, dp, sp]["want"]
        assert all(map(torch.equal, losses, first_losses))
        assert all(torch.equal(g, first[n]) for n, g in grads.items())
    assert sorted(names) == sorted(first)
    assert len(first_losses) == dp * 2 * M  # every dp and cp rank's shares


@pytest.mark.parametrize(
    ("model", "kind", "pp", "dp", "sp"), [c for c in TP_LAYOUTS if c[0] != "gpt"]
)
def test_pp_cp_tp_is_the_whole_model_within_rounding(results, model, kind, pp, dp, sp):
    """The tp x cp reference (so the pipeline) is the whole model within float32 rounding:
    the ranks' loss shares sum to its loss, every gradient gathered whole is its gradient."""
    losses, grads = results[8][0][model, kind, pp, dp, sp]["want"]
    _, _, whole, whole_grads = reference(model, kind, dp, 2, pp)
    torch.testing.assert_close(sum(losses), sum(whole), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    assert sorted(grads) == sorted(whole_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, whole_grads[name], rtol=1e-5, atol=1e-5 * scale)


def test_executor_refusals(results):
    for r in results[4]:
        no_count, uneven, hf_segments, shifting, checkpoint = r["refused"]
        assert "cannot save a checkpoint of a mesh with cp=2" in checkpoint
        assert "cp=2) needs count_fn" in no_count
        assert "segment 0 [0, 6) has 6 tokens, not a multiple of 2 * cp = 4" in uneven
        assert "move the cuts to multiples of 4" in uneven
        assert "(DecoderBlock) does not take sequence segments under context" in hf_segments
        assert "shifts labels inside each call" in shifting


def test_segment_layout() -> None:
    """Segments outer, cp inner: each segment cut into 2 * cp chunks, a rank's chunks of
    every segment side by side, its own tokens cut at the cuts / cp."""
    shards = [ContextShards(2, r, (0, 4, 12)) for r in range(2)]
    x = torch.arange(12).view(1, 12)
    assert [s.shard(x).tolist() for s in shards] == [[[0, 3, 4, 5, 10, 11]], [[1, 2, 6, 7, 8, 9]]]
    assert shards[0].local_cuts == (0, 2, 6)
    assert shards[0].positions(2).tolist() == [0, 3]
    assert shards[0].positions(4, start=2).tolist() == [4, 5, 10, 11]
    assert shards[1].positions(4, start=2).tolist() == [6, 7, 8, 9]
    batch = shard_batch({"input_ids": x, "labels": x}, shards[1], "the input batch")
    assert batch["labels"].tolist() == [[1, 2, 6, 7, 8, 9]]
    with pytest.raises(
        ValueError, match=r"segment 1 \[4, 10\) has 6 tokens, not a multiple of 2 \* cp"
    ):
        ContextShards(2, 0, (0, 4, 10))
    with pytest.raises(ValueError, match="sequences of 8 tokens but the segment cuts"):
        shards[0].shard(torch.zeros(1, 8))
    llama = hf.causal_lm_layers(hf.tiny_model("hf-llama", num_hidden_layers=1))
    with pytest.raises(
        ValueError, match=r"reference 1 \(DecoderBlock\) does not take sequence segments"
    ):
        zerobubble.reference_step(
            llama, token_loss, torch.zeros(1, 8, dtype=torch.long), target=torch.zeros(1, 8),
            microbatches=1, count_fn=count, cp=2, cuts=(0, 4, 8),
        )  # fmt: skip


def test_reference_refusals_under_tp(results):
    for r in results[8]:
        no_group, wrong_size = r["refused_tp"]
        assert "cp=2 and tp_mesh needs cp_group (the mesh's cp_group)" in no_group
        assert "cp=4 but cp_group has 2 ranks" in wrong_size


def test_layout_and_refusals() -> None:
    shards = [ContextShards(2, r) for r in range(2)]
    x = torch.arange(8).view(1, 8)
    assert [s.shard(x).tolist() for s in shards] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert shards[1].positions(4).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
        shards[0].shard(torch.zeros(1, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        shard_batch({"input_ids": x, "attention_mask": x}, shards[0], "the input batch")
    with pytest.raises(ValueError, match="expert parallelism with context parallelism"):
        ParallelSpec(2, 2, ep=2, cp=2)
    assert ParallelSpec(2, cp=2, tp=2).name(5) == "rank 5 (pp 1, cp 0, tp 1)"
    assert ParallelSpec(2, 2, cp=2).name(5) == "rank 5 (pp 1, dp 0, cp 1)"
    gpt2 = nn.Sequential(*hf.causal_lm_layers(hf.tiny_model("hf-gpt2", num_hidden_layers=1)))
    with pytest.raises(ValueError, match="stage 0 0 \\(GPT2Embedding\\) reads token positions"):
        context_parallel(gpt2, shards[0], LocalGroup(Turns(2), 0, 2), 0)
    llama = nn.Sequential(*hf.causal_lm_layers(hf.tiny_model("hf-llama", num_hidden_layers=1)))
    context_parallel(llama, shards[0], LocalGroup(Turns(2), 0, 2), 0)
    packed = {"input_ids": x[:, :4], "position_ids": torch.tensor([[0, 1, 0, 1]])}  # 2 documents
    with pytest.raises(ValueError, match="position ids other than the tokens' own"):
        llama[1](llama[0](**packed))
    with pytest.raises(ValueError, match="stage 3: 1 \\(MultiheadAttention\\) is an attention"):
        context_parallel(nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 1)), shards[0],
                         LocalGroup(Turns(2), 0, 2), 3)  # fmt: skip


class _Alone:
    """The exchange of a cp group of one rank: what it sends it receives."""

    def exchange(self, rank: int, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
        return blocks


def test_ring_over_past_segments_is_attention_over_the_joined_keys() -> None:
    """A segment's ring (one cp rank: its chunks in order) over two earlier segments' pieces
    is causal attention of its queries over the joined keys (within float32 rounding),
    gradients of the pieces included; it saves the pieces themselves, no joined copy."""
    slot = ContextSlot(ContextShards(1, 0), _Alone(), "test")
    gen = torch.Generator().manual_seed(0)
    q, k, v, *pieces = (torch.randn(2, 2, n, 4, generator=gen).requires_grad_()
                        for n in (4, 4, 4, 6, 2, 6, 2))  # fmt: skip
    past = (pieces[:2], pieces[2:])
    out = ring_attention(q, k, v, slot, 0.5, past=past)
    keys, values = torch.cat([*past[0], k], dim=2), torch.cat([*past[1], v], dim=2)
    future = torch.ones(4, 12, dtype=torch.bool).triu(9)  # queries at positions 8..11
    expect = torch.softmax((q @ keys.transpose(-2, -1) * 0.5).masked_fill(future, -torch.inf), -1)
    expect = expect @ values
    torch.testing.assert_close(out, expect)
    saved = out.grad_fn.saved_tensors
    assert all(any(s.data_ptr() == p.data_ptr() for s in saved) for p in pieces)
    assert all(s.shape[2] <= 8 for s in saved)  # nothing of the joined 12 tokens
    dout = torch.randn(out.shape, generator=gen)
    got = torch.autograd.grad(out, [q, k, v, *pieces], dout)
    want = torch.autograd.grad(expect, [q, k, v, *pieces], dout)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def hf_cp_step(model: nn.Module, cp: int, rows: int = 1) -> tuple[list, dict, list, dict]:
    """One step of an HF model's layers (two stages) at T tokens: the composed cp reference's
    losses and gradients, and the model's run whole."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 200, (rows, T), generator=gen)
    layers = hf.causal_lm_layers(model, check=False)
    kw = {"target": ids, "microbatches": rows, "count_fn": count, "num_stages": 2}
    losses, grads = zerobubble.reference_step(layers, token_loss, {"input_ids": ids}, cp=cp, **kw)
    whole, whole_grads = zerobubble.reference_step(layers, token_loss, {"input_ids": ids}, **kw)
    return losses, grads, whole, whole_grads


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_hf_ring_is_the_whole_model_within_rounding(family: str) -> None:
    """Qwen3 (per-head q_norm and k_norm before RoPE, grouped kv heads) and Mistral without
    its sliding window (its attention passes ``sliding_window=None`` to the interface, one
    kv head) take the ring unchanged: at cp=2 the shares sum to the whole loss, the
    gradients within rounding."""
    if family == "qwen3":
        config = transformers.Qwen3Config(
            vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(2)
            model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = hf.tiny_model("hf-mistral", num_hidden_layers=2, sliding_window=None)
    losses, grads, whole, whole_grads = hf_cp_step(model.train(), 2)
    torch.testing.assert_close(sum(losses), sum(whole), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, whole_grads[name], rtol=1e-5, atol=1e-5 * scale)


WHOLE = 24
"""The sequence length of the saved-tensors test: no width, head count or head size of the
tiny Llama (64, 128, 256; 4, 2; 16) and no cp rank's token count (12, 6) is 24."""


def saved_sizes(model: nn.Module, cp: int) -> set[int]:
    """Every size of every dim of the tensors autograd saved in one cp step of ``model``'s
    decoder blocks at ``WHOLE`` tokens (each cp rank in a thread of its own, a saved-tensors
    hook in each)."""
    layers = nn.Sequential(*hf.causal_lm_layers(model, check=False))
    ids = torch.randint(3, 200, (1, WHOLE), generator=torch.Generator().manual_seed(4))
    turned = TurnTaking(cp, torch.device("cpu"))
    group = turned.group(0, cp)
    seen: set[int] = set()

    def keep(x: torch.Tensor) -> torch.Tensor:
        seen.update(x.shape)
        return x

    def rank(r: int) -> None:
        rep = copy.deepcopy(layers)
        shards = ContextShards(cp, r)
        context_parallel(rep, shards, group, 0)
        hidden = rep[0](input_ids=shards.shard(ids))
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
            for block in rep[1:-1]:
                hidden = block(hidden)
        hidden["hidden"].sum().backward()

    turned.run(rank)
    return seen


def test_hf_ring_saves_no_whole_sequence_keys() -> None:
    """The ring's blocks save only their own tokens' tensors (``WHOLE / cp`` tokens): no saved
    tensor has the whole sequence's keys or values, nor a (T / cp) x T mask or scores, with
    sdpa or eager; the gather (attention dropout) saves them."""
    for attn in ("sdpa", "eager"):
        ring = hf.tiny_model("hf-llama", num_hidden_layers=2, attn_implementation=attn)
        sizes = saved_sizes(ring.train(), 2)
        assert WHOLE // 2 in sizes and WHOLE not in sizes, attn
    dropout = hf.tiny_model("hf-llama", num_hidden_layers=2, attention_dropout=0.1).train()
    assert WHOLE in saved_sizes(dropout, 2)


def test_hf_ring_refusals() -> None:
    """What the ring cannot honour is refused, naming the layer, before any exchange."""
    gemma2 = transformers.Gemma2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_implementation="eager",
        layer_types=["full_attention"], attn_logit_softcapping=50.0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        softcap = transformers.AutoModelForCausalLM.from_config(gemma2)
    cases = [
        (softcap, "1 \\(Gemma2Attention\\): the context-parallel ring does not take a soft cap"),
        (
            hf.tiny_model("hf-gpt-oss", num_hidden_layers=1, layer_types=["full_attention"]),
            "1 \\(GptOssAttention\\): .* does not take attention sinks \\(s_aux\\)",
        ),
        (hf.tiny_model("hf-mistral", num_hidden_layers=1), "does not take 'sliding_attention'"),
        (
            hf.tiny_model(
                "hf-llama", num_hidden_layers=1, attn_implementation="eager", output_attentions=True
            ),
            "1 \\(LlamaAttention\\): .* does not take output_attentions",
        ),
    ]
    for model, match in cases:
        with pytest.raises(ValueError, match=match):
            hf_cp_step(model.train(), 2)
