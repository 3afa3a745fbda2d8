"""Terminal output of the job: live progress on rank 0 and the final tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from zerobubble.profile.balance import imbalance
from zerobubble.profile.bubbles import CATEGORIES
from zerobubble.profile.stats import OpStats
from zerobubble.schedule.generators import generate
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.simulate import simulate
from zerobubble.train.job import JobResult, PhaseResult
from zerobubble.train.trials import predict_ms, segment_schedules

MIB = 2**20


class ConsoleReporter:
    """Rich progress bar plus one line per step (the loss), printed by rank 0.

    Picklable before :meth:`start`, so a launcher can hand it to the ranks.
    """

    def __init__(self, width: int = 120) -> None:
        self.width = width
        self._console: Console | None = None
        # The live bar and its task, together: both exist between start and close.
        self._live: tuple[Progress, TaskID] | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            self._console = Console(width=self.width)
        return self._console

    def info(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def start(self, total_steps: int) -> None:
        progress = Progress(
            TextColumn("{task.description:<8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        progress.start()
        self._live = progress, progress.add_task("train", total=total_steps, loss="-")

    def extend(self, more_steps: int) -> None:
        """``more_steps`` steps more than :meth:`start` announced (the plan's trials)."""
        if self._live is not None:
            progress, task = self._live
            progress.update(task, total=(progress.tasks[task].total or 0) + more_steps)

    def step(self, phase: str, step: int, loss: float, seconds: float, note: str) -> None:
        self.console.print(
            f"step {step:3d}  {phase:<8} loss {loss:.4f}  {seconds * 1e3:6.0f} ms"
            + (f"  ({note})" if note else ""),
            highlight=False,
        )
        if self._live is not None:
            progress, task = self._live
            progress.update(task, advance=1, description=phase, loss=f"{loss:.3f}")

    def close(self) -> None:
        if self._live is not None:
            self._live[0].stop()
            self._live = None


def print_summary(result: JobResult, console: Console | None = None) -> None:
    """The profile, the balance, the schedule comparison and the idle breakdown."""
    con = console or Console(width=120)
    _profile_table(result, con)
    _balance_table(result, con)
    if result.trials:
        _trials_table(result, con)
    if result.phases:
        _schedule_table(result, con)
        _idle_table(result, con)
        note = plan_lost(result.phases)
        if note:
            con.print(note, highlight=False, markup=False)
    else:
        _predictions(result, con)
    rep = result.trace_report
    if rep is not None:
        if rep.ok:
            con.print(
                f"trace check: OK ({rep.num_events} events, ranks {list(rep.ranks)}, "
                f"{len(rep.iterations)} iterations, memory within "
                f"{result.mem_limit / MIB:.2f} MiB)",
                highlight=False,
            )
        else:
            con.print(
                f"trace check: {rep.first} ({len(rep.violations)} in all)",
                highlight=False,
                markup=False,
            )
    for what, path in result.files.items():
        con.print(f"{what}: {path}", highlight=False)


def plan_lost(phases: Sequence[PhaseResult]) -> str:
    """A warning when the planned schedule's median step measured slower than a fixed kind's
    that trained beside it (a loaded machine, a profile off): empty when the plan won."""
    plan = next((p for p in phases if p.planned), None)
    fixed = [p for p in phases if not p.planned]
    if plan is None or not fixed:
        return ""
    best = min(fixed, key=lambda p: p.step_time)
    if plan.step_time <= best.step_time:
        return ""
    return (
        f"warning: the plan ({plan.name}) measured slower than {best.name}: median step "
        f"{plan.step_time * 1e3:.1f} ms against {best.step_time * 1e3:.1f} ms; the profile "
        "may be off (a loaded machine): rerun, or train with the fixed kind"
    )


def _recompute_note(result: JobResult) -> str:
    """The activation-checkpointing setting, for the titles of the measured tables."""
    mode = result.config.executor.recompute
    if mode == "none":
        return ""
    return f"; recompute={mode}: B includes the recomputed forward, M_B is what F keeps"


def _profile_table(result: JobResult, con: Console) -> None:
    prof = result.profile
    st = prof.stages
    bounds = prof.boundaries or ()
    table = Table(
        title=f"stage profile (ms: median/p95; host: median host work after each op; "
        f"{result.config.job.warmup} warm-up step dropped{_recompute_note(result)})",
        title_justify="left",
    )
    fu = prof.fused
    cols = (
        "stage",
        "layers",
        "F",
        "B",
        "W",
        "host F/B/W",
        "F unsplit",
        "BW unsplit",
        "M_B MiB",
        "M_W MiB",
        "Wp %",
        "Wt %",
    )
    lp = result.layers
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for s in range(st.num_stages):
        layers = f"{bounds[s]}-{bounds[s + 1] - 1}" if bounds else "-"
        unsplit = (fu.f[s], fu.bw[s]) if fu is not None else (None, None)
        host = "/".join(f"{st.host[op][s] or 0:.1f}" for op in "FBW")
        shares = lp.stage_w_share(bounds[s], bounds[s + 1]) if bounds and lp.params else None
        table.add_row(
            str(s),
            layers,
            *(_ms(x) for x in (st.f[s], st.b[s], st.w[s])),
            host,
            *(_ms(x) for x in unsplit),
            f"{st.mem_b[s] / MIB:.2f}",
            f"{(st.mem_w[s] or 0) / MIB:.2f}",
            *(("-", "-") if shares is None else (f"{100 * x:.0f}" for x in shares)),
        )
    con.print(table)
    con.print(
        "Wp % / Wt %: share of the stage's parameters (elements) and of its plain "
        "weight-gradient time that W takes over (from the layer profile)",
        highlight=False,
    )
    for s, lat in prof.latency:
        con.print(
            f"message latency stage {s} <-> {s + 1} (devices {prof.placement[s]} <-> "
            f"{prof.placement[s + 1]}; producer's compute end to the waiting receiver's "
            f"return, in the profiled steps): {lat.median:.3f} ms median, {lat.p95:.3f} ms "
            f"p95 ({lat.n} messages)",
            highlight=False,
        )
    if prof.comm_fit is not None:
        con.print(
            f"latency charged per cross-device dependency: {prof.comm_fit:.3f} ms, fitted so "
            "that the profiled schedules' simulated steps match their measured ones (see "
            "zerobubble.profile.calibrate)",
            highlight=False,
        )


def _ms(stats: OpStats | None) -> str:
    return "-" if stats is None else f"{stats.median:.1f}/{stats.p95:.0f}"


def _balance_table(result: JobResult, con: Console) -> None:
    b = result.balance
    table = Table(
        title="stage balancing (per-stage F+B+W per microbatch, ms)", title_justify="left"
    )
    for col in ("cut", "boundaries", "predicted", "max/mean", "measured", "max/mean "):
        table.add_column(col, justify="left" if col in ("cut", "boundaries") else "right")

    def fmt(xs: Iterable[float]) -> str:
        return " / ".join(f"{x:.1f}" for x in xs)

    measured_eq = b.measured_equal if b.measured_equal is not None else b.measured_balanced
    table.add_row(
        "equal layer counts",
        str(list(b.equal)),
        fmt(b.predicted_equal),
        f"{imbalance(b.predicted_equal):.2f}",
        fmt(measured_eq),
        f"{imbalance(measured_eq):.2f}",
    )
    table.add_row(
        "balanced (profiled)",
        str(list(b.balanced)),
        fmt(b.predicted_balanced),
        f"{imbalance(b.predicted_balanced):.2f}",
        fmt(b.measured_balanced),
        f"{imbalance(b.measured_balanced):.2f}",
    )
    con.print(table)


def _schedule_table(result: JobResult, con: Console) -> None:
    cfg = result.config
    table = Table(
        title=f"schedules (P={cfg.schedule.devices}, M={cfg.schedule.microbatches}; "
        f"median of {cfg.job.steps} steps "
        f"each, taking turns; pred. = simulated from the profile{_recompute_note(result)}; "
        "replay = simulated from these steps' own op times)",
        title_justify="left",
    )
    cols = (
        "schedule",
        "step ms",
        "min-max",
        "tokens/s",
        "bubble / pred.",
        "pipeline ms / pred. / replay",
        "act. peak MiB",
    )
    for col in cols:
        table.add_column(col, justify="left" if col == "schedule" else "right", no_wrap=True)
    for ph in result.phases:
        replay = "-" if ph.replayed_ms is None else f"{ph.replayed_ms:.0f}"
        table.add_row(
            _label(ph),
            f"{ph.step_time * 1e3:.0f}",
            f"{min(ph.step_s) * 1e3:.0f}-{max(ph.step_s) * 1e3:.0f}",
            f"{cfg.tokens_per_step / ph.step_time:,.0f}",
            f"{ph.bubble_rate:.1%} / {ph.predicted_bubble_rate:.1%}",
            f"{ph.pipe_time * 1e3:.0f} / {ph.predicted_ms:.0f} / {replay}",
            f"{ph.peak_memory / MIB:.2f}",
        )
    con.print(table)


def _trials_table(result: JobResult, con: Console) -> None:
    """The candidates tried before training and the one measurement chose."""
    table = Table(
        title=f"plan candidates (best prediction first; {result.config.job.trial_steps} "
        "measured steps each, taking turns; the fastest median step is the plan)",
        title_justify="left",
    )
    for col in ("candidate", "pred. ms", "pipeline ms", "step ms", "step min-max", "chosen"):
        table.add_column(col, justify="left" if col == "candidate" else "right", no_wrap=True)
    for t in result.trials:
        table.add_row(
            t.kind,
            f"{t.predicted_ms:.0f}",
            f"{t.pipe_time * 1e3:.0f}",
            f"{t.step_time * 1e3:.0f}",
            f"{min(t.step_s) * 1e3:.0f}-{max(t.step_s) * 1e3:.0f}",
            "yes" if t.chosen else "",
        )
    con.print(table)


def _predictions(result: JobResult, con: Console) -> None:
    """Without training: what the simulator predicts from the profile."""
    prof, cfg = result.profile, result.config
    parts = []
    for name, sched in (
        ("1f1b", generate("1f1b", cfg.schedule.devices, cfg.schedule.microbatches)),
        ("zb-h1", generate("zb-h1", cfg.schedule.devices, cfg.schedule.microbatches)),
        (f"{result.plan_kind} (plan)", result.plan),
    ):
        r = simulate(sched, prof.cost_model(fused=not sched.uses_split_backward))
        parts.append(f"{name} {float(r.makespan) + prof.step_fixed_ms:.0f} ms")
    if prof.segment_cost is not None:  # --segments: the segment kinds, cut as they would be
        P, M, k = cfg.schedule.devices, cfg.schedule.microbatches, cfg.schedule.segments
        for name, sched in segment_schedules(P, M, k):
            ms = predict_ms(prof, fuse_local_backward(sched))
            parts.append(f"{name} {ms:.0f} ms (cuts {list(prof.cuts(sched.segments))})")
    con.print("predicted pipeline step: " + ", ".join(parts), highlight=False)


def _label(ph: PhaseResult) -> str:
    return f"{ph.name} (planned)" if ph.planned else ph.name


def _idle_table(result: JobResult, con: Console) -> None:
    table = Table(
        title="idle time by cause (ms per iteration, summed over devices)", title_justify="left"
    )
    table.add_column("schedule")
    for c in (*CATEGORIES, "total idle", "pred. overhead"):
        table.add_column(c, justify="right")
    for ph in result.phases:
        parts = ph.idle_ms()
        table.add_row(
            _label(ph),
            *(f"{parts[c]:.1f}" for c in CATEGORIES),
            f"{sum(parts.values()):.1f}",
            f"{ph.predicted_overhead_ms:.1f}",
        )
    con.print(table)
    con.print(
        "pred. overhead: of the host work after each op that the prediction charges "
        "(recording, sends, posted receives, dispatch), the part that delayed the next op "
        "after its inputs were ready, as the measured overhead is defined",
        highlight=False,
    )
