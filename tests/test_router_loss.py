"""Router losses (issue 40, findings 4 and 5): how a step weighs each microbatch's router
terms (:attr:`ExecutorOptions.term_weight`, bitwise the formula at M = 1, 2, 4, 8 and
dp = 1, 2 for our MoE and Hugging Face Mixtral), the router z-loss, and DeepSeek-V3's
bias balancing (once per applied step, from the loads of all microbatches and replicas,
checkpointed)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zerobubble
from ranks import launch
from zerobubble.models import mlp_loss
from zerobubble.models.moe import build_moe_mlp
from zerobubble.parallel.mesh import build_mesh
from zerobubble.reference.step import dp_reference_step, reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.loss_terms import collect_loss_terms, term_weight, weighted_objective
from zerobubble.runtime.microbatch import split_batch

transformers = pytest.importorskip("transformers")
from zerobubble.interop import hf  # noqa: E402
from zerobubble.interop.hf_router import routers_of  # noqa: E402

SIZES, E, K = (6, 8, 3), 4, 2
ROWS, T = 12, 3
"""Our MoE: rows per replica (at M = 8 microbatches of 2 and of 1 row), tokens per row."""
HF_ROWS, LENGTH = 8, 6
MS = (1, 2, 4, 8)
BALANCE, Z = 0.05, 0.01
TIMEOUT = 240
ROOT = Path(__file__).resolve().parents[1]


# ---- the models and their data -------------------------------------------------------------------


def build(name: str) -> tuple[list[nn.Module], object, bool]:
    """Fresh layers, the loss, and whether it is count-normalised (Mixtral: its tokens)."""
    if name == "moe":
        model = build_moe_mlp(
            SIZES, hidden=16, num_experts=E, top_k=K, blocks=2, balance=BALANCE, z_loss=Z
        )
        return list(model), mlp_loss, False
    mixtral = hf.tiny_model("hf-mixtral")
    layers = hf.causal_lm_layers(mixtral, router_z_loss=Z)
    return layers, hf.CausalLMLoss(mixtral), True


def part(name: str, dp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica ``r``'s part of the global batch."""
    g = torch.Generator().manual_seed(11)
    if name == "moe":
        x = torch.randn(dp * ROWS, T, SIZES[0], generator=g)
        y = torch.randn(dp * ROWS, T, SIZES[2], generator=g)
        return x[r * ROWS : (r + 1) * ROWS], y[r * ROWS : (r + 1) * ROWS]
    ids = torch.randint(3, 256, (dp * HF_ROWS, LENGTH), generator=g)
    mine = ids[r * HF_ROWS : (r + 1) * HF_ROWS]
    return mine, mine.clone()


def user_name(layers: list[nn.Module], i: int, name: str) -> str:
    source = getattr(layers[i], "source_name", None)
    return source(name) if source is not None else f"{i}.{name}"


def formula(name: str, dp: int, m: int, mode: str) -> dict:
    """The step written out by hand: per replica ``d`` and microbatch ``j`` in order, the
    backward of ``L * s + sum_n r_n / (M * dp)`` ("mean": every router term weighs
    ``1 / (M * dp)``) or of ``(L + sum_n r_n) * s`` ("per_call"), ``s`` the loss's weight
    (``n_j / N``; 1 for the count-normalised loss); the replicas' gradients summed in rank
    order. Also each microbatch's raw terms and its objective as the pipeline reports it,
    ``L + sum_n r_n * w / s`` ("mean") or ``L + sum_n r_n``."""
    layers, loss_fn, counted = build(name)
    model = nn.Sequential(*layers)
    parts = [part(name, dp, r) for r in range(dp)]
    w = 1.0 / (m * dp)
    total = sum(len(x) for x, _ in parts)
    count = sum(hf.count_tokens(t) for _, t in parts) if counted else None
    out: dict = {"losses": [], "terms": [], "grads": {}}
    for x, target in parts:
        model.zero_grad(set_to_none=True)
        losses, terms = [], []
        for xj, tj in zip(split_batch(x, m), split_batch(target, m), strict=True):
            with collect_loss_terms(model) as found:
                h = model(xj)
            loss = loss_fn(h, tj, count) if counted else loss_fn(h, tj)
            s = 1.0 if counted else len(xj) / total
            if mode == "mean":
                root = loss * s
                for n in sorted(found):
                    root = root + found[n] * w
                with torch.no_grad():
                    value = loss
                    for n in sorted(found):
                        value = value + found[n] * (w / s)
            else:
                value = loss
                for n in sorted(found):
                    value = value + found[n]
                root = value * s
            root.backward()
            losses.append(value.detach())
            terms.append({n: t.detach() for n, t in found.items()})
        out["losses"].append(losses)
        out["terms"].append(terms)
        for i, layer in enumerate(layers):
            for n, p in layer.named_parameters():
                key = user_name(layers, i, n)
                g = out["grads"].get(key)
                out["grads"][key] = p.grad.clone() if g is None else g + p.grad
    return out


# ---- the weights, in one process ----------------------------------------------------------------


def test_term_weight_is_one_over_m_dp_or_none_and_bad_modes_are_refused():
    assert [term_weight("mean", m, dp) for m in MS for dp in (1, 2)] == [
        1.0,
        0.5,
        0.5,
        0.25,
        0.25,
        0.125,
        0.125,
        0.0625,
    ]
    assert term_weight("per_call", 8, 2) is None
    with pytest.raises(ValueError, match=r"term_weight='sum' is not one of 'mean', 'per_call'"):
        zerobubble.ExecutorOptions(term_weight="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="microbatches >= 1"):
        term_weight("mean", 0)


def test_the_train_jobs_executor_section_takes_the_term_weight():
    from zerobubble.train.config import ExecutorSection

    assert ExecutorSection().term_weight == "mean"
    assert ExecutorSection(term_weight="per_call").term_weight == "per_call"
    with pytest.raises(
        ValueError,
        match=r"executor.term_weight must be one of mean, per_call, got 'sum'; pass "
        r"--executor.term-weight mean or per_call",
    ):
        ExecutorSection(term_weight="sum")


def test_a_terms_gradient_is_exactly_its_weight():
    """``weighted_objective``: d root / d term is ``w`` ("mean") or the loss scale
    ("per_call"), bitwise, whatever the loss scale."""
    loss, r = torch.tensor(2.5, requires_grad=True), torch.tensor(0.3, requires_grad=True)
    for mode, scale, want in (("mean", 1 / 3, 1 / 16), ("per_call", 1 / 3, 1 / 3)):
        root, value = weighted_objective(loss, {"router_z": r}, scale, term_weight(mode, 8, 2))
        got = torch.autograd.grad(root, [loss, r])
        assert got[0] == torch.tensor(scale) and got[1] == torch.tensor(want), mode
        assert not value.requires_grad


@pytest.mark.bitwise
@pytest.mark.parametrize("name", ["moe", "mixtral"])
def test_the_references_weigh_terms_as_the_formula(name):
    """``reference_step`` (dp = 1) and, for our MoE, ``dp_reference_step`` (dp = 2) in both
    modes: losses, terms and every gradient bitwise the hand-written formula."""
    cases = [(1, m, mode) for m in MS for mode in ("mean", "per_call")]
    if name == "moe":
        cases += [(2, m, "mean") for m in (1, 8)] + [(2, 8, "per_call")]
    for dp, m, mode in cases:
        want = formula(name, dp, m, mode)
        layers, loss_fn, _ = build(name)
        if dp == 1:
            x, target = part(name, 1, 0)
            terms: dict = {}
            losses, grads = reference_step(
                layers, loss_fn, x, target=target, microbatches=m, terms=terms, term_weight=mode
            )
            losses = [losses]
            for j, found in enumerate(want["terms"][0]):
                assert sorted(terms) == sorted(found)
                assert all(torch.equal(terms[n][j], v) for n, v in found.items())
        else:
            parts = [part(name, dp, r) for r in range(dp)]
            losses, grads = dp_reference_step(layers, loss_fn, parts, m, term_weight=mode)
        what = (name, dp, m, mode)
        for got, exp in zip(losses, want["losses"], strict=True):
            assert all(map(torch.equal, got, exp)), what
        assert grads.keys() == want["grads"].keys(), what
        assert all(torch.equal(g, want["grads"][n]) for n, g in grads.items()), what


# ---- the pipeline at M = 1, 2, 4, 8 and dp = 1, 2 -----------------------------------------------


def matrix_ranks(dp: int, cases: list[tuple[str, int, str]]) -> dict:
    """:func:`matrix_steps` in a launch of its own."""
    init_distributed(timeout_s=120)
    out = matrix_steps(dp, cases)
    dist.destroy_process_group()
    return out


def four_ranks(cases: list[tuple[str, int, str]], tmp: str) -> dict:
    """The two 4-rank jobs in one launch: :func:`matrix_steps` at dp = 2, then
    :func:`bias_steps`."""
    init_distributed(timeout_s=120)
    out = {"matrix": matrix_steps(2, cases), "bias": bias_steps(tmp)}
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("router_bias"))
    return launch(four_ranks, 4, matrix_cases(), tmp, timeout=TIMEOUT)


def matrix_steps(dp: int, cases: list[tuple[str, int, str]]) -> dict:
    """dp = 1: P = 3 under zb-h1; dp = 2: pp = 2 x dp = 2 under zbv. One step per case."""
    world = dist.get_world_size()
    mesh = build_mesh(world // dp, dp) if dp > 1 else None
    kind = "zbv" if dp > 1 else "zb-h1"
    dp_rank = 0 if mesh is None else mesh.dp_rank
    out: dict = {"dp_rank": dp_rank}
    for name, m, mode in cases:
        layers, loss_fn, _ = build(name)
        pipe = zerobubble.Pipeline(
            layers,
            loss_fn,
            kind,
            microbatches=m,
            mesh=mesh,
            options=zerobubble.ExecutorOptions(term_weight=mode),  # type: ignore[arg-type]
        )
        x, target = part(name, dp, dp_rank)
        terms: dict = {}
        losses = pipe.step(x, target=target, terms=terms)
        out[(name, m, mode)] = {
            "losses": losses,
            "terms": terms,
            "grads": {n: p.grad.clone() for n, p in pipe.named_parameters()},
        }
    return out


def matrix_cases() -> list[tuple[str, int, str]]:
    """ "mean" at every M for both models; "per_call" (the old objective) at M = 2 and 8."""
    return [
        (name, m, mode)
        for name in ("moe", "mixtral")
        for m in MS
        for mode in ("mean", "per_call")
        if mode == "mean" or m in (2, 8)
    ]


@pytest.mark.slow
@pytest.mark.bitwise
@pytest.mark.parametrize("dp", [1, 2])
def test_the_router_terms_weigh_one_over_m_dp_at_every_m_and_dp(dp, request):
    """Each microbatch's router terms (our MoE's ``router_balance`` and ``router_z``;
    Mixtral's ``router_aux`` and ``router_z``) enter the step's objective times
    ``1 / (M * dp)``: losses, the raw terms and every gradient after the dp reduction are
    bitwise the formula written out by hand, and with ``term_weight="per_call"`` bitwise the
    old objective (each microbatch's whole term, weighted as its loss)."""
    cases = matrix_cases()
    if dp == 1:
        results = launch(matrix_ranks, 3, dp, cases, timeout=TIMEOUT)
    else:  # pp = 2 x dp = 2, in the launch test_deepseek_bias_... shares
        results = [r["matrix"] for r in request.getfixturevalue("four")]
    for case in cases:
        name, m, mode = case
        want = formula(name, dp, m, mode)
        expect_terms = {
            "moe": ["router_balance", "router_z"],
            "mixtral": ["router_aux", "router_z"],
        }
        grads: dict = {}
        last = 0
        for r in results:
            got = r[case]
            for n, g in got["grads"].items():
                assert torch.equal(g, want["grads"][n]), (case, n)
                grads[n] = g
            if got["losses"] is None:
                continue
            last += 1
            d = r["dp_rank"]
            assert all(map(torch.equal, got["losses"], want["losses"][d])), case
            assert sorted(got["terms"]) == expect_terms[name], case
            for n, values in got["terms"].items():
                assert all(map(torch.equal, values, [t[n] for t in want["terms"][d]])), case
        assert last == dp and grads.keys() == want["grads"].keys(), case


# ---- the router z-loss ---------------------------------------------------------------------------


def test_our_moes_z_term_is_st_moes_z_loss():
    """``MoE(z_loss=c)``: ``c`` times the mean over the layer's tokens of
    ``logsumexp(router logits) ** 2``, computed by hand; beside the balance term."""
    layers = build_moe_mlp(SIZES, hidden=16, num_experts=E, top_k=K, blocks=1, z_loss=Z)
    x = torch.randn(4, T, SIZES[0], generator=torch.Generator().manual_seed(2))
    with collect_loss_terms(layers) as found:
        layers(x)
    tokens = layers[1].norm(layers[0](x)).reshape(-1, SIZES[1])
    logits = layers[1].moe.router(tokens)
    want = torch.logsumexp(logits, dim=-1).square().mean() * Z
    assert list(found) == ["router_z"] and torch.equal(found["router_z"], want)
    with pytest.raises(ValueError, match=r"z_loss=-1 must be >= 0"):
        build_moe_mlp(SIZES, hidden=16, num_experts=E, top_k=K, blocks=1, z_loss=-1)


def router_logits_of(model: nn.Module, run) -> list[torch.Tensor]:
    """The logits of every router call of ``run()`` on ``model``'s own modules."""
    routers = routers_of(model)
    kept: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, _a, out: kept.append(out[routers.index]))
        for m in model.modules()
        if isinstance(m, routers.router_class)
    ]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return kept


@pytest.mark.parametrize("name", ["hf-mixtral", "hf-deepseek-v3"])
def test_hf_z_term_is_st_moes_z_loss_over_the_real_tokens(name):
    """``causal_lm_layers(model, router_z_loss=c)``: per MoE block ``c`` times the mean over
    the unpadded tokens of ``logsumexp(router logits) ** 2``, summed over the blocks in
    layer order, by hand from the model's own routers (Mixtral keeps its router loss beside
    it, DeepSeek-V3 has none); the check refuses blocks whose coefficient is not the one
    the check expects."""
    model = hf.tiny_model(name)
    layers = hf.causal_lm_layers(model, router_z_loss=Z)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, 256, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0

    def run():
        with collect_loss_terms(*layers) as found:
            h = layers[0]({"input_ids": ids, "attention_mask": mask})
            for layer in layers[1:]:
                h = layer(h)
        return found

    box: list = []
    logits = router_logits_of(model, lambda: box.append(run()))
    flat = mask.reshape(-1).float()
    parts = [
        (torch.logsumexp(t.float(), -1).square() * flat).sum() / flat.sum() * Z for t in logits
    ]
    want = parts[0]
    for p in parts[1:]:
        want = want + p
    found = box[0]
    assert sorted(found) == (["router_aux", "router_z"] if "mixtral" in name else ["router_z"])
    assert len(logits) == (4 if "mixtral" in name else 2)
    assert torch.equal(found["router_z"], want)
    moe_blocks = [b for b in layers if getattr(b, "z_loss", 0.0)]
    moe_blocks[-1].z_loss = 2 * Z
    with pytest.raises(ValueError, match=r"loss term 'router_z' \(.*\) is not the model's own"):
        hf.check_layers(model, layers)


# ---- DeepSeek-V3's bias balancing ----------------------------------------------------------------

RATE = 1e-3
BIAS = "e_score_correction_bias"


def ds_batch(step: int, dp: int = 2, rows: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(50 + step)
    ids = torch.randint(3, 256, (dp * rows, 8), generator=g)
    return ids, ids.clone()


def ds_loads(model: nn.Module, step: int, m: int = 2, dp: int = 2) -> dict[str, torch.Tensor]:
    """Per router (its state-dict prefix), the expert assignments of ``model``'s own forward
    over step ``step``'s microbatches of every replica."""
    loads: dict[str, torch.Tensor] = {}
    names = {m_: n for n, m_ in model.named_modules()}

    def count(module, _args, out):
        key = names[module]
        c = torch.bincount(out[-1].reshape(-1), minlength=out[0].shape[-1])
        loads[key] = c if key not in loads else loads[key] + c

    routers = [m_ for m_ in model.modules() if BIAS in m_._buffers]
    handles = [r.register_forward_hook(count) for r in routers]
    ids = ds_batch(step, dp)[0]
    try:
        with torch.no_grad():
            for x in ids.chunk(dp):
                for xj in x.chunk(m):
                    model(input_ids=xj)
    finally:
        for h in handles:
            h.remove()
    return loads


def moved(bias: torch.Tensor, loads: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's rule: ``bias + RATE * sign(mean load - load)``."""
    direction = torch.sign(loads.sum() - loads.numel() * loads).to(bias.dtype)
    return bias.add(direction, alpha=RATE)


def test_a_block_counts_training_forwards_once_and_moves_its_bias_only_when_applied():
    model = hf.tiny_model("hf-deepseek-v3")
    layers = hf.causal_lm_layers(model, bias_update=RATE)
    blocks = [b for b in layers if getattr(b, "balance", None) is not None]
    assert len(blocks) == 2  # the dense first block has no router
    ids = ds_batch(0, 1)[0]
    want = ds_loads(model, 0, m=1, dp=1)

    def forward():
        h = layers[0](ids)
        for layer in layers[1:-1]:
            h = layer(h)

    for b in blocks:
        b.begin_step()
    with torch.no_grad():
        forward()  # an evaluation counts nothing
    assert all(b.balance.loads is None for b in blocks)
    forward()
    keys = sorted(want)
    assert [b.balance.loads.tolist() for b in blocks] == [want[k].tolist() for k in keys]
    assert all(int(b.balance.loads.sum()) == ids.numel() * 2 for b in blocks)  # top-2
    before = [b.layer.mlp.gate.get_buffer(BIAS).clone() for b in blocks]
    for b in blocks:
        b.end_step(lambda t: t)
        b.commit_step(False)  # a skipped step moves nothing
    assert all(
        torch.equal(b.layer.mlp.gate.get_buffer(BIAS), x)
        for b, x in zip(blocks, before, strict=True)
    )
    forward()
    for b in blocks:
        b.end_step(lambda t: t)
        b.commit_step(True)
    for b, x, k in zip(blocks, before, keys, strict=True):
        got = b.layer.mlp.gate.get_buffer(BIAS)
        assert torch.equal(got, moved(x, want[k])) and not torch.equal(got, x), k
    with pytest.raises(
        ValueError, match=r"MixtralForCausalLM \(mixtral\): .*no block has a router with one"
    ):
        hf.causal_lm_layers(hf.tiny_model("hf-mixtral"), bias_update=RATE)


def state_of(pipe: zerobubble.Pipeline) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in pipe.state_dict().items()}


def bias_steps(tmp: str) -> dict:
    """pp = 2 x dp = 2, M = 2, AdamW with clipping: four sync steps (the second skipped by a
    NaN gradient, a checkpoint after the third), the fourth again from the checkpoint, the
    first three in conservative mode, and speculative refused."""
    from zerobubble.optim.checkpoint import load_checkpoint, save_checkpoint
    from zerobubble.optim.faults import FaultPlan, GradFault

    mesh = build_mesh(2, 2)
    nan = FaultPlan(grads=(GradFault(1, 0),))

    def make(mode: str, faults: FaultPlan | None = None):
        model = hf.tiny_model("hf-deepseek-v3")
        layers = hf.causal_lm_layers(model, bias_update=RATE)
        pipe = zerobubble.Pipeline(
            layers, hf.CausalLMLoss(model), "zb-h1", microbatches=2, mesh=mesh
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
        config = zerobubble.OptimConfig(mode=mode, max_norm=1.0)
        return pipe, pipe.set_optimizer(opt, config, faults=faults)

    def step(pipe, k):
        ids, labels = ds_batch(k)
        part = slice(mesh.dp_rank * 4, (mesh.dp_rank + 1) * 4)
        pipe.step(ids[part], target=labels[part])

    out: dict = {"pp_rank": mesh.pp_rank, "dp_rank": mesh.dp_rank, "sync": [], "actions": []}
    pipe, trainer = make("sync", nan)
    for k in range(4):
        step(pipe, k)
        out["sync"].append(state_of(pipe))
        out["actions"].append(trainer.last_commit.action.value)
        if k == 2:
            save_checkpoint(trainer, tmp, mesh=mesh)
    pipe, trainer = make("sync")
    load_checkpoint(trainer, tmp, mesh=mesh)
    out["loaded"] = state_of(pipe)
    step(pipe, 3)
    out["resumed"] = state_of(pipe)
    pipe, trainer = make("conservative", nan)
    for k in range(3):
        step(pipe, k)
    pipe.drain()
    out["conservative"] = state_of(pipe)
    try:
        make("speculative")
    except ValueError as e:
        out["speculative"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.bitwise
def test_deepseek_bias_moves_once_per_applied_step_from_every_replicas_loads(four):
    """Each router's bias after step k is the one before plus ``RATE * sign(mean load -
    load)``, the loads of step k's microbatches of both replicas counted by hand from
    Hugging Face's own model holding the pipeline's parameters; equal on both replicas; a
    skipped step (NaN gradient) leaves it; the checkpoint round-trips it (a resumed step is
    bitwise the uninterrupted one); conservative post-validation leaves what the sync step
    does; speculative is refused, naming the block and the modes that work."""
    results = [r["bias"] for r in four]  # the 4-rank launch the dp = 2 matrix shares
    assert all(r["actions"] == ["clip", "skip", "clip", "clip"] for r in results)
    # the whole model's state after each step (each pp rank's keys; dp replicas equal)
    for r in results:
        twin = next(q for q in results if q["pp_rank"] == r["pp_rank"] and q is not r)
        for a, b in zip(r["sync"], twin["sync"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    states = [
        {k: v for r in results if r["dp_rank"] == 0 for k, v in r["sync"][i].items()}
        for i in range(4)
    ]
    initial = hf.tiny_model("hf-deepseek-v3").state_dict()
    biases = sorted(k for k in initial if k.endswith(BIAS))
    assert len(biases) == 2
    for k in range(4):
        before = initial if k == 0 else states[k - 1]
        model = hf.tiny_model("hf-deepseek-v3")
        model.load_state_dict(before)
        loads = ds_loads(model, k)
        for key in biases:
            prefix = key.removesuffix("." + BIAS)
            want = before[key] if k == 1 else moved(before[key], loads[prefix])
            assert torch.equal(states[k][key], want), (k, key)
            assert (k == 1) == torch.equal(states[k][key], before[key]), (k, key)
    for r in results:
        saved = r["sync"][2]
        assert all(torch.equal(r["loaded"][k], v) for k, v in saved.items())
        assert all(torch.equal(r["resumed"][k], v) for k, v in r["sync"][3].items())
        assert all(torch.equal(r["conservative"][k], v) for k, v in saved.items())
        assert re.fullmatch(
            r"rank \d: BiasBalancedBlock updates its state once per applied optimizer step, but "
            r"speculative .*; use OptimConfig\(mode='sync'\) or mode='conservative'",
            r["speculative"],
        )


def test_the_docs_weighting_block_runs_as_written():
    """docs/moe.md, "How a step weighs the router terms": its python block, as written."""
    text = (ROOT / "docs" / "moe.md").read_text()
    section = text.split("### How a step weighs the router terms\n", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/moe.md", "exec"), {})
