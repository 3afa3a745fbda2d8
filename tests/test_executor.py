"""The executor on real processes (gloo): bitwise equality with the single-process
reference for every registered schedule kind, optimizers, trace, and failures.

Each launch runs many cases inside the spawned ranks (process start-up dominates).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from generated import RUNTIME_KINDS, generated
from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.interop.torch_pipelining import torch_rows
from zerobubble.models import GPTConfig, build_gpt, build_mlp, gpt_loss, mlp_loss
from zerobubble.parallel.partition import build_stage_modules, stage_bounds
from zerobubble.reference.step import reference_step
from zerobubble.runtime.launcher import LaunchError, init_distributed
from zerobubble.runtime.recorder import gather_traces
from zerobubble.runtime.stage import StageChunk
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import torch_csv
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Op, Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.validate import validate
from zerobubble.trace.format import TRACKS, chrome_trace, read_jsonl, write_jsonl

pytestmark = pytest.mark.slow

TIMEOUT = 240.0  # a whole launch, generous for a loaded 2-core machine


# ---- helpers run inside the ranks ---------------------------------------------------------


#: Kinds that solve a MILP: at M=2P+1 they take about 10 s each on a loaded machine, so they
#: run at M <= P only (still every kind runs).
EXACT_KINDS = ("optimal", "optimal-v")


#: The searching kinds' Ms at P = 4, where they solve in seconds (the others take 10 to 30 s
#: each on a loaded machine, and only the search itself differs from P = 2's runs of them):
#: every searching kind still runs at P = 4, and the fixed-placement searches at M = 2P + 1.
SEARCH_MS_AT_P4 = {
    "auto": (1,),
    "zb-auto": (1, 9),
    "zbv-auto": (1, 9),
    "optimal": (1,),
    "optimal-v": (1,),
}

MODELS = ("mlp", "gpt")


def cases(p: int) -> list[tuple[Schedule, str]]:
    """Every registered kind at M in {1, P-1, P, 2P+1} (M <= P for EXACT_KINDS; at P = 4 the
    searching kinds at :data:`SEARCH_MS_AT_P4` only), where the kind allows that M.
    Searching kinds get ``chunks=2`` (auto: at most 2 chunks per device).

    A covering design over (kind, M, model), not the product: each (kind, M) runs one model,
    alternating along the kind's Ms and starting with the kind's position, so every
    (kind, model) and (M, model) pair occurs too (a kind with one M runs both models). The
    model decides the tensors crossing stages (floats or token ids in, one layer shape or
    several), the kind and M which actions run where: no code path depends on all three.
    """
    out = []
    for i, kind in enumerate(RUNTIME_KINDS):
        gen = GENERATORS[kind]
        opts = {"chunks": 2} if "chunks" in gen.options else {}
        ms = {1, max(p - 1, 1), p} | (set() if kind in EXACT_KINDS else {2 * p + 1})
        if p == 4 and kind in SEARCH_MS_AT_P4:
            ms = set(SEARCH_MS_AT_P4[kind])
        mine = []
        for m in sorted(ms):
            try:
                mine.append(generated(kind, p, m, **opts))
            except ValueError:  # the kind does not support this M
                continue
        if len(mine) == 1:
            out += [(mine[0], model) for model in MODELS]
        else:
            out += [(s, MODELS[(i + j) % len(MODELS)]) for j, s in enumerate(mine)]
    return out


def make_model(kind: str, num_stages: int, m: int, seed: int = 0):
    """Layers (two more than stages, so the remainder rule is exercised), loss, batch."""
    gen = torch.Generator().manual_seed(seed + 1)
    n = 2 * m + 1  # uneven: tensor_split makes the last microbatch smaller
    if kind == "mlp":
        layers = list(build_mlp([5] * (num_stages + 3), seed=seed))
        return layers, mlp_loss, torch.randn(n, 5, generator=gen), torch.randn(n, 5, generator=gen)
    cfg = GPTConfig(vocab_size=17, max_seq_len=6, d_model=8, n_heads=2, n_layers=num_stages)
    layers = list(build_gpt(cfg))
    x = torch.randint(0, 17, (n, 6), generator=gen)
    return layers, gpt_loss, x, torch.randint(0, 17, (n, 6), generator=gen)


def param_names(pipe: PipelineExecutor, layers: list[nn.Module]) -> dict[str, nn.Parameter]:
    """This rank's parameters under the reference's names ("<layer index>.<name>")."""
    bounds = stage_bounds(len(layers), pipe.schedule.num_stages)
    out = {}
    for s, chunk in pipe.chunks.items():
        for name, p in chunk.module.named_parameters():
            local, rest = name.split(".", 1)
            out[f"{bounds[s].start + int(local)}.{rest}"] = p
    return out


@functools.cache
def reference(model: str, num_stages: int, m: int) -> tuple[list[torch.Tensor], dict]:
    """reference_step on :func:`make_model`'s model and batch, once per rank and arguments:
    the cases of one launch share a few (every kind at a given P and M cuts the same
    model into the same number of stages)."""
    layers, loss_fn, x, y = make_model(model, num_stages, m)
    return reference_step(layers, loss_fn, x, y, m)


def check_step(sched: Schedule, model: str, rank: int, **opts) -> dict:
    """One pipeline step against reference_step; returns what differed."""
    m = sched.num_microbatches
    layers, loss_fn, x, y = make_model(model, sched.num_stages, m)
    stages = build_stage_modules(layers, sched, rank)
    pipe = PipelineExecutor(sched, stages, loss_fn=loss_fn, options=ExecutorOptions(**opts))
    losses: list[torch.Tensor] = []
    returned = pipe.step(x, target=y, losses=losses)
    ref_losses, ref_grads = reference(model, sched.num_stages, m)
    name = f"{sched.name} P={sched.num_devices} M={m} {model}"
    bad = []
    if pipe.has_last:
        same = len(losses) == m and all(map(torch.equal, losses, ref_losses))
        if not same or returned != losses:
            bad.append(f"{name}: losses {losses} != reference {ref_losses}")
    elif returned is not None or losses:
        bad.append(f"{name}: rank {rank} without the last stage returned losses")
    mine = param_names(pipe, layers)
    for key, p in mine.items():
        if p.grad is None or not torch.equal(p.grad, ref_grads[key]):
            bad.append(f"{name}: gradient of {key} differs")
    return {"case": name, "checked": sorted(mine), "expected": sorted(ref_grads), "bad": bad}


def optimizer_run(rank: int, kind: str, opt_name: str) -> list[str]:
    """Five steps with an optimizer on both sides; returns parameters that differ."""
    sched = generate(kind, 2, 4)
    layers, loss_fn, _, _ = make_model("gpt", sched.num_stages, 4)
    pipe = PipelineExecutor(sched, build_stage_modules(layers, sched, rank), loss_fn=loss_fn)
    mine = param_names(pipe, layers)
    ref = dict(nn.Sequential(*layers).named_parameters())

    def make(params):
        if opt_name == "sgd":
            return torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)

    opt, ref_opt = make(list(mine.values())), make(list(ref.values()))
    for step in range(5):
        _, _, x, y = make_model("gpt", sched.num_stages, 4, seed=step)
        opt.zero_grad()
        pipe.step(x, target=y)
        opt.step()
        reference_step(layers, loss_fn, x, y, 4)
        ref_opt.step()
    return [f"{kind}/{opt_name}: {k}" for k, p in mine.items() if not torch.equal(p, ref[k])]


def trace_run(rank: int) -> dict:
    sched = generate("zb-h1", 2, 3)
    layers, loss_fn, x, y = make_model("mlp", sched.num_stages, 3)
    pipe = PipelineExecutor(sched, build_stage_modules(layers, sched, rank), loss_fn=loss_fn)
    for version in (7, 8):
        pipe.param_version = version
        pipe.step(x, target=y)
    events = gather_traces(pipe.trace)
    return {"events": events, "schedule": pipe.schedule, "generated": sched}


def untracked_chunk_refusal(rank: int) -> str:
    """A StageChunk that does not track memory, handed to a tracing executor."""
    sched = generate("1f1b", 2, 2)
    layers, loss_fn, _, _ = make_model("mlp", 2, 2)
    chunks = {
        s: StageChunk(m, s, 2, loss_fn=loss_fn if s == 1 else None, track_memory=False)
        for s, m in build_stage_modules(layers, sched, rank).items()
    }
    try:
        PipelineExecutor(sched, chunks, loss_fn=loss_fn)
    except ValueError as e:
        return str(e)
    return ""


def main_job(p: int, todo: list[tuple[Schedule, str]]) -> dict:
    """``todo``: :func:`cases` of ``p``, built once in the test, not on every rank."""
    info = init_distributed(timeout_s=60)
    out: dict = {"cases": [check_step(sched, model, info.rank) for sched, model in todo]}
    if p == 2:
        csv_text = "\n".join(",".join(row) for row in torch_rows("ZBVZeroBubble", 2, 4))
        imported = torch_csv.loads(csv_text, name="torch:ZBVZeroBubble", num_microbatches=4)
        out["torch"] = check_step(imported, "gpt", info.rank)
        out["directed"] = check_step(generate("zbv", 2, 3), "gpt", info.rank, directed_groups=True)
        # Untraced: the stages skip tracking saved tensors; same bits.
        out["untraced"] = check_step(generate("zb-h2", 2, 4), "gpt", info.rank, trace=False)
        # Unfused: every B and W runs split, as the schedule says.
        out["unfused"] = [
            check_step(generate(kind, 2, 5), model, info.rank, fuse_local_backward=False)
            for kind in ("zb-h1", "zbv")
            for model in ("mlp", "gpt")
        ]
        out["refused"] = untracked_chunk_refusal(info.rank)
        out["optim"] = [
            bad
            for kind in ("zb-h1", "zbv")
            for opt in ("sgd", "adamw")
            for bad in optimizer_run(info.rank, kind, opt)
        ]
        out["trace"] = trace_run(info.rank)
    dist.destroy_process_group()
    return out


# ---- the launches, one per P ----------------------------------------------------------------


@pytest.fixture(scope="module")
def p1():
    return launch(main_job, 1, 1, cases(1), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def p2():
    return launch(main_job, 2, 2, cases(2), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def p4():
    return launch(main_job, 4, 4, cases(4), timeout=TIMEOUT)


def assert_bitwise(per_rank: list[dict]) -> None:
    """No rank saw a difference, and together the ranks checked every parameter."""
    for case in zip(*per_rank, strict=True):
        bad = [b for c in case for b in c["bad"]]
        assert not bad, "\n".join(bad)
        checked = sorted(k for c in case for k in c["checked"])
        assert checked == case[0]["expected"], case[0]["case"]


@pytest.mark.parametrize("fixture", ["p1", "p2", "p4"])
def test_every_kind_matches_the_reference_bitwise(fixture, request):
    results = request.getfixturevalue(fixture)
    p = len(results)
    assert_bitwise([r["cases"] for r in results])
    kinds = {c["case"].split()[0] for c in results[0]["cases"]}
    assert kinds == set(RUNTIME_KINDS)  # every kind the executor runs ran
    counts = {c["case"].split()[2] for c in results[0]["cases"]}
    assert f"M={2 * p + 1}" in counts and "M=1" in counts
    models = {c["case"].split()[3] for c in results[0]["cases"]}
    assert models == set(MODELS)


@pytest.mark.parametrize("p", [1, 2, 4])
def test_the_cases_cover_every_kind_m_and_model_pair(p):
    runs = [(s.name, s.num_microbatches, model) for s, model in cases(p)]
    kind_m = {(k, m) for k, m, _ in runs}
    single = {k for k in RUNTIME_KINDS if sum(x == k for x, _ in kind_m) == 1}
    assert len(runs) == len(kind_m) + len(single)  # one model per (kind, M) but theirs
    assert {k for k, _ in kind_m} == set(RUNTIME_KINDS)
    assert {(k, model) for k, _, model in runs} == {(k, x) for k in RUNTIME_KINDS for x in MODELS}
    assert {(m, model) for _, m, model in runs} == {(m, x) for _, m in kind_m for x in MODELS}


def test_imported_torch_schedule_and_directed_groups_match(p2):
    assert_bitwise([[r["torch"]] for r in p2])
    assert p2[0]["torch"]["case"].startswith("torch:ZBVZeroBubble")
    assert_bitwise([[r["directed"]] for r in p2])


def test_untraced_steps_match_and_untracked_chunks_need_trace_off(p2):
    assert_bitwise([[r["untraced"]] for r in p2])
    for r in p2:
        assert "track_memory=False" in r["refused"] and "trace=False" in r["refused"]


def test_unfused_split_backward_matches_too(p2):
    assert_bitwise([r["unfused"] for r in p2])
    assert len(p2[0]["unfused"]) == 4


def test_sgd_and_adamw_steps_match_the_reference(p2):
    assert [r["optim"] for r in p2] == [[], []]


def test_trace_records_every_action_and_message(p2, tmp_path):
    events = p2[0]["trace"]["events"]
    assert p2[1]["trace"]["events"] is None  # gathered on rank 0 only
    sched: Schedule = p2[0]["trace"]["schedule"]
    # What ran is zb-h1 with stage 0's adjacent B/W pairs fused (the default).
    assert sched == fuse_local_backward(p2[0]["trace"]["generated"])
    assert {a.op for a in sched.actions[0]} == {Op.F, Op.BW}
    for it, version in ((0, 7), (1, 8)):
        step = [e for e in events if e.iteration == it]
        assert {e.param_version for e in step} == {version}
        for d in range(2):
            mine = sorted((e for e in step if e.rank == d), key=lambda e: e.start_ns)
            computes = [(e.op, e.stage, e.mb) for e in mine if e.track == "compute"]
            assert computes == [(a.op.value, a.stage, a.mb) for a in sched.actions[d]]
            assert mine[0].mem_before == 0 and mine[-1].mem_after == 0  # nothing leaks
            fwd = [e for e in mine if e.op == "F"]
            assert all(e.mem_after > e.mem_before for e in fwd)
            # Held bytes change only inside compute events, and each event starts
            # from where the previous one ended (the count is kept between ops).
            assert all(a.mem_after == b.mem_before for a, b in itertools.pairwise(mine))
            assert all(e.mem_before == e.mem_after for e in mine if e.track != "compute")
        sends = sorted(e.msg for e in step if e.op == "send")
        posts = sorted(e.msg for e in step if e.op == "post_recv")
        waits = sorted(e.msg for e in step if e.op == "wait_recv")
        expected = sorted(
            [("act", 0, 1, j) for j in range(3)] + [("grad", 1, 0, j) for j in range(3)]
        )
        assert sends == posts == waits == expected
        for e in step:
            if e.op == "send":
                assert e.peer == 1 - e.rank and e.stage == e.msg[1]
            if e.op in ("post_recv", "wait_recv"):
                assert e.peer == 1 - e.rank and e.stage == e.msg[2]
    path = tmp_path / "trace.jsonl"
    write_jsonl(events, path)
    assert read_jsonl(path) == events
    chrome = json.loads(json.dumps(chrome_trace(events)))
    threads = {
        (e["pid"], e["tid"], e["args"]["name"])
        for e in chrome["traceEvents"]
        if e["name"] == "thread_name"
    }
    assert threads == {(r, t, name) for r in (0, 1) for t, name in enumerate(TRACKS)}
    spans = [e for e in chrome["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == len(events)
    assert {e["pid"] for e in spans} == {0, 1}


# ---- refusals and failures -------------------------------------------------------------------


def test_invalid_schedule_is_refused_before_any_compute():
    sched = generate("1f1b", 1, 2)
    broken = sched.with_actions([sched.actions[0][::-1]])  # backwards before forwards
    with pytest.raises(ScheduleError) as expected:
        validate(broken)
    calls = []
    layer = nn.Linear(2, 2)
    layer.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ScheduleError) as err:
        PipelineExecutor(broken, {0: nn.Sequential(layer)}, loss_fn=mlp_loss)
    assert err.value.reason is Reason.LOCAL_ORDER
    assert str(err.value) == str(expected.value)
    assert calls == []


def test_a_segment_schedule_needs_its_cuts_and_a_token_count():
    sched = generate("seq-zb", 1, 2, segments=2)
    stages = {0: nn.Sequential(nn.Linear(2, 2))}
    for cuts, message in [
        (None, r"cuts each sequence into 2 segments: pass ExecutorOptions\(cuts=...\)"),
        ((0, 4), r"cuts=\[0, 4\] must be 3 increasing token positions from 0"),
        ((0, 4, 4), "must be 3 increasing"),
        ((1, 2, 4), "must be 3 increasing"),
        ((0, 2, 4), "runs sequence segments, whose losses .* pass count_fn"),
    ]:
        with pytest.raises(ValueError, match=message):
            PipelineExecutor(sched, stages, loss_fn=mlp_loss, options=ExecutorOptions(cuts=cuts))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [("comm_timeout_s", 0, "comm_timeout_s must be > 0"), ("recv_lookahead", -1, ">= 0")],
)
def test_bad_options_are_refused(field, value, message):
    with pytest.raises(ValueError, match=message):
        ExecutorOptions(**{field: value})


def mismatch_job() -> None:
    info = init_distributed(timeout_s=30)
    sched = generate("1f1b", 2, 2)
    layers = [nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Linear(5, 3)]  # 6 != 5
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, info.rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=10),
    )
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 3))


def test_shape_mismatch_names_both_stages():
    with pytest.raises(LaunchError) as err:
        launch(mismatch_job, 2, timeout=TIMEOUT, grace=20)
    by_rank = {f.rank: f.error for f in err.value.failures}
    want = "stage 0 -> stage 1: stage 1 (rank 1) cannot consume stage 0's output of [2, 6] float32"
    assert f"ShapeMismatchError: {want}" in by_rank[1]
    assert "PeerError: rank 0:" in by_rank[0] and "peer rank 1" in by_rank[0]


class Refuses(nn.Module):
    """Fails in its forward for a reason of its own, not its input's layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("refused by the layer itself")


def own_failure_job() -> None:
    info = init_distributed(timeout_s=30)
    sched = generate("1f1b", 2, 2)
    layers = [nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 3), Refuses())]
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, info.rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=10),
    )
    pipe.step(torch.randn(4, 4), target=torch.randn(4, 3))


def test_a_later_stage_failing_on_its_own_names_it_and_the_layer_not_its_neighbour():
    """Issue 23, item 6: only a layout error is a ShapeMismatchError blaming stage s-1."""
    with pytest.raises(LaunchError) as err:
        launch(own_failure_job, 2, timeout=TIMEOUT, grace=20)
    text = {f.rank: f.error for f in err.value.failures}[1]
    want = (
        "StageChunkError: stage 1, microbatch 0: forward (rank 1) failed in layer '0.1' "
        "(Refuses): RuntimeError: refused by the layer itself"
    )
    assert want in text and "ShapeMismatchError" not in text, text


class Bomb(nn.Module):
    """Identity that kills its process on the second microbatch it forwards with autograd."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():  # not the no-grad shape handshake
            self.calls += 1
            if self.calls == 2:
                if self.mode == "die":
                    os._exit(13)
                time.sleep(120)
        return x


def failure_job(mode: str, timeout_s: float) -> None:
    info = init_distributed(timeout_s=60)
    p = dist.get_world_size()
    sched = generate("zb-h1", p, 4)
    layers = list(build_mlp([3] * (p + 1), seed=0))
    layers.insert(2, Bomb(mode))  # on stage 1
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, info.rank, boundaries=[0, 1, 3, *range(4, p + 2)]),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=timeout_s),
    )
    pipe.step(torch.randn(8, 3), target=torch.randn(8, 3))


def test_dead_peer_makes_every_rank_fail_naming_peer_and_action():
    with pytest.raises(LaunchError) as err:
        launch(failure_job, 3, "die", 20.0, timeout=TIMEOUT, grace=30)
    by_rank = {f.rank: f for f in err.value.failures}
    assert by_rank[1].exitcode == 13
    for r in (0, 2):  # each failed on its own (not killed), naming rank 1 and what it did
        text = by_rank[r].error
        assert by_rank[r].exitcode == 1, text
        assert f"PeerError: rank {r}:" in text and "with peer rank 1 failed" in text
        assert any(w in text for w in ("wait_recv", "send", "post_recv")), text


def test_stuck_peer_times_out_with_the_waiting_action():
    with pytest.raises(LaunchError) as err:
        launch(failure_job, 2, "hang", 2.0, timeout=TIMEOUT, grace=1)
    stuck, waiter = err.value.failures  # the rank that stopped making progress comes first
    assert stuck.rank == 1 and stuck.stalled and stuck.exitcode is None  # stopped, not left
    assert "rank 0 died waiting on it" in stuck.error
    assert waiter.rank == 0 and waiter.exitcode == 1
    assert "PeerError: rank 0: wait_recv grad(s1->s0," in waiter.error
    assert "with peer rank 1 failed: no completion within the comm timeout of 2s" in waiter.error


def test_executor_options_refuse_compile_with_layer_recompute() -> None:
    with pytest.raises(ValueError, match="compile='aot_eager' with recompute='layers' is not"):
        ExecutorOptions(compile="aot_eager", recompute="layers")
    assert ExecutorOptions(compile="aot_eager", recompute="stage").compile == "aot_eager"
