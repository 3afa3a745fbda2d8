"""Tensor-parallel plans of stage modules (parallel/tp.py) at tp=2 (gloo, one 2-rank launch).

For our GPT and a tiny HF Llama, cut into a first, a middle and a last stage module, with
sequence parallelism off and on, each stage is parallelized by the default plan twice:

* ``split``: through a ``StageChunk`` with the B/W split (F, B, then W);
* ``plain``: plain autograd on the same parallelized module (no split).

Outputs, input gradients and every parameter gradient (the local shards of DTensor
gradients) of ``split`` equal ``plain``'s bitwise. Both are compared with the unparallelized
stage in one process (``full_tensor()`` of DTensor gradients, the same slice of sequence
shards) within ``REL`` = 1e-5 relative to the largest magnitude (4.1e-7 measured): tensor
parallelism sums the row-wise layers' partial products in another order. A middle stage
with sequence parallelism maps a (B, T/2, d) local tensor to a (B, T/2, d) local tensor. W issues no
collective (a dispatch mode sees every one, DTensor's included), and two microbatches
accumulate as plain autograd does (Partial gradients of replicated norms stay Partial).
The norms' gradients are made in B by default; the graph-level split (no norm rule) and
the opt-in LayerNorm kernel defer them to W on sequence shards, bitwise too. The
collectives of F and B of one block: q/k/v (Llama's gate/up too) share one prepared
input, so one all-gather per block half with sequence parallelism.
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import PrepareModuleInput
from torch.utils._python_dispatch import TorchDispatchMode

from ranks import launch
from zerobubble.interop.hf import causal_lm_layers, tiny_model
from zerobubble.interop.hf_layers import DecoderBlock
from zerobubble.interop.hf_tp import hf_block_plan
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.tp import default_plan, parallelize_stage
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.split import SplitRules, unsplit_modules
from zerobubble.runtime.stage import StageChunk

TP, B, T = 2, 2, 8
REL = 1e-5
FALLBACK = SplitRules(tuple(r for r in SplitRules.default().rules if r.split is not None))
LAYER_NORM = SplitRules.default().with_layer_norm()
GPT = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=2, seed=1)


def gpt_stages() -> list[nn.Sequential]:
    layers = list(build_gpt(GPT))
    return [nn.Sequential(*layers[:2]), nn.Sequential(layers[2]), nn.Sequential(*layers[3:])]


def llama_stages() -> list[nn.Sequential]:
    layers = causal_lm_layers(tiny_model("hf-llama", num_hidden_layers=2, seed=2))
    return [nn.Sequential(*layers[:2]), nn.Sequential(layers[2]), nn.Sequential(*layers[3:])]


class Collectives(TorchDispatchMode):
    """The collectives issued inside (DTensor's redistributions included, and the waits)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d"):
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def hidden_of(x: Any) -> Tensor:
    return x["hidden"] if isinstance(x, dict) else x


def with_hidden(x: Any, h: Tensor) -> Any:
    return {**x, "hidden": h} if isinstance(x, dict) else h


def grads(module: nn.Module, full: bool) -> dict[str, Tensor]:
    out = {}
    for n, p in module.named_parameters():
        g = p.grad
        assert g is not None, n
        if isinstance(g, DTensor):
            g = g.full_tensor() if full else g.to_local()
        out[n] = g
    return out


def close(a: Tensor, b: Tensor, scale: float | None = None) -> float:
    """max |a - b| relative to max |b| (or to ``scale``)."""
    return float((a - b).abs().max() / (b.abs().max() if scale is None else scale))


def stage_run(
    module: nn.Module,
    s: int,
    x: Any,
    gy: Tensor | None,
    target: Tensor,
    split: bool,
    rules: SplitRules | None = None,
):
    """Two microbatches (the same data) through stage ``s`` (0, 1 or 2 of 3): F F B B W W
    through a StageChunk, or two plain forward/backward passes. Returns the output, the
    input gradient, the gradients, the collectives that W issued and the modules whose
    gradients B made."""
    if split:
        if s > 0:  # a pytree's float leaves carry a gradient only if they require one
            x = with_hidden(x, hidden_of(x).detach().requires_grad_())
        loss_fn = gpt_loss if s == 2 else None
        chunk = StageChunk(module, s, 3, loss_fn=loss_fn, split_rules=rules)
        with Collectives() as f_comm:
            for mb in (0, 1):
                out = chunk.forward(mb, x, target=target) if s == 2 else chunk.forward(mb, x)
        with Collectives() as b_comm:
            for mb in (0, 1):
                gx = chunk.backward_input(mb, None if s == 2 else gy)
        with Collectives() as comm:
            for mb in (0, 1):
                chunk.backward_weight(mb)
        gx = None if s == 0 else (gx[0] if isinstance(gx, list) else gx)
        kept = [n for n, _ in unsplit_modules(chunk.module)]  # gradients made in B
        ops = {"F": f_comm.ops, "B": b_comm.ops, "W": comm.ops}
        return hidden_of(out), gx, grads(chunk.module, full=False), ops, kept
    for _ in (0, 1):
        leaf = None
        xi = x
        if s > 0:
            leaf = hidden_of(x).detach().requires_grad_()
            xi = with_hidden(x, leaf)
        y = module(xi)
        if s == 2:
            y = gpt_loss(y, target)
            y.backward()
        else:
            hidden_of(y).backward(gy)
    gx = None if leaf is None else leaf.grad
    return hidden_of(y).detach(), gx, grads(module, full=False), [], []


def shard(t: Tensor, sp: bool, rank: int) -> Tensor:
    return t.chunk(TP, dim=1)[rank].contiguous() if sp else t


def check_model(
    name: str, stages: list[nn.Sequential], mesh: Any, rank: int, rules: SplitRules | None = None
) -> dict:
    """Every check of one model, with sequence parallelism off and on (with ``rules``: the
    middle stage only, sequence parallelism on)."""
    gen = torch.Generator().manual_seed(5)
    vocab = GPT.vocab_size if name.startswith("gpt") else 256
    ids = torch.randint(0, vocab, (B, T), generator=gen)
    target = torch.randint(0, vocab, (B, T), generator=gen)
    # Each stage's input: the unparallelized stack's forward.
    single = [copy.deepcopy(m) for m in stages]
    xs: list[Any] = [ids]
    with torch.no_grad():
        for m in single[:-1]:
            xs.append(m(xs[-1]))
    # Per stage alone: output, input gradient, gradients for a random output gradient.
    want = []
    for s, m in enumerate(single):
        x = xs[s]
        if s > 0:
            x = with_hidden(x, hidden_of(x).detach().requires_grad_())
        y = m(x)
        if s == 2:
            y = gpt_loss(y, target)
            y.backward()
        else:
            gy = torch.randn(hidden_of(y).shape, generator=gen)
            hidden_of(y).backward(gy)
        gx = hidden_of(x).grad if s > 0 else None
        want.append((hidden_of(y).detach(), gx, grads(m, full=True), gy if s < 2 else None))
    out: dict[str, Any] = {}
    for sp in (False, True) if rules is None else (True,):
        for s, m in enumerate(stages):
            if rules is not None and s != 1:
                continue
            y_want, gx_want, g_want, gy = want[s]
            x = xs[s]
            if s > 0:
                x = with_hidden(x, shard(hidden_of(x).detach(), sp, rank))
            gy_local = None if gy is None else shard(gy, sp, rank)
            runs = {}
            for split in (True, False):
                mod = parallelize_stage(copy.deepcopy(m), mesh, stage=s, sequence_parallel=sp)
                runs[split] = stage_run(mod, s, x, gy_local, target, split, rules)
                if not split:
                    full = grads(mod, full=True)
            key = f"{name} sp={sp} stage={s}"
            (y1, gx1, g1, comm, kept), (y0, gx0, g0, _, _) = runs[True], runs[False]
            out[key + " W collectives"] = comm["W"]
            out[key + " F B collectives"] = (comm["F"], comm["B"])
            out[key + " kept in B"] = kept
            differ = [n for n in g0 if not torch.equal(g1[n], g0[n])]
            if not torch.equal(y1, y0):
                differ.append("out")
            if gx1 is not None and not torch.equal(gx1, gx0):
                differ.append("input grad")
            out[key + " bitwise"] = g1.keys() == g0.keys() and not differ
            out[key + " differ"] = differ
            y_ref = y_want if s == 2 else shard(y_want, sp, rank)
            errs = {"out": close(y0, y_ref)}
            if gx0 is not None:
                errs["input grad"] = close(gx0, shard(gx_want, sp, rank))
            # Relative to the stage's largest gradient: the key bias's is zero in exact
            # arithmetic (softmax ignores a constant per query), so only rounding.
            scale = max(float(g.abs().max()) for g in g_want.values())
            errs |= {n: close(full[n], 2 * g_want[n], 2 * scale) for n in g_want}
            out[key + " rel"] = max(errs.values())
            out[key + " errs"] = errs
            out[key + " shapes"] = (tuple(hidden_of(x).shape), tuple(y0.shape))
    return out


def run_ranks() -> dict:
    init_distributed()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    out = check_model("gpt", gpt_stages(), mesh, rank)
    out |= check_model("llama", llama_stages(), mesh, rank)
    # The norms on sequence shards through the graph-level split (no norm rule) and, for
    # our GPT's LayerNorm, through the opt-in LayerNorm kernel: deferred to W too.
    out |= check_model("gpt graph-split norms", gpt_stages(), mesh, rank, FALLBACK)
    out |= check_model("llama graph-split norms", llama_stages(), mesh, rank, FALLBACK)
    out |= check_model("gpt LayerNorm kernel", gpt_stages(), mesh, rank, LAYER_NORM)
    errors = {}
    first = parallelize_stage(gpt_stages()[0], mesh, stage=0, sequence_parallel=True)
    try:
        first(torch.zeros(B, T - 1, dtype=torch.long))
    except ValueError as e:
        errors["length"] = str(e)
    drop = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1))
    try:
        parallelize_stage(drop, mesh, {}, stage=3)
    except ValueError as e:
        errors["dropout"] = str(e)
    out["errors"] = errors
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(run_ranks, TP, timeout=600)


def test_split_equals_plain_autograd_on_the_same_tp_layout_bitwise(results):
    for r in results:
        bad = [k for k, v in r.items() if k.endswith("bitwise") and v is not True]
        assert not bad
        assert sum(k.endswith("bitwise") for k in r) == 15
        assert all(v == [] for k, v in r.items() if k.endswith("W collectives"))


def test_w_defers_every_layer_but_the_norms_and_graph_split_norms_too(results):
    for r in results:
        kept = {k[: -len(" kept in B")]: v for k, v in r.items() if k.endswith("kept in B")}
        assert kept["gpt sp=True stage=1"] == ["0.ln1", "0.ln2"]  # the default keeps norms in B
        assert kept["llama sp=False stage=1"] == [
            "0.layer.input_layernorm",
            "0.layer.post_attention_layernorm",
        ]
        for name in ("gpt graph-split norms", "llama graph-split norms", "gpt LayerNorm kernel"):
            assert kept[f"{name} sp=True stage=1"] == []


def test_tp_stages_match_the_single_process_stage_within_rel(results):
    for r in results:
        errs = {k: v for k, v in r.items() if k.endswith(" rel")}
        assert len(errs) == 15 and max(errs.values()) < REL, errs


def test_sequence_parallel_stages_take_and_give_local_shards(results):
    for r in results:
        for model in ("gpt", "llama"):
            assert r[f"{model} sp=True stage=1 shapes"][0][:2] == (B, T // TP)
            assert r[f"{model} sp=True stage=1 shapes"][1][:2] == (B, T // TP)
            assert r[f"{model} sp=True stage=0 shapes"][1][:2] == (B, T // TP)
            assert r[f"{model} sp=False stage=1 shapes"][1][:2] == (B, T)


def counts(ops: list[str]) -> dict[str, int]:
    """The collectives of ``ops`` by name (the waits and autograd wrappers left out)."""
    names = (op.split(".")[0] for op in ops)
    return dict(Counter(n for n in names if n not in ("wait_tensor", "_wrap_tensor_autograd")))


def test_one_gather_per_block_half_under_sequence_parallelism(results):
    """q/k/v (and Llama's gate/up) take one prepared input: per block and microbatch (two
    here) one all-gather per block half and one reduce-scatter per row-wise layer in F, the
    mirror in B (one per layer, 3 + 1 and 3 + 2 gathers, before); without sequence
    parallelism one all-reduce per block half each way."""
    for r in results:
        for model in ("gpt", "llama"):
            f, b = r[f"{model} sp=True stage=1 F B collectives"]
            want = {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4}
            assert counts(f) == counts(b) == want, (model, f, b)
            f, b = r[f"{model} sp=False stage=1 F B collectives"]
            assert counts(f) == counts(b) == {"all_reduce": 4}, (model, f, b)


def test_tp_refuses_uneven_sequences_and_dropout(results):
    for r in results:
        assert "sequence length 7 is not divisible by tp=2" in r["errors"]["length"]
        assert "stage 3: 1 has dropout 0.1" in r["errors"]["dropout"]


# ---- in one process: the plan derivation and the refusals of the default plan ------------


def test_hf_block_plan_maps_base_model_tp_plan_onto_the_stage_layer():
    layers = causal_lm_layers(tiny_model("hf-llama", num_hidden_layers=2), check=False)
    block = layers[2]
    assert isinstance(block, DecoderBlock)
    plan = hf_block_plan(block.config.base_model_tp_plan, {"layer": "model.layers.1"}, block)
    assert plan == {
        "layer.self_attn.q_proj": "colwise",
        "layer.self_attn.k_proj": "colwise",
        "layer.self_attn.v_proj": "colwise",
        "layer.self_attn.o_proj": "rowwise",
        "layer.mlp.gate_proj": "colwise",
        "layer.mlp.up_proj": "colwise",
        "layer.mlp.down_proj": "rowwise",
    }
    # "*" is one name component: layer 1's plan does not match under another path.
    assert (
        hf_block_plan({"layers.0.mlp.up_proj": "colwise"}, {"layer": "model.layers.1"}, block) == {}
    )
    with pytest.raises(ValueError, match="'moe_tp_experts': no mapping"):
        hf_block_plan(
            {"layers.*.mlp.experts": "moe_tp_experts"}, {"layer": "model.layers.1"}, block
        )


def test_default_plan_names_every_sharded_layer_of_a_gpt_stage():
    plan = default_plan(gpt_stages()[0], 2, stage=0, sequence_parallel=True)
    assert sorted(plan) == sorted(
        ["0", "0.tok", "0.pos", "1.attn"]
        + [f"1.{n}" for n in ("attn.q", "attn.k", "attn.v", "attn.out", "fc", "proj", "ln1", "ln2")]
    )
    assert isinstance(plan["1.attn"], PrepareModuleInput)
    assert sorted(default_plan(gpt_stages()[2], 2, stage=2, sequence_parallel=False)) == ["1"]


@pytest.mark.parametrize("loss_parallel", [False, True])
def test_default_plan_shards_a_vocabulary_tp_does_not_divide(loss_parallel):
    """Vocabulary 17 at tp=2: the token table and the LM head (tied or not) are planned,
    to be sharded by DTensor unevenly (tests/test_tp.py runs them)."""
    for tie in (False, True):
        cfg = GPTConfig(vocab_size=17, d_model=8, n_heads=2, seed=1, tie_embeddings=tie)
        layers = list(build_gpt(cfg))
        first, last = nn.Sequential(*layers[:2]), nn.Sequential(*layers[3:])
        lp = loss_parallel
        assert "0.tok" in default_plan(first, 2, stage=0, sequence_parallel=True)
        assert "1" in default_plan(last, 2, stage=2, sequence_parallel=False, loss_parallel=lp)


@pytest.mark.parametrize(
    ("stage", "tp", "match"),
    [
        ("gpt-heads", 8, r"stage 1: 0.attn has n_heads=4, not divisible by tp=8"),
        # the vocabulary (64) is sharded unevenly at tp=3; the heads (4) are refused
        ("gpt-vocab", 3, r"stage 0: 1.attn has n_heads=4, not divisible by tp=3"),
        ("odd-mlp", 2, r"stage 1: 0.fc has out_features=5, not divisible by tp=2; "),
        # kv heads fewer than tp are replicated; 3 at tp=2 can be neither sharded nor that
        ("mistral", 2, r"stage 1: 0.layer.self_attn has num_key_value_heads=3, which tp=2 "),
        (
            "unknown",
            2,
            r"stage 1: layer 0 \(Wrapper\) holds parameters but no tensor-parallel plan of its own",
        ),
        ("gpt2", 2, r"stage 1: layer 0 \(GPT2Block\) holds parameters"),
    ],
)
def test_default_plan_refuses_what_it_cannot_shard_exactly(stage, tp, match):
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    class OddMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 5)

        def tp_kinds(self, _layout: object) -> dict[str, str]:
            return {"fc": "colwise"}  # not a vocabulary dim: 5 is refused at tp=2

    if stage == "gpt-heads":
        module, s = gpt_stages()[1], 1
    elif stage == "gpt-vocab":
        module, s = gpt_stages()[0], 0
    elif stage == "gpt2":
        layers = causal_lm_layers(tiny_model("hf-gpt2"), check=False)
        module, s = nn.Sequential(layers[1]), 1
    elif stage == "mistral":
        kv3 = {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8}
        layers = causal_lm_layers(tiny_model("hf-mistral", num_hidden_layers=2, **kv3), check=False)
        module, s = nn.Sequential(layers[1]), 1
    elif stage == "odd-mlp":
        module, s = nn.Sequential(OddMLP()), 1
    else:
        module, s = nn.Sequential(Wrapper()), 1
    with pytest.raises(ValueError, match=match):
        default_plan(module, tp, stage=s, sequence_parallel=False)
