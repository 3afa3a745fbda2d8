"""Replay gates (pure), version headers on messages, and discarding a stage's work."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from generated import SLOW_SOLVES, generated
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.program.instructions import (
    Compute,
    Gate,
    Message,
    MsgKind,
    PostRecv,
    Send,
    VersionCheck,
    WaitRecv,
)
from zerobubble.program.lowering import lower
from zerobubble.program.passes.protocol import gate_position, insert_protocol, plan_gates
from zerobubble.runtime.p2p.comm import TensorMeta
from zerobubble.runtime.p2p.wire import HEADER_BYTES, Header, pack, packed_meta, unpack
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Op


def protocol_program(lowered, rank, *, speculative):
    """Rank ``rank``'s program after the protocol pass."""
    return insert_protocol(lowered, speculative=speculative).programs[rank]


def every_schedule():
    for kind, gen in GENERATORS.items():
        opts = {"chunks": 2} if "chunks" in gen.options else {}
        for p in (1, 2, 3, 4):
            for m in sorted({1, max(p - 1, 1), p, 2 * p + 1}):
                if (kind, p, m) in SLOW_SOLVES:
                    continue
                try:
                    yield generated(kind, p, m, **opts)
                except ValueError:
                    continue


def test_gates_sit_before_the_first_backward_and_pre_gate_work_is_only_forwards():
    planned = refused = 0
    for sched in every_schedule():
        lowered = lower(sched)
        try:
            plan = plan_gates(lowered)
        except ScheduleError as err:
            assert err.reason is Reason.DEADLOCK and "conservative" in str(err)
            refused += 1
            continue
        planned += 1
        for d, prog in enumerate(plan.programs):
            g = plan.gates[d]
            # Same instructions, only receive posts moved.
            assert Counter(prog) == Counter(lowered.programs[d])
            before = prog[:g]
            assert all(i.action.op is Op.F for i in before if isinstance(i, Compute)), (
                f"{sched.name} device {d}"
            )
            assert all(i.msg.kind is MsgKind.ACT for i in before if isinstance(i, Send | WaitRecv))
            assert gate_position(prog) >= g
            stale = {m for msgs in plan.stale[d].values() for m in msgs}
            posted = [i for i in before if isinstance(i, PostRecv)]
            assert {i.msg for i in posted} <= stale  # a post before the gate is always stale
            assert Counter(i.peer for i in posted) == Counter(plan.posted[d])
            assert {p: len(msgs) for p, msgs in plan.stale[d].items()} == {
                p: sum(
                    isinstance(i, Send) and i.peer == d for i in plan.programs[p][: plan.gates[p]]
                )
                for p in plan.stale[d]
            }
    assert planned > 100 and refused >= 1


def test_gate_that_would_need_post_gate_work_is_refused():
    with pytest.raises(ScheduleError) as err:
        plan_gates(lower(generate("1f1b-v", 4, 3)))
    assert err.value.reason is Reason.DEADLOCK
    assert "device 3 at wait_recv act(s2->s3,mb2)" in str(err.value)
    assert "Use conservative post-validation" in str(err.value)


@pytest.mark.parametrize(("kind", "p", "m"), [("zbv", 3, 6), ("1f1b", 2, 3), ("dualpipev", 4, 8)])
def test_protocol_program_inserts_the_gate_and_a_version_check_before_every_compute(kind, p, m):
    lowered = lower(generate(kind, p, m))
    plan = plan_gates(lowered)
    for d in range(p):
        for speculative in (False, True):
            prog = protocol_program(lowered, d, speculative=speculative)
            plain = [i for i in prog if not isinstance(i, Gate | VersionCheck)]
            assert plain == list(plan.programs[d] if speculative else lowered.programs[d])
            checks = [i.action for i in prog if isinstance(i, VersionCheck)]
            assert checks == [i.action for i in plain if isinstance(i, Compute)]
            for j, ins in enumerate(prog):
                if isinstance(ins, Compute):
                    assert prog[j - 1] == VersionCheck(ins.action)
            gates = [j for j, i in enumerate(prog) if isinstance(i, Gate)]
            if not speculative:
                assert gates == []
                continue
            (g,) = gates
            # The gate sits where the plan puts it: exactly plan.gates[d] lowered
            # instructions before it.
            assert sum(not isinstance(i, VersionCheck) for i in prog[:g]) == plan.gates[d]
            drain = prog[g].drain
            expected = [
                (peer, msg)
                for peer, msgs in plan.stale[d].items()
                for msg in msgs[plan.posted[d].get(peer, 0) :]
            ]
            assert list(drain) == expected
            # What a replay must wait for: the pre-gate posts plus the drain are exactly
            # the stale messages the peers send before their gates.
            posted = [(i.peer, i.msg) for i in prog[:g] if isinstance(i, PostRecv)]
            assert Counter(posted + list(drain)) == Counter(
                (peer, msg) for peer, msgs in plan.stale[d].items() for msg in msgs
            )


def test_speculative_protocol_refuses_a_schedule_that_cannot_replay():
    with pytest.raises(ValueError, match="Use conservative post-validation"):
        protocol_program(lower(generate("1f1b-v", 4, 3)), 0, speculative=True)
    assert protocol_program(lower(generate("1f1b-v", 4, 3)), 0, speculative=False)


def test_1f1b_gate_moves_the_early_gradient_post_behind_the_gate():
    plan = plan_gates(lower(generate("1f1b", 2, 3)))
    d0 = plan.programs[0]
    assert [str(i) for i in d0[: plan.gates[0]]] == [
        "F(s0,mb0)",
        "send act(s0->s1,mb0) to device 1",
        "F(s0,mb1)",
        "send act(s0->s1,mb1) to device 1",
    ]
    assert str(d0[plan.gates[0]]) == "post_recv grad(s1->s0,mb0) from device 1"
    assert plan.stale[1] == {0: tuple(i.msg for i in d0[:4] if isinstance(i, Send))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_header_round_trip_keeps_payload_bits_and_alignment(dtype):
    t = (torch.randn(3, 5) * 100).to(dtype)
    meta = TensorMeta.of(t)
    msg = Message(MsgKind.GRAD, 2, 1, 4)
    head0 = Header.of(msg, 7, 3, 1, t)
    assert head0 == Header(7, 3, 1, (1, 2, 1, 4, 15 * dtype.itemsize))
    buf = pack(t.t().contiguous().t(), head0)  # non-contiguous input
    assert TensorMeta.of(buf) == packed_meta(meta)
    got, head = unpack(buf.clone(), meta)
    assert head == head0 and head.message == Header.identity(msg, meta)
    assert (
        head.describe() == f"grad s2->s1 mb4 ({15 * dtype.itemsize} bytes) of iteration 7 attempt 1"
    )
    assert torch.equal(got, t) and got.dtype == dtype
    # The payload keeps a fresh allocation's 64-byte alignment (matmul kernels may
    # round differently on unaligned data).
    assert HEADER_BYTES % 64 == 0 and got.data_ptr() % 64 == 0


def test_discard_drops_forwarded_microbatches_without_touching_grads():
    layers = build_mlp([4, 4, 4])
    chunk = StageChunk(layers, 0, 2, split=True)
    x = torch.randn(2, 4)
    for mb in (0, 1):
        chunk.forward(mb, x)
    assert chunk.pending() == {0: "F", 1: "F"} and chunk.held_bytes() > 0
    chunk.discard()
    assert chunk.pending() == {} and chunk.held_bytes() == 0
    assert chunk.store.in_flight() == {}
    assert all(p.grad is None for p in layers.parameters())
    out = chunk.forward(0, x)  # the microbatch can run again
    chunk.backward_full(0, torch.ones_like(out))
    assert all(p.grad is not None for p in layers.parameters())
    last = StageChunk(build_mlp([4, 4]), 1, 2, loss_fn=mlp_loss)
    last.forward(0, x, target=x)
    last.discard()
    assert last.pending() == {}
