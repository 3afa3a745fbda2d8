"""Idle-time decomposition on a hand-built 1F1B trace whose every part is known; clock
alignment from messages."""

from __future__ import annotations

import pytest

from zerobubble.profile.bubbles import CATEGORIES, analyze_iteration
from zerobubble.schedule.ir import Action, Op
from zerobubble.trace.clocks import clock_offsets, pair_bounds
from zerobubble.trace.format import TraceEvent


def ev(rank, op, stage, mb, start, end, mem0=0, mem1=0, msg=None, peer=None) -> TraceEvent:
    return TraceEvent(0, rank, op, stage, mb, 0, start, end, mem0, mem1, peer, msg)


def act(j):
    return ("act", 0, 1, j)


def grad(j):
    return ("grad", 1, 0, j)


# P=2, M=3, 1F1B. Rank 0 (stage 0) and rank 1 (stage 1); times in ns.
TRACE = [
    ev(0, "F", 0, 0, 0, 10, 0, 100),
    ev(0, "send", 0, 0, 10, 10, 100, 100, act(0), 1),
    ev(0, "F", 0, 1, 10, 20, 100, 200),
    ev(0, "wait_recv", 0, 0, 21, 45, 200, 200, grad(0), 1),  # B(1,0) ended at 40
    ev(0, "B", 0, 0, 50, 60, 200, 100),
    ev(0, "F", 0, 2, 60, 70, 100, 200),
    ev(0, "wait_recv", 0, 1, 71, 72, 200, 200, grad(1), 1),  # B(1,1) ended at 65
    ev(0, "B", 0, 1, 90, 100, 200, 100),
    ev(0, "wait_recv", 0, 2, 101, 104, 100, 100, grad(2), 1),  # B(1,2) ended at 99
    ev(0, "B", 0, 2, 120, 130, 100, 0),
    ev(1, "wait_recv", 1, 0, 2, 14, 0, 0, act(0), 0),  # F(0,0) ended at 10
    ev(1, "F", 1, 0, 15, 25, 0, 50),
    ev(1, "B", 1, 0, 25, 40, 50, 0),
    ev(1, "wait_recv", 1, 1, 40, 40, 0, 0, act(1), 0),
    ev(1, "F", 1, 1, 40, 50, 0, 50),
    ev(1, "B", 1, 1, 50, 65, 50, 0),
    ev(1, "wait_recv", 1, 2, 66, 72, 0, 0, act(2), 0),  # F(0,2) ended at 70
    ev(1, "F", 1, 2, 74, 84, 0, 50),
    ev(1, "B", 1, 2, 84, 99, 50, 0),
]


def test_each_part_has_its_closed_form_value():
    it = analyze_iteration(TRACE, 0)
    d0, d1 = it.devices
    assert (it.start_ns, it.end_ns) == (0, 130)
    assert (d0.busy_ns, d0.idle_ns, d1.busy_ns, d1.idle_ns) == (60, 70, 75, 55)
    # Rank 0: [20,50] waits for B(1,0) (ends 40, the wait returns 45); in [70,90] the
    # input exists, the wait returns at 72; [100,120] waits from 100 (B(1,2) ended 99)
    # to 104. The busiest rank 1 computes 15 more: 15 of the 20 waited are imbalance.
    assert d0.parts() == {
        "dependency": 20 - 15,
        "memory": 0,
        "comm": 5 + 2 + 4,
        "imbalance": 15,
        "overhead": 5 + 18 + 16,
    }
    # Rank 1: [0,15] F(0,0) until 10, arrival 14; [65,74] F(0,2) until 70, arrival 72;
    # trailing [99,130] has nothing to run.
    assert d1.parts() == {
        "dependency": 10 + 5 + 31,
        "memory": 0,
        "comm": 4 + 2,
        "imbalance": 0,
        "overhead": 1 + 2,
    }
    assert (d0.peak_memory, d1.peak_memory, it.peak_memory) == (200, 50, 200)
    assert it.bubble_rate == pytest.approx((70 + 55) / (2 * 130))


def test_a_budget_turns_waits_with_a_ready_forward_into_memory_stalls():
    # During [20,40] rank 0 could run F(0,2) (stage 0, ready at T0) but holds 200 and
    # F needs 100 more: over 250. Over 300 it would fit, so nothing changes.
    tight = analyze_iteration(TRACE, 0, mem_budget=250).devices[0]
    assert (tight.memory_ns, tight.dependency_ns, tight.imbalance_ns) == (20, 0, 0)
    loose = analyze_iteration(TRACE, 0, mem_budget=300).devices[0]
    assert loose.parts() == analyze_iteration(TRACE, 0).devices[0].parts()


@pytest.mark.parametrize("budget", [None, 250])
def test_parts_sum_to_the_idle_time(budget):
    for d in analyze_iteration(TRACE, 0, mem_budget=budget).devices:
        assert sum(d.parts().values()) == d.idle_ns
        assert list(d.parts()) == list(CATEGORIES)


def test_overlapping_computes_are_refused():
    bad = [*TRACE[:4], ev(0, "B", 0, 0, 15, 60, 200, 100), *TRACE[5:]]
    with pytest.raises(ValueError, match="compute events overlap at B"):
        analyze_iteration(bad, 0)
    with pytest.raises(ValueError, match="iteration 3: every rank needs compute events"):
        analyze_iteration(TRACE, 3)
    # Declared as an overlapped pair, F(s0,mb1) [10, 20] and B(s0,mb0) [15, 60] run at once:
    # their union, 10..60, is busy once, and the parts still add up to the idle time.
    pair = (Action(Op.F, 0, 1), Action(Op.B, 0, 0))
    paired = analyze_iteration(bad, 0, overlaps=[pair]).devices[0]
    plain = analyze_iteration(TRACE, 0).devices[0]
    assert paired.busy_ns == plain.busy_ns - (20 - 10) - (60 - 50) + (60 - 10)
    parts = paired.dependency_ns + paired.memory_ns + paired.comm_ns + paired.imbalance_ns
    assert parts + paired.overhead_ns == paired.idle_ns


def test_clock_offsets_come_from_messages_both_ways():
    # True times: rank 0 sends act at 10, rank 1's wait returns at 15; rank 1 sends grad at
    # 20, rank 0's wait returns at 26. Rank 1's clock reads 1000 more.
    events = [
        ev(0, "send", 0, 0, 10, 11, msg=act(0), peer=1),
        ev(1, "wait_recv", 1, 0, 1012, 1015, msg=act(0), peer=0),
        ev(1, "send", 1, 0, 1020, 1021, msg=grad(0), peer=0),
        ev(0, "wait_recv", 0, 0, 22, 26, msg=grad(0), peer=1),
    ]
    (lo, hi) = pair_bounds(events)[0, 1]
    assert (lo.value, hi.value) == (10 - 1015, 26 - 1020)
    assert clock_offsets(events) == {0: 0, 1: (-1005 - 994) // 2}
    assert clock_offsets(events[:2]) == {0: 0, 1: 0}  # one direction: no correction needed
