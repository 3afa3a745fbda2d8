"""Segment schedules on the executor: P ranks (gloo) against one process.

The reference runs the whole (unsplit) model one microbatch at a time, each microbatch's
segments by :func:`~zerobubble.runtime.kv_segments.run_segments` (forwards in order,
backwards in reverse), every loss a sum over tokens divided by the batch's token count.
Against the whole sequence in one pass nothing is bitwise (shorter GEMMs and softmax
rows sum in another order; see tests/test_kv_segments.py), so that comparison is held to
float32 tolerances at the values' scale.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from generated import generated
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.runtime.executor import ExecutorOptions, PipelineExecutor
from zerobubble.runtime.kv_segments import run_segments
from zerobubble.runtime.partition import build_stage_modules, stage_bounds
from zerobubble.runtime.reference import reference_step

IGNORE = -100
T = 16


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def model_and_batch(num_stages: int, m: int) -> tuple[list[nn.Module], torch.Tensor, torch.Tensor]:
    """A GPT of num_stages blocks; 2m+1 rows, the last labels of some rows ignored (padding)."""
    cfg = GPTConfig(vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=num_stages)
    gen = torch.Generator().manual_seed(7)
    n = 2 * m + 1
    x = torch.randint(0, 17, (n, T), generator=gen)
    y = torch.randint(0, 17, (n, T), generator=gen)
    for row in range(0, n, 2):
        y[row, T - 1 - row % T :] = IGNORE
    return list(build_gpt(cfg)), x, y


@functools.cache
def references(num_stages: int, m: int, cuts: tuple[int, ...]) -> tuple[list, dict, list, dict]:
    """(segment losses, segment grads, one-pass losses, one-pass grads)."""
    layers, x, y = model_and_batch(num_stages, m)
    total = count(y)
    seg_losses = []
    for xj, yj in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
        run = run_segments(layers, xj, cuts, lambda out, yj=yj: token_loss(out, yj, total))
        seg_losses.append(run.loss)
    seg_grads = {n: p.grad.clone() for n, p in nn.Sequential(*layers).named_parameters()}
    one_losses, one_grads = reference_step(layers, token_loss, x, target=y, microbatches=m, count_fn=count)
    return seg_losses, seg_grads, one_losses, one_grads


def seq_job(rank: int, kind: str, p: int, m: int, k: int, cuts: tuple[int, ...]) -> dict:
    sched = generated(kind, p, m, segments=k)
    layers, x, y = model_and_batch(sched.num_stages, m)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(
        sched, stages, loss_fn=token_loss, count_fn=count, options=ExecutorOptions(cuts=cuts)
    )
    losses = pipe.step(x, target=y)
    bounds = stage_bounds(len(layers), sched.num_stages)
    grads = {}
    for s, chunk in pipe.chunks.items():
        for name, param in chunk.module.named_parameters():
            local, rest = name.split(".", 1)
            grads[f"{bounds[s].start + int(local)}.{rest}"] = param.grad
    return {"losses": losses, "grads": grads, "held": pipe.held_bytes()}


def check(results: list[dict], num_stages: int, m: int, cuts: tuple[int, ...]) -> None:
    seg_losses, seg_grads, one_losses, one_grads = references(num_stages, m, cuts)
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == sorted(seg_grads)
    assert all(r["held"] == 0 for r in results)
    assert all(map(torch.equal, losses, seg_losses)), (losses, seg_losses)
    for name, g in grads.items():
        assert torch.equal(g, seg_grads[name]), name
    torch.testing.assert_close(sum(losses), sum(one_losses), rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in one_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, one_grads[name], rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize(
    ("kind", "p", "k", "cuts"),
    [
        ("seq1f1b", 2, 2, (0, 9, 16)),
        ("seq-zb", 2, 4, (0, 6, 10, 13, 16)),
        ("seq1f1b", 3, 4, (0, 1, 2, 15, 16)),
        ("seq-zb", 3, 2, (0, 12, 16)),
    ],
)
def test_segment_schedules_match_the_segments_of_one_process(kind, p, k, cuts):
    m = 3
    results = launch(seq_job, p, kind, p, m, k, cuts, timeout=240)
    check(results, p, m, cuts)
