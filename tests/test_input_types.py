"""Inputs of a type the code took for granted, found by the type checker: each is now
refused with a message (they used to end in a TypeError or AttributeError from deep inside)
or read as documented, and the typed rewrites keep their exact results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerobubble.runtime.recorder import TraceEvent
from zerobubble.schedule.costs import CostModel, costs_from_mapping
from zerobubble.schedule.formats import json_format, torch_csv
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op
from zerobubble.train.options import build_config, options
from zerobubble.viz.measured import measured_row
from zerobubble.viz.timeline import Box


@pytest.mark.parametrize("op", [["F"], {"F": 1}, 1, None])
def test_json_action_op_that_is_not_a_string_is_refused(op: object) -> None:
    data = json_format.to_dict(generate("1f1b", 3, 3))
    data["actions"][1][2]["op"] = op
    with pytest.raises(ValueError, match="device 1 position 2: bad action"):
        json_format.from_dict(data)


def test_json_round_trip_keeps_a_v_schedule() -> None:
    sched = generate("zbv", 3, 6)
    assert json_format.from_dict(json_format.to_dict(sched)) == sched


def test_costs_file_null_comm_reads_as_no_latency() -> None:
    arrays = {"F": [1, 2, 3], "B": [1, 1, 1], "W": [0.5, 0.5, 0.5]}
    spec = costs_from_mapping({**arrays, "comm": None, "mem_B": None, "mem_limit": None})
    assert spec.stage_costs == CostModel.per_stage(f=[1, 2, 3], b=[1, 1, 1], w=[0.5] * 3)
    assert spec.stage_costs is not None and spec.stage_costs.comm == 0
    assert spec.mem_limit is None
    with pytest.raises(ValueError, match="costs: 'comm' must be a number, got 'x'"):
        costs_from_mapping({**arrays, "comm": "x"})
    with pytest.raises(ValueError, match="costs: 'mem_limit' must be a number, got True"):
        costs_from_mapping({**arrays, "mem_limit": True})
    # The host part of each op: a profile writes null for an op a stage never ran.
    host = {"F": [0.5, None, 1], "B": [0, 0, 0.5]}
    got = costs_from_mapping({**arrays, "host": host}).stage_costs
    assert got is not None and (got.host_f, got.host_b, got.host_w) == (
        (0.5, 0, 1),
        (0, 0, 0.5),
        (0, 0, 0),
    )
    assert costs_from_mapping(got.to_dict()).stage_costs == got
    with pytest.raises(ValueError, match="costs: 'host' must be an object with arrays F, B, W"):
        costs_from_mapping({**arrays, "host": {"BW": [1, 1, 1]}})
    with pytest.raises(ValueError, match=r"costs: host\['F'\] must be an array of numbers"):
        costs_from_mapping({**arrays, "host": {"F": "x"}})
    with pytest.raises(ValueError, match=r"costs: host_w\[0\]=1 exceeds w\[0\]=0.5"):
        costs_from_mapping({**arrays, "host": {"W": [1, 0, 0]}})


def test_cost_model_with_stages_from_takes_every_array() -> None:
    a = CostModel.per_stage(f=[1, 1, 1], b=[2, 2, 2], w=[3, 3, 3], comm=5)
    b = CostModel.per_stage(f=[7, 7, 7], b=[8, 8, 8], w=[0, 0, 0], mem_f=[4, 4, 4])
    mixed = a.with_stages_from(b, [0, 2])
    assert (mixed.f, mixed.b, mixed.w, mixed.comm) == ((7, 1, 7), (8, 2, 8), (0, 3, 0), 5)
    assert (mixed.mem_f, mixed.mem_w) == ((4, 1, 4), (2, 0.5, 2))


def ev(rank: int, op: str, stage: int | None, mb: int | None, start: int, end: int) -> TraceEvent:
    return TraceEvent(0, rank, op, stage, mb, 0, start, end, 0, 0)


def test_measured_row_boxes_of_a_v_placement() -> None:
    # Rank 0 holds stages 0 and 2 (chunks 0 and 1), rank 1 holds stage 1; times in ns.
    events = [
        ev(0, "F", 0, 0, 1_000_000, 2_000_000),
        ev(1, "F", 1, 0, 2_000_000, 4_000_000),
        ev(0, "F", 2, 0, 4_000_000, 5_000_000),
        ev(0, "BW", 2, 0, 5_000_000, 7_000_000),
        ev(0, "send", 2, 0, 7_000_000, 7_000_000),
    ]
    row = measured_row(events, 0, "v")
    assert row.num_devices == 2
    assert row.boxes == (
        Box(0, 0.0, 1.0, Op.F, 0, 0),
        Box(1, 1.0, 3.0, Op.F, 0, 0),
        Box(0, 3.0, 4.0, Op.F, 0, 1),
        Box(0, 4.0, 6.0, Op.BW, 0, 1),
    )


@pytest.mark.parametrize(("stage", "mb"), [(0, None), (None, 0)])
def test_measured_row_refuses_a_compute_event_without_its_place(
    stage: int | None, mb: int | None
) -> None:
    events = [ev(0, "F", 0, 0, 0, 10), ev(1, "B", stage, mb, 10, 20)]
    with pytest.raises(ValueError, match=r"rank 1: the B event of iteration 0 .* malformed"):
        measured_row(events, 0, "bad")


def test_torch_csv_load_names_the_schedule_after_the_file(tmp_path: Path) -> None:
    sched = generate("zb-h1", 3, 4)
    path = tmp_path / "plan.csv"
    torch_csv.save(sched, path)
    assert torch_csv.load(path).name == "plan"
    loaded = torch_csv.load(path, name="zb-h1", num_microbatches=4)
    assert loaded == sched
    with pytest.raises(TypeError):
        torch_csv.load(path, microbatches=4)  # a misspelt keyword is not swallowed


def test_float_option_takes_a_toml_integer_as_float() -> None:
    lr = next(o for o in options() if o.key == "optimizer.lr")
    value = lr.check(2, "job.toml")
    assert value == 2.0 and type(value) is float
    with pytest.raises(
        ValueError, match=re.escape("job.toml: optimizer.lr must be a number, got True")
    ):
        lr.check(True, "job.toml")


def test_build_config_refuses_devices_that_are_not_an_integer() -> None:
    assert build_config({"schedule.devices": 3}, devices=2).schedule.devices == 3
    for bad in ("4", 4.0, True):
        with pytest.raises(ValueError, match=re.escape("schedule.devices must be an integer, got")):
            build_config({"schedule.devices": bad}, devices=2)
