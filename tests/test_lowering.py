"""The lowering pass: messages, receive placement, order check, transport simulation."""

from __future__ import annotations

import pytest

from generated import SLOW_SOLVES, generated
from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.program.check import validate_lowered
from zerobubble.program.instructions import (
    Compute,
    LoweredSchedule,
    Message,
    MsgKind,
    PostRecv,
    Send,
    WaitRecv,
    WaitSends,
)
from zerobubble.program.lowering import check_comm_order, lower
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import BW, F, Schedule


def options(kind: str) -> dict:
    return {"chunks": 2} if "chunks" in GENERATORS[kind].options else {}


def act(s: int, j: int) -> Message:
    return Message(MsgKind.ACT, s, s + 1, j)


def grad(s: int, j: int) -> Message:
    return Message(MsgKind.GRAD, s, s - 1, j)


def test_1f1b_two_devices_exact_programs():
    sched = generate("1f1b", 2, 2)
    low = lower(sched, recv_lookahead=1)
    assert low.programs[0] == (
        Compute(F(0, 0)),
        Send(act(0, 0), 1),
        PostRecv(grad(1, 0), 1),
        Compute(F(0, 1)),
        Send(act(0, 1), 1),
        PostRecv(grad(1, 1), 1),
        WaitRecv(grad(1, 0), 1),
        Compute(BW(0, 0)),
        WaitRecv(grad(1, 1), 1),
        Compute(BW(0, 1)),
        WaitSends(),
    )
    assert low.programs[1] == (
        PostRecv(act(0, 0), 0),
        WaitRecv(act(0, 0), 0),
        Compute(F(1, 0)),
        PostRecv(act(0, 1), 0),
        Compute(BW(1, 0)),
        Send(grad(1, 0), 0),
        WaitRecv(act(0, 1), 0),
        Compute(F(1, 1)),
        Compute(BW(1, 1)),
        Send(grad(1, 1), 0),
        WaitSends(),
    )
    validate_lowered(low)


def test_message_ids_are_stable_and_readable():
    assert str(act(2, 5)) == "act(s2->s3,mb5)"
    assert str(grad(3, 0)) == "grad(s3->s2,mb0)"
    assert act(2, 5) == Message(MsgKind.ACT, 2, 3, 5)


def test_same_device_edges_need_no_message():
    # zbv: stages P-1 and P both live on the last device; one device holds everything at P=1.
    low = lower(generate("zbv", 2, 3))
    msgs = [i.msg for prog in low.programs for i in prog if isinstance(i, Send | PostRecv)]
    assert act(1, 0) not in msgs and grad(2, 0) not in msgs
    assert act(0, 0) in msgs and act(2, 0) in msgs
    single = lower(generate("zb-h1", 1, 3))
    assert all(isinstance(i, Compute) for i in single.programs[0])


SEARCHING = frozenset({"auto", "optimal", "optimal-v", "zb-auto", "zbv-auto"})
"""The kinds that solve a search (seconds per size); they lower at SEARCH_SIZES only."""
SEARCH_SIZES = ((1, 3), (2, 2), (3, 2), (3, 7), (4, 1))
"""Each P at least once and each M class at least once (M = 1 at P = 4, M = P - 1 at P = 3,
M = P at P = 2, M = 2P + 1 at P = 1 and at P = 3, where the searches pick V-shaped and
multi-chunk placements)."""


def sizes(kind: str) -> list[tuple[int, int]]:
    if kind in SEARCHING:
        return list(SEARCH_SIZES)
    return [(p, m) for p in (1, 2, 3, 4) for m in sorted({1, max(p - 1, 1), p, 2 * p + 1})]


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_every_generator_lowers_and_runs(kind):
    """A covering design over (kind, P, M): the kinds made directly lower at every P in 1..4
    and M = 1, below P, P and 2P + 1 (at P = 1, 2 and 4 the sizes test_executor runs every
    kind at, with the same options); the searching kinds at SEARCH_SIZES, every P and every
    M class at least once. Lowering reads placements and orders, not how a search found
    them."""
    assert set(GENERATORS) >= SEARCHING
    for p, m in sizes(kind):
        if (kind, p, m) in SLOW_SOLVES:
            continue
        sched = generated(kind, p, m, **options(kind))
        for lookahead in (0, 2, 1000):
            low = lower(sched, recv_lookahead=lookahead)
            validate_lowered(low)
            computes = [[i.action for i in prog if isinstance(i, Compute)] for prog in low.programs]
            assert computes == [list(a) for a in sched.actions]
            sends = sum(isinstance(i, Send) for prog in low.programs for i in prog)
            cross = sum(
                sched.placement[s] != sched.placement[s + 1] for s in range(sched.num_stages - 1)
            )
            assert (
                sends == 2 * cross * sched.num_units
            )  # one activation, one gradient per edge, unit


@pytest.mark.parametrize(
    ("name", "p", "m"),
    [("ZBVZeroBubble", 2, 4), ("InterleavedZeroBubble", 2, 4), ("Interleaved1F1B", 4, 8)],
)
def test_torch_schedules_lower(name, p, m):
    validate_lowered(lower(torch_schedule(name, p, m)))


def test_receive_is_posted_lookahead_computes_early():
    low = lower(generate("gpipe", 2, 3), recv_lookahead=2)
    prog = low.programs[1]
    # Device 1 runs F(1,0..2) then BW: act mb2 is posted before the compute two slots earlier.
    assert prog.index(PostRecv(act(0, 2), 0)) < prog.index(Compute(F(1, 0)))
    assert prog.index(WaitRecv(act(0, 2), 0)) == prog.index(Compute(F(1, 2))) - 1
    everything_first = lower(generate("gpipe", 2, 3), recv_lookahead=1000).programs[1]
    assert [type(i) for i in everything_first[:3]] == [PostRecv] * 3


def test_receives_are_hoisted_into_sender_order():
    # Device 1 consumes microbatch 1 before microbatch 0; device 0 sends 0 first.
    sched = Schedule(
        "crossed",
        2,
        2,
        2,
        (0, 1),
        [
            [F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)],
            [F(1, 1), F(1, 0), BW(1, 0), BW(1, 1)],
        ],
    )
    low = lower(sched, recv_lookahead=0)
    posts = [i.msg for i in low.programs[1] if isinstance(i, PostRecv)]
    assert posts == [act(0, 0), act(0, 1)]  # the sender's order, although mb1 is used first
    assert low.programs[1][:3] == (
        PostRecv(act(0, 0), 0),
        PostRecv(act(0, 1), 0),
        WaitRecv(act(0, 1), 0),
    )
    validate_lowered(low)


def _swap_posts(low: LoweredSchedule, device: int, a: int, b: int) -> LoweredSchedule:
    prog = list(low.programs[device])
    idx = [i for i, ins in enumerate(prog) if isinstance(ins, PostRecv)]
    prog[idx[a]], prog[idx[b]] = prog[idx[b]], prog[idx[a]]
    programs = list(low.programs)
    programs[device] = tuple(prog)
    return LoweredSchedule(low.schedule, tuple(programs))


def test_comm_order_mismatch_names_both_devices_and_the_message():
    low = _swap_posts(lower(generate("1f1b", 2, 3), recv_lookahead=1000), 1, 0, 1)
    with pytest.raises(ScheduleError) as err:
        check_comm_order(low)
    e = err.value
    assert e.reason is Reason.COMM_ORDER
    assert e.device == 1
    text = str(e)
    assert "message #0 from device 0 to device 1" in text
    assert "device 0 sends act(s0->s1,mb0)" in text
    assert "posted a receive for act(s0->s1,mb1)" in text
    with pytest.raises(ScheduleError, match=r"\[comm_order\].*matches|\[comm_order\].*sent"):
        validate_lowered(low)


def test_missing_receive_is_a_comm_order_error():
    low = lower(generate("1f1b", 2, 2), recv_lookahead=0)
    programs = list(low.programs)
    programs[1] = tuple(
        i for i in programs[1] if not (isinstance(i, PostRecv | WaitRecv) and i.msg.mb == 1)
    )
    bad = LoweredSchedule(low.schedule, tuple(programs))
    with pytest.raises(ScheduleError, match="device 1 posts no receive for it") as err:
        check_comm_order(bad)
    assert err.value.device == 0


def test_validator_reports_deadlock_with_stuck_instructions():
    # Device 0 waits for its gradient before computing the activation device 1 needs.
    low = lower(generate("1f1b", 2, 1), recv_lookahead=0)
    p0 = (
        PostRecv(grad(1, 0), 1),
        WaitRecv(grad(1, 0), 1),
        Compute(F(0, 0)),
        Send(act(0, 0), 1),
        Compute(BW(0, 0)),
        WaitSends(),
    )
    with pytest.raises(ScheduleError) as err:
        validate_lowered(LoweredSchedule(low.schedule, (p0, low.programs[1])))
    e = err.value
    assert e.reason is Reason.DEADLOCK
    assert (e.device, e.position) == (0, 1)
    assert "device 0 at position 1 (wait_recv grad(s1->s0,mb0) from device 1)" in str(e)
    assert "device 1 at position 1 (wait_recv act(s0->s1,mb0) from device 0)" in str(e)


def test_validator_reports_a_compute_without_its_receive():
    low = lower(generate("1f1b", 2, 1), recv_lookahead=0)
    p1 = tuple(i for i in low.programs[1] if not isinstance(i, WaitRecv))
    with pytest.raises(
        ScheduleError, match=r"\[missing\].*F\(s1,mb0\).*input act\(s0->s1,mb0\) is not available"
    ):
        validate_lowered(LoweredSchedule(low.schedule, (low.programs[0], p1)))


def test_negative_lookahead_is_refused():
    with pytest.raises(ValueError, match="recv_lookahead must be >= 0"):
        lower(generate("1f1b", 2, 2), recv_lookahead=-1)
