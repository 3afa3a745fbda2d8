"""The trace checker, the idle decomposition and the stage profile on real traces.

One launch (P=2, tiny MLP) runs every registered schedule kind for two steps with an
optimizer step recorded after each; the tests check those traces, then inject one
violation of each kind into them and expect the checker to name it.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist

from generated import RUNTIME_KINDS, generated
from ranks import launch
from zerobubble.cli import main
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.profile.bubbles import analyze_iteration
from zerobubble.profile.costs_file import Profile
from zerobubble.profile.stages import boundary_pairs, p2p_latency, stage_profile
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.recorder import gather_traces
from zerobubble.schedule.costs import load_costs_file
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.segments import (
    SegmentCost,
    balanced_cuts,
    equal_token_cuts,
    segment_model,
)
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate
from zerobubble.trace.check import check_trace, load_trace
from zerobubble.trace.clocks import clock_offsets
from zerobubble.trace.format import COMPUTE_OPS, TraceEvent, write_jsonl
from zerobubble.train.job import plan_schedule
from zerobubble.train.trials import (
    TrialResult,
    executed_costs,
    fastest,
    overlapping,
    plan_candidates,
    predict_ms,
    segment_counts,
)

pytestmark = pytest.mark.slow

M = 4


def traced_run(sched: Schedule, rank: int, **opts) -> list[TraceEvent] | None:
    """Two steps of ``sched`` with an optimizer step recorded after each; rank 0's gather."""
    layers = list(build_mlp([6] * (sched.num_stages + 2), seed=0))
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(**opts),
    )
    opt = torch.optim.SGD([p for c in pipe.chunks.values() for p in c.module.parameters()], 0.1)
    trainer = PipelineTrainer(pipe, opt, OptimConfig(max_norm=1.0))  # records opt_* events
    gen_ = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 6, generator=gen_), torch.randn(8, 6, generator=gen_)
    for _ in range(2):
        trainer.step(x, target=y)
    return gather_traces(pipe.trace)


def kinds_job(scheds: dict[str, Schedule]) -> dict:
    """``scheds``: every kind at P=2, built once in the test, not on every rank."""
    info = init_distributed(timeout_s=60)
    out: dict = {"traces": {}}
    for kind, sched in scheds.items():
        out["traces"][kind] = (sched, traced_run(sched, info.rank))
    # ZB-H1 with every B and W split (no fusion): what a profile is taken from, and
    # the trace the violation tests edit (both ranks run B and W).
    sched = generate("zb-h1", 2, M)
    out["split"] = (sched, traced_run(sched, info.rank, fuse_local_backward=False))
    out["latency"] = p2p_latency([(0, 1)], 4096, iters=3, warmup=1)
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def job():
    scheds = {
        kind: generated(
            kind, 2, M, **({"chunks": 2} if "chunks" in GENERATORS[kind].options else {})
        )
        for kind in RUNTIME_KINDS
    }
    return launch(kinds_job, 2, scheds, timeout=240)[0]


@pytest.fixture
def zbh1(job) -> list[TraceEvent]:
    return list(job["split"][1])


def test_every_kind_passes_and_its_idle_time_decomposes_exactly(job):
    assert set(job["traces"]) == set(RUNTIME_KINDS)
    for kind, (_sched, events) in job["traces"].items():
        report = check_trace(events)
        assert report.ok, f"{kind}: {report.first}"
        assert report.ranks == (0, 1) and report.iterations == (0, 1)
        assert report.notes == ("no memory budget given (--mem-budget BYTES): memory not checked",)
        for k in (0, 1):
            it = analyze_iteration(events, k, mem_budget=1)
            comp = [e for e in events if e.iteration == k and e.op in COMPUTE_OPS]
            off = clock_offsets(events)  # the decomposition puts the ranks on one clock
            window = max(e.end_ns + off[e.rank] for e in comp) - min(
                e.start_ns + off[e.rank] for e in comp
            )
            for d in it.devices:
                busy = sum(e.end_ns - e.start_ns for e in comp if e.rank == d.rank)
                assert d.idle_ns == window - busy
                assert sum(d.parts().values()) == d.idle_ns, kind


# ---- injected violations -------------------------------------------------------------------


def where(events, rank, op, stage=None, mb=None, it=0, msg=None) -> tuple[int, int]:
    """(position in the list, index among the rank's events) of the matching event."""
    k = 0
    for pos, e in enumerate(events):
        if e.rank != rank:
            continue
        same = (e.op, e.iteration) == (op, it) and (stage is None or e.stage == stage)
        if same and (mb is None or e.mb == mb) and (msg is None or e.msg == msg):
            return pos, k
        k += 1
    raise AssertionError(f"no {op} s{stage} mb{mb} on rank {rank}")


def rank_index(events, pos) -> int:
    return sum(1 for e in events[:pos] if e.rank == events[pos].rank)


def first(events, **kw):
    report = check_trace(events, **kw)
    assert not report.ok
    return report.first


def test_reordering_a_consumer_before_its_input_is_an_edge_violation(zbh1):
    ev = zbh1
    f, _ = where(ev, 1, "F", 1, 0)
    w, _ = where(ev, 1, "wait_recv", 1, 0, msg=("act", 0, 1, 0))
    a, b = ev[w], ev[f]  # swap the two, each taking the other's time slot
    ev[w] = dataclasses.replace(b, start_ns=a.start_ns, end_ns=a.end_ns)
    ev[f] = dataclasses.replace(a, start_ns=b.start_ns, end_ns=b.end_ns)
    v = first(ev)
    assert (v.check, v.rank, v.index, v.iteration, v.event) == (
        "edge",
        1,
        rank_index(ev, w),
        0,
        "F(s1,mb0)",
    )
    assert v.why == (
        f"runs before its input act(s0->s1,mb0) arrived: the wait_recv is event "
        f"#{rank_index(ev, f)}, after it"
    )


def test_a_dropped_b_is_named_at_its_w(zbh1, tmp_path, capsys):
    ev = zbh1
    pos, _ = where(ev, 1, "B", 1, 1)
    del ev[pos]
    w, k = where(ev, 1, "W", 1, 1)
    v = first(ev)
    assert (v.check, v.rank, v.index, v.event) == ("backward", 1, k, "W(s1,mb1)")
    assert v.why.startswith("runs but its B has not run before it on this rank (F is (event #")
    path = tmp_path / "t.jsonl"
    write_jsonl(ev, path)
    assert main(["check-trace", str(path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"FAIL: [backward] rank 1, event #{k}, line {w + 1}, iteration 0: ")


def test_a_duplicated_send_is_a_message_violation(zbh1):
    ev = zbh1
    pos, k = where(ev, 0, "send", 0, 2)
    ev.insert(pos + 1, dataclasses.replace(ev[pos], start_ns=ev[pos].end_ns))
    v = first(ev)
    assert (v.check, v.rank, v.index, v.event) == ("messages", 0, k + 1, "send act(s0->s1,mb2)")
    assert v.why == (
        f"act(s0->s1,mb2) appears twice (first at rank 0 event #{k}); each message is sent "
        "and received exactly once"
    )


def test_a_w_after_the_optimizer_step_is_refused(zbh1):
    ev = zbh1
    last_w = max(p for p, e in enumerate(ev) if (e.rank, e.op, e.iteration) == (0, "W", 0))
    w = ev.pop(last_w)
    opt, opt_k = where(ev, 0, "opt_reduce")  # the norm's all-reduce reads the gradients
    ev.insert(opt + 1, dataclasses.replace(w, start_ns=ev[opt].end_ns, end_ns=ev[opt].end_ns))
    v = first(ev)
    assert (v.check, v.rank, v.index, v.event) == ("optimizer", 0, opt_k + 1, f"W(s0,mb{w.mb})")
    assert v.why == (
        f"runs after rank 0's optimizer action opt_reduce (event #{opt_k}) on iteration 0's "
        "gradients"
    )


def test_work_discarded_by_a_replay_is_not_checked(zbh1):
    ev = zbh1
    start = next(p for p, e in enumerate(ev) if (e.rank, e.iteration) == (1, 1))
    prev = max(p for p in range(start) if ev[p].rank == 1)
    t = ev[prev].end_ns
    f = ev[where(ev, 1, "F", 1, 0, it=1)[0]]
    discarded = dataclasses.replace(f, start_ns=t, end_ns=t)
    ev.insert(start, discarded)
    v = first(ev)
    assert (v.check, v.event) == ("backward", "F(s1,mb0)")
    assert v.why.startswith("runs a second time")
    ev.insert(start + 1, dataclasses.replace(discarded, op="replay", stage=None, mb=None))
    report = check_trace(ev)
    assert report.ok, report.first
    assert report.notes[0] == "1 event(s) of replayed (discarded) work not checked"


def test_a_second_parameter_version_in_a_microbatch_is_refused(zbh1):
    ev = zbh1
    pos, k = where(ev, 0, "B", 0, 1)
    ev[pos] = dataclasses.replace(ev[pos], param_version=5)
    v = first(ev)
    assert (v.check, v.rank, v.index, v.event) == ("version", 0, k, "B(s0,mb1)")
    assert v.why == (
        "ran on parameter version 5 but the other 5 compute events of microbatch 1 in "
        "iteration 0 ran on version 0; a microbatch must see one version along the pipeline"
    )


def test_memory_over_the_budget_is_refused_at_the_first_event(zbh1):
    ev = zbh1
    peak = max(max(e.mem_before, e.mem_after) for e in ev)
    assert check_trace(ev, mem_budget=peak).ok
    pos, k = where(ev, 1, "F", 1, 2, it=1)
    ev[pos] = dataclasses.replace(ev[pos], mem_after=10**9)
    v = first(ev, mem_budget=peak)
    assert (v.check, v.rank, v.index, v.iteration) == ("memory", 1, k, 1)
    assert v.why == f"holds {10**9} bytes of activations, over the budget of {peak} bytes"
    reached = first(zbh1, mem_budget=peak - 1)
    assert reached.check == "memory" and f"holds {peak} bytes" in reached.why


def shifted(events, rank, ns, from_iteration=0):
    return [
        dataclasses.replace(e, start_ns=e.start_ns + ns, end_ns=e.end_ns + ns)
        if e.rank == rank and e.iteration >= from_iteration
        else e
        for e in events
    ]


def test_a_clock_offset_is_harmless_but_a_clock_jump_breaks_causality(zbh1):
    skewed = shifted(zbh1, 1, -(10**9))  # rank 1's epoch a second off: fine
    assert check_trace(skewed).ok
    for k in (0, 1):
        assert analyze_iteration(skewed, k) == analyze_iteration(zbh1, k)
    jumped = shifted(zbh1, 1, 10**9, from_iteration=1)  # its clock jumps between steps
    v = first(jumped)
    # The tightest bounds come from whichever messages were fastest: mb varies.
    assert (v.check, v.rank, v.iteration) == ("clock", 0, 1)
    assert v.event.startswith("wait_recv grad(s1->s0,mb")
    assert v.why.startswith("no clock offset between ranks 0 and 1 makes both act(s0->s1,mb")
    assert "(rank 0 -> 1, iteration 0) and grad(s1->s0,mb" in v.why
    assert v.why.endswith("(tolerance 1000 µs)")
    assert check_trace(jumped, tolerance_ns=2 * 10**9).ok


def test_cli_accepts_a_real_trace_and_rejects_garbage(job, tmp_path, capsys):
    path = tmp_path / "t.jsonl"
    write_jsonl(job["traces"]["zbv"][1], path)
    assert main(["check-trace", str(path), "--mem-budget", str(10**9)]) == 0
    out = capsys.readouterr().out
    assert out.endswith(
        "OK: " + f"{len(job['traces']['zbv'][1])} events, ranks [0, 1], 2 iterations\n"
    )
    assert load_trace(path)[1] == list(range(1, len(job["traces"]["zbv"][1]) + 1))
    path.write_text('{"op": "F"}\n')
    assert main(["check-trace", str(path)]) == 2
    assert "t.jsonl:1: not a trace event" in capsys.readouterr().err


# ---- the profile as a costs file -------------------------------------------------------------


def test_profile_json_loads_as_costs_and_drives_the_planner(job, tmp_path):
    sched, split_events = job["split"]
    _, fused_events = job["traces"]["1f1b"]
    split = stage_profile(split_events, 2, skip_iterations=1)
    fused = stage_profile(fused_events, 2, skip_iterations=1)
    assert [s.n for s in split.f] == [M, M] and all(s is None for s in split.bw)
    assert all(s is None for s in fused.b) and [s.n for s in fused.bw] == [M, M]
    rises = {
        s: max(
            e.mem_after - e.mem_before
            for e in split_events
            if e.op == "F" and e.stage == s and e.iteration == 1
        )
        for s in (0, 1)
    }
    # M_B: the most a microbatch holds from its F until B, i.e. after F or after B.
    f_rise = {
        (e.stage, e.mb): e.mem_after - e.mem_before
        for e in split_events
        if e.op == "F" and e.iteration == 1
    }
    after_b = {
        s: max(
            f_rise[s, e.mb] + e.mem_after - e.mem_before
            for e in split_events
            if e.op == "B" and e.stage == s and e.iteration == 1
        )
        for s in (0, 1)
    }
    assert split.mem_b == tuple(max(rises[s], after_b[s], 0) for s in (0, 1))
    lat = tuple((s, job["latency"][a, b]) for s, a, b in boundary_pairs(sched.placement))
    prof = Profile(split, sched.placement, lat, mem_limit=10 * max(rises.values()), fused=fused)
    spec = load_costs_file(prof.save(tmp_path / "profile.json"))
    model = spec.resolve(sched.placement)
    assert model == prof.cost_model()
    assert model.comm == job["latency"][0, 1].median
    assert spec.mem_limit == 10 * max(rises.values())
    data = json.loads((tmp_path / "profile.json").read_text())
    assert data["fused"]["BW"] == [s.median for s in fused.bw]
    assert data["units"] == {"time": "ms", "memory": "bytes"}
    planned, kind = plan_schedule(2, 8, model, spec.mem_limit, num_layers=2)
    assert kind == "auto" and planned.num_stages == 2
    validate(planned, mem_limit=spec.mem_limit, costs=model)

    def eff(st, op, col):  # compute plus host tail
        return [s.median + st.host[op][k] for k, s in enumerate(col)]

    assert model.f == tuple(eff(split, "F", split.f)) and model.w == tuple(eff(split, "W", split.w))
    assert data["compute"]["B"] == [s.median for s in split.b]
    fused_model = prof.cost_model(fused=True)
    assert fused_model.b == tuple(
        max(bw - w, 0.0)
        for bw, w in zip(eff(fused, "BW", fused.bw), eff(split, "W", split.w), strict=True)
    )
    assert fused_model.f == tuple(eff(fused, "F", fused.f))
    # A schedule as the executor runs it: stage 0 of ZB-H1 fused takes the unsplit
    # run's costs, stage 1 the split run's; 1F1B all unsplit, ZB-H1 unfused all split.
    ran = executed_costs(prof, fuse_local_backward(generate("zb-h1", 2, 8)))
    parts = prof.cost_model()
    assert (ran.f, ran.b, ran.w, ran.mem_f, ran.mem_w) == (
        (fused_model.f[0], parts.f[1]),
        (fused_model.b[0], parts.b[1]),
        (fused_model.w[0], parts.w[1]),
        (fused_model.mem_f[0], parts.mem_f[1]),
        (fused_model.mem_w[0], parts.mem_w[1]),
    )
    assert executed_costs(prof, generate("1f1b", 2, 8)) == fused_model
    assert executed_costs(prof, generate("zb-h1", 2, 8)) == parts

    # The plan's candidates: the plan and the alternatives that fit, each predicted as it
    # runs (fused), best first, none alike; the limit (10 M_B) fits ZB-H1 and ZB-H2.
    found = plan_candidates(prof, (kind, planned), 8, spec.mem_limit, top=4)
    runs = [fuse_local_backward(c.schedule).actions for c in found]
    assert len(set(map(str, runs))) == len(found) >= 2
    assert [c.predicted_ms for c in found] == sorted(c.predicted_ms for c in found)
    for c in found:
        assert c.predicted_ms == predict_ms(prof, fuse_local_backward(c.schedule))
        validate(c.schedule, mem_limit=spec.mem_limit, costs=model)
    assert found[0].predicted_ms <= predict_ms(prof, fuse_local_backward(planned))
    assert "auto" in [c.kind for c in found]  # the plan is never dropped as a duplicate
    assert plan_candidates(prof, (kind, planned), 8, spec.mem_limit, top=1) == found[:1]
    fixed = dataclasses.replace(prof, step_fixed_ms=5.0)  # a step's time outside compute
    ran = fuse_local_backward(planned)
    assert predict_ms(fixed, ran) == predict_ms(prof, ran) + 5.0
    h1_peak = int(max(simulate(generate("zb-h1", 2, 8), model).peak_memory))
    tight = plan_candidates(prof, (kind, planned), 8, h1_peak, top=4)
    assert "zb-h2" not in [c.kind for c in tight]  # it holds more than ZB-H1's peak:
    with pytest.raises(ValueError, match="memory"):
        validate(generate("zb-h2", 2, 8), mem_limit=h1_peak, costs=model)
    # With segments the segment kinds join, per segment from the measured segment cost;
    # the best of them is tried even when its prediction is not among the top.
    with pytest.raises(ValueError, match="no segment cost: profile with segments"):
        plan_candidates(prof, (kind, planned), 8, spec.mem_limit, top=4, segments=4)
    seg = dataclasses.replace(prof, segment_cost=SegmentCost(1.0, 0.05, "dense"), seq_len=64)
    cuts = balanced_cuts(64, 4, seg.segment_cost)
    assert seg.cuts(4) == cuts and cuts != equal_token_cuts(64, 4)
    seq = generate("seq-zb", 2, 8, segments=4)
    assert executed_costs(seg, seq) == segment_model(parts, cuts, seg.segment_cost)
    assert executed_costs(seg, generate("zb-h1", 2, 8)) == parts
    assert [segment_counts(k) for k in (1, 2, 3, 4, 6)] == [
        (), (2,), (2, 3), (2, 3, 4), (2, 3, 4, 5, 6)
    ]  # fmt: skip
    every = plan_candidates(seg, (kind, planned), 8, spec.mem_limit, top=20, segments=4)
    assert {c.kind for c in every if c.cuts} == {
        f"{kind}(k={k})" for kind in ("seq-zb", "seq1f1b") for k in (2, 3, 4)
    }
    for c in every:
        assert c.cuts == (seg.cuts(c.schedule.segments) if c.schedule.segments > 1 else None)
        assert c.predicted_ms == predict_ms(seg, fuse_local_backward(c.schedule))
    two = plan_candidates(seg, (kind, planned), 8, spec.mem_limit, top=2, segments=4)
    best_seq = next(c for c in every if c.cuts)
    assert two[0] == every[0] and best_seq in two
    assert plan_candidates(seg, (kind, planned), 8, spec.mem_limit, top=1, segments=4) == every[:1]
    # Measured medians decide; equal medians go to the better prediction, then the earlier.
    assert fastest([(0.30, 10.0), (0.25, 12.0), (0.25, 11.0)]) == 2
    assert fastest([(0.25, 11.0), (0.25, 11.0)]) == 0


def test_the_trial_names_candidates_it_could_not_tell_from_the_winner():
    def tried(kind: str, steps: tuple[float, ...], chosen: bool = False) -> TrialResult:
        return TrialResult(kind, 0.0, steps, steps, chosen)

    won = tried("zb-h2", (0.20, 0.22), chosen=True)
    apart = tried("zb-h1", (0.23, 0.25))  # slower on every step: told apart
    inside = tried("auto", (0.19, 0.30))  # its range covers the winner's
    touching = tried("1f1b", (0.22, 0.26))  # shares the winner's slowest step time
    assert overlapping([won, apart, inside, touching]) == ("auto", "1f1b")
    assert overlapping([apart, won]) == ()
    assert overlapping([apart, inside]) == ()  # nothing chosen: nothing to compare with


# ---- optimizer commits -----------------------------------------------------------------------


def test_commit_rules(zbh1):
    assert check_trace(zbh1, conservative=True).ok  # sync steps commit before the next forward
    pos, idx = where(zbh1, 1, "opt_commit")
    wrong = list(zbh1)
    wrong[pos] = dataclasses.replace(wrong[pos], param_version=5)
    v = first(wrong)
    assert (v.check, v.rank, v.index) == ("commit", 1, idx)
    assert (
        "commits iteration 0 as parameter version 5; every rank must commit it as version 1"
        in v.why
    )
    dropped = [e for i, e in enumerate(zbh1) if i != pos]
    v = first(dropped)
    assert v.check == "commit" and "committed on rank 0 but never on rank 1" in v.why
    twice = list(zbh1)
    twice.insert(
        pos + 1, dataclasses.replace(zbh1[pos], start_ns=zbh1[pos].end_ns, end_ns=zbh1[pos].end_ns)
    )
    v = first(twice)
    assert (v.check, v.rank, v.why) == ("commit", 1, "iteration 0 is committed twice on this rank")


def test_conservative_forward_before_commit(zbh1):
    ev = list(zbh1)
    c, _ = where(ev, 0, "opt_commit")
    later = next(e for e in ev[c + 1 :] if e.rank == 0 and e.op == "F" and e.iteration == 1)
    f = ev.index(later)
    # Move the commit just after the first forward of iteration 1, keeping times sequential.
    moved = ev.pop(c)
    f -= 1
    ev.insert(f + 1, dataclasses.replace(moved, start_ns=ev[f].end_ns, end_ns=ev[f].end_ns))
    assert check_trace(ev).ok  # fine for speculative runs
    v = first(ev, conservative=True)
    assert (v.check, v.rank, v.event) == ("commit", 0, "F(s0,mb0)")
    assert "starts before iteration 0 is committed on this rank" in v.why
