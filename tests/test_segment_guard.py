"""The segment guard (runtime/sequence/guard.py): every executor with segments checks its
stages on the segments against the whole sequence, on the first batch of each row count.

One launch of 2 ranks (seq-zb, P=2) through ``Pipeline``: a position table indexed by
``arange(T)`` on stage 0 and a causal attention in a class not named "...Attention" on
stage 1 are each refused with ValueError on both ranks, the message naming the stage and
the layer; our GPT and HF Llama pass (their whole runs being bitwise the unit reference is
tests/test_seq_runtime.py's, which runs through the guarded executor). In one process: the
check leaves parameters, buffers and the random state bitwise as they were, and a stateful
layer is checked from the state before the segments ran.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from generated import generated
from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.interop import hf
from zerobubble.models import GPTConfig, build_gpt
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.sequence.batch import cut_value
from zerobubble.runtime.sequence.guard import SegmentGuard, fresh_copy, join_segments

T = 16
CUTS = (0, 7, 16)
IGNORE = -100


def token_loss(out: torch.Tensor, labels: torch.Tensor, num_items: object) -> torch.Tensor:
    ce = F.cross_entropy(out.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return ce / num_items


def count(labels: torch.Tensor) -> int:
    return int((labels != IGNORE).sum())


class PositionTable(nn.Module):
    """Token and position embeddings, the positions ``arange(T)`` of the input's length."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(17, 8)
        self.pos = nn.Embedding(T, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tok(x) + self.pos(torch.arange(x.shape[1]))


class CausalMixer(nn.Module):
    """Causal self-attention over its own input (no segment protocol, no "Attention" name)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (4 * t for t in self.qkv(x).chunk(3, dim=-1))
        return x + F.scaled_dot_product_attention(q, k, v, is_causal=True)


def gpt_layers() -> list[nn.Module]:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=17, max_seq_len=T, d_model=8, n_heads=2, n_layers=2)
    return list(build_gpt(cfg))


def run(
    layers: list[nn.Module], x: object, y: torch.Tensor, boundaries: list[int] | None = None
) -> tuple[str | None, int]:
    """One step of seq-zb at P=2 through Pipeline: the error's message (or None) and how
    many stage checks ran on this rank."""
    sched = generated("seq-zb", 2, 2, segments=2)
    pipe = Pipeline(
        layers,
        token_loss,
        schedule=sched,
        count_fn=count,
        boundaries=boundaries,
        options=ExecutorOptions(cuts=CUTS, comm_timeout_s=60),
    )
    try:
        pipe.step(x, target=y)
        pipe.step(x, target=y)  # the same rows: not checked again
    except ValueError as e:
        return str(e), -1
    guard = pipe.executor.segment_guard
    assert guard is not None
    return None, guard.checks


def run_shared(layers: list[nn.Module], x: object, y: torch.Tensor) -> tuple[str | None, int]:
    """Pipelines of 2 and 3 segments sharing their chunks (``with_schedule``, as the job's
    trials): each guard checks its own cuts only (each stepped before the other's check
    ran, so each chunk carries both checks): the error (or None) and the checks run."""
    one = Pipeline(
        layers, token_loss, schedule=generated("seq-zb", 2, 2, segments=2), count_fn=count,
        options=ExecutorOptions(cuts=CUTS, comm_timeout_s=60),
    )  # fmt: skip
    three = (0, 5, 11, T)
    other = one.with_schedule(
        generated("seq-zb", 2, 2, segments=3),
        options=ExecutorOptions(cuts=three, comm_timeout_s=60),
    )
    try:
        for pipe in (one, other, one, other):
            pipe.step(x, target=y)
    except ValueError as e:
        return str(e), -1
    guards = [p.executor.segment_guard for p in (one, other)]
    return None, sum(g.checks for g in guards if g is not None)


def guard_job() -> dict[str, tuple[str | None, int]]:
    init_distributed(timeout_s=60)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 17, (4, T), generator=gen)
    y = torch.randint(0, 17, (4, T), generator=gen)
    out = {}
    gpt = gpt_layers()
    out["table"] = run([PositionTable(), *gpt[1:]], x, y)
    out["mixer"] = run([*gpt[:2], CausalMixer(), *gpt[2:]], x, y, [0, 2, 6])
    out["gpt"] = run(gpt_layers(), x, y)
    out["shared"] = run_shared(gpt_layers(), x, y)
    llama = hf.tiny_model("hf-llama", attn_implementation="sdpa", num_hidden_layers=2)
    mask = torch.ones(4, T, dtype=torch.long)
    mask[1, :5] = 0
    ids = torch.randint(3, 256, (4, T), generator=gen)
    labels = torch.randint(3, 256, (4, T), generator=gen).masked_fill(mask == 0, IGNORE)
    batch = {"input_ids": ids, "attention_mask": mask}
    out["llama"] = run(hf.causal_lm_layers(llama, check=False), batch, labels)
    dist.destroy_process_group()
    return out


def test_the_guard_refuses_position_readers_on_every_rank_and_passes_segment_aware_models():
    results = launch(guard_job, 2, timeout=240)
    for out in results:
        table, mixer = out["table"][0], out["mixer"][0]
        assert table is not None and mixer is not None
        assert "stage 0, layer 0 of the stage (PositionTable) computes other values" in table
        assert "stage 1, layer 0 of the stage (CausalMixer) computes other values" in mixer
        for message in (table, mixer):
            assert "cut at [0, 7, 16]" in message
            assert "SegmentAware only if it truly is right on segments" in message
            assert "a schedule without segments" in message
            assert "rtol=1e-05, atol=1e-06" in message
        assert out["gpt"] == (None, 1)  # one stage per rank, checked once over two steps
        assert out["shared"] == (None, 2)  # each cut set once, by its own guard
        assert out["llama"] == (None, 1)


class Counting(nn.Module):
    """A stateful layer: a buffer it adds to every call's output and then bumps, and dropout
    (random draws)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.drop(self.lin(x)) + self.calls
        self.calls += 1
        return out


def test_the_check_leaves_parameters_buffers_and_random_state_bitwise_untouched():
    stage = nn.Sequential(nn.Embedding(17, 8), Counting()).train()
    x = torch.randint(0, 17, (2, T))
    pieces = [((cut_value(x, s, e),), {}) for s, e in itertools.pairwise(CUTS)]
    before = {k: v.clone() for k, v in stage.state_dict().items()}
    rng = torch.get_rng_state()
    guard = SegmentGuard(CUTS, torch.device("cpu"))
    fresh = fresh_copy(stage)
    guard.check(0, fresh, pieces)
    # Each segment's call bumps the buffer: a stateful layer that is not segment-aware.
    assert (
        len(guard.failures) == 1 and "stage 0, layer 1 of the stage (Counting)" in guard.failures[0]
    )
    assert torch.equal(torch.get_rng_state(), rng)
    after = stage.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert stage.training and all(m.training for m in stage.modules())
    assert fresh[1].lin.weight is stage[1].lin.weight  # parameters shared, not copied


def test_segments_join_back_to_the_whole_sequence():
    ids = torch.arange(2 * T).view(2, T)
    batch = {"input_ids": ids, "attention_mask": torch.ones(2, T), "position_ids": ids}
    pieces = [cut_value(batch, s, e) for s, e in itertools.pairwise(CUTS)]
    whole = join_segments(pieces, CUTS)
    assert all(torch.equal(whole[k], batch[k]) for k in batch)


def test_where_the_guard_cannot_run_it_warns_instead_of_staying_silent():
    from types import SimpleNamespace

    from zerobubble.runtime.sequence.guard import SegmentGuard, UncheckedSegmentsWarning

    for tp, fsdp, cp, what in (
        (2, False, 1, "tensor parallelism"),
        (1, True, 1, "FSDP"),
        (1, False, 2, "context parallelism"),
    ):
        mesh = SimpleNamespace(tp_size=tp, cp_size=cp, spec=SimpleNamespace(fsdp=fsdp))
        with pytest.warns(UncheckedSegmentsWarning, match=f"segments under {what}: the segment"):
            assert SegmentGuard.install((0, 4, 8), {}, torch.device("cpu"), mesh) is None
    assert SegmentGuard.install(None, {}, torch.device("cpu"), mesh) is None  # no segments
