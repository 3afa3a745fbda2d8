"""Sequence segments in the schedule layer: the rule, the graph, the generators, the simulator.

Closed forms at uniform unit costs (F = B = W = 1 per segment): Seq1F1B costs
3Mk + 3(P - 1) and holds min(P - d + k - 1, Mk) segments on device d; the zero-bubble
variant costs 3Mk + P - 1 once Mk >= P + k - 1; the V (seq-zbv) costs 3Mk once
Mk >= 2P + k - 2 and holds min(Mk, P + k - 1) segments' worth (of a microbatch's k).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from fractions import Fraction

import pytest

from zerobubble.program.builder import build_programs
from zerobubble.program.plan import ProgramPlan
from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.deps import LOCAL_PRODUCER, Key, Kind, dependencies, needs, produces
from zerobubble.schedule.deps import backward_ops as backward_op_map
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import json_format, text, torch_csv
from zerobubble.schedule.generators import generate, seq1f1b, seq_zb, seq_zbv
from zerobubble.schedule.graph import _deps_by_dict, build_graph
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.segments import SegmentCost, balanced_cuts, equal_token_cuts, time_factors
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate

F, B, W, BW = Op.F, Op.B, Op.W, Op.BW


def unit_costs(p: int) -> CostModel:
    return CostModel(f=(1,) * p, b=(1,) * p, w=(1,) * p)


# ---- the rule ------------------------------------------------------------------------------


def test_segments_add_the_kv_needs_inside_one_microbatch_only() -> None:
    # k = 3: units 3, 4, 5 are microbatch 1's segments 0, 1, 2.
    assert needs(F, 1, 4, 3, segments=3) == (Key(Kind.ACT, 0, 4), Key(Kind.KV, 1, 3))
    assert needs(F, 0, 3, 3, segments=3) == ()  # the first segment reads no keys
    assert needs(B, 1, 4, 3, segments=3) == (
        Key(Kind.SAVED, 1, 4),
        Key(Kind.GRAD, 2, 4),
        Key(Kind.KVGRAD, 1, 5),
    )
    assert needs(BW, 2, 5, 3, segments=3) == (Key(Kind.SAVED, 2, 5),)  # last segment, stage
    assert produces(F, 1, 5, 3, segments=3) == (Key(Kind.ACT, 1, 5), Key(Kind.SAVED, 1, 5))
    assert produces(B, 0, 3, 3, segments=3) == (Key(Kind.WSTATE, 0, 3),)
    assert produces(BW, 0, 4, 3, segments=3) == (Key(Kind.KVGRAD, 0, 4),)
    assert Key(Kind.KVGRAD, 0, 4).consumer_mb == 3 and Key(Kind.KV, 0, 4).consumer_mb == 5


def test_one_segment_is_the_plain_rule() -> None:
    for op in Op:
        for stage in range(3):
            for mb in range(4):
                kinds = {k.kind for k in needs(op, stage, mb, 3) + produces(op, stage, mb, 3)}
                assert not kinds & {Kind.KV, Kind.KVGRAD}
    assert LOCAL_PRODUCER == {F: None, B: F, W: B, BW: F}


@pytest.mark.parametrize("kind", ["seq1f1b", "seq-zb", "seq-zbv"])
@pytest.mark.parametrize(("p", "m", "k"), [(2, 3, 2), (3, 2, 4), (3, 4, 2), (4, 3, 3)])
def test_graph_paths_agree_with_the_rule(kind: str, p: int, m: int, k: int) -> None:
    sched = generate(kind, p, m, segments=k)
    g = build_graph(sched)
    assert g.columns is not None
    assert g.deps == _deps_by_dict(g.flat, sched.num_stages, k)
    bops = backward_op_map(sched)
    for i, a in enumerate(g.flat):
        assert tuple(g.flat[x] for x in g.preds[i]) == dependencies(a, sched.num_stages, bops, k)


# ---- generators and their closed forms --------------------------------------------------------


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("m", [1, 3, 5])
def test_seq1f1b_closed_forms(p: int, m: int, k: int) -> None:
    sched = seq1f1b(p, m, segments=k)
    res = validate(sched, costs=unit_costs(p))
    assert res.cost == 3 * m * k + 3 * (p - 1)
    # F allocates 1 per segment, BW frees it: the peak is the segments in flight.
    assert res.peak_memory == tuple(min(p - d + k - 1, m * k) for d in range(p))
    # Default costs: one microbatch's totals split into k equal segments (exact).
    exact = simulate(sched, CostModel.from_device_totals(sched.placement, Fraction(1), segments=k))
    assert exact.cost == 3 * m + Fraction(3 * (p - 1), k)
    assert exact.peak_memory[0] == Fraction(min(p + k - 1, m * k), k)


def test_one_segment_is_1f1b_and_zb_h1() -> None:
    for p, m in [(2, 3), (3, 5), (4, 4)]:
        assert seq1f1b(p, m, segments=1).actions == generate("1f1b", p, m).actions
        assert seq_zb(p, m, segments=1).actions == generate("zb-h1", p, m).actions


@pytest.mark.parametrize(("p", "m", "k"), [(2, 2, 2), (3, 2, 2), (3, 3, 4), (4, 2, 4), (4, 5, 2)])
def test_seq_zb_closed_form_and_memory(p: int, m: int, k: int) -> None:
    assert m * k >= p + k - 1
    sched = seq_zb(p, m, segments=k)
    res = validate(sched, costs=unit_costs(p))
    assert res.cost == 3 * m * k + p - 1
    one_f_one_b = validate(seq1f1b(p, m, segments=k), costs=unit_costs(p))
    assert max(res.peak_memory) == max(one_f_one_b.peak_memory) == min(p + k - 1, m * k)


def _exact(sched: Schedule) -> CostModel:
    """Per-microbatch totals F = B = W = 1, each segment 1/k of them (exact)."""
    one = Fraction(1)
    return CostModel.from_device_totals(
        sched.placement, one, one, one, 0, one / 2, segments=sched.segments
    )


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_seq_zbv_closed_forms(p: int, k: int) -> None:
    """No bubble once Mk >= 2P + k - 2 (at k = 1 ZB-V's M >= 2P - 1 with its cool-down
    list-scheduled), at seq-zb's peak (P + k - 1) / k, reached on every device of the V."""
    for m in (1, 2, 3, 5):
        sched = seq_zbv(p, m, segments=k)
        assert sched.placement == tuple(range(p)) + tuple(reversed(range(p)))
        res = validate(sched, costs=_exact(sched))
        peak = min(Fraction(m), Fraction(p + k - 1, k))
        assert max(res.peak_memory) == peak, (p, m, k)
        if m * k >= 2 * p + k - 2:
            assert res.cost == 3 * m == res.ideal, (p, m, k)
        else:  # too few units to fill the V: a bubble, but never more than seq-zb's
            zb = seq_zb(p, m, segments=k)
            assert 3 * m < res.cost <= simulate(zb, _exact(zb)).cost


#: The outside check's 12 uniform-cost cases: P in {4, 8}, k in {2, 4, 8}, M in {P, 2P}.
TWELVE = [(p, k, m) for p in (4, 8) for k in (2, 4, 8) for m in (p, 2 * p)]


def test_seq_zbv_reaches_the_work_floor_at_seq_zbs_peak_where_seq_zb_does_not() -> None:
    # Powers of two: every figure is exact in floats (Fractions take 5x longer here).
    for p, k, m in TWELVE:
        v, zb = seq_zbv(p, m, segments=k), seq_zb(p, m, segments=k)
        rv = simulate(v, CostModel.from_device_totals(v.placement, segments=k))
        rz = simulate(zb, CostModel.from_device_totals(zb.placement, segments=k))
        assert rv.cost == 3 * m < rz.cost == 3 * m + (p - 1) / k, (p, k, m)
        assert max(rv.peak_memory) == max(rz.peak_memory) == (p + k - 1) / k
        assert (p, k, m) != (8, 2, 8) or (rv.cost, rz.cost) == (24.0, 27.5)  # 12.7% faster


def test_segments_shrink_the_bubble_k_fold_at_equal_work() -> None:
    p, m = 4, 4
    base = simulate(generate("1f1b", p, m), CostModel.from_device_totals(range(p), Fraction(1)))
    for k in (2, 4):
        seg = simulate(
            seq1f1b(p, m, segments=k),
            CostModel.from_device_totals(range(p), Fraction(1), segments=k),
        )
        assert seg.ideal == base.ideal == 3 * m
        assert seg.bubble_time * k == base.bubble_time == 3 * (p - 1)


def test_generators_refuse_bad_segments() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="segments must be an integer >= 1"):
            seq1f1b(2, 2, segments=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not take option 'segments'"):
        generate("zb-h1", 2, 2, segments=2)
    with pytest.raises(ValueError, match="segments must be an int >= 1"):
        Schedule("x", 1, 1, 1, (0,), ((),), segments=0)


# ---- the validator names what a segment order breaks ------------------------------------------


def _swap(sched: Schedule, device: int, a: Action, b: Action) -> Schedule:
    acts = [list(r) for r in sched.actions]
    i, j = acts[device].index(a), acts[device].index(b)
    acts[device][i], acts[device][j] = b, a
    return sched.with_actions(acts)


@pytest.mark.parametrize(
    ("device", "first", "second", "awaited"),
    [
        # A segment's forward before its predecessor's, whose keys and values it reads.
        (1, Action(F, 1, 0), Action(F, 1, 1), "F(s1,mb0)"),
        # Device 2 runs B of segment 0 before segment 1's B, whose key gradients it needs.
        (2, Action(B, 2, 1), Action(B, 2, 0), "B(s2,mb1)"),
    ],
)
def test_segments_out_of_order_are_a_local_order_error(
    device: int, first: Action, second: Action, awaited: str
) -> None:
    bad = _swap(seq_zb(3, 2, segments=2), device, first, second)
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    assert info.value.reason is Reason.LOCAL_ORDER
    assert info.value.action == second
    assert awaited in str(info.value)


def test_a_unit_beyond_m_times_k_is_out_of_range() -> None:
    sched = seq1f1b(2, 1, segments=2)
    acts = [list(r) for r in sched.actions]
    acts[0][0] = Action(F, 0, 2)
    with pytest.raises(ScheduleError) as info:
        validate(sched.with_actions(acts))
    assert info.value.reason is Reason.OUT_OF_RANGE


# ---- unequal segments ---------------------------------------------------------------------


def test_balanced_cuts_beat_equal_tokens_in_the_simulator() -> None:
    cost = SegmentCost.transformer(64, 256, kernel="causal")
    p, m, k, length = 4, 4, 4, 4096
    sched = seq_zb(p, m, segments=k)
    runs = {}
    for name, cuts in (
        ("equal", equal_token_cuts(length, k, 64)),
        ("balanced", balanced_cuts(length, k, cost, 64)),
    ):
        factors = time_factors(cuts, cost)
        assert sum(factors) == pytest.approx(k)
        model = CostModel.from_device_totals(range(p), segments=k)
        model = CostModel(**{**model.__dict__, "segment_time": factors})
        runs[name] = simulate(sched, model)
    # The same work: the mean segment is the same, only its spread differs.
    assert runs["equal"].ideal == pytest.approx(runs["balanced"].ideal)
    assert runs["balanced"].cost < runs["equal"].cost
    assert runs["balanced"].bubble_rate < runs["equal"].bubble_rate


def test_segment_memory_factors_scale_each_segment() -> None:
    sched = seq1f1b(1, 1, segments=2, split_backward=True)  # F0 F1 B1 W1 B0 W0
    base = CostModel((Fraction(1),), (Fraction(1),), (Fraction(1),), mem_f=(2,), mem_w=(1,))
    model = CostModel(**{**base.__dict__, "segment_memory": (1, 3)})
    assert simulate(sched, model).memory == ((2, 8, 5, 2, 1, 0),)
    with pytest.raises(ValueError, match="has 2 segment_memory factors, the schedule 3"):
        simulate(seq1f1b(1, 1, segments=3), model)
    assert CostSpec().resolve((0, 1), 2) == CostModel.from_device_totals((0, 1), segments=2)
    profiled = CostModel((4,), (6,), (2,), mem_f=(8,), mem_w=(2,), host_f=(2,))
    halves = CostSpec(stage_costs=profiled).resolve((0,), 2)
    # compute halves; F's host tail (2 of its 4) is per action, so each segment keeps it
    assert (halves.f, halves.b, halves.w, halves.mem_f, halves.mem_w) == (
        (3,),
        (3,),
        (1,),
        (4,),
        (1,),
    )
    assert halves.host_f == (2,) and halves.comm == profiled.comm
    # a segment factor scales the compute, not the host tail: F0 = 2 + 1 * 1, F1 = 2 + 1 * 3
    timed = replace(halves, segment_time=(Fraction(1), Fraction(3)))
    res = simulate(seq1f1b(1, 1, segments=2, split_backward=True), timed)
    assert res.makespan == 3 + 5 + 3 * 3 + 1 * 3 + 3 + 1


# ---- formats, programs, the command line ---------------------------------------------------


def test_json_keeps_the_segments_and_csv_refuses_them() -> None:
    sched = seq_zb(3, 2, segments=4)
    data = json.loads(json_format.dumps(sched))
    assert data["segments"] == 4
    assert json_format.loads(json_format.dumps(sched)) == sched
    assert "segments" not in json.loads(json_format.dumps(generate("zb-h1", 2, 2)))
    with pytest.raises(ValueError, match="cannot say; export it as JSON"):
        torch_csv.dumps(sched)
    lines = text.render(sched).splitlines()
    assert lines[0].startswith("seq-zb: P=3 S=3 M=2 segments=4 ")
    assert lines[1].split("|")[1].split()[:5] == ["F0.0", "F0.1", "F0.2", "F0.3", "F1.0"]


def test_programs_of_a_segment_schedule_build_and_check() -> None:
    sched = seq_zb(3, 2, segments=2)
    lowered = build_programs(sched, ProgramPlan(fuse_local_backward=False))
    for d, program in enumerate(lowered.programs):
        computes = [str(i) for i in program if str(i)[:2] in ("F(", "B(", "W(", "BW")]
        assert computes == [str(a) for a in sched.actions[d]]
    # Stage 0 fuses each B with the W right after it: the key gradients stay on the device.
    fused = build_programs(sched, ProgramPlan()).programs[0]
    assert [str(i) for i in fused if str(i)[:2] == "BW"] == [
        "BW(s0,mb1)",
        "BW(s0,mb0)",
        "BW(s0,mb3)",
        "BW(s0,mb2)",
    ]


def test_cli_schedule_with_segments() -> None:
    cmd = [sys.executable, "-m", "zerobubble.cli", "schedule", "seq1f1b", "-p", "3", "-m", "2"]
    out = subprocess.run([*cmd, "--segments", "4"], capture_output=True, text=True, check=True)
    # Costs are per microbatch (F=B=W=1), each segment 1/4: 1F1B's bubble over 4.
    assert out.stdout.startswith("seq1f1b: P=3 S=3 M=2 segments=4 cost=7.5 ")
    bad = subprocess.run(
        [*cmd[:4], "zb-h1", *cmd[5:], "--segments", "2"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "does not take option 'segments'" in bad.stderr
