"""Random ops inside tensor-parallel stages: per-tp-rank streams where activations are
sharded, the shared stream where they are replicated (runtime/rng.py, tp.TPRandom).

One 4-rank launch, pp=2 x tp=2, our GPT with dropout 0.1 (embedding, attention
probabilities, both residual branches), the default plan, M=4, with sequence parallelism
off and on:

* zb-h1 and zbv: losses and every gradient (local shard and placements) bitwise against
  :func:`tp_reference_step` with the same seed; so are zb-h1 with recompute="layers" (with
  sequence parallelism) and zbv with recompute="stage" (without), and a second run with
  the same seed against the first (directly) in the other two (kind, sequence parallelism)
  cells: a covering design, each recompute mode and the repeat once per kind;
* the dropout masks of each tp rank, per call (one per microbatch): in sharded regions (attention
  probabilities of the local heads; under sequence parallelism also the embedding's and
  the residual branches' sequence shards) the two ranks' masks are not equal (one stream
  for both would draw equal masks: same shapes, same state); in replicated regions
  (without sequence parallelism, the embedding's and residual branches') they are equal,
  and so is every layer's output (the final norm's replays in W by the graph-level split
  included): the replicas do not diverge;
* a tiny HF Llama with ``attention_dropout`` 0.1 (drawn on each rank's heads) under zb-h1
  with sequence parallelism: bitwise against :func:`tp_reference_step`;
* a plan that leaves a dropout uncovered is refused, naming the stage and the module.

In one process: the rule of :func:`rank_stream` (one draw from the shared stream on every
rank, the rank's own stream seeded from it).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.interop.hf import CausalLMLoss, causal_lm_layers, tiny_model
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.tp import parallelize_stage
from zerobubble.pipeline import Pipeline
from zerobubble.reference.tp import tp_reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.rng import derive_rank_seed, rank_stream

PP, TP, M, B, T = 2, 2, 4, 8, 8
SEED = 7
GPT = GPTConfig(vocab_size=64, max_seq_len=T, d_model=32, n_heads=4, n_layers=2, dropout=0.1)
SHARDED_ALWAYS = ("attn_drop",)
"""Dropouts on local heads: sharded with and without sequence parallelism."""
TIMEOUT = 300.0


def batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(GPT.vocab_size, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def grads(pipe: Pipeline) -> dict[str, tuple[Tensor, tuple]]:
    return {
        n: (local(p.grad).clone(), tuple(getattr(p.grad, "placements", ())))
        for n, p in pipe.named_parameters()
    }


def differ(got: dict[str, tuple[Tensor, tuple]], want: dict[str, Tensor]) -> list[str]:
    """Names whose gradient is not ``want``'s, bitwise (local shard and placements)."""
    bad = []
    for name, (g, where) in got.items():
        ref = want[name]
        if where != tuple(getattr(ref, "placements", ())) or not torch.equal(g, local(ref)):
            bad.append(name)
    return bad


def watch(layers: nn.Sequential) -> dict[str, list[Tensor]]:
    """Record every dropout's mask (where it zeroed) and every layer's output, per call."""
    seen: dict[str, list[Tensor]] = {}

    def record(name: str, mask: bool):
        def hook(_m: nn.Module, _args: tuple, out: Tensor) -> None:
            out = local(out).detach()
            seen.setdefault(name, []).append(out == 0 if mask else out.clone())

        return hook

    for name, m in layers.named_modules():
        if isinstance(m, nn.Dropout):
            m.register_forward_hook(record(name, True))
        elif name and "." not in name:
            m.register_forward_hook(record(name, False))
    return seen


def run(mesh, kind: str, sp: bool, **options) -> tuple[Pipeline, list[Tensor] | None]:
    x, y = batch()
    opts = ExecutorOptions(seed=SEED, **options)
    pipe = Pipeline(build_gpt(GPT), gpt_loss, kind, microbatches=M, mesh=mesh, options=opts)
    return pipe, pipe.executor.step(x, target=y)


def job() -> dict:
    init_distributed()
    out: dict = {}
    x, y = batch()
    for sp in (False, True):
        mesh = build_mesh(PP, tp=TP, sequence_parallel=sp)
        assert mesh.tp_mesh is not None
        at = (sp, mesh.pp_rank, mesh.tp_rank)
        for kind in ("zb-h1", "zbv"):
            layers = build_gpt(GPT)
            opts = ExecutorOptions(seed=SEED)
            pipe = Pipeline(
                layers, gpt_loss, kind, microbatches=M, mesh=mesh, options=opts, copy_layers=False
            )
            seen = watch(layers)  # after the plan's hooks: the layers' outputs as passed on
            losses = pipe.executor.step(x, target=y)
            ref_losses, ref = tp_reference_step(
                build_gpt(GPT),
                gpt_loss,
                x,
                target=y,
                microbatches=M,
                tp_mesh=mesh.tp_mesh,
                sequence_parallel=sp,
                num_stages=pipe.schedule.num_stages,
                seed=SEED,
            )
            first = grads(pipe)
            result = {
                "losses": None if losses is None else [float(v) for v in losses],
                "losses bitwise": losses is None or all(map(torch.equal, losses, ref_losses)),
                "bad": differ(first, ref),
                "seen": seen,
            }
            if (kind, sp) == ("zb-h1", True):
                result["recompute"] = differ(grads(run(mesh, kind, sp, recompute="layers")[0]), ref)
            elif (kind, sp) == ("zbv", False):
                result["recompute"] = differ(grads(run(mesh, kind, sp, recompute="stage")[0]), ref)
            else:  # the repeat once, where recompute does not run
                again = grads(run(mesh, kind, sp)[0])
                result["again"] = [n for n in first if not torch.equal(again[n][0], first[n][0])]
            out[(kind, *at)] = result
    # A tiny HF Llama whose attention draws attention_dropout (on this rank's heads): zb-h1
    # bitwise against the reference, with sequence parallelism (the last mesh).
    model = tiny_model("hf-llama", num_hidden_layers=2, seed=2, attention_dropout=0.1)
    pipe = Pipeline(
        causal_lm_layers(model, check=False),
        CausalLMLoss(model),
        "zb-h1",
        microbatches=M,
        mesh=mesh,
        options=ExecutorOptions(seed=SEED),
    )
    losses = pipe.executor.step(x, target=y)
    ref_losses, ref = tp_reference_step(
        causal_lm_layers(model, check=False),
        CausalLMLoss(model),
        x,
        target=y,
        microbatches=M,
        tp_mesh=mesh.tp_mesh,
        sequence_parallel=True,
        num_stages=PP,
        seed=SEED,
    )
    out["llama", mesh.pp_rank, mesh.tp_rank] = {
        "losses bitwise": losses is None or all(map(torch.equal, losses, ref_losses)),
        "bad": differ(grads(pipe), ref),
    }
    stage = nn.Sequential(*build_gpt(GPT)[1:2])
    try:
        parallelize_stage(stage, mesh.tp_mesh, {}, stage=1)
    except ValueError as e:
        out["refusal", mesh.pp_rank, mesh.tp_rank] = str(e)
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    merged: dict = {}
    for r in launch(job, PP * TP, timeout=TIMEOUT):
        merged.update(r)
    return merged


@pytest.mark.bitwise
def test_dropout_under_tp_is_bitwise_the_tp_reference(results: dict) -> None:
    for sp in (False, True):
        for kind in ("zb-h1", "zbv"):
            last = [0] if kind == "zbv" else [PP - 1]  # V: the loss on rank 0
            for d in range(PP):
                for t in range(TP):
                    r = results[kind, sp, d, t]
                    assert r["losses bitwise"] and (r["losses"] is not None) == (d in last)
                    assert r["bad"] == [] and r.get("recompute", []) == [], (kind, sp, d, t)
                    assert r.get("again", []) == [], (kind, sp, d, t)
                    assert ("again" in r) != ("recompute" in r), (kind, sp, d, t)
                # the tp ranks of the last stage compute the same loss (logits gathered)
                assert results[kind, sp, d, 0]["losses"] == results[kind, sp, d, 1]["losses"]


@pytest.mark.bitwise
def test_hf_llama_attention_dropout_under_tp_is_bitwise_the_tp_reference(results: dict) -> None:
    for d in range(PP):
        for t in range(TP):
            r = results["llama", d, t]
            assert r["losses bitwise"] and r["bad"] == [], (d, t)


def test_masks_differ_where_sharded_and_agree_where_replicated(results: dict) -> None:
    for sp in (False, True):
        for kind in ("zb-h1", "zbv"):
            kinds: set[str] = set()
            for d in range(PP):
                a, b = results[kind, sp, d, 0]["seen"], results[kind, sp, d, 1]["seen"]
                assert a.keys() == b.keys()
                for name in a:
                    assert len(a[name]) == len(b[name])
                    same = [torch.equal(u, v) for u, v in zip(a[name], b[name], strict=True)]
                    leaf = name.rsplit(".", 1)[-1]
                    if leaf.endswith("drop"):
                        kinds.add(leaf)
                        assert len(a[name]) == M  # one forward per microbatch
                        assert all(bool(m.any()) for m in a[name]), name  # dropout is on
                        sharded = sp or leaf in SHARDED_ALWAYS
                        assert same == [not sharded] * len(same), (kind, sp, d, name)
                    elif not sp:  # a replicated layer output: the replicas agree
                        assert all(same), (kind, sp, d, name)
            assert kinds == {"drop", "attn_drop", "resid_drop"}


def test_an_uncovered_dropout_is_refused(results: dict) -> None:
    for d in range(PP):
        for t in range(TP):
            assert results["refusal", d, t] == (
                "stage 1: 0.attn.attn_drop has dropout 0.1, and the tensor-parallel plan does "
                "not say where it draws: give it (or a module around it) TPRandom(sharded=True) "
                "in tp_plan= if its activations are sharded over the tp ranks (sequence "
                "shards, local heads), TPRandom(sharded=False) if they are replicated; or set "
                "dropout to 0"
            )


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
        ),
    ],
)
def test_rank_stream_draws_one_shared_value_and_seeds_the_rank_from_it(device: str) -> None:
    """The shared value comes from the CPU's generator; the rank's stream is the CPU's and
    ``device``'s default generator, both seeded from it and put back on exit."""
    torch.manual_seed(11)  # every device's default generator
    shared = int(torch.empty((), dtype=torch.int64).random_())
    after_one = torch.rand(3), torch.rand(3, device=device)
    draws = {}
    for rank in (0, 1):
        torch.manual_seed(11)
        with rank_stream(rank, device):
            draws[rank] = torch.rand(5, device=device)
            torch.rand(100, device=device)  # the rank's own draws do not move the shared stream
        # exactly one shared draw (from the CPU's), the device's shared stream untouched
        assert torch.equal(torch.rand(3), after_one[0])
        assert torch.equal(torch.rand(3, device=device), after_one[1])
        own = torch.Generator(device).manual_seed(derive_rank_seed(shared, rank))
        assert torch.equal(draws[rank], torch.rand(5, generator=own, device=device))
    assert not torch.equal(draws[0], draws[1])
    with pytest.raises(ValueError, match=r"^rank must be >= 0 to derive a seed, got -1$"):
        derive_rank_seed(0, -1)
