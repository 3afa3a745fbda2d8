"""Context parallelism (pp x cp, gloo): bitwise ``zerobubble.reference_step(cp=...)``.

Every case runs through ``zerobubble.Pipeline`` (its tie reduction called after the step).
One launch of pp=2 x cp=2 (4 ranks) runs our GPT (with dropout, seeded: the all-gather;
without, its LM head tied to the embedding: the ring; under zbv with the stage recomputed
in B) and a tiny HF Llama (4 query heads over 2 key/value heads) whose decoder blocks run
the ring (sdpa under zb-h1, eager under zbv: the V, two stages per rank) or, with attention
dropout (seeded), the all-gather; every rank's losses and every gradient after the cp
reduction are ``torch.equal`` the composed reference's, which plays the cp ranks in threads
(:mod:`zerobubble.reference.cp`). Against the model run whole on one process (plain
autograd) the cases without dropout agree within float32 rounding at the values' scale. A
second launch adds dp=2 (8 ranks, two of the cases) and cp=4 (four ring steps, the GPT and
the sdpa Llama). In one process: Qwen3 (q_norm, k_norm) under the ring within rounding of
the whole model; the ring's blocks save no tensor of the whole sequence's length (the
gather's do); what the ring cannot honour (soft cap, sinks, sliding window,
output_attentions) is refused.
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
from zerobubble.runtime.sequence.cp import ContextShards, context_parallel, shard_batch

IGNORE = -100
T = 16
M = 2
CASES = [  # pp=2 x cp=2; under zbv recompute="stage"
    ("gpt", "zb-h1"),  # attention dropout: the all-gather
    ("gpt-ring", "zbv"),  # no dropout: the ring
    ("llama-sdpa", "zb-h1"),  # the ring, grouped kv heads repeated to the query heads
    ("llama-eager", "zbv"),
    ("llama-dropout", "zb-h1"),  # sdpa with attention dropout: the all-gather
]
DROPOUT = ("gpt", "llama-dropout")  # seeded draws: bitwise the reference, not the whole model
CUTS = ExecutorOptions(cuts=(0, 8, T))
WITH_DP = [("gpt-ring", "zbv"), ("llama-sdpa", "zb-h1")]  # pp=2 x dp=2 x cp=2
CP4 = [("gpt-ring", "zb-h1"), ("gpt", "zbv"), ("llama-sdpa", "zbv")]  # pp=2 x cp=4


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
    """pp=2 x cp=2 on 4 ranks; pp=2 x dp=2 x cp=2, then pp=2 x cp=4 on 8."""
    init_distributed(timeout_s=60)
    out: dict[str, Any] = {}
    layouts = [(1, 2, CASES)] if world == 4 else [(2, 2, WITH_DP), (1, 4, CP4)]
    for dp, cp, cases in layouts:
        mesh = build_mesh(2, dp, cp=cp)
        for model, kind in cases:
            out[model, kind, dp, cp] = run_case(mesh, model, kind)
            out[model, kind, dp, cp]["at"] = (mesh.dp_rank * cp + mesh.cp_rank) * M
    if world == 4:
        out["refused"] = refusals(mesh)
    dist.destroy_process_group()
    return out


def run_case(mesh: Any, model: str, kind: str) -> dict:
    """One step of ``model`` under ``kind`` on ``mesh``: this rank's losses and gradients."""
    dp = mesh.dp_size
    sched = generated(kind, 2, M)
    layers, x, y = model_and_batch(model, sched.num_stages, M * dp)
    pipe = zerobubble.Pipeline(
        layers, token_loss, sched, mesh=mesh, count_fn=count,
        options=ExecutorOptions(seed=5, recompute="stage" if kind == "zbv" else "none"),
    )  # fmt: skip
    # every rank passes its dp part of whole sequences; the executor takes its chunks
    part = torch.tensor_split(torch.arange(M * dp), dp)[mesh.dp_rank]
    xs = x[part] if isinstance(x, torch.Tensor) else {k: v[part] for k, v in x.items()}
    losses = pipe.step(xs, target=y[part])
    pipe.tied.reduce(0)  # the tie's stage gradients summed (a trainer's step does it)
    grads = {name: p.grad.clone() for name, p in pipe.named_parameters()}
    blocks = [m for c in pipe.executor.chunks.values() for m in c.module.modules()
              if isinstance(m, DecoderBlock)]  # fmt: skip
    rings = {b.runs_ring for b in blocks}  # the HF blocks: all ring, or all gather
    return {"losses": losses, "grads": grads, "held": pipe.executor.held_bytes(), "rings": rings}


def refusals(mesh: Any) -> list[str]:
    """What the executor and the checkpoints refuse, before any collective, on every rank."""
    layers, _, _ = model_and_batch("gpt", 2, M)
    refused = []
    for sched, kw in [
        (generated("zb-h1", 2, M), {}),  # no count_fn
        (generated("seq-zb", 2, M, segments=2), {"count_fn": count, "options": CUTS}),
        (
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


@functools.cache
def reference(model: str, kind: str, dp: int, cp: int) -> tuple[list, dict, list, dict]:
    """(composed reference losses and grads, whole-model losses and grads)."""
    num_stages = generated(kind, 2, M).num_stages
    layers, x, y = model_and_batch(model, num_stages, M * dp)
    kw = {"target": y, "microbatches": M, "count_fn": count, "num_stages": num_stages}
    losses, grads = zerobubble.reference_step(layers, token_loss, x, dp=dp, cp=cp, seed=5, **kw)
    for m in layers:  # the model run whole: dropout off, so the bound holds
        m.eval()
    whole, whole_grads = zerobubble.reference_step(layers, token_loss, x, **kw)
    return losses, grads, whole, whole_grads  # under the user's names, as the Pipeline's


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict]]:
    return {world: launch(cp_job, world, world, timeout=240) for world in (4, 8)}


LAYOUTS = [(*c, 1, 2) for c in CASES] + [(*c, 2, 2) for c in WITH_DP] + [(*c, 1, 4) for c in CP4]


@pytest.mark.bitwise
@pytest.mark.parametrize(("model", "kind", "dp", "cp"), LAYOUTS)
def test_pp_cp_matches_the_composed_reference(results, model, kind, dp, cp):
    losses, grads, _, _ = reference(model, kind, dp, cp)
    got: dict[str, torch.Tensor] = {}
    rings: set[bool] = set()  # whether the HF blocks ran the ring (some ranks hold none)
    for r in results[4 if dp * cp == 2 else 8]:
        run = r[model, kind, dp, cp]
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


@pytest.mark.parametrize(("model", "kind", "dp", "cp"), [c for c in LAYOUTS if c[0] not in DROPOUT])
def test_pp_cp_is_the_whole_model_within_rounding(model, kind, dp, cp):
    """Without dropout (the Llama, the GPT's ring), the ranks' shares sum to the whole
    batch's loss and every gradient is within float32 rounding at the largest gradient's
    scale."""
    losses, grads, whole, whole_grads = reference(model, kind, dp, cp)
    torch.testing.assert_close(sum(losses), sum(whole), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in whole_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, whole_grads[name], rtol=1e-5, atol=1e-5 * scale)


def test_executor_refusals(results):
    for r in results[4]:
        no_count, segments, shifting, checkpoint = r["refused"]
        assert "cannot save a checkpoint of a mesh with cp=2" in checkpoint
        assert "cp=2) needs count_fn" in no_count
        assert "with sequence segments is not supported" in segments
        assert "segments of context-parallel chunks are not built" in segments
        assert "shifts labels inside each call" in shifting


def test_layout_and_refusals() -> None:
    shards = [ContextShards(2, r) for r in range(2)]
    x = torch.arange(8).view(1, 8)
    assert [s.shard(x).tolist() for s in shards] == [[[0, 1, 6, 7]], [[2, 3, 4, 5]]]
    assert shards[1].positions(4).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 2 \\* cp = 4"):
        shards[0].shard(torch.zeros(1, 6))
    with pytest.raises(ValueError, match="attention_mask"):
        shard_batch({"input_ids": x, "attention_mask": x}, shards[0], "the input batch")
    with pytest.raises(ValueError, match="tensor parallelism with context parallelism"):
        ParallelSpec(2, cp=2, tp=2)
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
