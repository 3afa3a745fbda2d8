"""Simulator semantics: timing, comm latency, memory states, bubble definitions."""

from __future__ import annotations

from fractions import Fraction

import pytest

from conftest import exact_costs
from zerobubble.schedule.costs import CostModel, CostSpec, parse_costs
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.simulate import simulate


def test_two_stage_timing_by_hand():
    # d0: F0 B0 W0 ; d1: F0 B0 W0 with F=1 B=2 W=3 per stage, comm 1/2.
    sched = Schedule(
        "t",
        2,
        2,
        1,
        (0, 1),
        [
            [Action(Op.F, 0, 0), Action(Op.B, 0, 0), Action(Op.W, 0, 0)],
            [Action(Op.F, 1, 0), Action(Op.B, 1, 0), Action(Op.W, 1, 0)],
        ],
    )
    costs = CostModel.per_stage([1, 1], [2, 2], [3, 3], comm=Fraction(1, 2))
    r = simulate(sched, costs)
    # d1.F starts after d0.F (1) + comm; d1.B right after; d0.B after d1.B + comm.
    assert r.start == ((0, 5, 7), (Fraction(3, 2), Fraction(5, 2), Fraction(9, 2)))
    assert r.end == ((1, 7, 10), (Fraction(5, 2), Fraction(9, 2), Fraction(15, 2)))
    assert r.makespan == 10 and r.span == (10, 6) and r.cost == 10
    assert r.idle == (((1, 5),), ())
    assert r.ideal == 6 and r.bubble_time == 4
    assert r.bubble_rate == pytest.approx(0.4)


@pytest.mark.parametrize("comm", [0, Fraction(1, 4), 1])
def test_comm_adds_latency_per_hop_in_gpipe(comm):
    """Fill and drain cross 2(P-1) device boundaries on the critical path."""
    p, m = 4, 8
    sched = generate("gpipe", p, m)
    r = simulate(sched, exact_costs(sched, comm=comm))
    assert r.cost == 3 * (m + p - 1) + 2 * (p - 1) * comm
    # 1F1B pays more: in its steady state a device waits for a gradient whose round
    # trip crosses 2(P-1-d) boundaries, so latency also shows between F and BW.
    sched = generate("1f1b", p, m)
    assert simulate(sched, exact_costs(sched, comm=comm)).cost >= r.cost


def test_memory_states_follow_r():
    sched = Schedule(
        "t",
        1,
        1,
        2,
        (0,),
        [
            [
                Action(Op.F, 0, 0),
                Action(Op.F, 0, 1),
                Action(Op.B, 0, 0),
                Action(Op.B, 0, 1),
                Action(Op.W, 0, 0),
                Action(Op.W, 0, 1),
            ]
        ],
    )
    r = simulate(sched, exact_costs(sched, mem_w=Fraction(1, 4)))
    assert r.memory == ((1, 2, Fraction(5, 4), Fraction(1, 2), Fraction(1, 4), 0),)
    assert r.peak_memory == (2,)


def test_chunks_split_costs_and_memory():
    sched = generate("zbv", 2, 4)
    c = exact_costs(sched, F=2, B=4, W=6)
    assert c.f == (1, 1, 1, 1) and c.b == (2,) * 4 and c.w == (3,) * 4
    assert c.mem_f == (Fraction(1, 2),) * 4 and c.mem_w == (Fraction(1, 4),) * 4


def test_cost_parsing_and_errors():
    spec = parse_costs("F=1,B=2,W=0.5,comm=1/10")
    assert (spec.F, spec.B, spec.W, spec.comm) == (1, 2, 0.5, Fraction(1, 10))
    with pytest.raises(ValueError, match="KEY one of F, B, W, comm"):
        parse_costs("X=1")
    with pytest.raises(ValueError, match=r"f\[1\]=-1 must be >= 0"):
        CostModel.per_stage([1, -1], [1, 1], [1, 1])
    with pytest.raises(ValueError, match="cost array 'b' has 1 entries"):
        CostModel.per_stage([1, 1], [1], [1, 1])
    with pytest.raises(ValueError, match="W cannot hold more than F allocated"):
        CostModel.per_stage([1], [1], [1], mem_f=[1], mem_w=[2])
    stage = CostModel.per_stage([1, 2, 3], [1, 1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="describes 3 virtual stages but the schedule has 4"):
        CostSpec(stage_costs=stage).resolve((0, 1, 2, 3))


def test_makespan_vs_cost_for_zb_h2():
    sched = generate("zb-h2", 4, 8)
    r = simulate(sched, exact_costs(sched))
    assert r.cost == 24 and r.makespan == 27
    assert r.bubble_rate == 0 and r.bubble_rate_makespan == pytest.approx(3 / 27)


def test_cost_models_mix_per_stage():
    a = CostModel.per_stage([1, 2, 3], [4, 5, 6], [7, 8, 9], comm=1, mem_f=[10, 10, 10])
    b = CostModel.per_stage([11, 12, 13], [14, 15, 16], [0, 0, 0], comm=5, mem_f=[20, 20, 20])
    m = a.with_stages_from(b, [0, 2])
    assert (m.f, m.b, m.w, m.comm) == ((11, 2, 13), (14, 5, 16), (0, 8, 0), 1)
    assert (m.mem_f, m.mem_w) == ((20, 10, 20), (10, 5, 10))
    assert a.with_stages_from(b, []) == a
    with pytest.raises(ValueError, match="cannot mix cost models of 3 and 1 stages"):
        a.with_stages_from(CostModel.per_stage([1], [1], [1]), [0])


def test_host_parts_are_part_of_the_durations_and_summed_per_device():
    # 1F1B, P=2, M=2: each device runs F, F, BW, BW (device 1: F, BW, F, BW).
    host = {"F": [1, 2], "B": [1, 1], "W": [0, 1]}
    m = CostModel.per_stage([4, 4], [4, 4], [2, 2], host=host)
    sched = generate("1f1b", 2, 2)
    r = simulate(sched, m)
    plain = simulate(sched, CostModel.per_stage([4, 4], [4, 4], [2, 2]))
    assert r.busy == plain.busy  # the durations include the host parts
    assert r.host == (2 * 1 + 2 * (1 + 0), 2 * 2 + 2 * (1 + 1))  # F's plus BW's (B + W)
    assert m.host_time(Op.BW, 1) == 2 and m.host_time(Op.W, 0) == 0
    mixed = m.with_stages_from(CostModel.per_stage([4, 4], [4, 4], [2, 2]), [1])
    assert (mixed.host_f, mixed.host_b, mixed.host_w) == ((1, 0), (1, 0), (0, 0))
    assert CostModel.per_stage([1], [1], [1]).host_f == (0,)
    with pytest.raises(ValueError, match=r"host_b\[1\]=5 exceeds b\[1\]=4"):
        CostModel.per_stage([4, 4], [4, 4], [2, 2], host={"B": [0, 5]})
    with pytest.raises(ValueError, match="cost array 'host_w' has 1 entries"):
        CostModel.per_stage([4, 4], [4, 4], [2, 2], host={"W": [0]})
    assert m.to_dict()["host"] == {"F": [1.0, 2.0], "B": [1.0, 1.0], "W": [0.0, 1.0]}
    assert "host" not in CostModel.per_stage([1], [1], [1]).to_dict()


def test_a_message_leaves_when_its_producers_compute_ends():
    # F(0) takes 4 of which 1 is host tail, so its activation leaves at 3 and arrives at
    # 3 + comm = 5; BW(1) has no host part: its gradient arrives at 15 + 2.
    m = CostModel.per_stage([4, 4], [4, 4], [2, 2], comm=2, host={"F": [1, 0]})
    r = simulate(generate("1f1b", 2, 1), m)
    assert r.start == ((0, 17), (5, 9)) and r.end == ((4, 23), (9, 15))
    assert m.hop(Op.F, 0) == 1 and m.hop(Op.BW, 1) == 2
    # Overhead as a trace counts it: F(0,1)'s input is local (ready at 0), so all of
    # F(0,0)'s host tail delayed it; F(0,1)'s tail ends at 8, long before BW(0,0)'s
    # gradient is ready at 17: it delays nothing.
    two = simulate(generate("1f1b", 2, 2), m)
    assert two.start == ((0, 4, 17, 27), (5, 9, 15, 19))
    assert two.host == (2, 0) and two.overhead == (1, 0)
