"""Hugging Face MoE experts sharded over ep, as our MoE's are: every family of transformers'
experts layout (use_experts_implementation), one grouped matmul per projection.

In one process: at ep=1 :class:`ShardedExperts` is HF's default grouped_mm experts bitwise
(forward and every gradient) for nine families and the flags none of them has, and HF's
eager loop within 1e-6; its B/W split is plain autograd bitwise with no graph-level split
and the expert gradients deferred to W; what it cannot reproduce is refused, and experts
outside the contract are found; the threaded reference (:func:`threaded_ep_reference_step`)
is :func:`ep_reference_step` bitwise on our MoE. On 6 gloo ranks (pp=3 x dp=2 x ep=2)
Mixtral, DeepSeek-V3, Qwen2-MoE, OLMoE and GPT-OSS run under dualpipev with overlapped
pairs (3 times), and some without pairs: bitwise the threaded reference, 5 all-to-alls
per microbatch and MoE layer (3 in F, 2 in B, none in W), and ep>1 refused for JetMoe's
experts and for a model without experts. In one launch of 4 gloo ranks: pp=2 x dp=2 x ep=2,
the tiny Mixtral (with its router loss) one step under zb-h1 and zbv, Qwen3-MoE under zbv
and GPT-OSS under zb-h1; pp=1 x dp=4 x ep=2 (1f1b, expert gradients summed over edp); then
ranks 0 and 1 as a world of two, pp=1 x ep=2 (1f1b). Losses and every gradient after the
reduction are bitwise the threaded reference and equal between those runs (the schedule and
the stage cuts do not change the arithmetic), and within 1e-5 of each tensor's largest
magnitude of HF's own model run per replica on the same microbatches with the replicas'
gradients summed (an expert's matmuls see both replicas' rows under ep, so that comparison
is not bitwise). The clipping norm counts every expert row block once (biases included),
bitwise ``get_total_norm`` of the layout's tensors; the whole HF state dict loads strictly
and :func:`gather_hf_experts` gives it back; a checkpoint round-trips, one entry per row
block."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import zerobubble
from ranks import launch
from test_ep import Deferral
from zerobubble.interop import hf
from zerobubble.interop.hf_experts import (
    ShardedExperts,
    expert_shard,
    gather_hf_experts,
    is_hf_experts,
    shard_hf_experts,
    unsharded_experts,
)
from zerobubble.models import mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.parallel.ep import ExpertGroup, expert_run, is_expert
from zerobubble.parallel.experts import shard_all_experts
from zerobubble.parallel.mesh import build_mesh
from zerobubble.reference.ep import ep_reference_step, threaded_ep_reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.costs import CostSpec

M, LOCAL, LENGTH = 2, 4, 6
TIMEOUT = 240.0
CASES = [
    ("hf-mixtral", "zb-h1"),
    ("hf-mixtral", "zbv"),
    ("hf-qwen3-moe", "zbv"),
    ("hf-gpt-oss", "zb-h1"),  # expert biases: deferred to W, summed over edp, normed in rows
]
#: The models whose norm, state dict and checkpoint ep_ranks checks, and in which step modes.
STATE_CASES = {"hf-mixtral": ("sync", "conservative", "speculative"), "hf-gpt-oss": ("sync",)}
PER_CALL = zerobubble.ExecutorOptions(term_weight="per_call")
"""Hugging Face's model adds its whole router loss per call: the runs compared with it weigh
the ``router_aux`` term so (docs/moe.md, "How a step weighs the router terms")."""


def batch(dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 256, (dp * LOCAL, LENGTH), generator=g)
    return ids, ids.clone()


def part(dp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(dp)
    return x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]


# ---- one process ---------------------------------------------------------------------------

#: Families beyond the shipped tiny configs, built from their HF config class (a block each).
FAMILY_CONFIGS = {
    "phimoe": {"intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    "flex_olmo": {"intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2},
    "glm4_moe": {
        "intermediate_size": 64,
        "moe_intermediate_size": 32,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 0,
        "n_group": 1,
        "topk_group": 1,
        "head_dim": 8,
    },
}
SHIPPED = (*hf.TINY_MOE_CONFIGS, *hf.TINY_BIAS_MOE_CONFIGS, *hf.TINY_CE_MOE_CONFIGS)


def family_model(name: str, impl: str = "grouped_mm"):
    """A tiny model of ``name`` (a shipped config or one of :data:`FAMILY_CONFIGS`)."""
    if name in FAMILY_CONFIGS:
        import transformers

        config = transformers.AutoConfig.for_model(
            name,
            vocab_size=256,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
            output_router_logits=False,
            bos_token_id=1,
            eos_token_id=2,
            pad_token_id=0,
            **FAMILY_CONFIGS[name],
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = hf.tiny_model(name)
    model.config._experts_implementation = impl
    return model


def moe_block(model) -> torch.nn.Module:
    """The last decoder layer's MoE block (DeepSeek-V3's first layer is dense)."""
    layer = model.model.layers[-1]
    return layer.mlp


def run_block(block, x, seed=5):
    torch.manual_seed(seed)  # PhiMoE's router draws jitter in train mode
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.bitwise
@pytest.mark.kernels
@pytest.mark.parametrize("name", [*SHIPPED, *FAMILY_CONFIGS])
def test_sharded_experts_at_ep1_are_hf_grouped_mm_bitwise_and_eager_within_rounding(name):
    """transformers' default experts, grouped_mm: forward, input, router and every expert
    gradient bitwise (the same ops on the same rows in the same order). HF's eager loop:
    within 1e-6 of each tensor's largest magnitude (another kernel, another row order)."""
    model = family_model(name)
    block = moe_block(model)
    mine = copy.deepcopy(block)
    assert shard_hf_experts(mine, ExpertGroup(), first_run=3) == 1
    experts = mine.experts
    assert isinstance(experts, ShardedExperts) and not is_hf_experts(experts)
    hf_experts = block.experts
    tensors = [n for n, _ in hf_experts.named_parameters(recurse=False)]
    assert [n for n, _ in experts.named_parameters(recurse=False)] == tensors
    assert [expert_run(p) for p in experts.parameters(recurse=False)] == list(
        range(3, 3 + len(tensors))
    )
    for p in experts.parameters(recurse=False):
        assert is_expert(p) and expert_shard(p) == (0, 4, 4)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in block.named_parameters()]
    eager = copy.deepcopy(block)
    eager.experts.config = copy.copy(eager.experts.config)
    eager.experts.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 32, generator=g)  # 240 (token, k) rows: torch.sort's own order
    got, want, loop = (run_block(m, x.clone().requires_grad_()) for m in (mine, block, eager))
    for out in (got, want, loop):
        out.square().sum().backward()
    assert torch.equal(got, want)
    assert close(loop, want, 1e-6)
    for (n, a), (_, b), (_, c) in zip(
        block.named_parameters(), mine.named_parameters(), eager.named_parameters(), strict=True
    ):
        assert torch.equal(b.grad, a.grad), n
        assert close(c.grad, a.grad, 1e-6), n


def split_step(module, x, store, recorded: bool):
    """F, then B of one microbatch (recorded: StageChunk's protocol; else a plain forward
    and a captured backward); returns the output, the input gradient and whether every
    parameter was still without a gradient after B."""
    from zerobubble.runtime.split import WeightGradStore

    assert isinstance(store, WeightGradStore)
    x = x.clone().requires_grad_()
    params = [p for p in module.parameters() if p.requires_grad]
    if recorded:
        with store.record(0, 0):
            out = run_block(module, x)
        grads = store.backward(0, 0, out, torch.ones_like(out), [x, *params])
        gx = grads[0]
        store.add_grads(
            0, 0, [(p, g) for p, g in zip(params, grads[1:], strict=True) if g is not None]
        )
    else:
        out = run_block(module, x)
        with store.capture(0, 0):
            out.backward(torch.ones_like(out))
        gx = x.grad
    experts = [p for p in module.parameters() if is_expert(p)]
    deferred = all(p.grad is None for p in experts)
    store.run(0, 0)
    return out, gx, deferred


@pytest.mark.bitwise
@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "captured"])
@pytest.mark.parametrize("name", ["hf-mixtral", "hf-gpt-oss", "hf-qwen2-moe"])
def test_the_bw_split_of_sharded_experts_is_plain_autograd_bitwise_with_w_deferred(name, recorded):
    """A split ShardedExperts has no graph-level split (W would re-run its forward and its
    all-to-alls): its grouped matmuls record their calls, B computes the input gradients
    and W the expert weight (and GPT-OSS's bias) gradients, bitwise plain autograd."""
    from zerobubble.runtime.split import WeightGradStore, enable_bw_split
    from zerobubble.runtime.split.fallback import GraphSplit

    block = moe_block(family_model(name))
    shard_hf_experts(block, ExpertGroup())
    plain = copy.deepcopy(block)
    store = WeightGradStore()
    enable_bw_split(block, store)
    experts = block.experts
    assert experts.store is store
    assert all(GraphSplit.of(m) is None for m in experts.modules())
    x = torch.randn(2, 50, 32, generator=torch.Generator().manual_seed(1))
    out, gx, deferred = split_step(block, x, store, recorded)
    xr = x.clone().requires_grad_()
    want = run_block(plain, xr)
    want.backward(torch.ones_like(want))
    assert deferred  # no expert gradient after B: all of them came from W
    assert torch.equal(out, want) and torch.equal(gx, xr.grad)
    for (n, p), (_, q) in zip(block.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n
    assert store.in_flight() == {} and store.held_tensors() == []


def with_flags(variant: str):
    """OLMoE's experts module rebuilt with the layouts no shipped family has: a post-expert
    norm (MuseSpark's flag), no gate (``up_proj`` and ``act_fn``, Nemotron-H's), and no gate
    with transposed stacks and biases. HF's own grouped_mm reads the flags at run time."""
    experts = hf.tiny_model("hf-olmoe").model.layers[0].mlp.experts
    g = torch.Generator().manual_seed(7)
    if variant == "post_norm":
        experts.has_post_expert_norm = True
        experts.post_expert_norm = torch.nn.RMSNorm(32)
        with torch.no_grad():
            experts.post_expert_norm.weight.copy_(torch.rand(32, generator=g) + 0.5)
        return experts
    transposed = variant == "no_gate_transposed_bias"
    del experts.gate_up_proj
    experts.has_gate, experts.is_transposed = False, transposed
    shapes = ((4, 32, 16), (4, 16, 32)) if transposed else ((4, 16, 32), (4, 32, 16))
    experts.up_proj = torch.nn.Parameter(torch.randn(shapes[0], generator=g) * 0.2)
    experts.down_proj = torch.nn.Parameter(torch.randn(shapes[1], generator=g) * 0.2)
    if transposed:
        experts.has_bias = True
        experts.up_proj_bias = torch.nn.Parameter(torch.randn(4, 16, generator=g))
        experts.down_proj_bias = torch.nn.Parameter(torch.randn(4, 32, generator=g))
    return experts


@pytest.mark.bitwise
@pytest.mark.parametrize("variant", ["post_norm", "no_gate", "no_gate_transposed_bias"])
def test_sharded_experts_follow_the_other_layout_flags_bitwise(variant):
    """The post-expert norm runs on the returned rows (row-wise, its weight dense); without
    a gate ``act_fn`` follows ``up_proj``; transposed stacks and biases as GPT-OSS's."""
    experts = with_flags(variant)
    mine = ShardedExperts(experts, ExpertGroup())
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in experts.named_parameters()]
    assert [is_expert(p) for p in mine.parameters()] == [
        not n.startswith("post_expert_norm") for n, _ in mine.named_parameters()
    ]
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(60, 32, generator=g)
    index = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(60)])
    weights = torch.rand(60, 2, generator=g)
    outs, grads = [], []
    for m in (experts, mine):
        h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
        out = m(h, index, w)
        out.square().sum().backward()
        outs.append(out)
        grads.append([h.grad, w.grad, *(p.grad for p in m.parameters())])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_sharded_experts_refuse_what_they_cannot_reproduce():
    model = hf.tiny_model("hf-mixtral")
    with pytest.raises(ValueError, match=r"ep=3 must divide the HF experts' num_experts=4"):
        shard_hf_experts(model.model.layers[0], ExpertGroup(object(), 0, 3))  # type: ignore[arg-type]
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:2].clone())
    with pytest.raises(ValueError, match=r"MixtralExperts.down_proj is not a \(4, ., .\) tensor"):
        ShardedExperts(experts, ExpertGroup())
    experts = model.model.layers[1].mlp.experts
    experts.scale = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(
        ValueError,
        match=r"mlp.experts: MixtralExperts has the parameter 'scale', which .* does not name, "
        r"so ShardedExperts cannot reproduce it; build the mesh with ep=1",
    ):
        shard_hf_experts(model.model.layers[1], ExpertGroup())
    experts = model.model.layers[2].mlp.experts
    experts.has_post_expert_norm = True
    with pytest.raises(ValueError, match=r"has_post_expert_norm=True but no post_expert_norm"):
        ShardedExperts(experts, ExpertGroup())

    class OwnForward(type(model.model.layers[3].mlp.experts)):  # Ergo's pattern
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return super().forward(hidden_states, top_k_index, top_k_weights) * 2

    experts = model.model.layers[3].mlp.experts
    experts.__class__ = OwnForward
    with pytest.raises(ValueError, match=r"OwnForward overrides the forward that "):
        ShardedExperts(experts, ExpertGroup())


def test_experts_outside_the_contract_are_found_unsharded():
    """JetMoe's experts (attention and MLP mixtures of its own layout) carry no contract:
    shard_hf_experts leaves them, unsharded_experts names them (the pipeline refuses ep>1)."""
    import transformers

    config = transformers.AutoConfig.for_model(
        "jetmoe",
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert shard_hf_experts(model.model, ExpertGroup()) == 0
    found = [(n, type(m).__name__) for n, m in unsharded_experts(model.model)]
    assert found == [
        ("layers.0.mlp.input_linear", "JetMoeParallelExperts"),
        ("layers.0.mlp.output_linear", "JetMoeParallelExperts"),
        ("layers.0.self_attention.experts", "JetMoeMoA"),
    ]
    mixtral = hf.tiny_model("hf-mixtral")
    shard_hf_experts(mixtral.model, ExpertGroup())
    assert unsharded_experts(mixtral.model) == []


def test_the_adapters_layers_shard_their_experts_through_the_layer_contract():
    """The pipeline and the threaded reference shard through each module's hook
    ``shard_experts`` (:func:`shard_all_experts`): on the adapter's layers that is
    :func:`shard_hf_experts` over the model, runs and rows alike; a refusal names the experts
    module as the model does; our MoE's hook is :meth:`MoE.shard` with one run each."""
    model = hf.tiny_model("hf-mixtral")
    whole = copy.deepcopy(model)
    layers = torch.nn.Sequential(*hf.causal_lm_layers(model))
    runs = shard_all_experts(layers, ExpertGroup(), first_run=2)
    found = shard_hf_experts(whole.model, ExpertGroup(), first_run=2)
    assert found == 4 and runs == 2 * found  # gate_up_proj and down_proj each
    mine = [(expert_run(p), expert_shard(p)) for p in layers.parameters() if is_expert(p)]
    theirs = [(expert_run(p), expert_shard(p)) for p in whole.parameters() if is_expert(p)]
    assert mine == theirs and [run for run, _ in mine] == list(range(2, 2 + runs))
    assert unsharded_experts(layers) == []

    broken = hf.tiny_model("hf-mixtral")
    broken.model.layers[1].mlp.experts.scale = torch.nn.Parameter(torch.ones(4))
    with pytest.raises(
        ValueError,
        match=r"^model\.layers\.1\.mlp\.experts: MixtralExperts has the parameter 'scale'",
    ):
        shard_all_experts(torch.nn.Sequential(*hf.causal_lm_layers(broken)), ExpertGroup())

    moe = build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2)
    assert shard_all_experts(moe, ExpertGroup()) == 2
    assert [expert_run(p) for p in moe[1].moe.experts.parameters()][:1] == [0]
    assert [expert_run(p) for p in moe[2].moe.experts.parameters()][:1] == [1]


@pytest.mark.parametrize(("dp", "ep"), [(2, 2), (4, 2)])
def test_the_threaded_reference_is_ep_reference_step_bitwise_on_our_moe(dp, ep):
    """Threads meeting at a LocalGroup compute what ep_reference_step's explicit
    concatenations compute: losses (with a balance term) and every gradient, bitwise."""

    def model():
        return build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=2, balance=0.01)

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(dp * 8, 3, 6, generator=g), torch.randn(dp * 8, 3, 3, generator=g)
    parts = [(x[r * 8 : (r + 1) * 8], y[r * 8 : (r + 1) * 8]) for r in range(dp)]
    want_losses, want = ep_reference_step(model(), mlp_loss, parts, 4, ep)
    losses, grads = threaded_ep_reference_step(model(), mlp_loss, parts, 4, ep)
    assert sorted(grads) == sorted(want)
    assert all(torch.equal(grads[n], want[n]) for n in want)
    assert [list(map(float, r)) for r in losses] == [list(map(float, r)) for r in want_losses]


def test_a_failing_replica_of_the_threaded_reference_raises_instead_of_hanging():
    calls = []

    def loss_fn(out, target):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("replica failed")
        return mlp_loss(out, target)

    model = build_moe_mlp((6, 8, 3), hidden=16, num_experts=4, top_k=2, blocks=1)
    parts = [(torch.randn(4, 6), torch.randn(4, 3)) for _ in range(2)]
    with pytest.raises(RuntimeError, match="replica failed"):
        threaded_ep_reference_step(model, loss_fn, parts, 2, 2)


# ---- ranks ---------------------------------------------------------------------------------


def one_step(mesh, name: str, kind: str) -> dict:
    model = hf.tiny_model(name)
    pipe = zerobubble.Pipeline(
        hf.causal_lm_layers(model),
        hf.CausalLMLoss(model),
        kind,
        microbatches=M,
        mesh=mesh,
        options=PER_CALL,
    )
    x, y = part(mesh.dp_size, mesh.dp_rank)
    terms: dict[str, list[torch.Tensor]] = {}
    hooks = Deferral(pipe.executor)
    losses = pipe.executor.step(x, target=y, terms=terms, hooks=hooks)
    sharded = [n for n, p in pipe.named_parameters() if expert_shard(p) is not None]
    return {
        "losses": None if losses is None else [t.numpy() for t in losses],
        "terms": {k: [t.numpy() for t in v] for k, v in terms.items()},
        "grads": {n: p.grad.numpy().copy() for n, p in pipe.named_parameters()},
        "shard": {n: expert_shard(p) for n, p in pipe.named_parameters()},
        "sharded": sharded,
        "after_b": hooks.after_b,
    }


def state_checks(mesh, name: str, modes: tuple[str, ...], tmp: str) -> dict:
    """The clipping norm of one trainer step (plain SGD, lr 0) on the zb-h1 pipeline in each
    step mode (post-validation passes the norm slots along the pipeline); the whole HF state
    dict loaded strictly, gathered back, and a checkpoint round trip: the names that differ."""
    out: dict = {"norm": []}
    for mode in modes:
        model = hf.tiny_model(name)
        pipe = zerobubble.Pipeline(
            hf.causal_lm_layers(model),
            hf.CausalLMLoss(model),
            "zb-h1",
            microbatches=M,
            mesh=mesh,
            options=PER_CALL,
        )
        trainer = pipe.set_optimizer(
            torch.optim.SGD(pipe.parameters(), lr=0.0),
            zerobubble.OptimConfig(mode=mode, max_norm=1e-3),
        )
        x, y = part(2, mesh.dp_rank)
        pipe.step(x, target=y)
        pipe.drain()
        assert trainer.last_commit is not None
        out["norm"].append(float(trainer.last_commit.total_norm))
    # The whole HF state dict loads strictly (each rank keeps its rows of the experts).
    other = hf.tiny_model(name, seed=1)
    pipe.load_state_dict(other.state_dict())
    whole = other.state_dict()
    bad = []
    for n, p in pipe.named_parameters():
        shard = expert_shard(p)
        want = whole[n] if shard is None else whole[n][shard[0] : shard[1]]
        if not torch.equal(p.detach(), want):
            bad.append(n)
    out["loaded"] = bad
    gathered = gather_hf_experts(pipe, mesh)  # whole HF tensors again: HF's own entries
    out["gathered"] = [n for n, t in gathered.items() if not torch.equal(t, whole[n])]
    # A checkpoint round-trips: ep peers' rows of one name are separate entries.
    saved = {n: p.detach().clone() for n, p in pipe.named_parameters()}
    from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint

    save_checkpoint(trainer, tmp, mesh=mesh)
    with torch.no_grad():
        for p in pipe.parameters():
            p.zero_()
    load_checkpoint(trainer, tmp, mesh=mesh)
    out["restored"] = [n for n, p in pipe.named_parameters() if not torch.equal(p, saved[n])]
    return out


def checkpoint_metadata(path: str) -> dict:
    """Every entry of the distributed checkpoints saved under ``path``, with its metadata."""
    from pathlib import Path

    from torch.distributed.checkpoint import FileSystemReader

    return {
        k: md
        for meta in Path(path).rglob(".metadata")
        for k, md in FileSystemReader(str(meta.parent)).read_metadata().state_dict_metadata.items()
    }


def four_ranks(tmp: str) -> dict:
    """One 4-rank launch: pp=2 x dp=2 x ep=2 (:data:`CASES`, :data:`STATE_CASES`), then
    pp=1 x dp=4 x ep=2 on the same world, then ranks 0 and 1 as a world of their own
    (a new default group over a file store) for pp=1 x dp=2 x ep=2."""
    rank = init_distributed(timeout_s=120).rank
    mesh = build_mesh(2, 2, ep=2)
    out: dict = {"ep_rank": mesh.ep_rank, "dp_rank": mesh.dp_rank, "pp_rank": mesh.pp_rank}
    out["tmp"] = tmp
    for name, kind in CASES:
        out[(name, kind)] = one_step(mesh, name, kind)
    for name, modes in STATE_CASES.items():
        out[("state", name)] = state_checks(mesh, name, modes, f"{tmp}/{name}")
    # pp=1 x dp=4 x ep=2: expert gradients summed over edp (2 ranks)
    wide = build_mesh(1, 4, ep=2)
    out["wide"] = {"dp_rank": wide.dp_rank, "step": one_step(wide, "hf-mixtral", "1f1b")}
    dist.destroy_process_group()
    if rank < 2:
        store = dist.FileStore(f"{tmp}/pp1.store", 2)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        pp1 = build_mesh(1, 2, ep=2)
        out["pp1"] = {"ep_rank": pp1.ep_rank, "step": one_step(pp1, "hf-mixtral", "1f1b")}
        dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    """The ranks' results of :func:`four_ranks` (one launch for the two tests below)."""
    return launch(four_ranks, 4, str(tmp_path_factory.mktemp("hf_ep")), timeout=TIMEOUT)


@pytest.mark.slow
@pytest.mark.bitwise
def test_hf_experts_on_dp4_ep2_sum_expert_gradients_over_edp(four):
    """Expert gradients (g_0 + g_2 for ep rank 0) bitwise the threaded reference; dense
    ones (gloo's 4-rank ring, its own order) within 1e-7 and equal on every replica."""
    results = [r["wide"] for r in four]
    losses, want = threaded_reference("hf-mixtral", 4, 2)
    for r in results:
        got = r["step"]
        assert all(map(torch.equal, map(torch.from_numpy, got["losses"]), losses[r["dp_rank"]]))
        for n, array in got["grads"].items():
            grad, shard = torch.from_numpy(array), got["shard"][n]
            if shard is not None:
                assert torch.equal(grad, want[n][shard[0] : shard[1]]), n
            else:
                assert torch.equal(grad, torch.from_numpy(results[0]["step"]["grads"][n])), n
                assert torch.allclose(grad, want[n], rtol=0, atol=1e-7), n


def hf_reference(
    name: str, dp: int, skewed: bool = False
) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """HF's own model per replica: per microbatch ``model(..., labels, num_items_in_batch=N)``
    (N the global token count, as the pipeline normalises), back-propagated unscaled; the
    replicas' gradients summed in rank order."""
    model = skew(hf.tiny_model(name)) if skewed else hf.tiny_model(name)
    _, labels = batch(dp)
    total = hf.count_tokens(labels)
    losses: list[list[torch.Tensor]] = []
    summed: dict[str, torch.Tensor] = {}
    for r in range(dp):
        model.zero_grad(set_to_none=True)
        x, y = part(dp, r)
        mine = []
        for xj, yj in zip(x.chunk(M), y.chunk(M), strict=True):
            loss = model(input_ids=xj, labels=yj, num_items_in_batch=total).loss
            loss.backward()
            mine.append(loss.detach())
        losses.append(mine)
        for n, p in model.named_parameters():
            assert p.grad is not None, n
            summed[n] = p.grad.clone() if n not in summed else summed[n] + p.grad
    return losses, summed


def skew(model):
    """Zero routers: every token picks the same two experts (topk's ties: 2 and 3, ep rank
    1's at ep=2); the other ep rank receives no rows."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    return model


def threaded_reference(name: str, dp: int, ep: int, skewed: bool = False):
    """The single-process ground truth: one thread per replica, the all-to-alls played out
    between them (:func:`threaded_ep_reference_step`)."""
    model = skew(hf.tiny_model(name)) if skewed else hf.tiny_model(name)
    parts = [part(dp, r) for r in range(dp)]
    return threaded_ep_reference_step(
        hf.causal_lm_layers(model), hf.CausalLMLoss(model), parts, M, ep, term_weight="per_call"
    )


def close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> bool:
    """Within ``rel`` of ``want``'s largest magnitude."""
    got, want = got.detach(), want.detach()
    return torch.allclose(got, want, rtol=0, atol=rel * max(float(want.abs().max()), 1e-30))


@pytest.mark.parametrize("skewed", [False, True])
def test_the_threaded_reference_of_hf_experts_is_close_to_hf_per_replica(skewed):
    """At dp=2 x ep=2, in one process, with and without an ep rank that receives no rows."""
    losses, grads = threaded_reference("hf-mixtral", 2, 2, skewed)
    want_losses, want = hf_reference("hf-mixtral", 2, skewed)
    assert sorted(grads) == sorted(want)
    assert all(close(grads[n], want[n]) for n in want), [
        n for n in want if not close(grads[n], want[n])
    ]
    pairs = [
        (a, b) for r, w in zip(losses, want_losses, strict=True) for a, b in zip(r, w, strict=True)
    ]
    assert len(pairs) == 2 * M and all(close(a, b) for a, b in pairs)
    if skewed:  # one ep rank's experts saw no token (topk's ties pick 2 and 3 here)
        experts = [grads[n] for n in grads if ".experts." in n]
        idle = [q for q in (0, 1) if all(not g[2 * q : 2 * q + 2].any() for g in experts)]
        assert len(idle) == 1, idle


@pytest.mark.slow
@pytest.mark.bitwise
def test_hf_experts_on_pp2_ep2_are_bitwise_the_threaded_reference_and_close_to_hf(four):
    results, tmp_path = four, four[0]["tmp"]
    pp1 = [r["pp1"] for r in four if "pp1" in r]
    assert len(pp1) == 2
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    refs = {name: hf_reference(name, 2) for name in {n for n, _ in CASES}}
    exact = {name: threaded_reference(name, 2, 2) for name in refs}
    # the zb-h1 Mixtral run by (replica, name), and its losses by replica
    h1 = {
        (r["dp_rank"], n): torch.from_numpy(a)
        for r in results
        for n, a in r[("hf-mixtral", "zb-h1")]["grads"].items()
    }
    h1_losses = {
        r["dp_rank"]: list(map(torch.from_numpy, r[("hf-mixtral", "zb-h1")]["losses"]))
        for r in results
        if r[("hf-mixtral", "zb-h1")]["losses"] is not None
    }
    for r in results:
        for name in STATE_CASES:
            state = r[("state", name)]
            assert state["loaded"] == [] and state["restored"] == [] and state["gathered"] == []
        # the sharded tensors, biases included, are stored whole under HF's names, once
        # per ep row block (DCP's chunks), and so is their optimizer state
        whole = hf.tiny_model(name).state_dict()
        stored = checkpoint_metadata(f"{tmp_path}/{name}")
        experts = {k: md for k, md in stored.items() if ".experts." in k}
        model_keys = {k.removeprefix("model.") for k in experts if k.startswith("model.")}
        assert model_keys == {k for k in whole if ".experts." in k}, sorted(experts)
        for key, md in experts.items():
            if key.startswith("optim.") and key.endswith(".step"):
                continue
            kind, _, fqn = key.partition(".")
            fqn = fqn if kind == "model" else fqn.rsplit(".", 1)[0]  # optim.<fqn>.<field>
            assert tuple(md.size) == tuple(whole[fqn].shape), key
            assert sorted(c.offsets[0] for c in md.chunks) == [0, 2], key
    for case in CASES:
        name, kind = case
        want_losses, want = refs[name]
        exact_losses, exact_grads = exact[name]
        held: dict[str, set] = {}
        assert any(r[case]["sharded"] for r in results), case
        for r in results:
            got = r[case]
            for n, array in got["grads"].items():
                grad, shard = torch.from_numpy(array), got["shard"][n]
                held.setdefault(n, set()).add(shard)
                ref = want[n] if shard is None else want[n][shard[0] : shard[1]]
                assert close(grad, ref), (case, n)
                bits = exact_grads[n] if shard is None else exact_grads[n][shard[0] : shard[1]]
                assert torch.equal(grad, bits), (case, n)
                if kind == "zbv" and name == "hf-mixtral":  # bitwise the zb-h1 run
                    assert torch.equal(grad, h1[(r["dp_rank"], n)]), (case, n)
            if got["losses"] is not None:
                mine = want_losses[r["dp_rank"]]
                pairs = zip(got["losses"], mine, strict=True)
                assert all(close(torch.from_numpy(a), b) for a, b in pairs)
                losses = map(torch.from_numpy, got["losses"])
                assert all(map(torch.equal, losses, exact_losses[r["dp_rank"]])), case
                assert list(got["terms"]) == (["router_aux"] if name != "hf-gpt-oss" else [])
                if kind == "zbv" and name == "hf-mixtral":
                    assert all(
                        map(
                            torch.equal,
                            map(torch.from_numpy, got["losses"]),
                            h1_losses[r["dp_rank"]],
                        )
                    )
            # split stages defer the HF expert weight gradients to W, like our MoE's
            assert all(pending for _, _, _, pending in got["after_b"]), case
            assert all(none for _, mb, none, _ in got["after_b"] if mb == 0), case
        if kind != "1f1b":
            assert any(r[case]["after_b"] for r in results), case
        # every parameter of the model is held; experts as two row blocks
        assert set(held) == set(want), case
        for n, shards in held.items():
            assert shards == ({None} if ".experts." not in n else {(0, 2, 4), (2, 4, 4)}), n
    # pp=1 x ep=2 under 1f1b: bitwise the pp=2 runs (replica = ep rank here)
    for q in pp1:
        step, replica = q["step"], q["ep_rank"]
        assert set(step["grads"]) == {n for d, n in h1 if d == replica}
        for n, array in step["grads"].items():
            assert torch.equal(torch.from_numpy(array), h1[(replica, n)]), n
        assert all(map(torch.equal, map(torch.from_numpy, step["losses"]), h1_losses[replica]))
    # the clipping norm: every expert row block once, in the unsharded model's order
    for name, modes in STATE_CASES.items():
        grads = {}
        for r in results:
            for n, array in r[(name, "zb-h1")]["grads"].items():
                shard = r[(name, "zb-h1")]["shard"][n]
                grads[(n, None if shard is None else shard[0])] = torch.from_numpy(array)
        order = []
        for n, _ in hf.tiny_model(name).named_parameters():
            order += [grads[(n, 0)], grads[(n, 2)]] if ".experts." in n else [grads[(n, None)]]
        norm = float(torch.nn.utils.get_total_norm(order))
        assert [r[("state", name)]["norm"] for r in results] == [[norm] * len(modes)] * 4, name


# ---- pp3 x dp2 x ep2: every family, overlapped pairs, all-to-all counts ---------------------

#: The families run at P=3 (4 decoder layers each: dualpipev's 6 stages hold one layer each).
FAMILIES = ("hf-mixtral", "hf-deepseek-v3", "hf-qwen2-moe", "hf-olmoe", "hf-gpt-oss")
P3, M3, REPEATS = 3, 4, 3
#: Per family, the kinds it runs and whether with pairs (a covering design: every family
#: under dualpipev's pairs; zbv's pairs, formed across its two chunks by the pass, on two
#: families; a kind without pairs on the others, Mixtral and GPT-OSS running theirs at
#: pp=2, in :data:`CASES`).
KINDS = {
    "hf-mixtral": (("dualpipev", True), ("zbv", True)),
    "hf-deepseek-v3": (("dualpipev", True), ("zb-h2", False)),
    "hf-qwen2-moe": (("dualpipev", True), ("zbv", True)),
    "hf-olmoe": (("dualpipev", True), ("zbv", False)),
    "hf-gpt-oss": (("dualpipev", True),),
}


def family(name: str):
    """A tiny model of ``name`` without a router loss, with 4 decoder layers."""
    overrides = {"hf-mixtral": {"output_router_logits": False}, "hf-deepseek-v3": {}}
    if name == "hf-deepseek-v3":
        overrides[name] = {"num_hidden_layers": 4}  # a dense layer, then three MoE layers
    return hf.tiny_model(name, **overrides.get(name, {}))


class AllToAlls:
    """Counts ``all_to_all_single`` calls per (action, stage, microbatch, lane), the action
    being the chunk method running on the calling thread (F, B, W, or BW when a fused
    backward runs as one autograd call); the lane is the ep group (forward) or its second
    group (backward)."""

    def __init__(self, mesh) -> None:
        import threading
        from collections import Counter

        self.counts: Counter = Counter()
        self.local = threading.local()
        self.lanes = {id(mesh.ep_group): "forward", id(mesh.ep_backward_group): "backward"}
        self.real = dist.all_to_all_single

        def counted(*args, group=None, **kwargs):
            where = getattr(self.local, "action", None)
            self.counts[(*where, self.lanes.get(id(group), "other"))] += 1
            return self.real(*args, group=group, **kwargs)

        dist.all_to_all_single = counted

    def watch(self, pipe) -> None:
        """Wrap the chunk methods of ``pipe`` so that calls know their action."""
        for chunk in pipe.executor.chunks.values():
            for op, method in (
                ("F", "forward"),
                ("B", "backward_input"),
                ("W", "backward_weight"),
                ("BW", "backward_full"),
            ):
                setattr(chunk, method, self._phased(op, chunk.stage, getattr(chunk, method)))

    def _phased(self, op, stage, run):
        def phased(mb, *args, **kwargs):
            before = getattr(self.local, "action", None)
            self.local.action = (op, stage, mb)
            try:
                return run(mb, *args, **kwargs)
            finally:
                self.local.action = before

        return phased


def refused(mesh, model) -> str:
    """The ValueError a Pipeline over ``model`` raises on this mesh (every rank raises)."""
    try:
        zerobubble.Pipeline(
            hf.causal_lm_layers(model), hf.CausalLMLoss(model), "zb-h1", microbatches=M3, mesh=mesh
        )
    except ValueError as e:
        return str(e)
    return ""


def p3_ranks() -> dict:
    import transformers

    from zerobubble.schedule.generators import generate

    init_distributed(timeout_s=120)
    mesh = build_mesh(P3, 2, ep=2)
    counter = AllToAlls(mesh)
    x, y = part(2, mesh.dp_rank)
    out: dict = {"dp_rank": mesh.dp_rank}
    for name in FAMILIES:
        model = family(name)
        layers, loss_fn = hf.causal_lm_layers(model), hf.CausalLMLoss(model)
        for kind, overlap in KINDS[name]:
            costs = CostSpec(a2a=1) if overlap else None  # zbv pairs where an a2a would hide
            sched = generate(kind, P3, M3, overlap=overlap, costs=costs)
            pipe = zerobubble.Pipeline(layers, loss_fn, sched, mesh=mesh)
            repeats = REPEATS if overlap else 1
            counter.counts.clear()
            counter.watch(pipe)
            runs, counted = [], {}
            for _ in range(repeats):  # a race shows only sometimes
                for p in pipe.parameters():
                    p.grad = None
                losses = pipe.executor.step(x, target=y)
                grads = {n: p.grad.clone() for n, p in pipe.named_parameters()}
                runs.append((losses, grads))
                counted = counted or dict(counter.counts)  # the first step's
            losses, grads = runs[0]
            same = all(
                (ls is None) == (losses is None)
                and (ls is None or all(map(torch.equal, ls, losses)))
                and all(torch.equal(g[n], grads[n]) for n in grads)
                for ls, g in runs[1:]
            )
            out[(name, kind, overlap)] = {
                "losses": None if losses is None else [t.numpy() for t in losses],
                "grads": {n: g.numpy() for n, g in grads.items()},
                "shard": {n: expert_shard(p) for n, p in pipe.named_parameters()},
                "repeats_equal": same,
                "paired": len(pipe.schedule.overlaps),
                "all_to_alls": counted,
                "moe_layers": {
                    s: sum(isinstance(m, ShardedExperts) for m in c.module.modules())
                    for s, c in pipe.executor.chunks.items()
                },
            }
    # ep > 1 never runs as plain dp: experts outside the contract, or none at all
    jetmoe = transformers.AutoConfig.for_model(
        "jetmoe",
        vocab_size=256,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,  # ties across stages with ep are refused before the experts
    )
    out["jetmoe"] = refused(mesh, transformers.AutoModelForCausalLM.from_config(jetmoe))
    out["dense"] = refused(mesh, hf.tiny_model("hf-llama", tie_word_embeddings=False))
    dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.bitwise
def test_every_family_at_pp3_dp2_ep2_with_pairs_is_bitwise_the_threaded_reference():
    """6 gloo ranks, pp=3 x dp=2 x ep=2, each family's experts sharded over the 2 replicas:
    dualpipev with its overlapped pairs, zbv with the pass's pairs (each run 3 times: a race
    shows only sometimes) and zb-h2 or zbv without pairs (:data:`KINDS`) give losses
    and every reduced gradient bitwise the threaded reference.
    Every microbatch's MoE layer issues 5 all-to-alls: 3 in F on the ep group (counts, rows,
    outputs back), 2 in its backward on the second group, none in W. A family whose experts
    ep cannot shard, and a model without experts, are refused on every rank."""
    results = launch(p3_ranks, 2 * P3, timeout=TIMEOUT)
    for name in FAMILIES:
        model = family(name)
        parts = [part(2, r) for r in range(2)]
        want_losses, want = threaded_ep_reference_step(
            hf.causal_lm_layers(model), hf.CausalLMLoss(model), parts, M3, 2
        )
        for kind, overlap in KINDS[name]:
            case = (name, kind, overlap)
            held: dict[str, set] = {}
            for r in results:
                got = r[case]
                assert got["repeats_equal"], case
                assert (got["paired"] > 0) == overlap, case
                for n, array in got["grads"].items():
                    shard = got["shard"][n]
                    held.setdefault(n, set()).add(shard)
                    bits = want[n] if shard is None else want[n][shard[0] : shard[1]]
                    assert torch.equal(torch.from_numpy(array), bits), (case, n)
                if got["losses"] is not None:
                    losses = map(torch.from_numpy, got["losses"])
                    assert all(map(torch.equal, losses, want_losses[r["dp_rank"]])), case
                # 5 all-to-alls per microbatch and MoE layer: 3 in F, 2 in B, none in W
                expected = {}
                for s, n_moe in got["moe_layers"].items():
                    for mb in range(M3 if n_moe else 0):
                        expected[("F", s, mb, "forward")] = 3 * n_moe
                        expected[("B", s, mb, "backward")] = 2 * n_moe
                assert got["all_to_alls"] == expected, case
            assert set(held) == set(want), case
            for n, shards in held.items():
                assert shards == ({None} if ".experts." not in n else {(0, 2, 4), (2, 4, 4)}), n
    for r in results:
        assert (
            "stage 1: model.layers.0.mlp.input_linear (JetMoeParallelExperts) holds experts"
            in r["jetmoe"]
        )
        assert "model.layers.0.self_attention.experts (JetMoeMoA)" in r["jetmoe"]
        assert r["dense"].startswith("ep=2 but no stage of the model holds experts to shard")
