"""The memory estimate before launch (:mod:`zerobubble.train.estimate`).

Activations are measured on fake tensors, so every figure is exact: the saved bytes of a
Linear/GELU stack are their closed form; a tiny Llama's per-layer M_B and M_W equal what
the profiler measures on real tensors; each rank's activation peak is its stage's bytes
times the simulator's in-flight count (P - r under 1F1B); and one launch at P = 2 compares
the prediction with what a real run's trace holds, and the parameter bytes with the built
stage modules'.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

from ranks import launch
from zerobubble.parallel.partition import stage_bounds
from zerobubble.runtime.options import ExecutorOptions
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import generate
from zerobubble.schedule.simulate import simulate
from zerobubble.train.estimate import estimate_memory, saved_bytes, stage_memory

transformers = pytest.importorskip("transformers")

from zerobubble.interop import hf  # noqa: E402

B, T, M = 2, 16, 4


def test_saved_bytes_of_a_linear_gelu_stack_is_its_closed_form():
    """Linear saves its input, GELU its input, the second Linear the GELU's output: 4 bytes
    times b (d + 2 h); the weights are parameters, not activations."""
    b, d, h = 3, 8, 32
    with torch.device("meta"):
        stack = nn.Sequential(nn.Linear(d, h), nn.GELU(), nn.Linear(h, d))
        x = torch.empty(b, d)
    assert saved_bytes(stack, x) == 4 * b * (d + 2 * h)
    with torch.device("meta"):
        deeper = nn.Sequential(*stack, nn.GELU(), nn.Linear(d, h))
    assert saved_bytes(deeper, x) == 4 * b * (d + 2 * h) + 4 * b * (2 * d)


def test_one_storage_counts_once():
    """x * x saves x twice, and a view of x: one storage, counted once at its full size."""

    class Square(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x * x).sum() + (x[1:] * x[1:]).sum()

    x = torch.empty(4, 5, device="meta", requires_grad=True)
    assert saved_bytes(Square(), x) == 4 * 4 * 5


def meta_llama() -> tuple[list[nn.Module], hf.CausalLMLoss]:
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf.tiny_config("hf-llama"))
    return hf.causal_lm_layers(model, check=False), hf.CausalLMLoss(model)


def batch() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    ids = torch.zeros(B, T, dtype=torch.long, device="meta")
    return {"input_ids": ids}, ids


def test_fake_measure_equals_the_profilers_real_one():
    """Per layer, M_B and M_W from fake tensors are the bytes the profiler counts on real
    ones, and a stage's are the sums of its layers'."""
    from zerobubble.profile.layers import profile_layers

    layers, loss = meta_llama()
    per_layer = stage_memory(layers, loss, len(layers), *batch())
    model = hf.tiny_model("hf-llama")
    ids = torch.randint(3, 256, (B, T))
    real = profile_layers(
        hf.causal_lm_layers(model), hf.CausalLMLoss(model), {"input_ids": ids}, ids, iters=1
    )
    assert tuple(s.mem_f for s in per_layer) == real.mem_b
    assert tuple(s.mem_w for s in per_layer) == real.mem_w
    for P in (2, 4):
        stages = stage_memory(layers, loss, P, *batch())
        for s, r in zip(stages, stage_bounds(len(layers), P), strict=True):
            assert s.mem_f == sum(per_layer[i].mem_f for i in r)
            assert s.mem_w == sum(per_layer[i].mem_w for i in r)


@pytest.mark.parametrize("P", [2, 4])
@pytest.mark.parametrize("kind", ["zb-h1", "1f1b"])
def test_activation_peak_is_stage_bytes_times_in_flight_count(kind, P):
    layers, loss = meta_llama()
    est = estimate_memory(layers, loss, kind, *batch(), pp=P, microbatches=M)
    sched = generate(kind, P, M, max_stages=len(layers))
    assert len(est.stages) == P
    for r, (rank, st) in enumerate(zip(est.ranks, est.stages, strict=True)):
        ratio = Fraction(st.mem_w, st.mem_f)  # M_W in units of M_B
        unit = CostModel((1,) * P, (1,) * P, (1,) * P, mem_f=(1,) * P, mem_w=(ratio,) * P)
        count = simulate(sched, unit).peak_memory[r]  # microbatches' worth in flight
        assert rank.activations == st.mem_f * count
        if kind == "1f1b":
            assert count == P - r
        else:  # 1F1B's P - r microbatches in flight and W's leftovers, within the paper's P
            assert P - r <= count <= P


def test_parameters_are_split_by_tp_and_fsdp_and_refused_when_wrong():
    layers, loss = meta_llama()
    plain = estimate_memory(layers, loss, "zb-h1", *batch(), pp=2, microbatches=M)
    est = estimate_memory(layers, loss, "zb-h1", *batch(), pp=2, microbatches=M, tp=2)
    for r, (a, b) in enumerate(zip(plain.ranks, est.ranks, strict=True)):
        held = [i for i in stage_bounds(len(layers), 2)[r]]
        norms = sum(
            p.numel() * 4
            for i in held
            for n, p in layers[i].named_parameters()
            if "norm" in n  # replicated over tp; every other matrix is halved
        )
        assert b.params == (a.params - norms) // 2 + norms
        assert b.grads == b.params and b.optimizer == 2 * b.params
        assert b.activations == a.activations
    fsdp = estimate_memory(layers, loss, "zb-h1", *batch(), pp=2, microbatches=M, dp_shard=2)
    for a, b in zip(plain.ranks, fsdp.ranks, strict=True):
        assert b.params == a.params + a.params // 2  # the shard and the gathered copy
        assert b.optimizer == a.optimizer // 2
    most = max(r.total for r in plain.ranks)
    assert not plain.fits(plain.ranks[0].total - 1) and plain.fits(most)
    lines = plain.lines(1 << 30)
    head = ["rank", "params", "grads", "optimizer", "activations", "total", "device", "fits"]
    assert lines[0].split() == head
    assert [ln.split()[-1] for ln in lines[1:]] == ["yes", "yes"]
    with pytest.raises(ValueError, match="pass device_bytes"):
        plain.fits()
    with pytest.raises(ValueError, match="not divisible by tp=3"):
        estimate_memory(layers, loss, "zb-h1", *batch(), pp=2, microbatches=M, tp=3)
    with pytest.raises(ValueError, match="needs pp= and microbatches="):
        estimate_memory(layers, loss, "zb-h1", *batch())


def test_a_vocabulary_tp_does_not_divide_counts_the_first_ranks_rows():
    """Vocabulary 17 at tp=2: tp rank 0 holds 9 rows of the token table and the LM head
    (DTensor's uneven ``Shard(0)``), as many as with a vocabulary of 18."""
    from zerobubble.models import GPTConfig, build_gpt, gpt_loss

    ids = torch.zeros(2, 8, dtype=torch.long)
    est = {}
    for vocab in (17, 18):
        for tie in (False, True):
            cfg = GPTConfig(
                vocab_size=vocab, max_seq_len=8, d_model=8, n_heads=2, tie_embeddings=tie
            )
            layers = list(build_gpt(cfg))
            est[vocab, tie] = estimate_memory(
                layers, gpt_loss, "zb-h1", ids, ids, pp=2, microbatches=2, tp=2
            )
    for tie in (False, True):
        assert [r.params for r in est[17, tie].ranks] == [r.params for r in est[18, tie].ranks]


def test_fsdp_shards_experts_over_the_replicas_holding_them():
    """With ep, FSDP shards an expert over the ``dp_shard / ep`` replicas holding it (its
    edp group), every other parameter over ``dp_shard`` (the parameter count alone: the
    MoE's routing cannot run on fake tensors)."""
    from zerobubble.models import build_moe_mlp
    from zerobubble.train.estimate import _param_bytes

    layers = list(build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2))
    bounds = stage_bounds(len(layers), 2)
    sched = generate("zb-h1", 2, 2)
    for dp_shard, edp in ((2, 1), (4, 2)):
        for r in range(2):
            named = [(n, p) for i in bounds[r] for n, p in layers[i].named_parameters()]
            experts = sum(p.numel() // 2 // edp for n, p in named if ".experts." in n)
            dense = sum(-(-p.numel() // dp_shard) for n, p in named if ".experts." not in n)
            got = _param_bytes(layers, list(bounds[r]), bounds, sched, r, 1, 2, dp_shard)
            assert got[2] == experts + dense, (dp_shard, r)


def run_job() -> dict:
    import zerobubble

    zerobubble.init_distributed()
    model = hf.tiny_model("hf-llama", seed=0)
    out = {}
    for kind in ("zb-h1", "1f1b"):
        pipe = zerobubble.Pipeline(
            hf.causal_lm_layers(model),
            hf.CausalLMLoss(model),
            kind,
            microbatches=M,
            options=ExecutorOptions(fuse_local_backward=False),
        )
        ids = torch.randint(3, 256, (B * M, T), generator=torch.Generator().manual_seed(1))
        pipe.step({"input_ids": ids}, target=ids)
        seen = {
            p.data_ptr(): p.numel() * p.element_size()
            for c in pipe.executor.chunks.values()
            for p in c.module.parameters()
        }
        events = pipe.executor.trace.events
        out[kind] = (max(e.mem_after for e in events), sum(seen.values()))
    return out


@pytest.mark.slow
def test_prediction_against_a_real_run():
    """Activations: the trace's peak is at most 0.1% above the prediction (a received
    boundary's frame is a few bytes larger than the tensor); parameters: exactly the
    stage modules'."""
    real = launch(run_job, 2, timeout=240)
    layers, loss = meta_llama()
    for kind in ("zb-h1", "1f1b"):
        est = estimate_memory(layers, loss, kind, *batch(), pp=2, microbatches=M)
        for r, rank in enumerate(est.ranks):
            peak, params = real[r][kind]
            assert rank.params == params
            assert 0.999 * peak <= rank.activations <= peak, (kind, r, peak, rank.activations)
