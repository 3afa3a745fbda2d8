"""The ``zerobubble`` command line: thin glue over the library.

Subcommand names and flags are fixed (scripts depend on them)::

    zerobubble schedule KIND -p P -m M [--chunks V] [--segments K] [--overlap]
                         [--costs F=1,B=1,W=1,comm=0,a2a=0] [--costs-file F]
                         [--mem-limit X] [--mem-w R] [--split-backward]
                         [--node-limit N] [--root-time-limit S] [--time-budget S]
                         [--format text|json|csv|program]
                         [--rank R] [--dp N] [--fsdp] [--protocol P] [-o FILE]
    zerobubble simulate FILE [--costs ...] [--costs-file F] [--mem-w R] [--mem-limit X] [--json]
    zerobubble compare -p P -m M [--costs ...] [--costs-file F] [--mem-limit X] [--plot FILE.png]
    zerobubble train --config train.toml [--table.key VALUE ...] [--export DIR]
                     (the trainer: zerobubble.train.recipe; flags override the file)
    zerobubble bench [-p P] [-m M] [--steps N] [--layers L] [--mem-limit BYTES] [--out DIR] ...
    zerobubble bench --config job.toml [--section.field VALUE ...]  (flags override the file;
                     one flag per field of zerobubble.train.config)
    zerobubble profile [same flags as bench]
    zerobubble plan --pp P --microbatches M [--kind KIND] [--costs-file F | --model NAME|DIR]
                    [--seq-len T] [--microbatch-size B] [--mem-limit X] [-o FILE.csv]
    zerobubble check-trace TRACE [--segments K] [--mem-budget BYTES] [--tolerance-us US]
                           [--opt-op NAME] [--conservative]
    zerobubble demo [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerobubble.schedule.costs import CostSpec, Number, load_costs_file, parse_costs
from zerobubble.schedule.generators import NoPairWarning

if TYPE_CHECKING:
    from zerobubble.schedule.ir import Schedule
    from zerobubble.train.config import TrainConfig
    from zerobubble.train.job import JobResult, PlanError, Reporter

EXIT_BAD_INPUT = 2
MAX_ACTIONS = 4 * 10**6
"""Largest schedule the CLI builds (3 P M V k actions, V >= 2): building, validating and
writing one takes about 600 bytes per action (0.71 GB measured for zb-h1 -p 4 -m 100000,
1.2e6 actions), so at most about 2.4 GB."""


def _number(text: str) -> Number:
    try:
        x = Fraction(text) if "/" in text else (int(text) if text.isdigit() else float(text))
    except (ValueError, ZeroDivisionError):
        x = math.nan
    if math.isnan(x):
        raise argparse.ArgumentTypeError(f"not a number: {text!r}")
    return x


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


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


def _check_size(p: int, m: int, chunks: int | None, segments: int | None = None) -> None:
    """Refuse what no generator finishes: they build every action in memory (F, B, W per
    stage and unit; V kinds hold 2 chunks; each of k segments is a unit of its own)."""
    actions = 3 * p * m * max(chunks or 1, 2) * (segments or 1)
    if actions > MAX_ACTIONS:
        given = f"-p {p} -m {m}" + (f" --chunks {chunks}" if chunks else "")
        given += f" --segments {segments}" if segments else ""
        fix = "fewer --segments" if segments else "a smaller P or M"
        raise ValueError(
            f"{given} means about {actions:.3g} actions, more than the command line "
            f"builds ({MAX_ACTIONS:.0e}); pick {fix}"
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

    _check_size(args.p, args.m, args.chunks, args.segments)
    exact = args.kind in ("optimal", "optimal-v")
    for flag, given in (("--node-limit", args.node_limit), ("--root-time-limit", args.root_time)):
        if given is not None and not exact:
            raise ValueError(
                f"{flag} is for the exact searches optimal and optimal-v, not {args.kind!r}"
            )
    spec = _cost_spec(args)
    limit = _mem_limit(args, spec)
    gen = GENERATORS.get(args.kind)
    proof = None
    if exact:  # the search's result says whether it proved its schedule optimal
        from zerobubble.schedule.search.milp import (
            DEFAULT_NODE_LIMIT,
            DEFAULT_ROOT_TIME_LIMIT,
            optimal_search,
        )

        assert gen is not None
        for option, given in (
            ("chunks", args.chunks),
            ("split_backward", args.split_backward),
            ("segments", args.segments),
            ("overlap", args.overlap),
        ):
            if given and option not in gen.options:  # as generate() refuses them
                raise ValueError(
                    f"schedule kind {args.kind!r} does not take option {option!r} "
                    f"(it takes: {', '.join(sorted(gen.options))})"
                )

        proof = optimal_search(
            args.p,
            args.m,
            chunks=args.chunks or 1,
            v_shape=args.kind == "optimal-v",
            costs=spec,
            mem_limit=limit,
            node_limit=args.node_limit or DEFAULT_NODE_LIMIT,
            root_time_limit=args.root_time or DEFAULT_ROOT_TIME_LIMIT,
        )
        sched = proof.schedule
    else:
        sched = generate(
            args.kind,
            args.p,
            args.m,
            chunks=args.chunks,
            split_backward=args.split_backward,
            costs=spec,
            mem_limit=limit if gen is not None and "mem_limit" in gen.options else None,
            time_budget_s=args.time_budget,
            segments=args.segments,
            overlap=args.overlap,
        )
    result = validate(sched, mem_limit=limit, costs=spec.resolve(sched.placement, sched.segments))
    if args.format == "json":
        out = json_format.dumps(sched)
    elif args.format == "csv":
        out = torch_csv.dumps(sched)
    elif args.format == "program":
        out = _programs(sched, args) + "\n"
    else:
        out = text.render(sched, result=result) + "\n"
        if proof is not None:
            out += proof.summary() + "\n"
    if args.output:
        Path(args.output).write_text(out)
    else:
        sys.stdout.write(out)
    if proof is not None and (args.format != "text" or args.output):
        print(proof.summary(), file=sys.stderr)  # beside a file format, not inside it
    return 0


def _programs(sched: Schedule, args: argparse.Namespace) -> str:
    """Each rank's finished program (every pass applied) as text."""
    from zerobubble.program.builder import build_programs, format_programs
    from zerobubble.program.plan import GradSync, ProgramPlan

    if args.rank is not None and not 0 <= args.rank < sched.num_devices:
        raise ValueError(f"--rank {args.rank} is not in [0, {sched.num_devices})")
    if args.fsdp and args.dp < 2:
        raise ValueError("--fsdp shards over the dp replicas: pass --dp N with N >= 2")
    sync = GradSync.NONE if args.dp == 1 else GradSync.FSDP if args.fsdp else GradSync.REDUCE
    plan = ProgramPlan(fuse_local_backward=not args.no_fuse, grad_sync=sync, protocol=args.protocol)
    head = (
        f"# {sched.name}: P={sched.num_devices}, M={sched.num_microbatches}, dp={args.dp}; {plan}"
    )
    return head + "\n" + format_programs(build_programs(sched, plan), args.rank)


def cmd_simulate(args: argparse.Namespace) -> int:
    from zerobubble.schedule.formats import load_schedule, text
    from zerobubble.schedule.validate import validate

    sched = load_schedule(args.file, num_microbatches=args.m)
    spec = _cost_spec(args)
    result = validate(
        sched, mem_limit=_mem_limit(args, spec), costs=spec.resolve(sched.placement, sched.segments)
    )
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
    from zerobubble.schedule.generators.common import check_counts

    check_counts(args.p, args.m)  # every kind would refuse them: one message, not a table of n/a
    _check_size(args.p, args.m, args.chunks)
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


def cmd_bench(args: argparse.Namespace) -> int:
    """The schedule benchmark: profile -> plan -> train 1F1B, ZB-H1 and the plan in turns on
    local CPU ranks (or this rank, under torchrun)."""
    from zerobubble.runtime.launcher import LaunchError, launch
    from zerobubble.train.console import ConsoleReporter, print_summary
    from zerobubble.train.job import run_job

    cfg = _bench_config(args)
    _make_out(Path(cfg.job.out), "--out")  # before any rank starts: a bad path is one message
    if cfg.job.torch_profile is not None:
        _make_out(Path(cfg.job.torch_profile), "--torch-profile")
    reporter = ConsoleReporter()
    began = time.perf_counter()
    if "RANK" in os.environ:  # started by torchrun or zerobubble.launch: this process is a rank
        result = run_job(cfg, reporter)
    else:
        try:
            results = launch(_rank, cfg.schedule.devices, cfg, reporter, timeout=cfg.job.timeout_s)
        except LaunchError as exc:
            print(f"zerobubble {args.command}: the job failed: {exc}", file=sys.stderr)
            return 1
        result = results[0]
        if isinstance(result, ValueError):  # refused on every rank alike
            raise result
    if result is None:  # not rank 0
        return 0
    print_summary(result, reporter.console)
    reporter.info(f"wall time {time.perf_counter() - began:.1f} s")
    report = result.trace_report
    return 0 if report is None or report.ok else 1


def cmd_train(args: argparse.Namespace) -> int:
    """The trainer: the recipe's run on local ranks (or this rank, under torchrun)."""
    from zerobubble.runtime.launcher import LaunchError, launch
    from zerobubble.train.recipe import build_recipe, load_recipe

    values = load_recipe(args.config) if args.config is not None else {}
    values.update({k: v for k, v in vars(args).items() if "." in k})  # flags given
    if args.export is not None:
        values["checkpoint.export_folder"] = str(args.export)
    recipe = build_recipe(values)
    _check_recipe(recipe)
    if args.dry_run:
        return _dry_run(recipe, args.device_memory)
    _make_out(Path(recipe.job.dump_folder), "[job] dump_folder")
    began = time.perf_counter()
    if "RANK" in os.environ:  # started by torchrun or zerobubble.launch: this process is a rank
        result = _train_rank(recipe)
    else:
        world = recipe.parallelism.world_size
        print(f"zerobubble train: {world} local ranks; outputs in {recipe.job.dump_folder}")
        try:
            result = launch(_train_rank, world, recipe, timeout=TRAIN_TIMEOUT_S)[0]
        except LaunchError as exc:
            print(f"zerobubble train: the job failed: {exc}", file=sys.stderr)
            return 1
    if isinstance(result, ValueError):  # refused on every rank alike
        raise result
    if result is None:
        return 0
    how = f"resumed at step {result.start}, " if result.start else ""
    print(
        f"zerobubble train: {how}{result.end} steps of {result.summary} under "
        f"{result.schedule} in {time.perf_counter() - began:.1f} s"
    )
    if result.warning:
        print(f"zerobubble train: warning: {result.warning}", file=sys.stderr)
    if recipe.checkpoint.export_folder is not None:
        print(f"zerobubble train: exported to {recipe.checkpoint.export_folder}")
    return 0


def _dry_run(recipe: Any, device_bytes: float | None) -> int:
    """``train --dry-run``: the memory estimate's table; 1 when a rank does not fit."""
    from zerobubble.train.dry_run import dry_run

    found = dry_run(recipe, None if device_bytes is None else int(device_bytes))
    print(found.table())
    if found.device_bytes is None:
        print("no device memory known (no CUDA device): pass --device-memory BYTES to compare")
        return 0
    if found.fits():
        return 0
    over = [str(r.rank) for r in found.ranks if not found.fits_rank(r.rank)]
    print(f"does not fit: rank(s) {', '.join(over)} exceed the device memory", file=sys.stderr)
    return 1


TRAIN_TIMEOUT_S = 30 * 24 * 3600.0
"""How long local ranks of ``zerobubble train`` may run: a training run ends when it ends."""


def _check_recipe(recipe: Any) -> None:
    """What can be refused before any rank starts: the model's name, the export folder."""
    from zerobubble.train.sources import check_name

    check_name(recipe)
    export = recipe.checkpoint.export_folder
    if export is not None and Path(export).exists() and any(Path(export).iterdir()):
        raise ValueError(
            f"export folder {export} is not empty: export into a new or empty folder "
            "(from_pretrained would read stale files)"
        )


def _train_rank(recipe: Any) -> Any:
    """One rank of ``zerobubble train``: a refusal comes back as a value (one message, not
    every rank's traceback); the lead rank prints the progress lines."""
    import torch.distributed as dist

    from zerobubble.runtime.launcher import init_distributed
    from zerobubble.train.trainer import train

    init_distributed()
    try:
        result = train(recipe, write_line=lambda line: print(line, flush=True))
    except ValueError as exc:
        return exc
    return result if dist.get_rank() == 0 else None


def _rank(cfg: TrainConfig, reporter: Reporter | None) -> JobResult | PlanError | None:
    """One launched rank of the job: a refusal (:class:`~zerobubble.train.job.PlanError`)
    comes back as a value, so the parent prints one message instead of every rank's
    traceback."""
    from zerobubble.train.job import PlanError, run_job

    try:
        return run_job(cfg, reporter)
    except PlanError as exc:
        return exc


def _make_out(out: Path, flag: str) -> None:
    """Create output folder ``out`` (given as ``flag``), or refuse it in one message."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else exc.strerror
        raise ValueError(
            f"{flag} {out}: cannot create the output folder ({why}); pass a folder path"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {out}: the folder is not writable; pass a folder you may write")


def cmd_plan(args: argparse.Namespace) -> int:
    """Write the PyTorch CSV of a schedule for one's own model (torchtitan's
    ``pipeline_parallel_schedule_csv``)."""
    from zerobubble.schedule.costs import CostSpec
    from zerobubble.schedule.formats import torch_csv
    from zerobubble.train.torch_plan import model_layers, plan_for_torch, profiled_costs, stages_of

    _check_size(args.pp, args.microbatches, None)
    spec, max_stages, source = None, None, "unit costs"
    if args.costs_file is not None:
        spec, source = load_costs_file(args.costs_file), str(args.costs_file)
    elif args.model is not None:
        layers, loss, vocab = model_layers(args.model)
        max_stages = len(layers)
        stages = stages_of(args.kind, args.pp, args.microbatches, max_stages)
        costs = profiled_costs(
            layers,
            loss,
            stages,
            vocab=vocab,
            seq_len=args.seq_len,
            microbatch_size=args.microbatch_size,
        )
        spec, source = CostSpec(stage_costs=costs), f"{args.model} profiled here (ms, bytes)"
    limit = args.mem_limit if args.mem_limit is not None else spec.mem_limit if spec else None
    sched, result = plan_for_torch(
        args.kind, args.pp, args.microbatches, costs=spec, mem_limit=limit, max_stages=max_stages
    )
    text = torch_csv.dumps(sched)
    peak = float(max(result.peak_memory))
    shown = f"{peak:,.0f}" if peak >= 1000 else f"{peak:g}"  # bytes, or M_B units
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    print(
        f"{sched.name}: pp={sched.num_devices}, {sched.num_stages} stages, "
        f"M={sched.num_microbatches}; simulated under {source}: bubble rate "
        f"{result.bubble_rate:.1%}, peak activations {shown}"
        + (f"; written to {args.output}" if args.output else ""),
        file=sys.stderr,
    )
    return 0


def cmd_check_trace(args: argparse.Namespace) -> int:
    from zerobubble.schedule.formats import load_schedule
    from zerobubble.trace.check import (
        DEFAULT_OPT_OPS,
        check_sizes,
        check_trace,
        load_trace,
    )

    events, lines = load_trace(args.trace)
    schedule = None if args.schedule is None else load_schedule(args.schedule)
    try:
        check_sizes(events, lines=lines, schedule=schedule)
    except ValueError as exc:  # an index out of any run's range: named with the file
        raise ValueError(f"{args.trace}: {exc}") from None
    report = check_trace(
        events,
        lines=lines,
        mem_budget=args.mem_budget,
        tolerance_ns=int(args.tolerance_us * 1000),
        opt_ops=args.opt_op or DEFAULT_OPT_OPS,
        conservative=args.conservative,
        segments=args.segments,
        schedule=schedule,
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
    """The main job: ``zerobubble bench`` with its defaults."""
    return cmd_bench(build_parser().parse_args(["bench", "--out", str(args.out)]))


def _bench_config(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the ``--config`` file, then the flags given on the command line."""
    from zerobubble.train.config import default_devices
    from zerobubble.train.options import build_config, load_toml
    from zerobubble.train.titan import overlay, to_job

    values = load_toml(args.config) if args.config is not None else {}
    given = {k: v for k, v in vars(args).items() if "." in k}  # only flags given
    values = overlay(values, to_job(given, "the command line"))
    devices = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else default_devices()
    cfg = build_config(values, devices=devices, profile_only=args.command == "profile")
    if cfg.model.name != "gpt" and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            f"--model {cfg.model.name} needs Hugging Face transformers, which is not installed: "
            "install the dev extra (pip install -e '.[dev]') or pip install transformers"
        )
    return cfg


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    """One flag per field of the job's config (``--model.d-model``, also spelled
    ``--model.d_model``, alias ``--d-model``) and per torchtitan key
    (``--parallelism.tensor_parallel_degree``)."""
    from zerobubble.train.options import options

    p.add_argument(
        "--config",
        type=Path,
        help="TOML file of the job's tables [model], [schedule], [executor], [optimizer], "
        "[job] and torchtitan's [training], [parallelism], [checkpoint], [metrics] "
        "(examples/job.toml; docs/e2e.md: torchtitan's keys); flags given here override it",
    )
    for opt in options():
        shown = "" if "default" in opt.doc else f" (default: {opt.default})"
        spelled = ("--" + opt.key,) if "_" in opt.key else ()  # as the TOML key is written
        p.add_argument(
            *opt.aliases,
            opt.flag,
            *spelled,
            dest=opt.key,
            type=_typed(opt.parse),
            default=argparse.SUPPRESS,
            metavar=opt.kind.__name__.upper(),
            help=(opt.doc + shown).replace("%", "%%"),
        )


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    """``--config``, ``--export`` and one flag per recipe key (``--training.steps``, also
    spelled ``--training.steps``'s dashed form)."""
    from zerobubble.train.recipe import recipe_options

    p.add_argument(
        "--config",
        type=Path,
        help="TOML recipe in torchtitan's tables: [job], [model], [optimizer], [lr_scheduler], "
        "[training], [parallelism], [activation_checkpoint], [checkpoint], [metrics], [data] "
        "(examples/train.toml; docs/train.md); flags given here override it",
    )
    p.add_argument(
        "--export",
        type=Path,
        metavar="DIR",
        help="after the last step, write the model as a Hugging Face directory here "
        "(checkpoint.export_folder); with --training.steps at a checkpoint's step (and "
        "--checkpoint.load_step), export that checkpoint without training",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="start no rank: print each pipeline rank's predicted parameters, gradients, "
        "optimizer state and activation peak under the schedule, and whether it fits "
        "(--device-memory, or the CUDA device's); exit 1 if it does not",
    )
    p.add_argument(
        "--device-memory",
        type=_number,
        metavar="BYTES",
        help="--dry-run: the device memory per rank to compare with",
    )
    for opt in recipe_options():
        shown = "" if "default" in opt.doc else f" (default: {opt.default})"
        dashed = (opt.flag,) if "_" in opt.key else ()
        p.add_argument(
            "--" + opt.key,
            *dashed,
            dest=opt.key,
            type=_typed(opt.parse),
            default=argparse.SUPPRESS,
            metavar=opt.kind.__name__.upper(),
            help=(opt.doc + shown).replace("%", "%%"),
        )


def _typed(parse: Callable[[str], object]) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


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
    parser.add_argument("--version", action="version", version=f"zerobubble {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("schedule", help="generate, validate and print a schedule")
    p.add_argument(
        "kind", choices=list(GENERATORS), metavar="KIND", help="one of: " + ", ".join(GENERATORS)
    )
    p.add_argument("-p", type=int, required=True, help="number of devices (pipeline ranks)")
    p.add_argument("-m", type=int, required=True, help="number of microbatches")
    p.add_argument("--chunks", type=int, help="chunks per device (interleaved kinds)")
    p.add_argument(
        "--segments",
        type=_positive_int,
        metavar="K",
        help="seq1f1b, seq-zb, seq-zbv: sequence segments per microbatch (default 2); auto: "
        "also try 2..K segments; --costs are per microbatch, each segment costs 1/K",
    )
    p.add_argument(
        "--split-backward",
        action="store_true",
        help="baselines: write each BW as B immediately followed by W",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="overlapped F&B pairs, one's all-to-all hidden behind the other's compute "
        "(--costs a2a=...): dualpipev's own, as DualPipe pairs them; auto, zb-auto and "
        "zbv-auto may pair inside their search; other kinds where a pair pays under --costs",
    )
    _add_cost_args(p)
    p.add_argument(
        "--node-limit",
        type=_positive_int,
        help="optimal, optimal-v: branch-and-bound nodes HiGHS may solve (default 1000); "
        "a work limit, so a run gives the same schedule and gap on any machine",
    )
    p.add_argument(
        "--root-time-limit",
        dest="root_time",
        type=_positive_float,
        metavar="S",
        help="optimal, optimal-v: seconds HiGHS may spend on the root node, which no node "
        "limit bounds (default 60); a root that finishes in time leaves the result a "
        "function of the input, one that does not returns the heuristic's schedule and "
        "the gap to the best bound",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        metavar="S",
        help="auto: return the best schedule found within S seconds (anytime search; "
        "without it the search is deterministic)",
    )
    p.add_argument(
        "--format",
        choices=("text", "json", "csv", "program"),
        default="text",
        help="program: each rank's final instruction list, after every pass",
    )
    p.add_argument("--rank", type=int, help="--format program: only this rank's program")
    p.add_argument(
        "--dp", type=_positive_int, default=1, help="--format program: data-parallel replicas"
    )
    p.add_argument("--fsdp", action="store_true", help="--format program: FSDP over --dp")
    p.add_argument(
        "--protocol",
        choices=("none", "checked", "speculative"),
        default="none",
        help="--format program: the optimizer protocol's instructions",
    )
    p.add_argument(
        "--no-fuse", action="store_true", help="--format program: keep every B and W split"
    )
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

    p = sub.add_parser(  # no abbreviations: --training.step must not pass as .steps
        "bench",
        help="schedule benchmark: profile, plan and train 1F1B, ZB-H1 and the plan in turns "
        "on a small GPT or tiny HF model on local CPU ranks",
        allow_abbrev=False,
    )
    _add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "train",
        help="train a model (HF directory, shipped config or factory) from a TOML recipe: "
        "pp x dp x tp x ep, checkpoints, export",
        allow_abbrev=False,
    )
    _add_recipe_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("profile", help="measure stage costs and write the costs file")
    _add_bench_args(p)
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "plan",
        help="write a schedule as the CSV PyTorch's pipelining runtime (and torchtitan's "
        "pipeline_parallel_schedule_csv) reads, planned for a model",
    )
    p.add_argument("--pp", type=_positive_int, required=True, help="pipeline ranks")
    p.add_argument(
        "--microbatches", type=_positive_int, required=True, help="microbatches per step"
    )
    p.add_argument(
        "--kind",
        choices=list(GENERATORS),
        default="auto",
        metavar="KIND",
        help="the schedule (default %(default)s: searched under the costs); one of: "
        + ", ".join(GENERATORS),
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--costs-file",
        type=Path,
        help="costs file (zerobubble profile writes one) with one entry per stage",
    )
    source.add_argument(
        "--model",
        help="profile this model here first: a shipped tiny config (hf-llama, ...) or a "
        "Hugging Face model directory (its config.json; weights are not read)",
    )
    p.add_argument(
        "--seq-len", type=_positive_int, default=128, help="--model: tokens per sequence"
    )
    p.add_argument(
        "--microbatch-size",
        type=_positive_int,
        default=1,
        help="--model: sequences per microbatch (torchtitan's pipeline_parallel_microbatch_size)",
    )
    p.add_argument(
        "--mem-limit",
        type=_number,
        help="activation memory per rank, in the costs' units (bytes with --model)",
    )
    p.add_argument("-o", "--output", help="write the CSV to FILE instead of stdout")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("check-trace", help="check an executed pipeline's JSONL trace")
    p.add_argument("trace", type=Path)
    p.add_argument(
        "--segments",
        type=_positive_int,
        default=1,
        metavar="K",
        help="the run's schedule cut each sequence into K segments (its mb are units): also "
        "check the segments' order on every stage",
    )
    p.add_argument(
        "--schedule",
        type=Path,
        metavar="FILE",
        help="the run's schedule (any format `schedule` reads): its overlapped F&B pairs may "
        "overlap in time",
    )
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

    p = sub.add_parser("demo", help="the main job (what `make demo` runs): zerobubble bench")
    p.add_argument("--out", default="out", help="folder for pictures and traces")
    p.set_defaults(func=cmd_demo)
    return parser


def _version() -> str:
    """The installed distribution's version (the command exists only once installed)."""
    from importlib.metadata import version

    return version("zerobubble")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and args.command in ("bench", "profile", "train"):
        message = _unknown_flags(unknown, args.command)
        print(f"zerobubble {args.command}: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # exits 2, as parse_args
    try:
        with warnings.catch_warnings():  # restores the handler below on the way out
            warnings.showwarning = _warning_line(args.command, warnings.showwarning)
            return int(args.func(args) or 0)
    except (ValueError, OSError) as exc:  # ScheduleError is a ValueError
        print(f"zerobubble {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _unknown_flags(unknown: Sequence[str], command: str) -> str:
    """What ``zerobubble bench`` or ``train`` says of flags it does not know: the first, with
    the closest flag it does know (a misspelt key would otherwise be one more guess)."""
    from zerobubble.train.options import closest, options

    if command == "train":
        from zerobubble.train.recipe import recipe_options

        flags = [f for o in recipe_options() for f in ("--" + o.key, o.flag)]
        flags += ["--config", "--export", "--dry-run", "--device-memory"]
    else:
        flags = [f for o in options() for f in (*o.aliases, o.flag, "--" + o.key)] + ["--config"]
    word = next((u for u in unknown if u.startswith("-")), unknown[0])
    name = word.split("=", 1)[0]
    return f"unknown flag {name!r}{closest(name, flags)} (zerobubble {command} --help lists them)"


def _warning_line(command: str, other: Callable[..., None]) -> Callable[..., None]:
    """A warning handler that prints what the schedule layer says to its caller (no pair
    formed) as one line of the command's, and hands every other warning to ``other``."""

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, NoPairWarning):
            print(f"zerobubble {command}: warning: {message}", file=sys.stderr)
        else:
            other(message, category, *args, **kwargs)

    return show


if __name__ == "__main__":
    raise SystemExit(main())
