"""torch.profiler ranges of the runtime: one per trace event, named as the event is.

Inside the ranks every run records a few steps under ``torch.profiler`` and
returns the ``zb.*`` range names the profiler saw and the names of the trace events
recorded meanwhile; they must be the same multiset (each event's work runs in one
range of its name, and no range runs without an event).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import zerobubble
from ranks import launch
from zerobubble.cli import main
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.parallel.mesh import build_mesh
from zerobubble.runtime.launcher import init_distributed

pytestmark = pytest.mark.slow

TIMEOUT = 240.0
SIZES = [6, 8, 8, 8, 6]
M = 4


def profiled_names(
    pp: int, dp: int, kind: str, mode: str, *, fsdp: bool = False, steps: int = 2
) -> dict:
    """``steps`` training steps and a drain under the profiler; both name counts."""
    mesh = build_mesh(pp, dp, fsdp=fsdp)
    pipe = zerobubble.Pipeline(build_mlp(SIZES, seed=0), mlp_loss, kind, microbatches=M, mesh=mesh)
    # A tiny max_norm: every step clips (post-validation: defers, then steps and replays).
    opt = torch.optim.AdamW(pipe.parameters(), lr=0.01)
    pipe.set_optimizer(opt, zerobubble.OptimConfig(mode=mode, max_norm=1e-3))
    gen = torch.Generator().manual_seed(1)
    pipe.step(torch.randn(2 * M, 6, generator=gen), target=torch.randn(2 * M, 6, generator=gen))
    pipe.executor.trace.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            x, y = torch.randn(2 * M, 6, generator=gen), torch.randn(2 * M, 6, generator=gen)
            pipe.step(x, target=y)
        pipe.drain()
    ranges = Counter(e.name for e in prof.events() if e.name.startswith("zb."))
    events = Counter(e.name for e in pipe.executor.trace.events)
    program = [name for name in pipe.executor.names if name is not None]
    return {"ranges": ranges, "events": events, "program": program}


def two_ranks() -> dict:
    init_distributed(timeout_s=60)
    out = {
        "pipeline": profiled_names(2, 1, "zbv", "sync"),
        "reduce": profiled_names(1, 2, "1f1b", "sync"),
        "fsdp": profiled_names(1, 2, "1f1b", "sync", fsdp=True, steps=1),
    }
    dist.destroy_process_group()
    return out


def three_ranks() -> dict:
    init_distributed(timeout_s=60)
    out = profiled_names(3, 1, "zb-h1", "speculative")
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def p2() -> list[dict]:
    return launch(two_ranks, 2, timeout=TIMEOUT)


def test_every_event_of_a_pipeline_and_its_optimizer_step_runs_in_a_range_of_its_name(p2):
    for rank, out in enumerate(p2):
        run = out["pipeline"]
        assert run["ranges"] == run["events"]
        # Each of the two steps: every traced instruction of the program once, and the
        # synchronous optimizer step's three events.
        step = Counter(run["program"]) + Counter(["zb.opt_reduce", "zb.opt_step", "zb.opt_commit"])
        assert run["ranges"] == step + step
        # zbv on 2 ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2.
        mine = {
            0: {"zb.F s0 mb0", "zb.BW s0 mb3", "zb.B s3 mb1", "zb.W s3 mb1",
                "zb.send act s0->s1 mb2", "zb.post_recv grad s1->s0 mb2",
                "zb.wait_recv act s2->s3 mb3", "zb.send grad s3->s2 mb0"},
            1: {"zb.F s2 mb0", "zb.BW s2 mb0", "zb.B s2 mb3", "zb.W s1 mb3",
                "zb.wait_recv act s0->s1 mb2", "zb.send grad s1->s0 mb2",
                "zb.send act s2->s3 mb3", "zb.post_recv grad s3->s2 mb0"},
        }[rank]  # fmt: skip
        assert mine | {"zb.wait_sends"} <= set(run["ranges"])


def test_gradient_reductions_and_fsdp_collectives_run_in_ranges_too(p2):
    for out in p2:
        reduce, fsdp = out["reduce"], out["fsdp"]
        assert reduce["ranges"] == reduce["events"]
        assert {"zb.reduce_grads s0", "zb.wait_reduce", "zb.BW s0 mb3"} <= set(reduce["ranges"])
        assert fsdp["ranges"] == fsdp["events"]
        assert fsdp["ranges"]["zb.unshard s0"] == fsdp["ranges"]["zb.reduce_scatter s0"] == 1


def test_speculative_post_validation_on_three_ranks():
    for rank, out in enumerate(launch(three_ranks, 3, timeout=TIMEOUT)):
        assert out["ranges"] == out["events"]
        names = set(out["ranges"])
        assert {"zb.opt_prefix", "zb.opt_step", "zb.opt_commit"} <= names
        if rank < 2:  # deferred (the prefix is over max_norm), validated, replayed
            assert {"zb.opt_defer", "zb.opt_validate", "zb.replay"} <= names
        assert f"zb.F s{rank} mb{M - 1}" in names


def test_train_torch_profile_writes_a_kineto_trace_per_rank(tmp_path, capsys):
    prof = tmp_path / "prof"
    tiny = [
        "-p", "2", "-m", "2", "--layers", "1", "--d-model", "8", "--heads", "2",
        "--seq-len", "8", "--microbatch-size", "1", "--steps", "1", "--baseline-steps", "1",
        "--job.layer-iters", "1", "--job.corpus-chars", "20000",
    ]  # fmt: skip
    assert main(["bench", *tiny, "--out", str(tmp_path / "out"), "--torch-profile", str(prof)]) == 0
    for rank in (0, 1):
        trace = json.loads((prof / f"rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert f"zb.F s{rank} mb1" in names and "zb.opt_step" in names
    assert f"torch profile: {prof}" in capsys.readouterr().out
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", *tiny, "--torch-profile", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert f"--torch-profile {blocker}: cannot create the output folder" in err
    assert "is a file, not a folder" in err and "Traceback" not in err
