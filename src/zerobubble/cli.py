"""The ``zerobubble`` command line: thin glue over the library.

Subcommand names and flags are fixed (scripts depend on them)::

    zerobubble schedule KIND -p P -m M [--chunks V] [--costs F=1,B=1,W=1,comm=0]
                         [--costs-file F] [--mem-limit X] [--mem-w R] [--split-backward]
                         [--format text|json|csv] [-o FILE]
    zerobubble simulate FILE [--costs ...] [--costs-file F] [--mem-w R] [--mem-limit X] [--json]
    zerobubble compare -p P -m M [--costs ...] [--costs-file F] [--mem-limit X] [--plot FILE.png]
    zerobubble train [-p P] [-m M] [--steps N] [--layers L] [--mem-limit BYTES] [--out DIR] ...
    zerobubble profile [same flags as train]
    zerobubble check-trace TRACE [--mem-budget BYTES] [--tolerance-us US] [--opt-op NAME]
                           [--conservative]
    zerobubble demo [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING

from zerobubble.schedule.costs import CostSpec, Number, load_costs_file, parse_costs

if TYPE_CHECKING:
    from zerobubble.train.config import TrainConfig

EXIT_BAD_INPUT = 2


def _number(text: str) -> Number:
    try:
        return Fraction(text) if "/" in text else (int(text) if text.isdigit() else float(text))
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _microseconds(text: str) -> float:
    """A finite duration >= 0 (NaN would silently disable the check it bounds)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a finite number of microseconds >= 0; give e.g. 1000"
        )
    return value


def _add_cost_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--costs",
        default="F=1,B=1,W=1,comm=0",
        help="per-device totals of F, B, W and cross-device latency comm "
        "(a device with v chunks spends 1/v per chunk); default %(default)s",
    )
    p.add_argument(
        "--costs-file",
        type=Path,
        help="JSON with per-virtual-stage arrays F, B, W (and optional comm, mem_B, mem_W, "
        "mem_limit), e.g. written by the profiler; overrides --costs",
    )
    p.add_argument(
        "--mem-w",
        type=_number,
        default=0.5,
        help="r = M_W / M_B, the share of activation memory kept after B until W (default 0.5)",
    )
    p.add_argument(
        "--mem-limit",
        type=_number,
        help="activation-memory limit per device in M_B units (or the costs file's units)",
    )


def _cost_spec(args: argparse.Namespace) -> CostSpec:
    if args.costs_file is not None:
        return load_costs_file(args.costs_file)
    return parse_costs(args.costs, mem_w=args.mem_w)


def _mem_limit(args: argparse.Namespace, spec: CostSpec) -> Number | None:
    return args.mem_limit if args.mem_limit is not None else spec.mem_limit


# ---- subcommands -----------------------------------------------------------------------------


def cmd_schedule(args: argparse.Namespace) -> int:
    from zerobubble.schedule.formats import json_format, text, torch_csv
    from zerobubble.schedule.generators import GENERATORS, generate
    from zerobubble.schedule.validate import validate

    spec = _cost_spec(args)
    limit = _mem_limit(args, spec)
    gen = GENERATORS.get(args.kind)
    sched = generate(
        args.kind,
        args.p,
        args.m,
        chunks=args.chunks,
        split_backward=args.split_backward,
        costs=spec,
        mem_limit=limit if gen is not None and "mem_limit" in gen.options else None,
    )
    result = validate(sched, mem_limit=limit, costs=spec.resolve(sched.placement))
    if args.format == "json":
        out = json_format.dumps(sched)
    elif args.format == "csv":
        out = torch_csv.dumps(sched)
    else:
        out = text.render(sched, result=result) + "\n"
    if args.output:
        Path(args.output).write_text(out)
    else:
        sys.stdout.write(out)
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from zerobubble.schedule.formats import load_schedule, text
    from zerobubble.schedule.validate import validate

    sched = load_schedule(args.file, num_microbatches=args.m)
    spec = _cost_spec(args)
    result = validate(sched, mem_limit=_mem_limit(args, spec), costs=spec.resolve(sched.placement))
    if args.json:
        summary = result.summary()
        summary["idle"] = [[[float(a), float(b)] for a, b in gaps] for gaps in result.idle]
        print(json.dumps(summary, indent=2))
    else:
        print(text.render(sched, result=result))
        _print_table([(sched.name, result)], None)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from zerobubble.schedule.compare import compare

    spec = _cost_spec(args)
    entries = compare(
        args.p, args.m, spec, args.kinds, mem_limit=_mem_limit(args, spec), chunks=args.chunks
    )
    if args.json:
        print(
            json.dumps(
                [
                    {"kind": e.kind, **(e.result.summary() if e.result else {"error": e.error})}
                    for e in entries
                ],
                indent=2,
            )
        )
    else:
        _print_table(
            [(e.kind, e.result or e.error) for e in entries],
            f"P={args.p} M={args.m} costs: {_describe(args)}",
        )
    if args.plot:
        from zerobubble.viz.timeline import plot_results

        path = plot_results([e.result for e in entries if e.result is not None], args.plot)
        print(f"timelines written to {path}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Profile -> plan -> train on local CPU ranks (or this rank, under torchrun)."""
    from zerobubble.runtime.launcher import LaunchError, launch
    from zerobubble.train.console import ConsoleReporter, print_summary
    from zerobubble.train.job import run_job

    cfg = _train_config(args)
    reporter = ConsoleReporter()
    began = time.perf_counter()
    if "RANK" in os.environ:  # started by torchrun or zerobubble.launch: this process is a rank
        result = run_job(cfg, reporter)
    else:
        try:
            result = launch(run_job, cfg.devices, cfg, reporter, timeout=args.timeout)[0]
        except LaunchError as exc:
            print(f"zerobubble {args.command}: the job failed: {exc}", file=sys.stderr)
            return 1
    if result is None:  # not rank 0
        return 0
    print_summary(result, reporter.console)
    reporter.info(f"wall time {time.perf_counter() - began:.1f} s")
    report = result.trace_report
    return 0 if report is None or report.ok else 1


def cmd_check_trace(args: argparse.Namespace) -> int:
    from zerobubble.schedule.trace_check import DEFAULT_OPT_OPS, check_trace, load_trace

    events, lines = load_trace(args.trace)
    report = check_trace(
        events,
        lines=lines,
        mem_budget=args.mem_budget,
        tolerance_ns=int(args.tolerance_us * 1000),
        opt_ops=args.opt_op or DEFAULT_OPT_OPS,
        conservative=args.conservative,
    )
    for note in report.notes:
        print(f"note: {note}")
    if not report.ok:
        print(f"FAIL: {report.first}")
        if len(report.violations) > 1:
            print(f"({len(report.violations) - 1} more violations of the same check)")
        return 1
    print(
        f"OK: {report.num_events} events, ranks {list(report.ranks)}, "
        f"{len(report.iterations)} iterations"
    )
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    """The main job: ``zerobubble train`` with its defaults."""
    return cmd_train(build_parser().parse_args(["train", "--out", str(args.out)]))


def _train_config(args: argparse.Namespace) -> TrainConfig:
    from zerobubble.train.config import TrainConfig, default_devices

    devices = args.p
    if devices is None:
        devices = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else default_devices()
    d = TrainConfig()
    return TrainConfig(
        devices=devices,
        microbatches=args.m if args.m is not None else max(d.microbatches, 2 * devices),
        microbatch_size=args.microbatch_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_heads=args.heads,
        n_layers=args.layers if args.layers is not None else max(d.n_layers, devices),
        lr=args.lr,
        grad_clip=args.grad_clip,
        steps=args.steps,
        baseline_steps=args.baseline_steps,
        warmup=args.warmup,
        mem_limit=args.mem_limit,
        mem_ratio=args.mem_ratio,
        seed=args.seed,
        out=str(args.out),
        profile_only=args.command == "profile",
    )


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from zerobubble.train.config import TrainConfig

    d = TrainConfig()
    p.add_argument("-p", type=int, help="pipeline ranks (default: one per CPU core)")
    p.add_argument(
        "-m", type=int, help=f"microbatches per step (default: max({d.microbatches}, 2P))"
    )
    p.add_argument("--microbatch-size", type=int, default=d.microbatch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--d-model", type=int, default=d.d_model)
    p.add_argument("--heads", type=int, default=d.n_heads)
    p.add_argument("--layers", type=int, help=f"transformer blocks (default: max({d.n_layers}, P))")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument(
        "--grad-clip",
        type=float,
        default=d.grad_clip,
        help="clip the global gradient norm to this (default %(default)s)",
    )
    p.add_argument("--steps", type=int, default=d.steps, help="measured steps of each schedule")
    p.add_argument(
        "--baseline-steps",
        type=int,
        default=d.baseline_steps,
        help="profiling steps of 1F1B and ZB-H1 each",
    )
    p.add_argument("--warmup", type=int, default=d.warmup, help="unmeasured steps per phase")
    p.add_argument("--mem-limit", type=int, help="activation bytes per device the plan may hold")
    p.add_argument(
        "--mem-ratio",
        type=float,
        default=d.mem_ratio,
        help="without --mem-limit: this multiple of 1F1B's predicted peak (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", type=Path, default=Path(d.out), help="folder for outputs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole job")


def _describe(args: argparse.Namespace) -> str:
    return str(args.costs_file) if args.costs_file else f"{args.costs} r={float(args.mem_w):g}"


def _print_table(rows: Sequence[tuple[str, object]], caption: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    from zerobubble.schedule.simulate import SimResult

    table = Table(title=caption, title_justify="left")
    for col in ("schedule", "cost", "bubble rate", "bubble (makespan)", "peak memory"):
        table.add_column(col, justify="left" if col == "schedule" else "right")
    for name, r in rows:
        if isinstance(r, SimResult):
            table.add_row(
                name,
                f"{float(r.cost):g}",
                f"{r.bubble_rate:.2%}",
                f"{r.bubble_rate_makespan:.2%}",
                f"{float(max(r.peak_memory)):g}",
            )
        else:
            table.add_row(name, "-", "-", "-", f"n/a: {str(r)[:70]}")
    Console(width=120).print(table)


# ---- parser --------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from zerobubble.schedule.generators import GENERATORS

    parser = argparse.ArgumentParser(
        prog="zerobubble", description="Zero-bubble pipeline-parallel schedules for PyTorch."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schedule", help="generate, validate and print a schedule")
    p.add_argument(
        "kind", choices=list(GENERATORS), metavar="KIND", help="one of: " + ", ".join(GENERATORS)
    )
    p.add_argument("-p", type=int, required=True, help="number of devices (pipeline ranks)")
    p.add_argument("-m", type=int, required=True, help="number of microbatches")
    p.add_argument("--chunks", type=int, help="chunks per device (interleaved kinds)")
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="baselines: write each BW as B immediately followed by W",
    )
    _add_cost_args(p)
    p.add_argument("--format", choices=("text", "json", "csv"), default="text")
    p.add_argument("-o", "--output", help="write to FILE instead of stdout")
    p.set_defaults(func=cmd_schedule)

    p = sub.add_parser("simulate", help="validate and simulate a schedule file (JSON or torch CSV)")
    p.add_argument("file", type=Path)
    p.add_argument("-m", type=int, help="microbatches (CSV only; default: inferred)")
    _add_cost_args(p)
    p.add_argument("--json", action="store_true", help="print figures as JSON")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("compare", help="every schedule kind side by side")
    p.add_argument("-p", type=int, required=True)
    p.add_argument("-m", type=int, required=True)
    p.add_argument("--kinds", nargs="+", help="subset of kinds (default: all)")
    p.add_argument("--chunks", type=int, default=2, help="chunks for interleaved kinds")
    _add_cost_args(p)
    p.add_argument("--plot", type=Path, help="write all timelines to this PNG")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("train", help="profile, plan and train a small GPT on local CPU ranks")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("profile", help="measure stage costs and write the costs file")
    _add_train_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("check-trace", help="check an executed pipeline's JSONL trace")
    p.add_argument("trace", type=Path)
    p.add_argument("--mem-budget", type=int, help="activation bytes per rank never to exceed")
    p.add_argument(
        "--tolerance-us",
        type=_microseconds,
        default=1000.0,
        help="slack of the cross-rank causality check in microseconds (default %(default)s)",
    )
    p.add_argument(
        "--opt-op",
        action="append",
        help="event op that reads or applies an iteration's gradients (default: every opt_* "
        "op of zerobubble.optim that does); repeatable",
    )
    p.add_argument(
        "--conservative",
        action="store_true",
        help="the run used conservative post-validation: no forward of k+1 before k is committed",
    )
    p.set_defaults(func=cmd_check_trace)

    p = sub.add_parser("demo", help="the main job (what `make demo` runs): zerobubble train")
    p.add_argument("--out", default="out", help="folder for pictures and traces")
    p.set_defaults(func=cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # ScheduleError is a ValueError
        print(f"zerobubble {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    raise SystemExit(main())
