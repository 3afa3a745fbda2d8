"""The profile's all-to-all: each op charged the expert all-to-all waits inside it, the cost
model taking them out of compute, a pp = 2 x ep = 2 run measured, and the trial's paired
candidates."""

from __future__ import annotations

import time

import pytest
import torch

import zerobubble
from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.models import mlp_loss
from zerobubble.models.moe import MoE, build_moe_mlp
from zerobubble.parallel.ep import ExpertGroup, expert_groups, timing_waits
from zerobubble.parallel.mesh import build_mesh
from zerobubble.profile.costs_file import Profile
from zerobubble.profile.stages import StageProfile, all_to_all_ms
from zerobubble.profile.stats import OpStats
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.generators import generate
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.trace.format import TraceEvent
from zerobubble.train.job import plan_schedule
from zerobubble.train.trials import plan_candidates, predict_ms


def _event(rank: int, op: str, stage: int, mb: int, start: int, end: int, it: int = 1):
    return TraceEvent(it, rank, op, stage, mb, 0, start, end, 0, 0)


def test_each_op_is_charged_the_waits_inside_it():
    """Per stage, the median over F events and over backward events (B or BW) of the wait
    time inside each (partly inside: the part inside; another rank's waits: not); W and
    warm-up iterations are not counted; a stage that never waited gets 0."""
    ms = 1_000_000
    events = [
        _event(0, "F", 0, 0, 0, 10 * ms),
        _event(0, "F", 0, 1, 10 * ms, 20 * ms),
        _event(0, "F", 0, 2, 20 * ms, 30 * ms),
        _event(0, "B", 0, 0, 30 * ms, 40 * ms),
        _event(0, "W", 0, 0, 40 * ms, 50 * ms),
        _event(0, "BW", 0, 1, 50 * ms, 60 * ms),
        _event(1, "F", 1, 0, 0, 10 * ms),
        _event(1, "B", 1, 0, 10 * ms, 20 * ms),
        _event(0, "F", 0, 0, 0, 10 * ms, it=0),  # warm-up
    ]
    waits = {
        0: [
            (2 * ms, 5 * ms),  # F0: 3
            (8 * ms, 12 * ms),  # F0: 2, F1: 2
            (21 * ms, 22 * ms),  # F2: 1 (+1 below)
            (28 * ms, 29 * ms),
            (33 * ms, 37 * ms),  # B0: 4
            (41 * ms, 49 * ms),  # inside W: not counted
            (51 * ms, 57 * ms),  # BW1: 6
        ],
        1: [],
    }
    f, b = all_to_all_ms(events, waits, 2, skip_iterations=1)
    assert f == (2.0, 0.0)  # median of 5, 2, 2 ms; stage 1 waited for none
    assert b == (5.0, 0.0)  # median of 4 and 6 ms


def _stats(x: float) -> OpStats:
    return OpStats(x, x, 1)


def test_the_cost_model_prices_the_all_to_all_apart_from_compute():
    """A stage's a2a is the smaller of its F and backward medians (never above either op's
    compute); the model charges it as all-to-all and the rest as compute, so each op still
    costs what was measured, and a pair can hide it. Without a measurement: 0."""
    none = (None, None)
    split = StageProfile(
        f=(_stats(3.0), _stats(4.0)),
        b=(_stats(2.0), _stats(5.0)),
        w=(_stats(1.0), _stats(2.0)),
        bw=none,
        mem_b=(10, 10),
        mem_w=(4, 4),
        host={"F": (0.5, 0.0), "B": (0.25, 0.0), "W": (0.0, 0.0), "BW": none},
        a2a_f=(1.0, 0.0),
        a2a_b=(1.5, 0.0),
    )
    assert split.a2a == (1.0, 0.0)
    model = Profile(split, (0, 1)).cost_model()
    assert model.a2a == (1.0, 0.0)
    assert (model.f, model.b) == ((2.5, 4.0), (1.25, 5.0))
    assert [model.duration(op, 0) for op in ("F", "B", "W")] == [3.5, 2.25, 1.0]
    assert Profile(split, (0, 1)).to_dict()["a2a"] == [1.0, 0.0]
    capped = StageProfile(**{**split.__dict__, "a2a_f": (9.0, 0.0), "a2a_b": (9.0, 0.0)})
    assert capped.a2a == (2.0, 0.0)  # B's compute median
    plain = StageProfile(**{**split.__dict__, "a2a_f": (), "a2a_b": ()})
    assert plain.a2a == (0.0, 0.0) and "a2a" not in Profile(plain, (0, 1)).to_dict()


class _Work:
    def wait(self) -> None:
        time.sleep(0.002)


def test_expert_groups_and_their_waits_are_found_without_the_model():
    """The profiler finds a stage's expert layers by their ``ep`` groups (here our MoE, on
    one process: ep=1, so no all-to-all to time) and records a group's waits only while
    asked, into one list; asking twice at once is refused."""
    layer = build_moe_mlp((4, 8, 4), hidden=8, num_experts=4, top_k=2, blocks=2)
    groups = expert_groups(layer)
    moes = [m for m in layer.modules() if isinstance(m, MoE)]
    assert len(moes) == 2 and groups == tuple(m.ep for m in moes)  # one group each here
    assert all(g.size == 1 for g in groups)
    assert expert_groups(torch.nn.Linear(2, 2)) == ()
    group = ExpertGroup()
    group.wait(_Work(), "before")  # not recorded
    with timing_waits([group, group]) as waited:
        group.wait(_Work(), "inside")
        group.wait(_Work(), "inside")
        with pytest.raises(RuntimeError, match="already being recorded"), timing_waits([group]):
            pass
    group.wait(_Work(), "after")
    assert len(waited) == 2 and all(end > start for start, end in waited)


SIZES, E, K, M, LOCAL, T = (6, 8, 3), 4, 2, 4, 8, 3


def _measured_run() -> dict:
    """pp = 2 x ep = 2: stage 0 holds a Linear and a MoE block, stage 1 a Linear; ZB-H1 with
    every B and W split (as the profile runs), two steps under the waits' recording."""
    init_distributed()
    mesh = build_mesh(2, 2, ep=2)
    model = build_moe_mlp(SIZES, hidden=16, num_experts=E, top_k=K, blocks=1, seed=0)
    opts = ExecutorOptions(fuse_local_backward=False)
    pipe = zerobubble.Pipeline(
        model, mlp_loss, generate("zb-h1", 2, M), mesh=mesh, boundaries=[0, 2, 3], options=opts
    )
    groups = [g for c in pipe.executor.chunks.values() for g in expert_groups(c.module)]
    g = torch.Generator().manual_seed(mesh.dp_rank)
    with timing_waits(groups) as waited:
        for _ in range(2):
            x, y = torch.randn(LOCAL, T, SIZES[0], generator=g), torch.randn(LOCAL, T, SIZES[2])
            pipe.step(x, target=y)
    trace = pipe.executor.trace
    waits = [(a - trace.epoch_ns, b - trace.epoch_ns) for a, b in waited]
    counts = {}
    for e in trace.events:
        if e.action is not None:
            inside = sum(e.start_ns <= a and b <= e.end_ns for a, b in waits)
            counts.setdefault((str(e.action.op), e.action.stage), set()).add(inside)
    f, b = all_to_all_ms(trace.events, {trace.rank: waits}, 2, skip_iterations=0)
    return {"counts": counts, "f": f, "b": b, "groups": [x.size for x in groups]}


def test_a_pp2_ep2_run_charges_each_moe_op_its_five_all_to_alls():
    """Every F of the MoE stage waited for exactly 3 all-to-alls (counts, rows, outputs
    back), every B for 2 (the rows' reverses), every W for none; the stage without experts
    for none, so its all-to-all is exactly 0 and the MoE stage's is the waits' median."""
    for r in launch(_measured_run, 4, timeout=240):
        if r["groups"]:  # pp rank 0: the MoE stage
            assert r["groups"] == [2]
            assert r["counts"] == {("F", 0): {3}, ("B", 0): {2}, ("W", 0): {0}}
            assert r["f"][0] > 0 and r["b"][0] > 0
        else:
            assert r["counts"] == {("F", 1): {0}, ("B", 1): {0}, ("W", 1): {0}}
            assert r["f"] == r["b"] == (0.0, 0.0)


def test_the_trial_tries_the_plan_with_and_without_its_pairs_and_dualpipev_with_its():
    """A profile of a V placement (P=2, four stages) that measured an all-to-all: the plan
    pairs, and the trial's candidates are the plan with its pairs, the plan without them and
    DualPipeV with its own, each predicted as it runs; none of them where the executor may
    not overlap (recomputation), and the plan alone without an all-to-all."""
    s4 = tuple(_stats(x) for x in (3.0, 4.0, 4.0, 3.0))
    none4 = (None,) * 4
    split = StageProfile(
        f=s4,
        b=s4,
        w=tuple(_stats(2.0) for _ in range(4)),
        bw=none4,
        mem_b=(10,) * 4,
        mem_w=(4,) * 4,
        host={"F": (0.0,) * 4, "B": (0.0,) * 4, "W": (0.0,) * 4, "BW": none4},
        a2a_f=(2.0,) * 4,
        a2a_b=(2.0,) * 4,
    )
    fused = StageProfile(
        f=s4,
        b=none4,
        w=none4,
        bw=tuple(_stats(6.0) for _ in range(4)),
        mem_b=(10,) * 4,
        mem_w=none4,
        host={"F": (0.0,) * 4, "B": none4, "W": none4, "BW": (0.0,) * 4},
    )
    prof = Profile(split, (0, 1, 1, 0), fused=fused)
    model = prof.cost_model()
    planned, kind = plan_schedule(2, 8, model, 100, num_layers=4, overlap=True)
    assert planned.overlaps and planned.num_stages == 4
    found = plan_candidates(prof, (kind, planned), 8, 100, top=10)
    pairs = {c.kind: c.pairs for c in found}
    assert pairs["auto"] == len(planned.overlaps) and pairs["auto without pairs"] == 0
    assert pairs["dualpipev with pairs"] > 0 and len(pairs) == 3  # the rest: two stages
    for c in found:
        assert c.predicted_ms == predict_ms(prof, fuse_local_backward(c.schedule))
    by_kind = {c.kind: c.predicted_ms for c in found}
    assert by_kind["auto"] < by_kind["auto without pairs"]
    assert [
        c.kind for c in plan_candidates(prof, (kind, planned), 8, 100, top=10, pairs=False)
    ] == ["auto"]
    unmeasured = StageProfile(**{**split.__dict__, "a2a_f": (), "a2a_b": ()})
    plain = Profile(unmeasured, (0, 1, 1, 0), fused=fused)
    unpaired, _ = plan_schedule(2, 8, plain.cost_model(), 100, num_layers=4, overlap=True)
    assert not unpaired.overlaps  # no all-to-all: no pair pays (and the job is not warned)
