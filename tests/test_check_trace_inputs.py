"""``zerobubble check-trace`` without torch, and on every kind of malformed input."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from synthetic_trace import synthetic_trace
from zerobubble.cli import main
from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Op
from zerobubble.trace.format import EventOp, TraceEvent, read_jsonl, write_jsonl

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def trace_file(tmp_path) -> Path:
    path = tmp_path / "trace.jsonl"
    write_jsonl(synthetic_trace(generate("zbv", 3, 6), latency=7), path)
    return path


def test_check_trace_never_imports_torch(trace_file):
    code = (
        "import sys\n"
        "from zerobubble.cli import main\n"
        f"rc = main(['check-trace', {str(trace_file)!r}])\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print('torch modules:', loaded)\n"
        "sys.exit(rc if not loaded else 3)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert "torch modules: []" in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: " in done.stdout


def test_events_parse_op_and_message_kind_into_enums(trace_file):
    events = read_jsonl(trace_file)
    assert events == synthetic_trace(generate("zbv", 3, 6), latency=7)
    assert {type(e.op) for e in events} == {Op, EventOp}
    assert {type(e.msg[0]) for e in events if e.msg is not None} == {MsgKind}
    for e in events:
        assert TraceEvent.from_dict(dataclasses.asdict(e)) == e
    # What the executor passes (strings) is parsed the same way.
    assert TraceEvent(**{**dataclasses.asdict(events[0]), "op": "F"}).op is Op.F


def _valid_line(trace_file: Path) -> str:
    return trace_file.read_text().splitlines()[0]


def _with_field(trace_file: Path, field: str, value: object) -> str:
    d = json.loads(_valid_line(trace_file))
    d[field] = value
    return json.dumps(d)


BAD_LINES = {
    # name: (second line of the file, words the message must contain)
    "array": (lambda f: "[1, 2, 3]", ["JSON array, not an object", "write one event object"]),
    "null": (lambda f: "null", ["JSON null, not an object"]),
    "string": (lambda f: '"hello"', ["JSON string, not an object"]),
    "rank": (lambda f: _with_field(f, "rank", "zero"), ["'rank'", '"zero"', "an integer"]),
    "start_ns": (lambda f: _with_field(f, "start_ns", "soon"), ["'start_ns'", '"soon"']),
    "iteration": (lambda f: _with_field(f, "iteration", None), ["'iteration'", "is null"]),
    "bool": (lambda f: _with_field(f, "mb", True), ["'mb'", "true", "an integer or null"]),
    "msg": (lambda f: _with_field(f, "msg", ["act", 0]), ["'msg'", "[kind, src stage"]),
    "missing": (
        lambda f: json.dumps({k: v for k, v in json.loads(_valid_line(f)).items() if k != "op"}),
        ["'op'", "is missing", "add it"],
    ),
    "unknown": (lambda f: _with_field(f, "colour", 1), ["'colour'", "not an event field"]),
    "syntax": (lambda f: '{"rank": 0,', ["not valid JSON", "one JSON object per line"]),
    "nan": (lambda f: _with_field(f, "start_ns", 1).replace(": 1,", ": NaN,"), ["NaN"]),
}


@pytest.mark.parametrize("name", BAD_LINES)
def test_a_malformed_line_exits_2_naming_file_line_field_and_fix(name, trace_file, capsys):
    line, words = BAD_LINES[name]
    trace_file.write_text(_valid_line(trace_file) + "\n" + line(trace_file) + "\n")
    assert main(["check-trace", str(trace_file)]) == 2
    err = capsys.readouterr().err
    assert f"{trace_file}:2:" in err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "soon"])
def test_tolerance_must_be_a_finite_non_negative_number(value, trace_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check-trace", str(trace_file), "--tolerance-us", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tolerance-us" in err and repr(value) in err and "finite" in err


def test_a_missing_file_exits_2(tmp_path, capsys):
    assert main(["check-trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "nope.jsonl" in capsys.readouterr().err


def test_an_empty_file_exits_2(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert main(["check-trace", str(path)]) == 2
    assert f"{path}: no events" in capsys.readouterr().err
