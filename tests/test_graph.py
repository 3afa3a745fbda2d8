"""The flat dependency graph: the array path and the dict path must agree exactly."""

from __future__ import annotations

import pytest

from zerobubble.schedule.deps import backward_ops, dependencies
from zerobubble.schedule.generators import generate
from zerobubble.schedule.graph import _deps_by_dict, build_graph
from zerobubble.schedule.ir import Action, Op, Schedule


def mixed_backwards() -> Schedule:
    """ZB-H1 with every even microbatch of stage 1 run as BW instead of B + W."""
    sched = generate("zb-h1", 3, 6)
    rows = []
    for acts in sched.actions:
        row = []
        for a in acts:
            if a.stage == 1 and a.mb % 2 == 0 and a.op is Op.B:
                row.append(Action(Op.BW, 1, a.mb))
            elif not (a.stage == 1 and a.mb % 2 == 0 and a.op is Op.W):
                row.append(a)
        rows.append(row)
    return sched.with_actions(rows)


SCHEDULES = {
    "1f1b": lambda: generate("1f1b", 4, 9),
    "zbv": lambda: generate("zbv", 4, 9),
    "v-half": lambda: generate("v-half", 4, 9),
    "1f1b-v": lambda: generate("1f1b-v", 3, 7),
    "mixed": mixed_backwards,
    "partial": lambda: generate("zb-h2", 3, 5).with_actions(  # device 1 ran nothing
        [generate("zb-h2", 3, 5).actions[0], (), generate("zb-h2", 3, 5).actions[2]]
    ),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_array_path_matches_dict_path_and_ir_dependencies(name):
    sched = SCHEDULES[name]()
    g = build_graph(sched)
    assert g.columns is not None
    assert g.deps == _deps_by_dict(g.flat, sched.num_stages, sched.segments)
    bw = backward_ops(sched)
    for i, a in enumerate(g.flat):
        want = tuple(g.index[x] for x in dependencies(a, sched.num_stages, bw) if x in g.index)
        assert tuple(g.flat[x] for x in g.preds[i]) == tuple(g.flat[x] for x in want)
    assert g.index == {a: i for i, a in enumerate(g.flat)}


@pytest.mark.parametrize(
    ("bad", "first"),
    [
        (Action(Op.F, 9, 0), 4),  # stage out of range: indexed after device 0's four actions
        (Action(Op.F, 0, -1), 4),
        (Action(Op.F, 1.0, 0), 4),
        (Action("F", 0, 0), 0),  # a str op equals Op.F: the dict sees F(s0,mb0) again
    ],
    ids=["stage", "mb", "float", "str-op"],
)
def test_anything_malformed_takes_the_dict_path(bad, first):
    sched = generate("1f1b", 2, 2)
    g = build_graph(sched.with_actions([(*sched.actions[0], bad), sched.actions[1]]))
    assert g.columns is None
    assert g.index[bad] == first


def test_duplicates_index_their_first_occurrence():
    sched = generate("1f1b", 2, 2)
    dup = sched.actions[1][0]
    g = build_graph(sched.with_actions([sched.actions[0], (*sched.actions[1], dup)]))
    assert g.columns is not None and g.columns.has_duplicates
    assert g.index[dup] == 4
