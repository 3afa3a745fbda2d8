"""Hugging Face MoE experts (Mixtral, Qwen3-MoE) sharded over ep, as our MoE's are.

In one process: at ep=1 :class:`ShardedExperts` is HF's experts module bitwise in the
forward; the threaded reference (:func:`threaded_ep_reference_step`) is
:func:`ep_reference_step` bitwise on our MoE. On 4 gloo ranks (pp=2 x dp=2 x ep=2) the
tiny Mixtral (with its router loss) runs one step under zb-h1 and zbv and Qwen3-MoE under
zbv; 2 ranks run pp=1 x ep=2 (1f1b). Losses and every gradient after the reduction are
bitwise the threaded reference and equal between those runs (the schedule and the stage
cuts do not change the arithmetic), and within 1e-5 of each tensor's largest magnitude
of HF's own model run per replica on the same microbatches with the replicas' gradients
summed (an expert's matmuls see both replicas' rows under ep, so that comparison is not
bitwise). The clipping norm counts every expert row block once, bitwise
``get_total_norm`` of the layout's tensors; the whole HF state dict loads strictly and
:func:`gather_hf_experts` gives it back; a checkpoint round-trips."""

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
    shard_hf_experts,
)
from zerobubble.models import mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.runtime.ep import ExpertGroup, expert_run, is_expert
from zerobubble.runtime.ep_reference import ep_reference_step, threaded_ep_reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.mesh import build_mesh

M, LOCAL, LENGTH = 2, 4, 6
TIMEOUT = 240.0
CASES = [("hf-mixtral", "zb-h1"), ("hf-mixtral", "zbv"), ("hf-qwen3-moe", "zbv")]
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


@pytest.mark.parametrize("name", hf.TINY_MOE_CONFIGS)
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_sharded_experts_at_ep1_are_the_hf_block_bitwise(name, impl):
    """HF's eager experts: forward and every gradient bitwise. transformers' default
    grouped_mm: forward, input and router gradients bitwise, expert weight gradients
    within 1e-6 of their largest magnitude (its own backward kernel)."""
    model = hf.tiny_model(name)
    model.config._experts_implementation = impl
    block = model.model.layers[0].mlp
    mine = copy.deepcopy(block)
    assert shard_hf_experts(mine, ExpertGroup(), first_run=3) == 1
    experts = mine.experts
    assert isinstance(experts, ShardedExperts)
    assert [expert_run(p) for p in experts.parameters()] == [3, 4]
    assert all(map(is_expert, experts.parameters()))
    assert expert_shard(experts.gate_up_proj) == (0, 4, 4)
    assert [n for n, _ in mine.named_parameters()] == [n for n, _ in block.named_parameters()]
    x = torch.randn(3, 7, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    want, got = block(x), mine(x2)
    assert torch.equal(want, got)
    want.square().sum().backward()
    got.square().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(block.gate.weight.grad, mine.gate.weight.grad)
    for n in ("gate_up_proj", "down_proj"):
        a, b = getattr(block.experts, n).grad, getattr(experts, n).grad
        if impl == "eager":
            assert torch.equal(a, b), n
        else:
            assert torch.allclose(a, b, rtol=0, atol=1e-6 * float(a.abs().max())), n


def test_shard_hf_experts_refuses_an_ep_that_does_not_divide_the_experts():
    model = hf.tiny_model("hf-mixtral")
    with pytest.raises(ValueError, match=r"ep=3 must divide the HF experts' num_experts=4"):
        shard_hf_experts(model.model.layers[0], ExpertGroup(object(), 0, 3))  # type: ignore[arg-type]
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        experts.down_proj = torch.nn.Parameter(experts.down_proj[:2].clone())
    with pytest.raises(ValueError, match=r"MixtralExperts.down_proj is not a \(4, ., .\) tensor"):
        ShardedExperts(experts, ExpertGroup())
    experts = model.model.layers[1].mlp.experts
    experts.is_transposed = True
    with pytest.raises(ValueError, match=r"has \{'is_transposed': True\}: ShardedExperts"):
        ShardedExperts(experts, ExpertGroup())


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


def ep_ranks(tmp: str) -> dict:
    init_distributed(timeout_s=120)
    mesh = build_mesh(2, 2, ep=2)
    out: dict = {"ep_rank": mesh.ep_rank, "dp_rank": mesh.dp_rank, "pp_rank": mesh.pp_rank}
    for name, kind in CASES:
        out[(name, kind)] = one_step(mesh, name, kind)
    # The clipping norm: one step of a trainer (plain SGD, lr 0) on the zb-h1 pipeline, in
    # each step mode (post-validation passes the norm slots along the pipeline).
    out["norm"] = []
    for mode in ("sync", "conservative", "speculative"):
        model = hf.tiny_model("hf-mixtral")
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
    other = hf.tiny_model("hf-mixtral", seed=1)
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
    dist.destroy_process_group()
    return out


def pp1_ranks() -> dict:
    init_distributed(timeout_s=120)
    mesh = build_mesh(1, 2, ep=2)
    out = {"ep_rank": mesh.ep_rank, "step": one_step(mesh, "hf-mixtral", "1f1b")}
    dist.destroy_process_group()
    return out


def wide_ranks() -> dict:
    """pp=1 x dp=4 x ep=2: expert gradients summed over edp (2 ranks)."""
    init_distributed(timeout_s=120)
    mesh = build_mesh(1, 4, ep=2)
    out = {"dp_rank": mesh.dp_rank, "step": one_step(mesh, "hf-mixtral", "1f1b")}
    dist.destroy_process_group()
    return out


@pytest.mark.slow
@pytest.mark.bitwise
def test_hf_experts_on_dp4_ep2_sum_expert_gradients_over_edp():
    """Expert gradients (g_0 + g_2 for ep rank 0) bitwise the threaded reference; dense
    ones (gloo's 4-rank ring, its own order) within 1e-7 and equal on every replica."""
    results = launch(wide_ranks, 4, timeout=TIMEOUT)
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


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return torch.allclose(got, want, rtol=0, atol=1e-5 * max(float(want.abs().max()), 1e-30))


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
def test_hf_experts_on_pp2_ep2_are_bitwise_the_threaded_reference_and_close_to_hf(tmp_path):
    results = launch(ep_ranks, 4, str(tmp_path), timeout=TIMEOUT)
    pp1 = launch(pp1_ranks, 2, timeout=TIMEOUT)
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
        assert r["loaded"] == [] and r["restored"] == [] and r["gathered"] == []
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
                assert list(got["terms"]) == ["router_aux"]
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
    grads = {}
    for r in results:
        for n, array in r[("hf-mixtral", "zb-h1")]["grads"].items():
            shard = r[("hf-mixtral", "zb-h1")]["shard"][n]
            grads[(n, None if shard is None else shard[0])] = torch.from_numpy(array)
    order = []
    for n, _ in hf.tiny_model("hf-mixtral").named_parameters():
        order += [grads[(n, 0)], grads[(n, 2)]] if ".experts." in n else [grads[(n, None)]]
    norm = float(torch.nn.utils.get_total_norm(order))
    assert [r["norm"] for r in results] == [[norm] * 3] * 4
