"""`zerobubble train` end to end on a tiny GPT: profile, plan, train, outputs."""

from __future__ import annotations

import json

import pytest

from zerobubble.cli import main
from zerobubble.schedule.costs import load_costs_file
from zerobubble.schedule.trace_check import check_trace, load_trace
from zerobubble.train.config import JobSection, ModelSection, ScheduleSection, TrainConfig

pytestmark = pytest.mark.slow

TINY = [
    "-p", "2", "-m", "4", "--layers", "1", "--d-model", "16", "--heads", "2",
    "--seq-len", "8", "--microbatch-size", "2", "--steps", "2", "--baseline-steps", "2",
]  # fmt: skip


@pytest.mark.xfail(
    strict=False,
    reason="known, open (issue 13): at these tiny sizes the trace check finds the planned "
    "schedule 128 bytes (0.2%) over its activation budget since pytree frames landed",
)
def test_train_profiles_plans_trains_and_writes_its_outputs(tmp_path, capfd):
    out = tmp_path / "out"
    assert main(["train", *TINY, "--out", str(out)]) == 0
    text = capfd.readouterr().out
    steps = [line for line in text.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 * (1 + 2) + 3 * (1 + 2)  # profile, then train: warm-up + 2 each
    assert sum("(warm-up, not measured)" in s for s in steps) == 2 + 3
    for title in ("stage profile", "stage balancing", "schedules (P=2, M=4", "idle time by cause"):
        assert title in text
    assert "trace check: OK" in text and "wall time" in text
    spec = load_costs_file(out / "profile.json")
    assert spec.stage_costs.num_stages == 2 and spec.mem_limit > 0
    data = json.loads((out / "profile.json").read_text())
    assert data["boundaries"][0] == 0 and data["boundaries"][-1] == 4
    assert len(data["layers"]["F"]) == 4  # embedding, 1 block, norm, head
    events, lines = load_trace(out / "trace.jsonl")
    assert check_trace(events, lines=lines, mem_budget=spec.mem_limit).ok
    assert {e.iteration for e in events} == {0, 1, 2}
    assert (out / "timeline.png").stat().st_size > 0
    assert json.loads((out / "trace.chrome.json").read_text())["traceEvents"]
    assert "planned with auto under a memory limit of" in text
    assert "auto (planned)" in text


def test_bad_configurations_are_refused_before_launching():
    with pytest.raises(ValueError, match="baseline_steps must be >= 1"):
        JobSection(baseline_steps=0)
    with pytest.raises(ValueError, match="5 devices need at least 5 layers but the model has 4"):
        TrainConfig(schedule=ScheduleSection(devices=5), model=ModelSection(n_layers=1))
    assert main(["train", "-p", "8", "--layers", "2"]) == 2
