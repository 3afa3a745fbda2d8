"""Overlapped F&B pairs with sequence segments: an MoE GPT on seq-zbv at P = 2 (gloo).

``generate("seq-zbv", 2, M, segments=2, overlap=True, costs=CostSpec(a2a=1))`` pairs an F
unit with a backward unit of the other stage on its device (a V: stages 0 and 3 on rank 0,
1 and 2 on rank 1); the dependency rule with segments (a backward needs the next segment's
backward of its stage, a forward the previous segment's forward) keeps each pair's halves
independent. Each half is a unit of its own stage, so the segment extension's per-stage,
per-sequence state and the segment guard's per-stage copy are touched by one thread at a
time. The step runs ``REPEATS`` times in one launch (a race shows only sometimes), once
more with the halves run in sequence by a hook, and each is bitwise
:func:`zerobubble.reference_step` with the same ``cuts``: losses and every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zerobubble
from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.models import GPTConfig
from zerobubble.models.moe import build_moe_gpt
from zerobubble.program.instructions import Overlap
from zerobubble.runtime.overlap import OverlapPair
from zerobubble.schedule.costs import CostSpec
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.simulate import simulate

pytestmark = pytest.mark.slow

P, M, K, T, REPEATS = 2, 3, 2, 8, 3
CUTS = (0, 3, T)  # unequal segments
A2A = CostSpec(a2a=1)
IGNORE = -100


def schedule() -> Schedule:
    return generate("seq-zbv", P, M, segments=K, overlap=True, costs=A2A)


def layers() -> list[torch.nn.Module]:
    cfg = GPTConfig(vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=2, seed=3)
    return list(build_moe_gpt(cfg, num_experts=4, top_k=2))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, 17, (2 * M, T), generator=gen)
    y = torch.randint(0, 17, (2 * M, T), generator=gen)
    y[1, T - 2 :] = IGNORE  # padding at the end of one row
    return x, y


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


def in_sequence(pair: OverlapPair) -> None:
    pair.run_forward()
    pair.run_backward()


def job() -> list:
    zerobubble.init_distributed(timeout_s=60)
    sched = schedule()
    x, y = batch()
    runs = []
    for hook in [None] * REPEATS + [in_sequence]:
        pipe = zerobubble.Pipeline(
            layers(), token_loss, sched, count_fn=count,
            options=ExecutorOptions(cuts=CUTS, overlap_fn=hook),
        )  # fmt: skip
        losses = pipe.step(x, target=y)
        grads = {n: q.grad.clone() for n, q in pipe.named_parameters() if q.grad is not None}
        guard = pipe.executor.segment_guard
        pairs = sum(isinstance(i, Overlap) for i in pipe.executor.program)
        runs.append((losses, grads, guard is not None and guard.checks > 0, pairs))
    torch.distributed.destroy_process_group()
    return runs


def test_the_segment_schedule_has_pairs_of_two_stages_that_pay():
    sched = schedule()
    assert sched.segments == K and len(sched.overlaps) >= 4
    assert all(f.stage != b.stage for f, b in sched.overlaps)
    plain = generate("seq-zbv", P, M, segments=K)
    costs = A2A.resolve(sched.placement, K)
    assert simulate(sched, costs).makespan < simulate(plain, costs).makespan


@pytest.mark.bitwise
def test_pairs_with_segments_are_bitwise_the_reference_every_time():
    results = launch(job, P, timeout=300)
    x, y = batch()
    want_losses, want = zerobubble.reference_step(
        layers(), token_loss, x, target=y, microbatches=M, cuts=CUTS, count_fn=count,
        num_stages=schedule().num_stages,
    )  # fmt: skip
    for i in range(REPEATS + 1):
        runs = [r[i] for r in results]
        (losses,) = [losses for losses, *_ in runs if losses is not None]
        assert all(map(torch.equal, losses, want_losses)), i
        grads = {n: g for _, gr, *_ in runs for n, g in gr.items()}
        assert grads.keys() == {n for n, g in want.items() if g is not None}
        bad = [n for n, g in grads.items() if not torch.equal(g, want[n])]
        assert not bad, (i, bad)
        assert all(checked for *_, checked, _ in runs), i  # the guard ran on every rank
        assert sum(pairs for *_, pairs in runs) == len(schedule().overlaps), i
