"""Our JSON schedule format (``zerobubble.schedule/1``).

Exactly this shape, so other tools can read it without zerobubble::

    {"format": "zerobubble.schedule/1", "name": str, "num_devices": P,
     "num_stages": S, "num_microbatches": M, "placement": [device of stage 0, ...],
     "actions": [[{"op": "F", "stage": 0, "mb": 0}, ...], ...one list per device...]}

plus ``"segments": k`` when a microbatch's sequence runs as k > 1 segments; each
action's ``mb`` is then a unit, microbatch ``mb // k``'s segment ``mb % k``
(see :class:`~zerobubble.schedule.ir.Schedule`); and ``"overlaps": [[F, B], ...]``
(actions as above) when the schedule overlaps F&B pairs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeGuard

from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.textfile import read_text

FORMAT = "zerobubble.schedule/1"


def to_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": schedule.name,
        "num_devices": schedule.num_devices,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "placement": list(schedule.placement),
        **({"segments": schedule.segments} if schedule.segments > 1 else {}),
        **(
            {"overlaps": [[_action(f), _action(b)] for f, b in schedule.overlaps]}
            if schedule.overlaps
            else {}
        ),
        "actions": [[_action(a) for a in acts] for acts in schedule.actions],
    }


def _action(a: Action) -> dict[str, Any]:
    return {"op": a.op.value, "stage": a.stage, "mb": a.mb}


def dumps(schedule: Schedule) -> str:
    """Compact JSON: one line per device keeps diffs of hand-edited files readable."""
    d = to_dict(schedule)
    head = {k: v for k, v in d.items() if k != "actions"}
    lines = [json.dumps(head)[:-1] + ', "actions": [']
    rows = [json.dumps(acts, separators=(", ", ": ")) for acts in d["actions"]]
    lines += ["  " + row + ("," if i + 1 < len(rows) else "") for i, row in enumerate(rows)]
    lines.append("]}")
    return "\n".join(lines) + "\n"


def from_dict(data: object, source: str = "schedule JSON") -> Schedule:
    """Parse our JSON object; errors name ``source``, the field and what was expected."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: expected a JSON object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise ValueError(
            f"{source}: not a zerobubble schedule: format is {data.get('format')!r}, "
            f"expected {FORMAT!r}"
        )
    for key in ("num_devices", "num_stages", "num_microbatches", "placement", "actions"):
        if key not in data:
            raise ValueError(f"{source}: missing the field {key!r}")
    rows = data["actions"]
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise ValueError(
            f"{source}: 'actions' must be a list with one list of actions per device, "
            f"got {rows!r:.60}"
        )
    actions = [
        tuple(_parsed(a, f"{source}: device {d} position {i}") for i, a in enumerate(acts))
        for d, acts in enumerate(rows)
    ]
    pairs = data.get("overlaps", [])
    if not isinstance(pairs, list) or not all(isinstance(p, list) and len(p) == 2 for p in pairs):
        raise ValueError(f"{source}: 'overlaps' must be a list of [F, B] pairs, got {pairs!r:.60}")
    overlaps = tuple(
        (_parsed(f, f"{source}: overlap {i}"), _parsed(b, f"{source}: overlap {i}"))
        for i, (f, b) in enumerate(pairs)
    )
    placement = data["placement"]
    if not isinstance(placement, list) or not all(_is_int(x) for x in placement):
        raise ValueError(
            f"{source}: 'placement' must be a list of device numbers, one per stage, "
            f"got {placement!r:.60}"
        )
    counts = {k: _count(data, k, source) for k in ("num_devices", "num_stages", "num_microbatches")}
    segments = _count(data, "segments", source) if "segments" in data else 1
    total = sum(len(r) for r in actions)
    if counts["num_microbatches"] * segments > total:
        raise ValueError(
            f"{source}: num_microbatches={counts['num_microbatches']} but the file holds "
            f"{total} actions, and every microbatch needs a forward on every stage; "
            "fix num_microbatches"
        )
    return Schedule(
        name=str(data.get("name", "schedule")),
        num_devices=counts["num_devices"],
        num_stages=counts["num_stages"],
        num_microbatches=counts["num_microbatches"],
        placement=tuple(placement),
        actions=tuple(actions),
        segments=segments,
        overlaps=overlaps,
    )


def _parsed(a: object, where: str) -> Action:
    if isinstance(a, dict):
        name, stage, mb = a.get("op"), a.get("stage"), a.get("mb")
        op = _OPS.get(name) if isinstance(name, str) else None
        if op is not None and _is_int(stage) and _is_int(mb):
            return Action(op, stage, mb)
    raise ValueError(
        f'{where}: bad action {a!r}; expected {{"op": "F"|"B"|"W"|"BW", "stage": int, "mb": int}}'
    )


_OPS = {op.value: op for op in Op}


def _is_int(x: object) -> TypeGuard[int]:
    """A JSON integer (``bool`` is an ``int`` subclass but not a count here)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _count(data: Mapping[str, Any], key: str, source: str) -> int:
    x = data[key]
    if not _is_int(x) or x < 1:
        raise ValueError(f"{source}: {key!r} must be an integer >= 1, got {x!r}")
    return x


def read_json(path: str | Path, what: str = "JSON file") -> object:
    """A JSON file's value; a syntax error names the file, the line and the column
    (and text that is not UTF-8 the file, ``what`` it is and the line)."""
    p = Path(path)
    return parse_json(read_text(p, what), str(p))


def parse_json(text: str, source: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{source}: not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None


def loads(text: str, source: str = "schedule JSON") -> Schedule:
    return from_dict(parse_json(text, source), source)


def load(path: str | Path) -> Schedule:
    return loads(read_text(path, "schedule file"), str(path))


def save(schedule: Schedule, path: str | Path) -> None:
    Path(path).write_text(dumps(schedule))
