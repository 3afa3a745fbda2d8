"""Our JSON schedule format (``zerobubble.schedule/1``).

Exactly this shape, so other tools can read it without zerobubble::

    {"format": "zerobubble.schedule/1", "name": str, "num_devices": P,
     "num_stages": S, "num_microbatches": M, "placement": [device of stage 0, ...],
     "actions": [[{"op": "F", "stage": 0, "mb": 0}, ...], ...one list per device...]}
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerobubble.schedule.ir import Action, Op, Schedule

FORMAT = "zerobubble.schedule/1"


def to_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": schedule.name,
        "num_devices": schedule.num_devices,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "placement": list(schedule.placement),
        "actions": [
            [{"op": a.op.value, "stage": a.stage, "mb": a.mb} for a in acts]
            for acts in schedule.actions
        ],
    }


def dumps(schedule: Schedule) -> str:
    """Compact JSON: one line per device keeps diffs of hand-edited files readable."""
    d = to_dict(schedule)
    head = {k: v for k, v in d.items() if k != "actions"}
    lines = [json.dumps(head)[:-1] + ', "actions": [']
    rows = [json.dumps(acts, separators=(", ", ": ")) for acts in d["actions"]]
    lines += ["  " + row + ("," if i + 1 < len(rows) else "") for i, row in enumerate(rows)]
    lines.append("]}")
    return "\n".join(lines) + "\n"


def from_dict(data: Mapping[str, Any]) -> Schedule:
    """Parse our JSON object; errors name the field and what was expected."""
    if data.get("format") != FORMAT:
        raise ValueError(
            f"not a zerobubble schedule: format is {data.get('format')!r}, expected {FORMAT!r}"
        )
    for key in ("num_devices", "num_stages", "num_microbatches", "placement", "actions"):
        if key not in data:
            raise ValueError(f"schedule JSON is missing the field {key!r}")
    ops = {op.value: op for op in Op}
    actions = []
    for d, acts in enumerate(data["actions"]):
        row = []
        for i, a in enumerate(acts):
            try:
                row.append(Action(ops[a["op"]], int(a["stage"]), int(a["mb"])))
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    f"device {d} position {i}: bad action {a!r}; expected "
                    '{"op": "F"|"B"|"W"|"BW", "stage": int, "mb": int}'
                ) from None
        actions.append(row)
    return Schedule(
        name=str(data.get("name", "schedule")),
        num_devices=int(data["num_devices"]),
        num_stages=int(data["num_stages"]),
        num_microbatches=int(data["num_microbatches"]),
        placement=tuple(int(x) for x in data["placement"]),
        actions=actions,
    )


def loads(text: str) -> Schedule:
    return from_dict(json.loads(text))


def load(path: str | Path) -> Schedule:
    return loads(Path(path).read_text())


def save(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(dumps(schedule))
