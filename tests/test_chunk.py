"""StageChunks chained in one process reproduce reference_step bitwise in any legal op order."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from zerobubble.models import GPTConfig, build_gpt, build_mlp, gpt_loss, mlp_loss
from zerobubble.reference.step import reference_step
from zerobubble.runtime.microbatch import loss_scales, split_batch
from zerobubble.runtime.split import WeightGradStore
from zerobubble.runtime.stage import StageChunk, StageChunkError, storage_bytes
from zerobubble.schedule.deps import backward_ops, dependencies
from zerobubble.schedule.generators import gpipe, one_f_one_b, zb_h1, zbv
from zerobubble.schedule.ir import Action, Op, Schedule

GPT = GPTConfig(vocab_size=32, max_seq_len=8, d_model=16, n_heads=2, n_layers=3, seed=1)


def sequential_order(schedule: Schedule) -> list[Action]:
    """A legal single-process order: round-robin over devices, each action once its deps ran."""
    bw = backward_ops(schedule)
    done: set[Action] = set()
    pos = [0] * schedule.num_devices
    order: list[Action] = []
    while len(order) < len(schedule):
        progressed = False
        for d, acts in enumerate(schedule.actions):
            if pos[d] < len(acts):
                a = acts[pos[d]]
                if all(dep in done for dep in dependencies(a, schedule.num_stages, bw)):
                    order.append(a)
                    done.add(a)
                    pos[d] += 1
                    progressed = True
        assert progressed, "schedule deadlocks"
    return order


def scrambled_order(num_stages: int, m: int, seed: int) -> list[Action]:
    """All F in order; backward in reverse microbatch order, BW for some; W shuffled at the end."""
    rng = random.Random(seed)
    order = [Action(Op.F, s, j) for j in range(m) for s in range(num_stages)]
    fused = {j for j in range(m) if rng.random() < 0.3}
    for j in reversed(range(m)):
        op = Op.BW if j in fused else Op.B
        order += [Action(op, s, j) for s in reversed(range(num_stages))]
    ws = [Action(Op.W, s, j) for s in range(num_stages) for j in range(m) if j not in fused]
    rng.shuffle(ws)
    return order + ws


def make_chunks(
    model: nn.Sequential,
    cuts: list[int],
    loss_fn,
    *,
    placement: tuple[int, ...] | None = None,
    split: bool = True,
) -> list[StageChunk]:
    """Chunks for model[cuts[i]:cuts[i+1]]; stages on one device share a store."""
    bounds = [*cuts, len(model)]
    n = len(cuts)
    placement = placement or tuple(range(n))
    stores = {d: WeightGradStore() for d in set(placement)}
    return [
        StageChunk(
            model[bounds[s] : bounds[s + 1]],
            s,
            n,
            loss_fn=loss_fn if s == n - 1 else None,
            store=stores[placement[s]],
            split=split,
        )
        for s in range(n)
    ]


def run_order(chunks, order, x, y, m) -> list[torch.Tensor]:
    """Execute ``order`` on ``chunks``, passing activations and gradients in memory."""
    xs, ys = split_batch(x, m), split_batch(y, m)
    scales = loss_scales([len(t) for t in xs])
    acts, grads, losses = {}, {}, {}
    for a in order:
        c, s, j = chunks[a.stage], a.stage, a.mb
        if a.op is Op.F:
            inp = xs[j] if c.is_first else acts[s - 1, j]
            if c.is_last:
                losses[j] = c.forward(j, inp, target=ys[j], loss_scale=scales[j])
            else:
                acts[s, j] = c.forward(j, inp)
        elif a.op is Op.W:
            c.backward_weight(j)
        else:
            g = None if c.is_last else grads[s + 1, j]
            step = c.backward_input if a.op is Op.B else c.backward_full
            grads[s, j] = step(j, g)
    for c in chunks:
        assert c.pending() == {} and c.held_bytes() == 0
    return [losses[j] for j in range(m)]


def assert_matches_reference(model, ref, chunks, order, loss_fn, x, y, m) -> None:
    ref_losses, ref_grads = reference_step(ref, loss_fn, x, y, m)
    losses = run_order(chunks, order, x, y, m)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def gpt_data(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, GPT.vocab_size, (batch, GPT.max_seq_len + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def mlp_data(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 6, generator=g), torch.randn(batch, 3, generator=g)


CASES = {
    # name: (schedule or None for scrambled, model kind, cuts, microbatches)
    "zb-h1": (lambda: zb_h1(3, 4), "gpt", [0, 2, 3]),
    "zbv": (lambda: zbv(2, 4), "gpt", [0, 2, 3, 4]),
    "1f1b-fused": (lambda: one_f_one_b(3, 4), "mlp", [0, 1, 2]),
    "gpipe-split": (lambda: gpipe(2, 4, split_backward=True), "mlp", [0, 2]),
    "scrambled-gpt": (None, "gpt", [0, 1, 3, 5]),
    "scrambled-mlp": (None, "mlp", [0, 1, 3]),
    "tied-one-stage": (None, "gpt-tied", [0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chained_chunks_match_reference_bitwise(case: str) -> None:
    make_schedule, kind, cuts = CASES[case]
    m = 4
    if kind.startswith("gpt"):
        cfg = GPTConfig(**{**GPT.__dict__, "tie_embeddings": kind == "gpt-tied"})
        model, loss_fn, (x, y) = build_gpt(cfg), gpt_loss, gpt_data(6)  # uneven microbatches
    else:
        model, loss_fn, (x, y) = build_mlp([6, 8, 8, 8, 3], seed=2), mlp_loss, mlp_data(7)
    ref = copy.deepcopy(model)
    if make_schedule is None:
        placement = None
        order = scrambled_order(len(cuts), m, seed=len(case))
    else:
        schedule = make_schedule()
        placement = schedule.placement
        order = sequential_order(schedule)
    chunks = make_chunks(model, cuts, loss_fn, placement=placement)
    assert_matches_reference(model, ref, chunks, order, loss_fn, x, y, m)


@pytest.mark.parametrize("in_order", [True, False], ids=["1f1b", "scrambled"])
def test_unsplit_chunks_match_reference_too(in_order: bool) -> None:
    # In microbatch order every BW lets autograd add its gradients directly;
    # scrambled, most go through the store and mix with direct ones.
    model = build_gpt(GPT)
    ref = copy.deepcopy(model)
    chunks = make_chunks(model, [0, 2, 4], gpt_loss, split=False)
    x, y = gpt_data(4)
    order = sequential_order(one_f_one_b(3, 4)) if in_order else scrambled_order(3, 4, 7)
    assert_matches_reference(model, ref, chunks, order, gpt_loss, x, y, 4)


def test_steps_with_an_optimizer_stay_bitwise_equal() -> None:
    model = build_gpt(GPT)
    ref = copy.deepcopy(model)
    chunks = make_chunks(model, [0, 2, 3], gpt_loss)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    order = sequential_order(zb_h1(3, 4))
    for step in range(3):
        x, y = gpt_data(4, seed=step)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        assert_matches_reference(model, ref, chunks, order, gpt_loss, x, y, 4)
        for opt in opts:
            opt.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


def test_forward_returns_the_unscaled_loss_and_backward_uses_the_scaled_one() -> None:
    model = build_mlp([6, 3], seed=0)
    ref = copy.deepcopy(model)
    chunk = StageChunk(model, 0, 1, loss_fn=mlp_loss)
    x, y = mlp_data(4)
    loss = chunk.forward(0, x, target=y, loss_scale=0.25)
    assert torch.equal(loss, mlp_loss(ref(x), y)) and not loss.requires_grad
    assert chunk.backward_full(0, None) is None  # stage 0: no input gradient
    (mlp_loss(ref(x), y) * 0.25).backward()
    assert torch.equal(model[0].weight.grad, ref[0].weight.grad)


def test_held_bytes_of_an_mlp_stage_exactly() -> None:
    # Middle stage Linear(4,8) -> Tanh -> Linear(8,3) on n float32 rows.
    n = 5
    chunk = StageChunk(build_mlp([4, 8, 3], seed=0), 1, 3)
    chunk.forward(0, torch.randn(n, 4))
    # After F: the input (4n floats, also saved by the first Linear) and the
    # Tanh output (8n, saved by Tanh and by the second Linear).
    assert chunk.held_bytes() == 4 * n * (4 + 8)
    chunk.backward_input(0, torch.randn(n, 3))
    # After B: per Linear its input and its output gradient: (4n + 8n) + (8n + 3n).
    # An MLP's weight-gradient state is larger than its forward state.
    assert chunk.held_bytes() == 4 * n * (4 + 8 + 8 + 3)
    chunk.backward_weight(0)
    assert chunk.held_bytes() == 0


def test_held_bytes_of_a_gpt_block_exactly() -> None:
    b, t, d, h = 2, 32, 16, 4
    cfg = GPTConfig(vocab_size=8, max_seq_len=t, d_model=d, n_heads=h, n_layers=1)
    chunk = StageChunk(build_gpt(cfg)[1], 1, 3)
    chunk.forward(0, torch.randn(b, t, d))
    # After F, per token (float32): block input, ln1 out, q/k/v copies made by the
    # batched matmuls, merged heads, residual, ln2 out (8d), MLP hidden before and
    # after GELU (8d), two LayerNorms' mean and rstd (4); plus the softmax output
    # (h * t per token).
    after_f = 4 * b * t * (16 * d + 4) + 4 * b * h * t * t
    assert chunk.held_bytes() == after_f
    chunk.backward_input(0, torch.randn(b, t, d))
    # After B: the inputs of the six Linears (ln1 out shared by q/k/v, merged
    # heads, ln2 out, GELU out: 7d) and their output gradients (3d + d + 4d + d),
    # plus the four LayerNorm parameter gradients waiting for W (4 * d floats).
    after_b = 4 * b * t * 16 * d + 4 * 4 * d
    assert chunk.held_bytes() == after_b < after_f
    chunk.backward_weight(0)
    assert chunk.held_bytes() == 0


def test_b_frees_the_graph_of_a_whole_gpt_stage() -> None:
    # Embeddings, blocks, head and loss on one stage: after B only W's operands
    # (layer inputs, output gradients, LayerNorm gradients) may stay alive.
    model = build_gpt(GPT)
    chunk = StageChunk(model, 0, 1, loss_fn=gpt_loss)
    x, y = gpt_data(2)
    chunk.forward(0, x, target=y)
    after_f = chunk.held_bytes()
    chunk.backward_input(0, None)
    weights = list(model.parameters())
    w_operands = storage_bytes(chunk.store.held_tensors(0), exclude=weights)
    assert after_f > chunk.held_bytes() == w_operands > 0
    chunk.backward_weight(0)
    assert chunk.held_bytes() == 0


def test_out_of_order_w_holds_gradients_until_earlier_microbatches_finish() -> None:
    chunk = StageChunk(build_mlp([4, 3], seed=0), 1, 3)
    for j in range(2):
        chunk.forward(j, torch.randn(2, 4))
        chunk.backward_input(j, torch.randn(2, 3))
    chunk.backward_weight(1)
    assert chunk.module[0].weight.grad is None
    assert chunk.pending() == {0: "B"}
    assert chunk.held_bytes() > 0  # microbatch 1's gradients wait for microbatch 0
    chunk.backward_weight(0)
    assert chunk.module[0].weight.grad is not None and chunk.held_bytes() == 0


def test_held_bytes_kept_between_ops_equals_a_recount_after_every_op() -> None:
    # Two chunks share one store (a V placement's device); out-of-order B and W
    # make one chunk's W flush gradients that waited. The count kept between ops
    # (queried like the executor's trace, around every op of every chunk) must
    # equal a recount from scratch.
    model = build_gpt(GPT)
    chunks = make_chunks(model, [0, 2, 3], gpt_loss, placement=(0, 0, 1))
    x, y = gpt_data(4)
    xs, ys = split_batch(x, 4), split_batch(y, 4)
    acts, grads = {}, {}
    seen = 0
    for a in scrambled_order(3, 4, seed=11):
        c, s, j = chunks[a.stage], a.stage, a.mb
        before = [k.held_bytes() for k in chunks]
        if a.op is Op.F:
            inp = xs[j] if c.is_first else acts[s - 1, j]
            kw = {"target": ys[j]} if c.is_last else {}
            acts[s, j] = c.forward(j, inp, **kw)
        elif a.op is Op.W:
            c.backward_weight(j)
        else:
            step = c.backward_input if a.op is Op.B else c.backward_full
            grads[s, j] = step(j, None if c.is_last else grads[s + 1, j])
        for k, held in zip(chunks, before, strict=True):
            if k is not c:  # an op of one chunk leaves the others' counts alone
                assert k.held_bytes() == held
        kept = [k.held_bytes() for k in chunks]
        for k in chunks:
            k._held = None  # forget the kept count: the next query recounts
        assert [k.held_bytes() for k in chunks] == kept
        seen += sum(kept) > 0
    assert seen > 10 and all(k.held_bytes() == 0 for k in chunks)


def test_untracked_chunk_refuses_held_bytes() -> None:
    chunk = StageChunk(build_mlp([4, 3], seed=0), 1, 3, track_memory=False)
    chunk.forward(0, torch.randn(2, 4))
    with pytest.raises(RuntimeError, match=r"track_memory=True"):
        chunk.held_bytes()


def test_pass_through_stages() -> None:
    identity = StageChunk(nn.Identity(), 1, 3)
    out = identity.forward(0, torch.ones(2, 3))
    g = torch.full((2, 3), 2.0)
    assert torch.equal(out, torch.ones(2, 3))
    assert torch.equal(identity.backward_full(0, g), g)
    ids = StageChunk(nn.Identity(), 0, 3)  # integer ids: no gradient either way
    ids.forward(0, torch.tensor([[1, 2]]))
    assert ids.backward_full(0, None) is None and ids.pending() == {}


def _mid_chunk() -> StageChunk:
    return StageChunk(build_mlp([4, 3], seed=0), 1, 3)


def test_misuse_errors_name_stage_and_microbatch() -> None:
    c = _mid_chunk()
    with pytest.raises(StageChunkError, match=r"stage 1, microbatch 0: .*never forwarded"):
        c.backward_input(0, torch.zeros(2, 3))
    c.forward(0, torch.zeros(2, 4))
    with pytest.raises(StageChunkError, match=r"stage 1, microbatch 0: forwarded twice"):
        c.forward(0, torch.zeros(2, 4))
    with pytest.raises(StageChunkError, match=r"stage 1, microbatch 0: .*W before B"):
        c.backward_weight(0)
    with pytest.raises(StageChunkError, match=r"microbatch 0: grad_output has shape \(2, 4\)"):
        c.backward_input(0, torch.zeros(2, 4))
    with pytest.raises(StageChunkError, match=r"dtype torch.float64.*dtype torch.float32"):
        c.backward_input(0, torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(StageChunkError, match="grad_output is None"):
        c.backward_input(0, None)
    c.backward_input(0, torch.zeros(2, 3))
    with pytest.raises(StageChunkError, match="B already ran"):
        c.backward_input(0, torch.zeros(2, 3))
    c.backward_weight(0)
    with pytest.raises(StageChunkError, match="never forwarded"):
        c.backward_weight(0)
    with pytest.raises(StageChunkError, match=r"stage 1, microbatch 5: target= is only used"):
        c.forward(5, torch.zeros(2, 4), target=torch.zeros(2, 3))


def test_last_stage_errors() -> None:
    last = StageChunk(build_mlp([4, 3], seed=0), 2, 3, loss_fn=mlp_loss)
    with pytest.raises(StageChunkError, match=r"stage 2, microbatch 0: .*needs target="):
        last.forward(0, torch.zeros(2, 4))
    last.forward(0, torch.zeros(2, 4), target=torch.zeros(2, 3))
    with pytest.raises(StageChunkError, match="pass grad_output=None"):
        last.backward_input(0, torch.zeros(()))
    bad = StageChunk(build_mlp([4, 3], seed=0), 0, 1, loss_fn=lambda out, tgt: out - tgt)
    with pytest.raises(StageChunkError, match=r"scalar tensor, got \(2, 3\)"):
        bad.forward(0, torch.zeros(2, 4), target=torch.zeros(2, 3))


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="last stage: pass loss_fn"):
        StageChunk(nn.Linear(2, 2), 1, 2)
    with pytest.raises(ValueError, match="drop loss_fn"):
        StageChunk(nn.Linear(2, 2), 0, 2, loss_fn=mlp_loss)
    with pytest.raises(ValueError, match=r"stage 2 is not in \[0, num_stages=2\)"):
        StageChunk(nn.Linear(2, 2), 2, 2)
