"""Per-layer and per-stage profiles, stage balancing and summary statistics (one process)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zerobubble.models import build_mlp, mlp_loss
from zerobubble.parallel.partition import stage_bounds
from zerobubble.profile.balance import (
    balanced_boundaries,
    boundaries_of,
    imbalance,
    stage_costs,
)
from zerobubble.profile.costs_file import Profile
from zerobubble.profile.layers import profile_layers
from zerobubble.profile.stages import StageProfile, message_latency, stage_profile
from zerobubble.profile.stats import OpStats
from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op
from zerobubble.schedule.simulate import simulate
from zerobubble.trace.format import EventOp, TraceEvent


def test_opstats_median_and_nearest_rank_p95():
    s = OpStats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.p95, s.n) == (3.0, 5.0, 5)
    assert OpStats.of(list(map(float, range(1, 21)))).p95 == 19.0  # ceil(0.95 * 20) = 19th
    assert OpStats.of([7.0]) == OpStats(7.0, 7.0, 1)
    with pytest.raises(ValueError, match="no samples"):
        OpStats.of([])


def test_layer_profile_measures_every_layer_and_leaves_the_model_alone():
    layers = list(build_mlp([8, 16, 16, 4], seed=0))
    before = [p.clone() for layer in layers for p in layer.parameters()]
    x, y = torch.randn(5, 8), torch.randn(5, 4)
    prof = profile_layers(layers, mlp_loss, x, y, warmup=1, iters=3)
    assert prof.num_layers == 3
    assert all(s.n == 3 for col in (prof.f, prof.b, prof.w) for s in col)
    assert all(s.p95 >= s.median for col in (prof.f, prof.b, prof.w) for s in col)
    assert prof.costs() == [
        f.median + b.median + w.median for f, b, w in zip(prof.f, prof.b, prof.w, strict=True)
    ]
    # Every layer holds at least its input between F and B, and W needs part of it.
    assert prof.mem_b[0] >= 5 * 8 * 4 and prof.mem_b[1] >= 5 * 16 * 4
    assert all(0 < w <= b for w, b in zip(prof.mem_w, prof.mem_b, strict=True))
    assert type(layers[0][0]) is nn.Linear and type(layers[2]) is nn.Linear  # not split
    after = [p for layer in layers for p in layer.parameters()]
    assert all(torch.equal(a, b) and a.grad is None for a, b in zip(after, before, strict=True))
    with pytest.raises(ValueError, match="warmup >= 0 and iters >= 1"):
        profile_layers(layers, mlp_loss, x, y, iters=0)


def test_one_equal_cut_rule_and_the_balanced_cut():
    assert boundaries_of(stage_bounds(9, 2)) == [0, 5, 9]
    assert boundaries_of(stage_bounds(10, 4)) == [0, 2, 5, 8, 10]  # interior stages first
    costs = [1.0, 4.0, 4.0, 4.0, 4.0, 4.0, 4.0, 1.0, 1.0]  # embedding, 6 blocks, norm, head
    equal = boundaries_of(stage_bounds(len(costs), 2))
    assert stage_costs(costs, equal) == [17.0, 10.0]
    assert imbalance(stage_costs(costs, equal)) == pytest.approx(17 / 13.5)
    cut = balanced_boundaries(costs, 2)
    assert cut == [0, 4, 9] and stage_costs(costs, cut) == [13.0, 14.0]
    assert imbalance([2.0, 2.0]) == 1.0


def test_stage_profile_times_ops_and_their_host_tails():
    def ev(op, mb, start, end, mem0=0, mem1=0, msg=None):
        return TraceEvent(0, 0, op, 0 if mb is not None else None, mb, 0, start, end, mem0, mem1,
                          1 if msg else None, msg)  # fmt: skip

    m = ("act", 0, 1, 0)
    events = [
        ev("F", 0, 0, 10, 0, 100),
        ev("send", 0, 12, 13, 100, 100, m),  # host: gap 2 + send 1
        ev("post_recv", 1, 14, 15, 100, 100, m),  # gap 1 + post 1
        ev("wait_recv", 1, 15, 30, 100, 100, m),  # gap 0, the wait itself excluded
        ev("F", 1, 31, 40, 100, 250),  # gap 1: F(0,0)'s tail is 6 ns
        ev("wait_sends", None, 41, 42, 250, 250),  # F(0,1)'s tail: gap 1
    ]
    prof = stage_profile(events, 1, skip_iterations=0)
    assert prof.f[0] == OpStats(9.5e-6, 10e-6, 2)
    assert prof.host["F"] == (pytest.approx(3.5e-6),)
    assert prof.host["B"] == (None,) and prof.b == (None,)
    assert prof.mem_b == (150,)  # the largest rise
    with pytest.raises(ValueError, match="no measured F of stages"):
        stage_profile(events, 1, skip_iterations=1)


def test_message_latency_is_what_a_waiting_receiver_paid_on_aligned_clocks():
    """Two ranks whose clocks differ by 5 ns (rank 1 reads 5 more). Message act mb0 leaves
    F(0,0) at 100 and returns rank 1's wait (waiting since 50) at 170 on its clock; grad
    mb0 leaves B(1,0) at 271 (rank 1's clock) and returns rank 0's wait at 331. The
    clock bounds are [100 - 170, 331 - 271] = [-70, 60], so rank 1 is shifted by the
    middle, -5: both messages took 65 ns. Act mb1's wait began after its producer ended
    (the message may have waited for the receiver): not a sample."""

    def ev(rank, op, start, end, stage, mb, **kw):
        return TraceEvent(
            op=op, stage=stage, mb=mb, iteration=1, rank=rank, param_version=1,
            start_ns=start, end_ns=end, mem_before=0, mem_after=0, **kw,
        )  # fmt: skip

    act0, act1 = (MsgKind.ACT, 0, 1, 0), (MsgKind.ACT, 0, 1, 1)
    grad0 = (MsgKind.GRAD, 1, 0, 0)
    events = [
        ev(0, Op.F, 0, 100, 0, 0),
        ev(0, EventOp.SEND, 100, 110, 0, 0, peer=1, msg=act0),
        ev(0, Op.F, 111, 118, 0, 1),
        ev(0, EventOp.SEND, 119, 120, 0, 1, peer=1, msg=act1),
        ev(0, EventOp.WAIT_RECV, 121, 331, 0, 0, peer=1, msg=grad0),
        ev(0, Op.B, 332, 400, 0, 0),
        ev(1, EventOp.WAIT_RECV, 50, 170, 1, 0, peer=0, msg=act0),
        ev(1, Op.F, 171, 221, 1, 0),
        ev(1, Op.B, 222, 271, 1, 0),
        ev(1, EventOp.SEND, 271, 281, 1, 0, peer=0, msg=grad0),
        ev(1, EventOp.WAIT_RECV, 290, 295, 1, 1, peer=0, msg=act1),
    ]
    assert message_latency(events) == {0: OpStats.of([65 / 1e6, 65 / 1e6])}
    assert message_latency(events, events, skip_iterations=1)[0].n == 4  # runs add up
    assert message_latency(events, skip_iterations=2) == {}  # all warm-up


def _stats(x: float) -> OpStats:
    return OpStats(x, x, 1)


def test_a_replay_of_the_profiled_runs_is_their_prediction_and_prices_each_run_by_its_ops():
    """replay_model takes every op's time from the run it is given: replaying the profile's
    own split run gives the cost model the planner predicts with, replaying its unsplit run
    the fused one's durations (a BW costs the measured BW plus its host tail either way),
    so each profiled schedule's replay is its prediction; a run at another pace (a V-shaped
    one here, with B/W split on some stages and BW alone on others) is priced by its ops."""
    none = (None, None, None)
    split = StageProfile(
        f=(_stats(3.0), _stats(4.0), _stats(5.0)),
        b=(_stats(2.0), _stats(3.0), _stats(4.0)),
        w=(_stats(1.0), _stats(2.0), _stats(1.5)),
        bw=none,
        mem_b=(10, 10, 10),
        mem_w=(4, 4, 4),
        host={"F": (0.5, 0.25, 0.0), "B": (0.5, 0.5, 0.5), "W": (0.25, 0.0, 0.0), "BW": none},
    )
    fused = StageProfile(
        f=(_stats(2.5), _stats(3.5), _stats(4.5)),
        b=none,
        w=none,
        bw=(_stats(2.75), _stats(4.5), _stats(5.0)),
        mem_b=(10, 10, 10),
        mem_w=none,
        host={"F": (0.5, 0.5, 0.5), "B": none, "W": none, "BW": (0.75, 0.5, 0.25)},
    )
    prof = Profile(split, (0, 1, 2), ((0, _stats(0.5)), (1, _stats(0.5))), fused=fused)
    for kind, run, model in (
        ("zb-h1", split, prof.cost_model()),
        ("1f1b", fused, prof.cost_model(fused=True)),
    ):
        sched = generate(kind, 3, 6)
        replay = prof.replay_model(run)
        assert simulate(sched, replay).makespan == simulate(sched, model).makespan
        assert replay.comm == prof.comm == 0.5
    assert prof.replay_model(split).f == (3.5, 4.25, 5.0)
    assert prof.replay_model(split).b == (2.5, 3.5, 4.5)
    assert prof.replay_model(split).w == (1.25, 2.0, 1.5)
    assert prof.replay_model(fused).b == (3.5, 5.0, 5.25)  # BW and its tail, all on b
    assert prof.replay_model(fused).w == (0.0, 0.0, 0.0)
    # A run that split stage 1 only, twice as slow there: priced by its own ops.
    mixed = StageProfile(
        f=(_stats(2.5), _stats(8.0), _stats(4.5)),
        b=(None, _stats(6.0), None),
        w=(None, _stats(4.0), None),
        bw=(_stats(2.75), None, _stats(5.0)),
        mem_b=(10, 10, 10),
        mem_w=(None, 4, None),
        host={"F": (0.0,) * 3, "B": (None, 0.0, None), "W": (None, 0.0, None), "BW": (0.0,) * 3},
    )
    replay = prof.replay_model(mixed)
    assert (replay.f, replay.b, replay.w) == ((2.5, 8.0, 4.5), (2.75, 6.0, 5.0), (0.0, 4.0, 0.0))
    lopsided = StageProfile(
        f=(_stats(1.0),), b=(None,), w=(None,), bw=(None,), mem_b=(1,), mem_w=(None,),
        host={"F": (0.0,), "B": (None,), "W": (None,), "BW": (None,)},
    )  # fmt: skip
    with pytest.raises(ValueError, match="the run has 1 stages, the profile 3"):
        prof.replay_model(lopsided)
    no_backward = StageProfile(**{**mixed.__dict__, "bw": (_stats(1.0), None, None)})
    with pytest.raises(ValueError, match="no backward of stage 2"):
        prof.replay_model(no_backward)
