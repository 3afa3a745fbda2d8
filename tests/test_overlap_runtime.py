"""Overlapped F&B pairs at run time: the program's Overlap instruction, both halves at once
(the default: the F on a helper thread), bitwise as in sequence, a collective of one half in
flight while the other computes, and the user hook."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ranks import launch
from zerobubble import composition
from zerobubble.cli import main
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.mesh import PipelineMesh, build_mesh
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.profile.bubbles import analyze_iteration
from zerobubble.program.builder import build_programs
from zerobubble.program.instructions import Compute, Overlap, Send, VersionCheck, output_message
from zerobubble.program.plan import ProgramPlan
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import init_distributed
from zerobubble.runtime.overlap import LaneGroups, OverlapPair, run_pair
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import json_format
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.trace.check import check_trace
from zerobubble.trace.format import write_jsonl

F, BW = Op.F, Op.BW

# ---- the program: one instruction per pair -----------------------------------------------------


@pytest.mark.parametrize("p, m", [(2, 6), (3, 10)])
def test_every_pair_becomes_one_instruction_with_its_receives_before_and_sends_after(p, m):
    sched = generate("dualpipev", p, m, overlap=True)
    plan = ProgramPlan(grad_sync="reduce", protocol="checked")
    lowered = build_programs(sched, plan)
    pairs = set(sched.overlaps)
    found = set()
    for d, prog in enumerate(lowered.programs):
        for i, ins in enumerate(prog):
            if isinstance(ins, Compute):
                assert not any(ins.action in pair for pair in pairs)  # every paired compute ...
            if not isinstance(ins, Overlap):
                continue
            f, b = ins.computes  # ... is inside its pair, with both version checks
            found.add((f.action, b.action))
            assert [type(x) for x in ins.parts] == [VersionCheck, Compute] * 2
            assert [x.action for x in ins.parts] == [f.action, f.action, b.action, b.action]
            # The F's output leaves right after the pair (when it goes to another device).
            msg = output_message(f.action, sched.num_stages)
            if msg is not None and sched.placement[msg.dst_stage] != d:
                assert prog[i + 1] == Send(msg, sched.placement[msg.dst_stage])
    assert found == pairs


def test_a_replay_gate_inside_a_pair_is_refused_naming_the_pair():
    """Two stages on one device, F(s0,mb1) & BW(s1,mb0): the gate goes before the first
    backward, which is the pair's."""
    a = Action
    acts = (a(F, 0, 0), a(F, 1, 0), a(F, 0, 1), a(BW, 1, 0), a(BW, 0, 0), a(F, 1, 1))
    acts += (a(BW, 1, 1), a(BW, 0, 1))
    sched = Schedule("gate", 1, 2, 2, (0, 0), (acts,), overlaps=((acts[2], acts[3]),))
    assert build_programs(sched, ProgramPlan(protocol="checked"))
    with pytest.raises(ScheduleError) as err:
        build_programs(sched, ProgramPlan(protocol="speculative"))
    assert err.value.reason is Reason.OVERLAP
    assert "F(s0,mb1) & BW(s1,mb0) on device 0 has 'replay gate" in str(err.value)


# ---- bitwise as in sequence ---------------------------------------------------------------------

GPT = GPTConfig(vocab_size=17, max_seq_len=8, d_model=8, n_heads=2, n_layers=3)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 17, (8, 8), generator=g), torch.randint(0, 17, (8, 8), generator=g)


def in_sequence(pair: OverlapPair) -> None:
    """A user hook: the backward first, then the F, both on the executor's thread."""
    pair.run_backward()
    pair.run_forward()


def test_the_hook_must_run_each_half_once_and_errors_reach_the_caller():
    ran: list[str] = []
    f, b = Action(F, 0, 1), Action(BW, 1, 0)

    def pair(fail: str = "") -> OverlapPair:
        def half(name: str):
            def run() -> None:
                ran.append(name)
                if name == fail:
                    raise RuntimeError(f"{name} failed")

            return run

        return OverlapPair(f, b, half("F"), half("B"))

    run_pair(pair(), None, 10.0)
    assert sorted(ran) == ["B", "F"]
    run_pair(pair(), in_sequence, 10.0)
    assert ran[2:] == ["B", "F"]
    with pytest.raises(ValueError, match=r"returned without running BW\(s1,mb0\)"):
        run_pair(pair(), lambda p: p.run_forward(), 10.0)
    with pytest.raises(ValueError, match="ran F\\(s0,mb1\\) twice"):
        run_pair(pair(), lambda p: (p.run_forward(), p.run_forward(), p.run_backward()), 10.0)
    for half in ("F", "B"):  # an exception of either thread is raised to the caller
        with pytest.raises(RuntimeError, match=f"{half} failed"):
            run_pair(pair(half), None, 10.0)


def backward_first(pair: OverlapPair) -> None:
    """docs/moe.md's worked hook: the backward on a helper thread, the F here."""
    helper = threading.Thread(target=pair.run_backward)
    helper.start()
    pair.run_forward()
    helper.join()


def overlapped_steps(p: int, m: int) -> dict[bool, tuple[list | None, dict, tuple]]:
    """One step without and one with the hook, in one launch: {hook: what the step gave}."""
    rank = init_distributed(timeout_s=60).rank
    out = {hook: overlapped_step(rank, p, m, hook) for hook in (False, True)}
    dist.destroy_process_group()
    return out


def overlapped_step(rank: int, p: int, m: int, hook: bool) -> tuple[list | None, dict, tuple]:
    sched = generate("dualpipev", p, m, overlap=True)
    layers = list(build_gpt(GPT))
    threads: set[str] = set()
    options = ExecutorOptions(overlap_fn=backward_first if hook else None)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(sched, stages, loss_fn=gpt_loss, options=options)
    for chunk in pipe.chunks.values():  # which threads run the forwards
        chunk.module.register_forward_hook(lambda *_: threads.add(threading.current_thread().name))
    x, y = batch()
    losses = pipe.step(x, target=y)
    bounds = stage_bounds(len(layers), sched.num_stages)
    grads = {
        f"{bounds[s].start + int(name.split('.', 1)[0])}.{name.split('.', 1)[1]}": p.grad
        for s, chunk in pipe.chunks.items()
        for name, p in chunk.module.named_parameters()
    }
    events = list(pipe.trace.events)
    return losses, grads, (events, sorted(threads))


@pytest.mark.bitwise
@pytest.mark.kernels
def test_overlapped_pairs_run_at_once_bitwise_as_the_reference(tmp_path):
    """P = 3 (V placement, 6 stages), dualpipev's pairs: each pair's F ran on a helper
    thread; losses and gradients are bitwise those of one process over the same
    microbatches, also under docs/moe.md's hook (the backward on the helper); the trace
    checks out given the pairs (whose events may overlap in time)."""
    both = launch(overlapped_steps, 3, 3, 6, timeout=240)
    results, hooked = [r[False] for r in both], [r[True] for r in both]
    for r, h in zip(results, hooked, strict=True):
        assert (r[0] is None) == (h[0] is None)
        assert r[0] is None or all(map(torch.equal, r[0], h[0]))
        assert all(torch.equal(g, h[1][k]) for k, g in r[1].items())
    losses = next(r[0] for r in results if r[0] is not None)
    grads = {k: v for r in results for k, v in r[1].items()}
    x, y = batch()
    want_losses, want_grads = reference_step(list(build_gpt(GPT)), gpt_loss, x, y, 6)
    assert all(map(torch.equal, losses, want_losses))
    assert grads.keys() == want_grads.keys()
    assert all(torch.equal(g, want_grads[k]) for k, g in grads.items())
    events = [e for r in results for e in r[2][0]]
    sched = generate("dualpipev", 3, 6, overlap=True)
    report = check_trace(events, overlaps=sched.overlaps)
    assert report.ok, report.first
    # The idle-time breakdown takes the pairs' overlapping events: their union is busy.
    for dev in analyze_iteration(events, 0, overlaps=sched.overlaps).devices:
        spans = sorted((e.start_ns, e.end_ns) for e in events if e.rank == dev.rank and e.action)
        union, reach = 0, None
        for a, b in spans:
            union += b - a if reach is None or a >= reach else max(0, b - reach)
            reach = b if reach is None else max(reach, b)
        assert dev.busy_ns == union
        parts = dev.dependency_ns + dev.memory_ns + dev.comm_ns + dev.imbalance_ns
        assert parts + dev.overhead_ns == dev.idle_ns
    write_jsonl(events, tmp_path / "trace.jsonl")
    (tmp_path / "sched.json").write_text(json_format.dumps(sched))
    assert (
        main(
            [
                "check-trace",
                str(tmp_path / "trace.jsonl"),
                "--schedule",
                str(tmp_path / "sched.json"),
            ]
        )
        == 0
    )
    assert all(any(t.startswith("zerobubble F(") for t in r[2][1]) for r in results)


# ---- a collective of one half in flight while the other computes -------------------------------


class _Exchange(torch.autograd.Function):
    """Swap the halves of the rows with the data-parallel peer: forward on ``lanes.forward``,
    the gradient's swap back on ``lanes.backward``. ``spans`` gets each forward exchange's
    (start, end) in ``perf_counter_ns``; a ``stall`` (seconds) delays both directions."""

    @staticmethod
    def forward(ctx, x, lanes, spans, stall):  # type: ignore[override]
        ctx.lanes, ctx.stall = lanes, stall
        out = torch.empty_like(x)
        t0 = time.perf_counter_ns()
        if stall:
            time.sleep(stall)  # a slow peer: the other rank's exchange waits for this one
        dist.all_to_all_single(out, x.contiguous(), group=lanes.forward)
        spans.append((t0, time.perf_counter_ns()))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out = torch.empty_like(grad)
        if ctx.stall:
            time.sleep(ctx.stall)
        dist.all_to_all_single(out, grad.contiguous(), group=ctx.lanes.backward)
        return out, None, None, None


class _Shared:
    """What every copy of an exchange layer shares (the stage builder copies the layers)."""

    def __init__(self, lanes: LaneGroups, spans: list, stall: float) -> None:
        self.lanes, self.spans, self.stall = lanes, spans, stall

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class Exchange(nn.Module):
    def __init__(self, lanes: LaneGroups, spans: list, stall: float) -> None:
        super().__init__()
        self.shared = _Shared(lanes, spans, stall)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shared
        return _Exchange.apply(x, s.lanes, s.spans, s.stall)


def exchanging_layers(lanes: LaneGroups, spans: list, stall: float) -> list[nn.Module]:
    torch.manual_seed(0)
    out: list[nn.Module] = []
    for _ in range(4):  # four stages: Linear, exchange, Linear
        out += [nn.Linear(16, 16), Exchange(lanes, spans, stall), nn.Linear(16, 16)]
    return out


def mse(y: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return ((y - t) ** 2).sum()


def exchanging_steps() -> dict[bool, tuple[list | None, dict, list, list]]:
    """One step together and one in turn (hooked), in one launch: {hooked: what it gave}."""
    init_distributed(timeout_s=60)
    mesh = build_mesh(2, 2)
    # Every rank makes every lane group, in one order (new_group is collective).
    lanes_of = {
        pp: LaneGroups(dist.new_group([2 * pp, 2 * pp + 1]), dist.new_group([2 * pp, 2 * pp + 1]))
        for pp in range(2)
    }
    out = {
        hooked: exchanging_step(mesh, lanes_of[mesh.pp_rank], hooked) for hooked in (False, True)
    }
    dist.destroy_process_group()
    return out


def exchanging_step(
    mesh: PipelineMesh, lanes: LaneGroups, hooked: bool
) -> tuple[list | None, dict, list, list]:
    spans: list[tuple[int, int]] = []
    stall = 0.03 if mesh.dp_rank == 1 else 0.0
    sched = generate("dualpipev", 2, 4, overlap=True)
    layers = exchanging_layers(lanes, spans, stall)
    options = ExecutorOptions(overlap_fn=in_sequence if hooked else None)
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, mesh.pp_rank),
        loss_fn=mse,
        mesh=mesh,
        options=options,
    )
    g = torch.Generator().manual_seed(mesh.dp_rank)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    losses = pipe.step(x, target=y)
    grads = {
        f"{s}.{n}": p.grad.clone()
        for s, c in pipe.chunks.items()
        for n, p in c.module.named_parameters()
    }
    epoch = pipe.trace.epoch_ns
    in_flight = [(a - epoch, b - epoch) for a, b in spans]
    pairs = dict(sched.overlaps)
    backwards = [
        (e.start_ns, e.end_ns)
        for e in pipe.trace.events
        if e.action is not None and e.action in pairs.values()
    ]
    return losses, grads, (in_flight if mesh.dp_rank == 0 else []), backwards


def _hidden(spans: list, backwards: list) -> int:
    """How many paired backwards computed while a forward's exchange was in flight."""
    return sum(any(max(a, b0) < min(a1, b1) for a, a1 in spans) for b0, b1 in backwards)


def test_a_collective_of_the_forward_is_in_flight_while_the_paired_backward_computes():
    """pp = 2 x dp = 2, dualpipev's pairs, a layer per stage that swaps rows with its
    data-parallel peer (forward and backward on lane groups of their own); dp rank 1 is a
    slow peer, so dp rank 0's exchanges wait. From the timestamps: on dp rank 0 every
    paired backward computes while a forward's exchange is in flight. Run in sequence by
    a hook (one thread: disjoint spans), none does; losses and gradients are bitwise the
    same either way."""
    both = launch(exchanging_steps, 4, timeout=240)
    together, in_turn = [r[False] for r in both], [r[True] for r in both]
    for (l1, g1, *_), (l2, g2, *_) in zip(together, in_turn, strict=True):
        assert (l1 is None) == (l2 is None)
        if l1 is not None:
            assert all(map(torch.equal, l1, l2))
        assert all(torch.equal(g1[k], g2[k]) for k in g1) and g1.keys() == g2.keys()
    for rank in (0, 2):  # dp rank 0 of each pipeline rank
        _, _, spans, backwards = together[rank]
        assert backwards and _hidden(spans, backwards) == len(backwards)
        _, _, spans, backwards = in_turn[rank]
        assert _hidden(spans, backwards) == 0


def test_overlap_with_recompute_under_expert_parallelism_is_accepted():
    """Pairs, recompute and ep together are a job's features, which the table accepts (the
    replay's all-to-alls go on the backwards' lane: tests/test_ep_compose.py runs them)."""
    from types import SimpleNamespace

    from zerobubble.parallel.checks import features as _features
    from zerobubble.parallel.mesh import ParallelSpec

    sched = generate("dualpipev", 2, 6, overlap=True)
    mesh = SimpleNamespace(spec=ParallelSpec(2, 2, ep=2))
    features = _features(sched, ExecutorOptions(recompute="layers"), mesh)  # type: ignore[arg-type]
    assert features == {"overlap", "recompute", "dp", "ep"}
    assert composition.refusal(features) is None
    composition.check(features, "schedule 'dualpipev'")


def test_pairs_run_in_sequence_under_tp_with_recompute_and_at_once_otherwise():
    """A drawing replay and the paired forward could wait on each other across tp ranks
    (DTensor's collectives cannot hand the generators on): under tp with recompute the
    executor runs a pair's halves one after the other; a user's hook always wins."""
    from types import SimpleNamespace

    from zerobubble.parallel.checks import pair_runner
    from zerobubble.runtime.overlap import in_sequence

    tp, flat = SimpleNamespace(tp_size=2), SimpleNamespace(tp_size=1)
    stage = ExecutorOptions(recompute="stage")
    assert pair_runner(stage, tp) is in_sequence  # type: ignore[arg-type]
    assert pair_runner(ExecutorOptions(), tp) is None  # type: ignore[arg-type]
    assert pair_runner(stage, flat) is None  # type: ignore[arg-type]
    assert pair_runner(stage, None) is None
    mine = ExecutorOptions(recompute="stage", overlap_fn=in_sequence)
    assert pair_runner(mine, flat) is in_sequence  # type: ignore[arg-type]
    ran: list[str] = []
    pair = OverlapPair(
        Action(Op.F, 0, 1), Action(Op.B, 3, 0), lambda: ran.append("F"), lambda: ran.append("B")
    )
    in_sequence(pair)
    assert ran == ["F", "B"]
