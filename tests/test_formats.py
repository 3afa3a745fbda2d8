"""JSON, PyTorch CSV and text formats."""

from __future__ import annotations

import json

import pytest

from generated import generated
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.formats import json_format, load_schedule, save_schedule, text, torch_csv
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Action, Op


def all_kinds():
    for kind in GENERATORS:
        try:
            yield generated(kind, 3, 7)
        except ValueError:
            yield generated(kind, 3, 12)


@pytest.mark.parametrize("sched", list(all_kinds()), ids=lambda s: s.name)
def test_round_trips_are_exact(sched, tmp_path):
    assert json_format.loads(json_format.dumps(sched)) == sched
    save_schedule(sched, tmp_path / "s.json")
    assert load_schedule(tmp_path / "s.json") == sched
    if sched.segments > 1:  # PyTorch's CSV has no segments (test_seq_schedule: it refuses)
        return
    assert torch_csv.loads(torch_csv.dumps(sched), name=sched.name) == sched
    save_schedule(sched, tmp_path / "s.csv")
    assert load_schedule(tmp_path / "s.csv").actions == sched.actions


def test_json_shape_is_exact():
    sched = generate("1f1b", 2, 2, split_backward=True)
    data = json.loads(json_format.dumps(sched))
    assert data == {
        "format": "zerobubble.schedule/1",
        "name": "1f1b",
        "num_devices": 2,
        "num_stages": 2,
        "num_microbatches": 2,
        "placement": [0, 1],
        "actions": [
            [
                {"op": "F", "stage": 0, "mb": 0},
                {"op": "F", "stage": 0, "mb": 1},
                {"op": "B", "stage": 0, "mb": 0},
                {"op": "W", "stage": 0, "mb": 0},
                {"op": "B", "stage": 0, "mb": 1},
                {"op": "W", "stage": 0, "mb": 1},
            ],
            [
                {"op": "F", "stage": 1, "mb": 0},
                {"op": "B", "stage": 1, "mb": 0},
                {"op": "W", "stage": 1, "mb": 0},
                {"op": "F", "stage": 1, "mb": 1},
                {"op": "B", "stage": 1, "mb": 1},
                {"op": "W", "stage": 1, "mb": 1},
            ],
        ],
    }


def test_json_errors_name_the_field():
    with pytest.raises(ValueError, match="format is 'other'"):
        json_format.loads('{"format": "other"}')
    good = json.loads(json_format.dumps(generate("1f1b", 1, 1)))
    del good["placement"]
    with pytest.raises(ValueError, match="missing the field 'placement'"):
        json_format.from_dict(good)
    good = json.loads(json_format.dumps(generate("1f1b", 1, 1)))
    good["actions"][0][0]["op"] = "X"
    with pytest.raises(ValueError, match="device 0 position 0: bad action"):
        json_format.from_dict(good)


def test_csv_cells_map_to_our_ops():
    sched = torch_csv.loads("0F0,0I0,0W0,0F1,0B1\n")
    assert sched.actions[0] == (
        Action(Op.F, 0, 0),
        Action(Op.B, 0, 0),
        Action(Op.W, 0, 0),
        Action(Op.F, 0, 1),
        Action(Op.BW, 0, 1),
    )
    assert torch_csv.dumps(sched) == "0F0,0I0,0W0,0F1,0B1\n"


def test_csv_torch_extras():
    text_ = "0F0,1F0,,0REDUCE_GRAD,(0F1;1B0)OVERLAP_F_B,None\n"
    sched = torch_csv.loads(text_)
    assert sched.actions[0] == (
        Action(Op.F, 0, 0),
        Action(Op.F, 1, 0),
        Action(Op.F, 0, 1),
        Action(Op.BW, 1, 0),
    )
    assert (sched.num_devices, sched.num_stages, sched.placement) == (1, 2, (0, 0))
    with pytest.raises(ValueError, match="communication action"):
        torch_csv.loads("0F0,0SEND_F0\n")
    with pytest.raises(ValueError, match="cannot parse 'zz'"):
        torch_csv.loads("0F0,zz\n")


def test_csv_stage_on_two_ranks_is_wrong_device():
    with pytest.raises(ScheduleError) as err:
        torch_csv.loads("0F0,1F0\n1F0\n")
    assert err.value.reason is Reason.WRONG_DEVICE and err.value.device == 1


def test_text_timeline():
    sched = generate("zb-h1", 2, 2)
    assert text.render(sched).splitlines() == [
        "zb-h1: P=2 S=2 M=2 cost=7 bubble=14.3%",
        "d0 |F0 F1 ...B0 W0 B1 W1 ",
        "d1 |...F0 B0 F1 B1 W0 W1 ",
    ]
    assert text.render_order(generate("zbv", 1, 1)) == "d0: F0a F0b B0b W0b B0a W0a"
