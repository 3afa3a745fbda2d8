"""fuse_local_backward: which B/W pairs merge, and that nothing else changes."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from generated import SLOW_SOLVES, generated
from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate


def ops_of(sched: Schedule, stage: int) -> set[Op]:
    return {a.op for acts in sched.actions for a in acts if a.stage == stage}


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("p", [2, 4])
def test_zb_h_fuses_exactly_stage_zero(kind, p):
    sched = generate(kind, p, 2 * p + 1)
    fused = fuse_local_backward(sched)
    validate(fused)
    assert ops_of(fused, 0) == {Op.F, Op.BW}
    for s in range(1, p):
        assert ops_of(fused, s) == {Op.F, Op.B, Op.W}
    for d in range(1, p):
        assert fused.actions[d] == sched.actions[d]
    # Device 0: each B(0,j) W(0,j) pair became BW(0,j) in place.
    expect = [
        Action(Op.BW, 0, a.mb) if a.op is Op.B else a for a in sched.actions[0] if a.op is not Op.W
    ]
    assert list(fused.actions[0]) == expect
    assert (fused.name, fused.placement) == (sched.name, sched.placement)


def test_v_shape_fuses_the_local_handover():
    # P=2, V placement: device 0 holds stages 0 and 3, device 1 stages 1 and 2.
    # Stage 2's B feeds stage 1 on its own device; stage 3's and stage 1's cross.
    # In the cool-down stage 2's last B waits for its W behind stage 1's backward.
    fused = fuse_local_backward(generate("zbv", 2, 6))
    validate(fused)
    assert ops_of(fused, 0) == {Op.F, Op.BW}
    bw2 = [a.mb for a in fused.actions[1] if a.op is Op.BW]
    assert bw2 == [0, 1, 2, 3, 4] and all(a.stage == 2 for a in fused.actions[1] if a.op is Op.BW)
    assert ops_of(fused, 1) == ops_of(fused, 3) == {Op.F, Op.B, Op.W}


def test_nothing_to_fuse_returns_the_schedule_itself():
    one = generate("1f1b", 3, 5)  # BW already
    assert fuse_local_backward(one) is one

    # B and W of stage 0 that are not adjacent stay split.
    def acts(*names: str) -> list[Action]:
        return [Action(Op(n[:-2]), int(n[-2]), int(n[-1])) for n in names]

    d0 = acts("F00", "F01", "B00", "B01", "W00", "W01")
    d1 = acts("F10", "B10", "W10", "F11", "B11", "W11")
    s = Schedule("t", 2, 2, 2, (0, 1), [d0, d1])
    validate(s)
    assert fuse_local_backward(s) is s  # stage 1's pairs are adjacent but cross devices


def _kinds():
    for kind, gen in GENERATORS.items():
        for p in (2, 3, 4):
            for m in (1, p, 2 * p + 1):
                if (kind, p, m) in SLOW_SOLVES:
                    continue
                opts = {"chunks": 2} if "chunks" in gen.options else {}
                try:
                    yield generated(kind, p, m, **opts)
                except ValueError:
                    continue


def test_every_kind_keeps_its_timing_and_memory():
    """Under random uneven costs and comm, every action that is not fused starts and ends
    at the same time, a fused BW spans exactly its B and W, and cost, makespan and
    peak memory are unchanged (BW costs B + W and releases what both release)."""
    rng = random.Random(7)
    checked = 0
    for sched in _kinds():
        validate(sched)
        fused = fuse_local_backward(sched)
        validate(fused)
        assert fuse_local_backward(fused) is fused  # idempotent
        S = sched.num_stages
        costs = CostModel.per_stage(
            [Fraction(rng.randint(1, 9)) for _ in range(S)],
            [Fraction(rng.randint(1, 9)) for _ in range(S)],
            [Fraction(rng.randint(1, 9)) for _ in range(S)],
            comm=Fraction(rng.randint(0, 3), 2),
        )
        a, b = simulate(sched, costs), simulate(fused, costs)
        assert (b.cost, b.makespan, b.peak_memory) == (a.cost, a.makespan, a.peak_memory)
        for d, acts in enumerate(sched.actions):
            times = {}
            for act, t0, t1 in zip(acts, a.start[d], a.end[d], strict=True):
                times[act] = (t0, t1)
            for act, t0, t1 in zip(fused.actions[d], b.start[d], b.end[d], strict=True):
                if act.op is Op.BW and act not in times:
                    start = times[Action(Op.B, act.stage, act.mb)][0]
                    end = times[Action(Op.W, act.stage, act.mb)][1]
                    assert (t0, t1) == (start, end), (sched.name, act)
                    checked += 1
                else:
                    assert (t0, t1) == times[act], (sched.name, act)
    assert checked > 100  # the grid does fuse
