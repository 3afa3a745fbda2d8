"""Loss parallel (parallel/loss.py): cross-entropy on the LM head's vocabulary shards, on by
default with tp, never gathering the logits.

One 6-rank launch, pp=3 x tp=2, zb-h1 (M=3) with the default plans:

* our GPT (5 layers, targets with -100), with loss parallel (the default) and without
  (``loss_parallel=False``, gathered): each bitwise against :func:`tp_reference_step`
  with the same option (losses, and every gradient's local shard and placements); the
  last stage's LM head hands the loss a ``Shard(-1)`` DTensor with it and a plain tensor
  without; the two runs' losses within :func:`bound` of each other per microbatch, their
  gradients within ``GRAD_REL`` of the largest; the last stage's peak activation bytes
  lower with it, every other stage's equal;
* a loss that does not say it takes sharded logits (a plain ``F.cross_entropy``): gathered
  under the default, bitwise the ``loss_parallel=False`` run; refused with
  ``loss_parallel=True`` on every rank, naming the stage;
* :func:`vocab_parallel_cross_entropy` directly on a tp=2 DTensor against
  ``F.cross_entropy`` (mean, sum, every target ignored: NaN as torch), its gradient
  within ``U * (2 * vocab + 16)`` per entry, and a target outside the vocabulary refused.

The Hugging Face models (the tiny Llama and Qwen2, padded labels normalised by the batch's
token count) run loss parallel in tests/test_tp.py's default-plan runs at pp=2 x tp=2, with
and without sequence parallelism, bitwise their reference; the Llama there runs gathered
too, within :func:`bound` of it. In one process here: the rule's refusals
(:class:`LossParallel`, ``TensorParallel``, ``Parallelize.from_mesh``) and the default
plan's LM head kinds (tests/test_tp.py checks the Hugging Face head's, and that
``CausalLMLoss`` takes shards only for ``ForCausalLMLoss``).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ranks import launch
from zerobubble.models.gpt import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.loss import LossParallel, cross_entropy, vocab_parallel_cross_entropy
from zerobubble.parallel.mesh import build_mesh
from zerobubble.parallel.parallelize import Parallelize, TensorParallel
from zerobubble.parallel.tp import ShardedLogits, default_plan
from zerobubble.pipeline import Pipeline
from zerobubble.reference.tp import tp_reference_step
from zerobubble.runtime.launcher import init_distributed

PP, TP, M, B, T = 3, 2, 3, 6, 8
GPT = GPTConfig(vocab_size=64, max_seq_len=T, d_model=32, n_heads=4, n_layers=2, seed=3)
U = 2.0**-24
GRAD_REL = 1e-5
"""Loss parallel against gathered: max |difference| over a model's gradients relative to
its largest gradient (measured at pp=2 x tp=2 under zb-h1: 1.4e-7 for our GPT, 1.6e-7 for
the tiny Llama, 2.1e-7 for the tiny Qwen2)."""
TIMEOUT = 300.0


def bound(vocab: int, tokens: int, mean_loss: float) -> float:
    """Per microbatch, |loss parallel - gathered| of a token-mean cross-entropy in float32:
    the same row max and shifted logits, then a vocab-term sum of exponentials in another
    order (each within (vocab + 2) ulps of exact), the log's and the subtraction's
    rounding, and a tokens-term sum of token losses in another order."""
    return U * (2 * vocab + 16 + 8 * math.log(vocab) + (2 * tokens + 8) * mean_loss)


def plain_ce(logits: Tensor, target: Tensor) -> Tensor:
    """A cross-entropy that does not say it takes sharded logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def gpt_batch() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(GPT.vocab_size, (B, T + 1), generator=g)
    target = ids[:, 1:].clone()
    target[1, :5] = -100
    target[4, 2:] = -100
    return ids[:, :-1], target


def local(t: Tensor) -> tuple[Tensor, tuple]:
    return (t.to_local(), tuple(t.placements)) if isinstance(t, DTensor) else (t, ())


def whole(t: Tensor) -> Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def run(mesh, layers, loss, x, y, kind="zb-h1", **options) -> dict:
    """One step of a pipeline and of its tp reference with the same options (each on its
    copy of ``layers``): whether they are bitwise equal, the losses, whole gradients, the
    head's output type and the peak activation bytes of this rank."""
    pipe = Pipeline(layers, loss, kind, microbatches=M, mesh=mesh, **options)
    seen: list[str] = []
    S = pipe.schedule.num_stages
    if S - 1 in pipe.executor.chunks:
        head = list(pipe.executor.chunks[S - 1].module.children())[-1]
        head.register_forward_hook(lambda _m, _a, out: seen.append(_layout(out)))
    losses = pipe.executor.step(x, target=y)
    ref_losses, ref = tp_reference_step(
        layers, loss, x, target=y, microbatches=M, tp_mesh=mesh.tp_mesh, num_stages=S,
        sequence_parallel=mesh.spec.sequence_parallel, **options,
    )  # fmt: skip
    bad = []
    for name, p in pipe.named_parameters():
        (got, where), (want, want_where) = local(p.grad), local(ref[name])
        if where != want_where or not torch.equal(got, want):
            bad.append(name)
    return {
        "losses": losses,
        "same_losses": None if losses is None else all(map(torch.equal, losses, ref_losses)),
        "bad": bad,
        "grads": {n: whole(p.grad) for n, p in pipe.named_parameters()},
        "head": sorted(set(seen)),
        "peak": max(e.mem_after for e in pipe.executor.trace.events),
    }


def _layout(out: Tensor) -> str:
    return str(tuple(out.placements)) if isinstance(out, DTensor) else "plain"


def direct(mesh) -> dict:
    """vocab_parallel_cross_entropy on a tp=2 DTensor against F.cross_entropy."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(5, 3, 64, generator=g) * 3
    target = torch.randint(64, (5, 3), generator=g)
    target[0, 1] = target[3, 0] = -100
    out = {}
    for reduction in ("mean", "sum"):
        whole_ = logits.clone().requires_grad_()
        want = F.cross_entropy(whole_.reshape(-1, 64), target.reshape(-1), reduction=reduction)
        want.backward()
        sharded = distribute_tensor(logits.clone(), mesh, [Shard(-1)]).requires_grad_()
        got = cross_entropy(sharded, target, reduction=reduction)
        got.backward()
        out[reduction] = (got.item(), want.item(), whole(sharded.grad), whole_.grad)
    none = torch.full_like(target, -100)
    sharded = distribute_tensor(logits, mesh, [Shard(2)])
    out["nan"] = float(vocab_parallel_cross_entropy(sharded, none))
    target[2, 2] = 64
    with pytest.raises(ValueError) as e:
        gpt_loss(sharded, target)
    out["range"] = str(e.value)
    return out


def job() -> dict:
    init_distributed()
    out: dict = {}
    mesh = build_mesh(PP, tp=TP)
    x, y = gpt_batch()
    gpt = list(build_gpt(GPT))
    out["gpt"] = run(mesh, gpt, gpt_loss, x, y)
    out["gpt gathered"] = run(mesh, gpt, gpt_loss, x, y, loss_parallel=False)
    out["plain"] = run(mesh, gpt, plain_ce, x, y)
    with pytest.raises(ValueError) as e:
        Pipeline(gpt, plain_ce, "zb-h1", microbatches=M, mesh=mesh, loss_parallel=True)
    out["refused"] = str(e.value)
    assert mesh.tp_mesh is not None
    out["direct"] = direct(mesh.tp_mesh)
    return {(mesh.pp_rank, mesh.tp_rank): out}


@pytest.fixture(scope="module")
def ranks() -> dict:
    results: dict = {}
    for r in launch(job, PP * TP, timeout=TIMEOUT):
        results.update(r)
    return results


def rel(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    scale = max(float(g.abs().max()) for g in b.values())
    return max(float((a[n] - b[n]).abs().max()) for n in b) / scale


@pytest.mark.bitwise
def test_bitwise_against_the_tp_reference_with_and_without(ranks) -> None:
    for (d, t), out in ranks.items():
        last = d == PP - 1
        for key in ("gpt", "gpt gathered", "plain"):
            r = out[key]
            assert r["bad"] == [], (key, d, t)
            assert r["same_losses"] is (True if last else None), (key, d, t)
        if last:
            sharded = [str((Shard(2),))]
            assert out["gpt"]["head"] == sharded
            assert out["gpt gathered"]["head"] == ["plain"]


@pytest.mark.bitwise
def test_a_loss_that_does_not_take_shards_gets_the_gathered_logits(ranks) -> None:
    for (d, _t), out in ranks.items():
        plain, gathered = out["plain"], out["gpt gathered"]
        assert plain["head"] == gathered["head"]
        if d == PP - 1:
            assert all(map(torch.equal, plain["losses"], gathered["losses"]))
        assert all(torch.equal(plain["grads"][n], g) for n, g in gathered["grads"].items())
        assert out["refused"] == (
            "stage 2: loss_parallel=True, but the loss plain_ce does not say it takes logits "
            "sharded over the vocabulary (an attribute loss_parallel = True, as gpt_loss and "
            "CausalLMLoss have): its cross-entropy would see a DTensor. Fix: leave "
            "loss_parallel at None (the logits are then gathered for this loss), or compute "
            "the loss with zerobubble.parallel.loss.cross_entropy and mark it with "
            "takes_sharded_logits"
        )


def test_within_the_bound_of_the_gathered_loss(ranks) -> None:
    tokens = B // M * T
    for (d, _t), out in ranks.items():
        assert rel(out["gpt"]["grads"], out["gpt gathered"]["grads"]) < GRAD_REL
        if d != PP - 1:
            continue
        for lp, gathered in zip(out["gpt"]["losses"], out["gpt gathered"]["losses"], strict=True):
            assert abs(float(lp - gathered)) <= bound(GPT.vocab_size, tokens, float(gathered))


def test_the_last_stage_holds_less(ranks) -> None:
    for (d, t), out in ranks.items():
        lp, gathered = out["gpt"]["peak"], out["gpt gathered"]["peak"]
        assert (lp < gathered) if d == PP - 1 else (lp == gathered), (d, t)


def test_vocab_parallel_cross_entropy_against_torch(ranks) -> None:
    for out in ranks.values():
        r = out["direct"]
        for reduction in ("mean", "sum"):
            got, want, grad, want_grad = r[reduction]
            tokens = 13 if reduction == "sum" else 1
            assert abs(got - want) <= bound(64, 15, abs(want) / tokens) * tokens
            torch.testing.assert_close(grad, want_grad, rtol=0, atol=U * (2 * 64 + 16))
        assert math.isnan(r["nan"])
        assert r["range"] == (
            "loss parallel: target 64 is out of the vocabulary [0, 64) (and not ignore_index=-100)"
        )


# ---- in one process -----------------------------------------------------------------------


class _Mesh:
    """Stands in for a tp mesh where only its size is read (the default plan)."""

    def size(self) -> int:
        return TP


def test_the_rule_refuses_what_cannot_run_loss_parallel() -> None:
    with pytest.raises(ValueError, match=r"^loss_parallel must be None, True or False, got 'on'"):
        LossParallel(1, gpt_loss, "on")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^stage 4: loss_parallel=True, but the loss plain_ce"):
        LossParallel(4, plain_ce, True)
    assert not LossParallel(4, plain_ce).sharded(4)  # gathered, as documented
    assert LossParallel(4, gpt_loss).sharded(4) and not LossParallel(4, gpt_loss).sharded(3)
    assert not LossParallel(4, gpt_loss, False).sharded(4)
    assert LossParallel(4, None).sharded(3) is False  # a rank without the loss stage
    with pytest.raises(ValueError, match=r"^loss_parallel=True with tp_plan="):
        TensorParallel(_Mesh(), {}, loss=LossParallel(0, gpt_loss, True))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^loss_parallel=True but the mesh has no tensor"):
        Parallelize.from_mesh(None, loss=LossParallel(0, gpt_loss, True))
    no_head = nn.Sequential(*list(build_gpt(GPT))[:-1])  # ends with the final norm
    tp = TensorParallel(_Mesh(), loss=LossParallel(0, gpt_loss, True))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^stage 0: loss_parallel=True, but its last layer 3 "):
        tp.default(0, no_head)

    lenient = TensorParallel(_Mesh(), loss=LossParallel(0, gpt_loss))  # type: ignore[arg-type]
    assert not any(isinstance(s, ShardedLogits) for s in lenient.default(0, no_head).values())


def test_the_default_plan_shards_the_head_of_the_loss_stage_only() -> None:
    stage = nn.Sequential(*list(build_gpt(GPT))[2:])  # block, final norm, head
    plans = {
        lp: default_plan(stage, TP, stage=1, sequence_parallel=False, loss_parallel=lp)
        for lp in (False, True)
    }
    assert isinstance(plans[True]["2"], ShardedLogits)
    assert not isinstance(plans[False]["2"], ShardedLogits)
    assert plans[True].keys() == plans[False].keys()
