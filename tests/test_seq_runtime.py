"""Segment schedules on the executor: P ranks (gloo) against one process.

Bitwise against :func:`unit_reference`: the whole (unsplit) model in one process doing
what the pipeline does per unit (segments forward in order, backward last first, each
loss a sum over the segment's tokens over the batch's count, parameter gradients added
in unit order). Against the whole sequence in one pass nothing is bitwise (shorter GEMMs
and softmax rows sum in another order, gradients over segments in another order; see
tests/test_kv_segments.py), so that comparison is held to float32 tolerances at the
values' scale.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from generated import generated
from ranks import launch
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.runtime.executor import ExecutorOptions, PipelineExecutor
from zerobubble.runtime.kv_segments import SegmentContext, segment_scope
from zerobubble.runtime.launcher import init_distributed
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


def unit_reference(
    layers: list[nn.Module], x: torch.Tensor, y: torch.Tensor, m: int, cuts: tuple[int, ...]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """The pipeline's arithmetic in one process: per microbatch, the segments forward in
    order and backward last first (each B's roots: the segment's loss, a sum over its
    tokens over the batch's count, and its keys and values with the gradients the later
    segments sent); a microbatch's loss the sum of its segments' in order; parameter
    gradients added in unit order (what the weight-gradient store does)."""
    model = nn.Sequential(*layers)
    params = list(model.parameters())
    total = count(y)
    pairs = list(itertools.pairwise(cuts))
    losses, per_unit = [], []
    for xj, yj in zip(torch.tensor_split(x, m), torch.tensor_split(y, m), strict=True):
        contexts, seg_losses = [], []
        for start, end in pairs:
            past = None
            if contexts:
                earlier = zip(*(c.new_kv() for c in contexts), strict=True)
                past = [
                    [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kvs]
                    for kvs in earlier
                ]
            context = SegmentContext(start, past)
            with segment_scope([model], context):
                out = model(xj[:, start:end])
            seg_losses.append(token_loss(out, yj[:, start:end], total))
            contexts.append(context)
        acc: dict[int, list] = {}
        grads_j: list[list[torch.Tensor | None]] = [[] for _ in pairs]
        for i in reversed(range(len(pairs))):
            roots, root_grads = [seg_losses[i]], [torch.ones_like(seg_losses[i])]
            for kv, kv_grad in zip(contexts[i].new_kv(), acc.get(i, []), strict=False):
                if kv_grad is not None:
                    roots.extend(kv)
                    root_grads.extend(kv_grad)
            leaves = [t for kvs in contexts[i].past or [] for kv in kvs for t in kv]
            got = torch.autograd.grad(roots, params + leaves, root_grads, allow_unused=True)
            grads_j[i] = list(got[: len(params)])
            n_layers = len(contexts[i].past or [])
            for layer in range(n_layers):
                for s in range(i):
                    at = len(params) + 2 * (layer * i + s)
                    sums = acc.setdefault(s, [None] * n_layers)
                    held, new = sums[layer], (got[at], got[at + 1])
                    sums[layer] = new if held is None else (held[0] + new[0], held[1] + new[1])
        losses.append(sum(seg_losses[1:], seg_losses[0]).detach())
        per_unit.extend(grads_j)
    grads: dict[str, torch.Tensor] = {}
    names = [n for n, _ in model.named_parameters()]
    for unit in per_unit:
        for name, g in zip(names, unit, strict=True):
            if g is not None:
                grads[name] = g.clone() if name not in grads else grads[name] + g
    return losses, grads


@functools.cache
def references(num_stages: int, m: int, cuts: tuple[int, ...]) -> tuple[list, dict, list, dict]:
    """(unit losses, unit-order grads, one-pass losses, one-pass grads)."""
    layers, x, y = model_and_batch(num_stages, m)
    seg_losses, seg_grads = unit_reference(layers, x, y, m, cuts)
    one_losses, one_grads = reference_step(
        layers, token_loss, x, target=y, microbatches=m, count_fn=count
    )
    return seg_losses, seg_grads, one_losses, one_grads


def seq_job(kind: str, p: int, m: int, k: int, cuts: tuple[int, ...]) -> dict:
    rank = init_distributed(timeout_s=60).rank
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
    held = pipe.held_bytes()
    dist.destroy_process_group()
    return {"losses": losses, "grads": grads, "held": held}


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
