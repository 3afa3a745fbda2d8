"""Bad input, as a table: each row is a command line (and the files it reads), the exit
status it must give and fragments its message must hold. Exit 2 is a refusal with one
message naming the input, the problem and the fix; never a traceback, never exit 0.

docs/e2e.md ("Bad input and how it is reported") lists the same cases.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from zerobubble.cli import main
from zerobubble.schedule.costs import CostModel, load_costs_file
from zerobubble.schedule.formats import json_format, load_schedule, torch_csv
from zerobubble.schedule.generators import generate
from zerobubble.schedule.validate import validate
from zerobubble.trace.format import read_jsonl
from zerobubble.train.options import load_toml

SCHEDULE = json.loads(json_format.dumps(generate("zb-h1", 2, 4)))


def schedule_with(**fields: object) -> str:
    return json.dumps({**SCHEDULE, **fields})


def schedule_with_mb(mb: object) -> str:
    data = json.loads(json.dumps(SCHEDULE))
    data["actions"][0][0]["mb"] = mb
    return json.dumps(data)


TINY = [
    "-p", "2", "-m", "4", "--layers", "1", "--d-model", "16", "--heads", "2",
    "--seq-len", "8", "--microbatch-size", "2",
]  # fmt: skip

# (id, argv with {f} for the file, file content or None, exit status, message fragments)
CASES = [
    (
        "costs-file-scalars",
        "schedule zb-h1 -p 2 -m 4 --costs-file {f}",
        '{"F": 1, "B": 1, "W": 1}',
        2,
        ["infile: ", "'F' must be a non-empty array of numbers", '"F": [1.0, 1.0]'],
    ),
    (
        "costs-file-syntax",
        "schedule zb-h1 -p 2 -m 4 --costs-file {f}",
        '{"F": [1, 1],\n "B": [1, 1] "W": [1, 1]}',
        2,
        ["infile: ", "not valid JSON", "line 2 column"],
    ),
    (
        "costs-file-zero",
        "schedule zb-h1 -p 2 -m 4 --costs-file {f}",
        '{"F": [0, 0], "B": [0, 0], "W": [0, 0]}',
        2,
        ["infile: ", "every F, B and W is 0"],
    ),
    (
        "simulate-actions-int",
        "simulate {f}",
        schedule_with(actions=5),
        2,
        ["infile: ", "'actions' must be a list with one list of actions per device, got 5"],
    ),
    (
        "simulate-num-devices-null",
        "simulate {f}",
        schedule_with(num_devices=None),
        2,
        ["'num_devices' must be an integer >= 1, got None"],
    ),
    (
        "simulate-placement-null",
        "simulate {f}",
        schedule_with(placement=None),
        2,
        ["'placement' must be a list of device numbers, one per stage, got None"],
    ),
    (
        "simulate-huge-m",
        "simulate {f}",
        schedule_with(num_microbatches=10**30),
        2,
        [f"num_microbatches={10**30}", "holds 24 actions", "fix num_microbatches"],
    ),
    (
        "simulate-fractional-mb",
        "simulate {f}",
        schedule_with_mb(0.7),
        2,
        ["device 0 position 0: bad action", "'mb': 0.7", '"mb": int'],
    ),
    (
        "simulate-syntax",
        "simulate {f}",
        '{"format": "zerobubble.schedule/1",\n\n  "name": }',
        2,
        ["infile: ", "not valid JSON", "line 3 column 11"],
    ),
    (
        "simulate-csv-huge-m",
        f"simulate {{f}} -m {10**30}",
        "0F0,0I0,0W0\n",
        2,
        [f"{10**30} microbatches but the CSV holds 3 compute actions", "own -m"],
    ),
    (
        "schedule-huge-m",
        f"schedule zb-h1 -p 2 -m {10**30}",
        None,
        2,
        ["-p 2 -m 1000", "more than the command line builds", "pick a smaller P or M"],
    ),
    ("compare-p0", "compare -p 0 -m 4", None, 2, ["number of devices P must be an integer >= 1"]),
    (
        "compare-m0",
        "compare -p 2 -m 0",
        None,
        2,
        ["number of microbatches M must be an integer >= 1, got 0"],
    ),
    (
        "costs-all-zero",
        "schedule zb-h1 -p 2 -m 4 --costs F=0,B=0,W=0",
        None,
        2,
        ["'F=0,B=0,W=0'", "F + B + W is 0", "e.g. F=1,B=1,W=1"],
    ),
    ("costs-negative", "compare -p 2 -m 4 --costs F=-1", None, 2, ["'F=-1'", ">= 0"]),
    ("mem-limit-nan", "schedule zb-h1 -p 2 -m 4 --mem-limit nan", None, 2, ["not a number"]),
    (
        "bench-one-device",
        "bench -p 1",
        None,
        2,
        ["schedule.devices must be >= 2, got 1", "pass -p 2 or more"],
    ),
    ("bench-negative-steps", "bench -p 2 --steps -1", None, 2, ["job.steps must be >= 0, got -1"]),
    (
        "bench-heads",
        "bench -p 2 --heads 3",
        None,
        2,
        ["model.d_model=128 is not divisible by model.n_heads=3", "divisors of --d-model"],
    ),
    (
        "bench-out-below-file",
        "bench -p 2 --out {f}/sub",
        "a regular file",
        2,
        ["cannot create the output folder", "infile is a file, not a folder"],
    ),
    (
        "bench-fractional-layers",
        "bench -p 2 --layers 0.5",
        None,
        2,
        ["--model.n-layers", "expected an integer, got '0.5'"],
    ),
    ("bench-nan-lr", "bench -p 2 --lr nan", None, 2, ["optimizer.lr must be a finite number"]),
    (
        "bench-too-few-layers",
        "bench -p 8 --layers 2",
        None,
        2,
        ["8 devices need at least 8 layers but the model has 5", "--layers 5"],
    ),
    (
        "bench-config-unknown-key",
        "bench --config {f}",
        "[model]\nwidth = 3\n",
        2,
        ["infile: ", "unknown key 'model.width'", "[model] takes d_model, n_heads"],
    ),
    (
        "bench-config-float-for-int",
        "bench --config {f}",
        "[job]\nmicrobatch_size = 0.7\n",
        2,
        ["job.microbatch_size must be an integer, got 0.7"],
    ),
    (
        "bench-config-syntax",
        "bench --config {f}",
        "[job]\nsteps = = 3\n",
        2,
        ["infile: ", "not valid TOML", "line 2"],
    ),
    (
        "bench-config-not-a-section",
        "bench --config {f}",
        "steps = 3\n",
        2,
        ["'steps' is not a section", "[job]"],
    ),
    # Absurd cost values: refused naming the file and the field (1e308 was an
    # OverflowError traceback: its makespan is inf).
    (
        "costs-file-1e308",
        "schedule zb-h1 -p 2 -m 2 --costs-file {f}",
        '{"F": [1e308, 1e308], "B": [1e308, 1e308], "W": [1, 1]}',
        2,
        ["infile: ", "F[0]=1e+308", "at most 1e+15"],
    ),
    (
        "costs-file-infinity",
        "schedule auto -p 2 -m 2 --costs-file {f}",
        '{"F": [1, 1], "B": [1, Infinity], "W": [1, 1]}',
        2,
        ["infile: ", "B[1]=inf", "at most 1e+15"],
    ),
    (
        "costs-file-nan",
        "simulate-costs",
        '{"F": [1, NaN], "B": [1, 1], "W": [1, 1]}',
        2,
        ["infile: ", "F[1]=nan", "not NaN"],
    ),
    (
        "costs-file-negative",
        "schedule zb-h1 -p 2 -m 2 --costs-file {f}",
        '{"F": [1, 1], "B": [1, 1], "W": [1, -1]}',
        2,
        ["infile: ", "W[1]=-1", ">= 0"],
    ),
    (
        "costs-file-huge-comm-and-limit",
        "schedule zb-auto -p 2 -m 2 --costs-file {f}",
        '{"F": [1, 1], "B": [1, 1], "W": [1, 1], "mem_limit": 1e300}',
        2,
        ["infile: ", "mem_limit=1e+300", "at most 1e+15"],
    ),
    (
        "costs-file-huge-mem",
        "schedule zb-h1 -p 2 -m 2 --costs-file {f}",
        '{"F": [1, 1], "B": [1, 1], "W": [1, 1], "mem_B": [1e20, 1]}',
        2,
        ["infile: ", "mem_B[0]=1e+20"],
    ),
    ("costs-flag-1e308", "compare -p 2 -m 4 --costs F=1e308", None, 2, ["'F=1e308'", "1e+15"]),
    # Costs 1e300 apart: drawn (the timeline's columns are clamped), not an OverflowError.
    (
        "costs-file-tiny",
        "schedule zb-h1 -p 2 -m 2 --costs-file {f}",
        '{"F": [1e-300, 1], "B": [1, 1], "W": [1, 1]}',
        0,
        [],
    ),
    (
        "node-limit-not-exact",
        "schedule zbv -p 3 -m 4 --node-limit 3",
        None,
        2,
        ["--node-limit is for the exact searches optimal and optimal-v, not 'zbv'"],
    ),
    (
        "node-limit-zero",
        "schedule optimal -p 2 -m 2 --node-limit 0",
        None,
        2,
        ["argument --node-limit: expected an integer >= 1, got '0'"],
    ),
    (
        "root-time-limit-not-exact",
        "schedule zb-auto -p 3 -m 4 --root-time-limit 5",
        None,
        2,
        ["--root-time-limit is for the exact searches optimal and optimal-v, not 'zb-auto'"],
    ),
    (
        "root-time-limit-nan",
        "schedule optimal -p 2 -m 2 --root-time-limit nan",
        None,
        2,
        ["argument --root-time-limit: expected a number of seconds > 0, got 'nan'"],
    ),
    # Files that are not UTF-8: each message names the file and the line.
    (
        "costs-file-not-utf8",
        "schedule zb-h1 -p 2 -m 2 --costs-file {f}",
        b'{"F": [1, 1],\n "B": [1, 1], "W": [1, 1], "x": "\xe9"}',
        2,
        ["infile: the costs file is not UTF-8 text", "0xe9 on line 2", "save it as UTF-8"],
    ),
    (
        "simulate-json-not-utf8",
        "simulate {f}",
        b"\xff\xfe{}",
        2,
        ["infile: the schedule file is not UTF-8 text", "0xff on line 1"],
    ),
    (
        "simulate-csv-not-utf8",
        "simulate {f}",
        b"0F0,0I0,0W0\n0F1,0I1,0W1\x80\n",
        2,
        ["infile: the schedule file is not UTF-8 text", "0x80 on line 2"],
    ),
    (
        "check-trace-not-utf8",
        "check-trace {f}",
        b"\n\n\xc3\x28\n",
        2,
        ["infile: the trace is not UTF-8 text", "0xc3 on line 3"],
    ),
    (
        "bench-config-not-utf8",
        "bench --config {f}",
        b"[job]\nsteps = 3 # \xe9t\xe9\n",
        2,
        ["infile: the config file is not UTF-8 text", "0xe9 on line 2"],
    ),
]


def exit_status(argv: list[str]) -> int:
    """``main``'s status; argparse's own refusals (a flag's type) exit 2 by SystemExit."""
    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argv", "content", "code", "fragments"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_bad_input_table(argv, content, code, fragments, tmp_path, capsys):
    path = tmp_path / "infile"  # one name for every file: the fragments can name it
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    if argv == "simulate-costs":  # a schedule file and the costs file
        sched = tmp_path / "sched.json"
        sched.write_text(json_format.dumps(generate("zb-h1", 2, 4)))
        argv = f"simulate {sched} --costs-file {{f}}"
    assert exit_status([a.format(f=path) for a in argv.split()]) == code
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err + captured.out
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_argparse_refusals_exit_2_naming_the_flag(capsys):
    assert exit_status(["bench", "--steps", "three"]) == 2
    assert "argument --steps/--job.steps: expected an integer, got 'three'" in (
        capsys.readouterr().err
    )


def test_validate_refuses_a_nan_memory_limit():
    sched = generate("zb-h1", 3, 6)
    with pytest.raises(ValueError, match="mem_limit is NaN"):
        validate(sched, mem_limit=float("nan"))
    assert validate(sched, mem_limit=math.inf).cost == validate(sched).cost


def test_schedule_json_errors_name_the_source():
    with pytest.raises(ValueError, match=r"^my\.json: not valid JSON: .* line 1 column 2$"):
        json_format.loads("{,}", "my.json")


@pytest.mark.slow
def test_unplannable_memory_limit_is_one_message_from_the_parent(tmp_path, capfd):
    """Found only after profiling: every rank stops alike, the parent prints one message."""
    argv = ["bench", *TINY, "--steps", "1", "--baseline-steps", "1", "--mem-limit", "1"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    captured = capfd.readouterr()
    assert "Traceback" not in captured.err and "rank " not in captured.err
    assert "cannot plan auto within --mem-limit 1 bytes per device" in captured.err
    assert "raise the limit to at least" in captured.err


def test_api_refuses_absurd_costs_and_files_that_are_not_utf8(tmp_path):
    """The library's own readers and the cost model, not only the command line."""
    with pytest.raises(ValueError, match=r"^f\[0\]=1e\+308 must be finite and at most 1e\+15"):
        CostModel.per_stage([1e308], [1], [1])
    with pytest.raises(ValueError, match=r"^comm=nan must be a number, not NaN$"):
        CostModel.per_stage([1], [1], [1], comm=math.nan)
    path = tmp_path / "file.txt"
    path.write_bytes(b"\xff\n")
    readers = {
        "schedule file": (load_schedule, json_format.load, torch_csv.load),
        "costs file": (load_costs_file,),
        "trace": (read_jsonl,),
        "config file": (load_toml,),
    }
    for what, loads in readers.items():
        for load in loads:
            with pytest.raises(ValueError, match=rf"^{path}: the {what} is not UTF-8 text "):
                load(path)


# ---- sizes from outside: refused before anything is sized by them, under a memory limit ----

MEMORY_LIMIT = 512 * 2**20
"""Address space of the process that runs the cases below (Python and the torch-free command
line need about 30 MB resident): MemoryError, or being killed, fails the test."""


def _mutated(path, out, where: str, field: str, value: int, index: int = 1) -> None:
    """``path``'s trace with ``field`` of its first compute (``where="compute"``) or message
    (``"message"``) event set to ``value`` (``msg`` takes ``index`` of the message id)."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        d = json.loads(line)
        if (d["msg"] is None) == (where == "compute"):
            if field == "msg":
                d["msg"][index] = value
            else:
                d[field] = value
            lines[i] = json.dumps(d)
            break
    out.write_text("\n".join(lines) + "\n")


def test_sizes_from_outside_exit_2_naming_the_field_and_the_limit_in_bounded_memory(tmp_path):
    """Each case was a MemoryError under a 3 GB cap, or ran without end (the trace checker
    walked every (stage, microbatch) pair up to a mutated index; seq-zb built 2e9 units)."""
    import subprocess
    import sys

    from synthetic_trace import synthetic_trace
    from zerobubble.trace.format import write_jsonl

    files = {}
    for name, sched in (
        ("seg", generate("seq-zb", 2, 4, segments=2)),
        ("ov", generate("dualpipev", 2, 4, overlap=True)),
    ):
        files[f"{name}.json"] = tmp_path / f"{name}.json"
        files[f"{name}.json"].write_text(json_format.dumps(sched))
        trace = tmp_path / f"{name}.jsonl"
        write_jsonl(synthetic_trace(sched), trace)
        for where, field, value, index in (
            ("compute", "mb", 10**7, 1),
            ("compute", "mb", 10**30, 1),
            ("compute", "stage", 10**7, 1),
            ("compute", "stage", 10**30, 1),
            ("compute", "rank", 10**7, 1),
            ("message", "msg", 10**30, 3),
            ("message", "msg", 10**7, 2),
        ):
            key = f"{name}-{field}{index if field == 'msg' else ''}-{value:.0e}"
            files[key] = tmp_path / f"{key}.jsonl"
            _mutated(trace, files[key], where, field, value, index)
    files["sched-mb"] = tmp_path / "sched-mb.json"
    files["sched-mb"].write_text(schedule_with_mb(10**30))
    files["csv-stage"] = tmp_path / "stage.csv"
    files["csv-stage"].write_text("10000000F0,0I0,0W0\n")
    big = f"{10**30}"
    cases = [  # argv ({name} is files[name]), message fragments
        ("schedule seq-zb -p 2 -m 2 --segments 1000000000", ["--segments 1000000000", "(4e+06)"]),
        ("schedule seq1f1b -p 2 -m 2 --segments 1000000000", ["pick fewer --segments"]),
        ("schedule zb-h1 -p 10000000 -m 1", ["-p 10000000 -m 1 means about", "4e+06"]),
        ("check-trace {seg-mb-1e+07}", ["field 'mb' = 10000000", "must be in [0, 98)"]),
        ("check-trace {seg-mb-1e+30} --segments 2", [f"field 'mb' = {big}", "[0, 98)"]),
        ("check-trace {seg-mb-1e+07} --schedule {seg.json}", ["'mb' = 10000000", "8 units"]),
        ("check-trace {seg-mb-1e+30} --segments 2 --schedule {seg.json}", ["[0, 8)"]),
        ("check-trace {ov-mb-1e+30}", [f"field 'mb' = {big}", "[0, 87)"]),
        ("check-trace {ov-mb-1e+07} --schedule {ov.json}", ["'mb' = 10000000", "[0, 4)"]),
        ("check-trace {seg-stage-1e+07}", ["field 'stage' = 10000000", "[0, 98)"]),
        ("check-trace {ov-stage-1e+30} --schedule {ov.json}", ["'stage'", "4 stages"]),
        ("check-trace {seg-msg3-1e+30}", [f"field 'msg[3]' = {big}"]),
        ("check-trace {ov-msg2-1e+07} --schedule {ov.json}", ["field 'msg[2]' = 10000000"]),
        ("check-trace {seg-rank-1e+07} --schedule {seg.json}", ["'rank' = 10000000", "2 devices"]),
        ("simulate {sched-mb}", ["[out_of_range]", f"microbatch {big} is outside [0, 4)"]),
        ("simulate {csv-stage}", ["a cell names stage 10000000", "must be < 3"]),
    ]
    argvs = [
        [str(files[a[1:-1]]) if a.startswith("{") else a for a in argv.split()] for argv, _ in cases
    ]
    script = (
        "import contextlib, io, json, sys\n"
        "from zerobubble.cli import main\n"
        "out = []\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            code = main(argv)\n"
        "        except SystemExit as e:\n"
        "            code = e.code\n"
        "    out.append((code, err.getvalue()))\n"
        "print(json.dumps(out))\n"
    )

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))

    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit,
        env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    for (argv, fragments), (code, err) in zip(cases, got, strict=True):
        assert code == 2, (argv, code, err)
        assert "Traceback" not in err and "MemoryError" not in err, (argv, err)
        for fragment in fragments:
            assert fragment in err, (argv, fragment, err)
