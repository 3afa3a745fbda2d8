"""Overlapped F&B pairs (DualPipe's, PyTorch's ``OVERLAP_F_B``) in the schedule layer: the IR's
rules, DualPipeV's pairs against PyTorch's, the block the simulator times, the all-to-all
cost, the validator, the fusion pass and the formats."""

from __future__ import annotations

import dataclasses
import json
import warnings
from fractions import Fraction

import pytest

from zerobubble.cli import main
from zerobubble.interop.torch_pipelining import torch_schedule
from zerobubble.schedule.costs import CostModel, CostSpec, costs_from_mapping, parse_costs
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import json_format, text, torch_csv
from zerobubble.schedule.generators import NoPairWarning, generate
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.passes import fuse_local_backward, overlap_where_it_pays
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate

F, B, W, BW = Op.F, Op.B, Op.W, Op.BW


PAIR = ((Action(F, 0, 1), Action(BW, 0, 0)),)


def one_device(pairs: tuple[tuple[Action, Action], ...] = PAIR) -> Schedule:
    """One stage, two microbatches: F0 F1 BW0 BW1, F1 overlapped with BW0."""
    acts = (Action(F, 0, 0), Action(F, 0, 1), Action(BW, 0, 0), Action(BW, 0, 1))
    return Schedule("pair", 1, 1, 2, (0,), (acts,), overlaps=pairs)


def costs(a2a) -> CostModel:
    one = (Fraction(1),)
    return CostModel(one, one, one, a2a=(Fraction(a2a),))


@pytest.mark.parametrize(
    ("a2a", "lone", "paired", "exposed"),
    [
        # F = 1, BW = 2, each also waits a2a for its all-to-all when alone. The pair's
        # block takes max(compute 1 + 2, all-to-all 2 * a2a); the rest runs alone.
        (0, 6, 6, 0),
        ("1/2", 8, 1.5 + 3 + 2.5, 1),
        (2, 14, 3 + 4 + 4, 2 + 1 + 2),
    ],
)
def test_a_pair_is_one_block_of_max_compute_and_all_to_all(a2a, lone, paired, exposed):
    sequential = simulate(one_device(()), costs(a2a))
    overlapped = simulate(one_device(), costs(a2a))
    assert sequential.makespan == lone
    assert overlapped.makespan == paired
    assert sum(overlapped.exposed_a2a) == exposed
    assert sum(sequential.exposed_a2a) == 4 * Fraction(a2a)
    # the block is timed on its F; its backward ends with it
    assert overlapped.start[0][2] == overlapped.end[0][2] == overlapped.end[0][1]


def two_devices(order1: tuple[Action, ...]) -> Schedule:
    """Device 0 runs F0, then F1 overlapped with BW0, then BW1; device 1 runs ``order1``."""
    acts0 = (Action(F, 0, 0), Action(F, 0, 1), Action(BW, 0, 0), Action(BW, 0, 1))
    pair = ((Action(F, 0, 1), Action(BW, 0, 0)),)
    return Schedule("two", 2, 2, 2, (0, 1), (acts0, order1), overlaps=pair)


def test_a_pair_starts_once_both_inputs_are_in():
    f0, f1, bw0, bw1 = Action(F, 1, 0), Action(F, 1, 1), Action(BW, 1, 0), Action(BW, 1, 1)
    sched = two_devices((f0, bw0, f1, bw1))
    c = CostModel.per_stage(f=[1, 1], b=[1, 1], w=[0, 0])
    # BW(s0, mb0) needs BW(s1, mb0), done at 3 (after F(s1, mb0) at 1-2): the pair waits
    # for it, where alone F(s0, mb1) runs at 1.
    assert simulate(sched, c).start[0] == (0, 3, 5, 7)
    assert simulate(sched.with_actions(sched.actions, overlaps=()), c).start[0] == (0, 1, 3, 5)


def test_the_ir_refuses_pairs_it_cannot_run():
    f0, f1, bw0, bw1 = Action(F, 0, 0), Action(F, 0, 1), Action(BW, 0, 0), Action(BW, 0, 1)
    with pytest.raises(ValueError, match="must pair an F with the B or BW"):
        one_device(((bw0, f1),))
    with pytest.raises(ValueError, match=r"must come right after F\(s0,mb0\)"):
        one_device(((f0, bw0),))
    with pytest.raises(ValueError, match="an action is in two overlapped pairs"):
        acts = (f0, bw0, f1, bw1)
        Schedule("x", 1, 1, 2, (0,), (acts,), overlaps=((f0, bw0), (f1, bw1), (f1, bw1)))
    # with segments the IR takes a pair of units as it is; the validator judges it
    seg = Schedule("x", 1, 1, 1, (0,), ((f0, f1, bw1, bw0),), segments=2, overlaps=((f1, bw1),))
    with pytest.raises(ScheduleError, match="whose result it needs"):
        validate(seg)


def test_the_validator_refuses_a_pair_of_one_stage():
    """A pair's halves run on two threads: one stage's F and backward would share its module
    (a graph-level split swaps its parameters during a forward) and its store."""
    with pytest.raises(ScheduleError) as err:
        validate(one_device())
    assert err.value.reason is Reason.OVERLAP and err.value.action == Action(BW, 0, 0)
    assert "F(s0,mb1) and BW(s0,mb0) are actions of one stage" in str(err.value)
    assert "pair an F with a backward of another stage on its device" in str(err.value)
    validate(one_device(()))  # run in sequence: fine


def test_the_validator_refuses_a_backward_paired_with_its_own_forward():
    f0, f1, bw0, bw1 = Action(F, 0, 0), Action(F, 0, 1), Action(BW, 0, 0), Action(BW, 0, 1)
    sched = Schedule("x", 1, 1, 2, (0,), ((f0, f1, bw1, bw0),), overlaps=((f1, bw1),))
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    assert err.value.reason is Reason.OVERLAP and err.value.action == bw1
    assert "overlapped with F(s0,mb1), whose result it needs" in str(err.value)


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8), (4, 10)])
def test_dualpipev_pairs_are_pytorchs(p, m):
    ours = generate("dualpipev", p, m, overlap=True)
    theirs = torch_schedule("DualPipeV", p, m)
    assert ours.overlaps == theirs.overlaps and ours.actions == theirs.actions
    assert ours.actions == generate("dualpipev", p, m).actions  # the same order
    assert not generate("dualpipev", p, m).overlaps
    # the main step's two pairs per round and step 5's one (the last device's first apart)
    assert len(ours.overlaps) == sum(2 * (m - 2 * p + r + 1) + p - r - 1 for r in range(p)) - 1


def test_overlap_pays_when_the_all_to_all_compares_with_compute():
    """A DeepSeek-V3-like mix (all-to-all as long as compute): overlapped DualPipeV beats it
    run in sequence and ZB-V; without all-to-all, pairing only costs."""
    spec = CostSpec(a2a=1)
    times = {}
    for kind, overlap in (("dualpipev", True), ("dualpipev", False), ("zbv", False)):
        sched = generate(kind, 4, 16, overlap=overlap)
        times[kind, overlap] = validate(sched, costs=spec.resolve(sched.placement)).makespan
    assert times["dualpipev", True] < min(times["dualpipev", False], times["zbv", False])
    free = CostSpec()
    on, off = (generate("dualpipev", 4, 16, overlap=o) for o in (True, False))
    assert simulate(on, free.resolve(on.placement)).makespan > simulate(off).makespan


@pytest.mark.parametrize(
    ("kind", "before", "after", "peak"), [("zbv", 83, 61, 4.5), ("v-half", 89.5, 87.5, 3.5)]
)
def test_other_kinds_pair_where_it_pays(kind, before, after, peak):
    """Any kind with two stages on a device may take pairs (the pass behind generate's
    ``overlap``): each pair is of two stages, kept where it hides some all-to-all, leaves
    the schedule runnable (v-half has candidates whose wait would close a cycle) and does
    not lengthen the step; an F moved up to its partner holds its activation earlier (zbv's
    peak rises by half a microbatch's, to dualpipev's), which ``mem_limit`` bounds; none
    without an all-to-all."""
    spec = CostSpec(a2a=1)
    plain = generate(kind, 4, 16)
    model = spec.resolve(plain.placement)
    paired = overlap_where_it_pays(plain, model)
    assert [sorted(a) for a in paired.actions] == [sorted(a) for a in plain.actions]
    assert paired.overlaps and all(f.stage != b.stage for f, b in paired.overlaps)
    assert validate(plain, costs=model).cost == before
    result = validate(paired, costs=model)
    assert result.cost == after and max(result.peak_memory) == peak
    assert generate(kind, 4, 16, overlap=True, costs=spec) == paired
    bounded = overlap_where_it_pays(plain, model, mem_limit=max(simulate(plain).peak_memory))
    assert max(simulate(bounded, model).peak_memory) <= max(simulate(plain).peak_memory)
    assert overlap_where_it_pays(plain) == plain  # no all-to-all: nothing to hide


def test_overlap_without_a_pair_says_so():
    """One stage per device: no pair can exist (ValueError); none that pays: a warning."""
    for kind in ("zb-h1", "1f1b", "zb-h2"):
        with pytest.raises(ValueError, match=f"schedule kind '{kind}' places one stage per"):
            generate(kind, 3, 6, overlap=True, costs=CostSpec(a2a=1))
    with pytest.warns(NoPairWarning, match="no all-to-all cost was given"):
        assert generate("zbv", 3, 6, overlap=True).overlaps == ()


def test_fusion_keeps_a_pair_and_moving_it_apart_drops_it():
    f1, b0, w0 = Action(F, 0, 1), Action(B, 0, 0), Action(W, 0, 0)
    acts = (Action(F, 0, 0), f1, b0, w0, Action(B, 0, 1), Action(W, 0, 1))
    sched = Schedule("x", 1, 1, 2, (0,), (acts,), overlaps=((f1, b0),))
    fused = fuse_local_backward(sched)
    assert fused.overlaps == ((f1, Action(BW, 0, 0)),)
    apart = sched.with_actions([(acts[0], f1, w0, b0, *acts[4:])])
    assert apart.overlaps == ()


def test_formats_carry_the_pairs():
    sched = generate("dualpipev", 3, 6, overlap=True)
    assert json_format.loads(json_format.dumps(sched)) == sched
    data = json.loads(json_format.dumps(sched))
    assert data["overlaps"][0] == [
        {"op": "F", "stage": 0, "mb": 5},
        {"op": "BW", "stage": 5, "mb": 2},
    ]
    csv_text = torch_csv.dumps(sched)
    assert "(0F5;5B2)OVERLAP_F_B" in csv_text.splitlines()[0]
    back = torch_csv.loads(csv_text, name=sched.name)
    assert back == sched
    assert " F5a&BW2b F3b&BW0a BW3b " in text.render_order(sched).splitlines()[0]
    assert "F5a&BW2b" in text.render(sched, CostSpec(a2a=1).resolve(sched.placement))


def test_the_all_to_all_cost_is_read_and_checked():
    assert parse_costs("F=1,a2a=0.5").a2a == 0.5
    model = CostSpec(a2a=1).resolve((0, 1, 1, 0))
    assert model.a2a == (0.5, 0.5, 0.5, 0.5) and model.duration(F, 0) == 1
    assert model.duration(W, 0) == 0.5 and model.per_segment(2).a2a == (0.25,) * 4
    spec = costs_from_mapping({"F": [1, 1], "B": [1, 1], "W": [1, 1], "a2a": [0.5, 0.25]})
    assert spec.stage_costs is not None and spec.stage_costs.a2a == (0.5, 0.25)
    assert spec.stage_costs.to_dict()["a2a"] == [0.5, 0.25]
    with pytest.raises(ValueError, match=r"a2a=\[-1\] must hold one finite number >= 0"):
        CostModel((1,), (1,), (1,), a2a=(-1,))


def test_the_command_line_overlaps_dualpipev(capsys):
    assert (
        main(["schedule", "dualpipev", "-p", "2", "-m", "4", "--overlap", "--costs", "a2a=1"]) == 0
    )
    out = capsys.readouterr().out
    assert "cost=18.5" in out and "&BW" in out
    argv = ["schedule", "zbv", "-p", "4", "-m", "16", "--overlap", "--costs", "a2a=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cost=61" in out and "&B" in out  # 83 without pairs
    assert main(["schedule", "seq-zb", "-p", "2", "-m", "4", "--overlap"]) == 2
    assert "'seq-zb' places one stage per device" in capsys.readouterr().err
    argv = ["schedule", "seq-zbv", "-p", "2", "-m", "3", "--segments", "2", "--overlap"]
    assert main([*argv, "--costs", "a2a=1"]) == 0
    out = capsys.readouterr().out
    assert "cost=13.25" in out and "F2.0a&B0.0b" in out  # 15.5 without pairs
    assert main(["schedule", "zb-h1", "-p", "3", "-m", "6", "--overlap"]) == 2
    assert "error: schedule kind 'zb-h1' places one stage per device" in capsys.readouterr().err
    assert main(["schedule", "zbv", "-p", "3", "-m", "6", "--overlap"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "zerobubble schedule: warning: schedule kind 'zbv' with overlap=True formed no "
        "overlapped F&B pair: no all-to-all cost was given (costs=..., a2a=X); every action "
        "runs alone"
    ]


def test_the_documented_costs():
    """docs/schedules.md's table: cost at P=4, M=16, F=B=W=1 per device."""
    want = {
        ("dualpipev", False): (49.5, 84.5),
        ("dualpipev", True): (51, 61.5),
        ("zbv", False): (48, 83),
        ("zbv", True): (48, 61),
    }
    for (kind, overlap), costs in want.items():
        got = []
        for a2a in (0, 1):
            spec = CostSpec(a2a=a2a)
            with warnings.catch_warnings():  # zbv without all-to-all: no pair pays
                warnings.simplefilter("ignore", NoPairWarning)
                sched = generate(kind, 4, 16, overlap=overlap, costs=spec)
            got.append(simulate(sched, spec.resolve(sched.placement)).cost)
        assert tuple(got) == costs, (kind, overlap)


def test_a_pair_of_segment_units_is_timed_on_its_units_scaled_costs():
    """With segments each half is one segment's unit: its compute and its all-to-all scale
    by its segment's ``segment_time`` (unequal here), as a lone unit's do."""
    sched = generate("seq-zbv", 2, 3, segments=2, overlap=True, costs=CostSpec(a2a=1))
    base = CostSpec(a2a=1).resolve(sched.placement, 2)
    costs = dataclasses.replace(base, segment_time=(0.5, 1.5))
    got = simulate(sched, costs)
    scale = {0: 0.5, 1: 1.5}
    for f, b in sched.overlaps:
        d = sched.placement[f.stage]
        i = sched.actions[d].index(f)
        sf, sb = scale[f.mb % 2], scale[b.mb % 2]
        comm = costs.a2a[f.stage] * sf + costs.a2a[b.stage] * sb
        compute = costs.duration(F, f.stage) * sf + costs.duration(b.op, b.stage) * sb - comm
        assert got.end[d][i] - got.start[d][i] == max(compute, comm), (f, b)
        assert got.end[d][i + 1] == got.end[d][i]  # the backward ends with the block
