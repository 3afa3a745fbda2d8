"""Pictures of measured iterations: the real timeline of each device, and beside it
a stacked bar per device of where its idle time went (:mod:`zerobubble.profile.bubbles`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.patches import Patch

from zerobubble.profile.bubbles import CATEGORIES, IterationBubbles
from zerobubble.schedule.ir import Op
from zerobubble.trace.clocks import clock_offsets
from zerobubble.trace.format import COMPUTE_OPS, TraceEvent
from zerobubble.viz.timeline import Box, Row, draw_row, op_legend, row_heights, save

#: One colour per idle cause.
CAUSE_COLORS = {
    "dependency": "#9e9e9e",
    "memory": "#c2185b",
    "comm": "#5e35b1",
    "imbalance": "#f9a825",
    "overhead": "#6d4c41",
}


def measured_row(events: Sequence[TraceEvent], iteration: int, title: str) -> Row:
    """The compute events of one iteration as boxes, in ms from its first compute start
    (ranks' clocks aligned by :func:`~zerobubble.trace.clocks.clock_offsets`)."""
    off = clock_offsets(events)
    comp = [(e, _stage_mb(e)) for e in events if e.iteration == iteration and e.op in COMPUTE_OPS]
    if not comp:
        raise ValueError(f"no compute events in iteration {iteration}")
    t0 = min(e.start_ns + off[e.rank] for e, _ in comp)
    ranks = sorted({e.rank for e, _ in comp})
    stages = {r: sorted({s for e, (s, _) in comp if e.rank == r}) for r in ranks}
    boxes = tuple(
        Box(
            ranks.index(e.rank),
            (e.start_ns + off[e.rank] - t0) / 1e6,
            (e.end_ns + off[e.rank] - t0) / 1e6,
            Op(e.op),
            mb,
            stages[e.rank].index(s),
        )
        for e, (s, mb) in comp
    )
    return Row(title, len(ranks), boxes)


def _stage_mb(e: TraceEvent) -> tuple[int, int]:
    """The stage and microbatch of a compute event; a trace whose compute event lacks them
    is malformed."""
    if e.stage is None or e.mb is None:
        raise ValueError(
            f"rank {e.rank}: the {e.op} event of iteration {e.iteration} has no stage or "
            "microbatch; the trace is malformed (check it with `zerobubble check-trace`)"
        )
    return e.stage, e.mb


def plot_measured(
    panels: Sequence[tuple[Row, IterationBubbles]], path: str | Path, *, time_label: str = "ms"
) -> Path:
    """One measured timeline per panel with its idle breakdown per device beside it."""
    if not panels:
        raise ValueError("nothing to plot: no measured iterations given")
    rows = [row for row, _ in panels]
    end = max((b.end for r in rows for b in r.boxes), default=1.0) or 1.0
    idle_end = max(max(d.idle_ns for d in it.devices) for _, it in panels) / 1e6 or 1.0
    heights = row_heights(rows)
    fig, axes = plt.subplots(
        len(panels),
        2,
        figsize=(16, sum(heights) + 0.9),
        squeeze=False,
        gridspec_kw={"height_ratios": heights, "width_ratios": (4.2, 1)},
    )
    for (row, it), (ax_t, ax_b) in zip(panels, axes, strict=True):
        draw_row(ax_t, row, end)
        ax_t.set_xlabel(time_label, fontsize=7)
        n = len(it.devices)
        for i, dev in enumerate(it.devices):
            left = 0.0
            for cause in CATEGORIES:
                width = dev.parts()[cause] / 1e6
                ax_b.barh(n - 1 - i, width, left=left, height=0.86, color=CAUSE_COLORS[cause])
                left += width
        ax_b.set_yticks(range(n))
        ax_b.set_yticklabels([f"d{d.rank}" for d in reversed(it.devices)], fontsize=7)
        ax_b.set_xlim(0, idle_end * 1.05)
        ax_b.set_title(f"idle by cause, bubble {it.bubble_rate:.1%}", fontsize=8.5, loc="left")
        ax_b.tick_params(axis="x", labelsize=7)
        ax_b.set_xlabel(time_label, fontsize=7)
    causes = [Patch(color=CAUSE_COLORS[c], label=c) for c in CATEGORIES]
    fig.legend(handles=op_legend() + causes, loc="upper right", ncol=10, fontsize=7, frameon=False)
    return save(fig, path)
