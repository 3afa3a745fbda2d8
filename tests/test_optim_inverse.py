"""Inverse rollback in a pipeline, on the GPT and the MLP: 8 iterations with 2 rollbacks
against the synchronous step. The inverse is not exact (each undo rounds, and recovering
the moments divides by beta1, beta2); this states the measured worst relative difference
per model, with margin, and checks that the runs stay within it and are not bitwise.
Parameters only: the optimizer state of a parameter whose gradient is pure rounding noise
(an attention key bias, which softmax ignores) has no meaningful relative error; one undo's
state error is bounded in tests/test_optim_rollback.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import GPTConfig, build_gpt, build_mlp, gpt_loss, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan, GradFault
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

ITERS, M = 8, 4
GPT = GPTConfig(vocab_size=64, max_seq_len=16, d_model=32, n_heads=4, n_layers=2, seed=5)
BOUNDS = {"gpt": 5e-3, "mlp": 1e-6}
"""Worst relative difference (max|a - b| / max|b| per parameter, any iteration) of
inverse-rollback post-validation from the synchronous step. Measured (docs/optim.md): MLP
8.8e-8; GPT over 4 seeds x 5 rollback patterns 1.1e-3 (the token embedding with rollbacks
in iterations 1 and 6, the case below; 3.3e-6 with the first pattern): where the undone
step's gradient dwarfs an entry's second moment, the new moment no longer holds the old
one's bits, the inverse recovers it to ~10%, and Adam's division by sqrt(v) turns that into
an lr-scale difference (docs/optim.md). The GPT bound is that measured worst with margin,
not a small multiple of eps. Excluded: the
attention key biases, whose gradient is zero in exact arithmetic (softmax ignores a shift
of every key): Adam normalises their rounding noise into lr-sized steps, so any rounding
difference makes them diverge (measured 0.88 relative); snapshot rollback is exact there."""

FAULTS = {"base": ((2, 0), (5, 3)), "early": ((1, 0), (6, 3))}
"""(iteration, microbatch) of the NaN gradients on the last stage: two rollbacks each."""


def model(name: str) -> tuple[list, object]:
    if name == "gpt":
        return list(build_gpt(GPT)), gpt_loss
    return list(build_mlp([8] * 6, seed=2)), mlp_loss


def batch(name: str, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(300 + i)
    if name == "gpt":
        ids = torch.randint(0, GPT.vocab_size, (2 * M, GPT.max_seq_len + 1), generator=gen)
        return ids[:, :-1], ids[:, 1:]
    return torch.randn(2 * M, 8, generator=gen), torch.randn(2 * M, 8, generator=gen)


def run(rank: int, name: str, cfg: OptimConfig, faults: str) -> list[dict[str, torch.Tensor]]:
    sched = generate("zb-h1", 2, M)
    layers, loss = model(name)
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, rank),
        loss_fn=loss,
        options=ExecutorOptions(trace=False),
    )
    named = [
        (f"s{s}.{n}", q)
        for s in sorted(pipe.chunks)
        for n, q in pipe.chunks[s].module.named_parameters()
    ]
    opt = torch.optim.AdamW([q for _, q in named], lr=3e-3, weight_decay=0.1)
    snaps = []

    def record(_) -> None:
        snap = {}
        for n, q in named:
            snap[n] = q.detach().clone()
        snaps.append(snap)

    # NaN on the last stage only: rank 0 steps provisionally and rolls back (twice).
    plan = FaultPlan(grads=tuple(GradFault(i, 1, mb=mb) for i, mb in FAULTS[faults]))
    trainer = PipelineTrainer(pipe, opt, cfg, faults=plan, on_commit=record)
    for i in range(ITERS):
        x, y = batch(name, i)
        trainer.step(x, target=y)
    trainer.drain()
    return snaps


def inverse_job(name: str, faults: str) -> dict:
    rank = init_distributed(timeout_s=120).rank
    base = run(rank, name, OptimConfig(max_norm=1.0), faults)
    out = {}
    for spec in (False, True):
        cfg = OptimConfig(
            mode="speculative" if spec else "conservative", max_norm=1.0, rollback="inverse"
        )
        worst: dict[str, float] = {}
        for a, b in zip(run(rank, name, cfg, faults), base, strict=True):
            for k in b:
                diff = (a[k].double() - b[k].double()).abs().max().item()
                worst[k] = max(worst.get(k, 0.0), diff / b[k].double().abs().max().item())
        out["spec" if spec else "cons"] = worst
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize(("name", "faults"), [("gpt", "base"), ("gpt", "early"), ("mlp", "base")])
def test_inverse_rollback_stays_within_the_stated_bound_per_model(name, faults):
    results = launch(inverse_job, 2, name, faults, timeout=300)
    worst = {k: v for r in results for errs in r.values() for k, v in errs.items()}
    noise = [k for k in worst if k.endswith("attn.k.bias")]
    for k in noise:
        del worst[k]
    assert noise == ([f"s0.{b}.attn.k.bias" for b in (1, 2)] if name == "gpt" else [])
    top = max(worst, key=worst.get)
    assert worst[top] <= BOUNDS[name], (top, worst[top])
    assert worst[top] > 0  # not exact: the bound is what is asserted
