"""Every consumer of the dependency rule agrees with it (schedule.deps), on random schedules.

The expectations here are derived from ``deps.needs``/``deps.produces`` alone;
each consumer (graph, validator, searches' graph, V-family generator,
lowering, trace checker, bubble breakdown) is checked against them.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from generated import generated
from synthetic_trace import synthetic_trace
from zerobubble.profile.bubbles import analyze_iteration
from zerobubble.program.instructions import Compute, MsgKind, Send, WaitRecv
from zerobubble.program.lowering import lower
from zerobubble.schedule.deps import (
    LOCAL_PRODUCER,
    PRODUCERS,
    RULES,
    Key,
    Kind,
    needs,
    produces,
)
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import GENERATORS
from zerobubble.schedule.graph import CODE, _deps_by_dict, action_code, build_graph
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.search.graph import OPS, ActionGraph
from zerobubble.schedule.validate import validate
from zerobubble.trace.check import check_trace
from zerobubble.trace.clocks import clock_offsets
from zerobubble.trace.format import EventOp

KINDS = sorted(k for k in GENERATORS if k != "optimal")  # the MILP is too slow for a fuzz


def test_the_rule_in_words():
    S, j = 4, 3
    assert needs(Op.F, 0, j, S) == ()
    assert needs(Op.F, 2, j, S) == (Key(Kind.ACT, 1, j),)
    assert needs(Op.B, 3, j, S) == (Key(Kind.SAVED, 3, j),)
    assert needs(Op.B, 1, j, S) == (Key(Kind.SAVED, 1, j), Key(Kind.GRAD, 2, j))
    assert needs(Op.BW, 1, j, S) == needs(Op.B, 1, j, S)
    assert needs(Op.W, 1, j, S) == (Key(Kind.WSTATE, 1, j),)
    assert produces(Op.F, 3, j, S) == (Key(Kind.SAVED, 3, j),)  # the last F feeds the loss
    assert produces(Op.B, 0, j, S) == (Key(Kind.WSTATE, 0, j),)  # stage 0's grad is dropped
    assert PRODUCERS[Kind.GRAD] == (Op.B, Op.BW)
    assert LOCAL_PRODUCER == {Op.F: None, Op.B: Op.F, Op.W: Op.B, Op.BW: Op.F}
    assert set(KINDS) >= SEARCHING
    assert {k.value for k in Kind if k.travels} == {m.value for m in MsgKind}
    # Every need some op has is produced by some op, with the flow that reaches it.
    for op, rule in RULES.items():
        for k in rule.needs:
            assert PRODUCERS[k], (op, k)


def test_one_integer_encoding():
    S, M = 3, 5
    g = ActionGraph((0, 1, 2), M)
    ids = [g.index(op, s, j) for op in OPS for s in range(S) for j in range(M)]
    assert ids == list(range(3 * S * M))
    assert g.index(Op.B, 2, 4) == action_code(CODE[Op.B], 2, 4, S, M) == (1 * S + 2) * M + 4


SEARCHING = frozenset({"auto", "optimal-v", "zb-auto", "zbv-auto"})
"""The searching kinds drawn here (seconds of solving per size): at P = 3, M = 4 only."""


@st.composite
def schedules(draw) -> Schedule:
    """A covering design over (kind, P, M), drawn: the kinds made directly at P in 2..4 and
    M = P (no steady state), P + 1 (warm-up and cool-down meet) or 2P (a steady state); the
    searching kinds at P = 3, M = 4 only (P >= 3, their V-shaped and multi-chunk placements),
    the size test_fuzz_schedule and test_placement_search generate them at, so the draws
    solve no searches of their own. The rule is checked per action, whatever made the order.
    M = P with two chunks where a kind takes them is what test_lowering and test_executor
    generate."""
    kind = draw(st.sampled_from(KINDS))
    if kind in SEARCHING:
        p, m = 3, 4
    else:
        p = draw(st.integers(2, 4))
        m = draw(st.sampled_from((p, p + 1, 2 * p)))
    opts = {"chunks": 2} if m == p and "chunks" in GENERATORS[kind].options else {}
    try:
        sched = generated(kind, p, m, **opts)
    except (ValueError, ScheduleError):
        assume(False)
    if draw(st.booleans()):
        sched = fuse_local_backward(sched)
    return sched


def producers_of(sched: Schedule) -> dict[Key, Action]:
    """Which action of the schedule produces each key (from the rule alone)."""
    out: dict[Key, Action] = {}
    for _, _, a in sched:
        for k in produces(a.op, a.stage, a.mb, sched.num_stages, sched.segments):
            out.setdefault(k, a)
    return out


FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(schedules())
def test_graph_validator_and_generators_agree(sched):
    made = producers_of(sched)
    g = build_graph(sched)
    assert g.columns is not None
    assert g.deps == _deps_by_dict(g.flat, sched.num_stages, sched.segments)
    for i, a in enumerate(g.flat):
        want = tuple(made[k] for k in needs(a.op, a.stage, a.mb, sched.num_stages, sched.segments))
        assert tuple(g.flat[x] for x in g.preds[i]) == want
    validate(sched)  # every generator (the V family's reorder included) obeys the rule


@FUZZ
@given(schedules(), st.randoms(use_true_random=False))
def test_validator_refuses_an_action_moved_before_a_local_producer(sched, rnd):
    made = producers_of(sched)
    dev_of = {a: (d, i) for d, i, a in sched}
    cands = [
        (a, made[k])
        for _, _, a in sched
        for k in needs(a.op, a.stage, a.mb, sched.num_stages)
        if dev_of[made[k]][0] == dev_of[a][0]
    ]
    a, prod = rnd.choice(cands)
    d = dev_of[a][0]
    row = list(sched.actions[d])
    row.remove(a)
    row.insert(dev_of[prod][1], a)
    rows = [row if e == d else acts for e, acts in enumerate(sched.actions)]
    with pytest.raises(ScheduleError) as exc:
        validate(sched.with_actions(rows))
    assert exc.value.reason is Reason.LOCAL_ORDER
    assert exc.value.action == a
    named = [made[k] for k in needs(a.op, a.stage, a.mb, sched.num_stages)]
    assert prod in named and any(f"depends on {x}," in str(exc.value) for x in named)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.integers(1, 4))
def test_search_graph_edges_are_the_rule(placement, m):
    placement = tuple(placement)
    g = ActionGraph(placement, m)
    S = len(placement)
    want = set()
    for op in OPS:
        for s in range(S):
            for j in range(m):
                for k in needs(op, s, j, S):
                    prod = next(p for p in PRODUCERS[k.kind] if p in OPS)
                    cross = placement[k.stage] != placement[s]
                    want.add((g.index(prod, k.stage, j), g.index(op, s, j), cross))
    chains = {
        (g.index(op, s, j), g.index(op, s, j + 1), False)
        for op in OPS
        for s in range(S)
        for j in range(m - 1)
    }
    assert set(g.edges) == want | chains
    assert len(g.edges) == len(want) + len(chains)


@FUZZ
@given(schedules())
def test_lowering_receives_and_sends_exactly_the_travelling_keys(sched):
    S, place = sched.num_stages, sched.placement
    for d, prog in enumerate(lower(sched).programs):
        waited: list = []
        for ins in prog:
            if isinstance(ins, WaitRecv):
                waited.append(
                    (ins.msg.kind.value, ins.msg.src_stage, ins.msg.dst_stage, ins.msg.mb)
                )
            elif isinstance(ins, Compute):
                a = ins.action
                want = [
                    (k.kind.value, k.stage, k.consumer_stage, k.mb)
                    for k in needs(a.op, a.stage, a.mb, S)
                    if k.kind.travels and place[k.stage] != d
                ]
                assert waited == want, a
                waited = []
        sends = [i.msg for i in prog if isinstance(i, Send)]
        want_sends = [
            (k.kind.value, k.stage, k.consumer_stage, k.mb)
            for a in sched.actions[d]
            for k in produces(a.op, a.stage, a.mb, S)
            if k.kind.travels and place[k.consumer_stage] != d
        ]
        assert [(m.kind.value, m.src_stage, m.dst_stage, m.mb) for m in sends] == want_sends


@FUZZ
@given(schedules(), st.randoms(use_true_random=False))
def test_trace_checker_knows_every_cross_rank_need(sched, rnd):
    events = synthetic_trace(sched, latency=3)
    assert check_trace(events).ok
    msgs = sorted({e.msg for e in events if e.msg is not None})
    assume(msgs)
    drop = rnd.choice(msgs)  # the message vanishes entirely: only the rule says it was needed
    report = check_trace([e for e in events if e.msg != drop])
    assert not report.ok and report.first.check == "edge"
    # The consumer of the lost message is named: F for an activation, B or BW for a gradient.
    consumer = report.first.event.split("(")[0]
    assert consumer in (["F"] if drop[0] is MsgKind.ACT else ["B", "BW"])
    assert report.first.event.endswith(f"(s{drop[2]},mb{drop[3]})")


@FUZZ
@given(schedules())
def test_bubble_breakdown_finds_each_input_producer(sched):
    """Communication time is (wait end - producer end), clamped to the gap, summed over the
    cross-device inputs the rule names: recomputed here from the rule alone."""
    events = synthetic_trace(sched, dt=10, latency=25)
    got = analyze_iteration(events, 0)
    off = clock_offsets(events)  # the breakdown first aligns the ranks' clocks
    events = [
        dataclasses.replace(e, start_ns=e.start_ns + off[e.rank], end_ns=e.end_ns + off[e.rank])
        for e in events
    ]
    S = sched.num_stages
    computes = [e for e in events if isinstance(e.op, Op)]
    made = {}
    for e in computes:
        for k in produces(e.op, e.stage, e.mb, S):
            made[k] = e
    waits = {(e.rank, e.msg): e.end_ns for e in events if e.op is EventOp.WAIT_RECV}
    t0 = min(e.start_ns for e in computes)
    comm = dict.fromkeys(range(sched.num_devices), 0)
    for d in range(sched.num_devices):
        lo = t0
        for c in (e for e in computes if e.rank == d):
            hi = c.start_ns
            for k in needs(c.op, c.stage, c.mb, S):
                if k.kind.travels and made[k].rank != d:
                    msg = (k.kind.value, k.stage, k.consumer_stage, k.mb)
                    p = min(max(made[k].end_ns, lo), hi)
                    comm[d] += min(max(waits[d, msg], p), hi) - p
            lo = c.end_ns
    assert {b.rank: b.comm_ns for b in got.devices} == comm
    assert sum(comm.values()) > 0 or not any(e.msg for e in events)
    for b in got.devices:
        assert sum(dataclasses.astuple(b)[3:8]) == b.idle_ns
