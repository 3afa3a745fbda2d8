"""Timeline pictures: one row per device, boxes with real durations, coloured by op.

Works for simulated schedules (``SimResult``) and, through :class:`Box`, for
measured traces, so the same picture compares prediction and reality.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: pictures go to files
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from zerobubble.schedule.ir import Op
from zerobubble.schedule.simulate import SimResult

#: One colour per op; later chunks of a device are drawn lighter.
OP_COLORS = {Op.F: "#3b6fb6", Op.B: "#2aa198", Op.W: "#7cb342", Op.BW: "#ef8a17"}
IDLE_COLOR = "#f2f2f2"


@dataclass(frozen=True)
class Box:
    """One drawn action."""

    device: int
    start: float
    end: float
    op: Op
    mb: int
    chunk: int = 0
    label: str = ""
    """The text inside the box (default: ``mb``); ``3.1`` is microbatch 3's segment 1."""


@dataclass(frozen=True)
class Row:
    """A labelled timeline: a schedule's boxes plus its title."""

    title: str
    num_devices: int
    boxes: tuple[Box, ...]


def boxes_of(result: SimResult) -> Row:
    sched = result.schedule
    k = sched.segments
    boxes = tuple(
        Box(
            d,
            float(result.start[d][i]),
            float(result.end[d][i]),
            a.op,
            a.mb,
            sched.chunk_of_stage[a.stage],
            f"{a.mb // k}.{a.mb % k}" if k > 1 else "",
        )
        for d, acts in enumerate(sched.actions)
        for i, a in enumerate(acts)
    )
    title = (
        f"{sched.name}  cost {float(result.cost):g}  bubble {result.bubble_rate:.1%}  "
        f"peak mem {float(max(result.peak_memory)):g}"
    )
    return Row(title, sched.num_devices, boxes)


def _lighten(hex_color: str, amount: float) -> tuple[float, float, float]:
    r, g, b = matplotlib.colors.to_rgb(hex_color)
    return r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount


def draw_row(ax: Axes, row: Row, end: float) -> None:
    """Draw one timeline into ``ax`` with time running from 0 to ``end``."""
    ax.set_facecolor(IDLE_COLOR)
    for b in row.boxes:
        color = _lighten(OP_COLORS[b.op], min(0.45 * b.chunk, 0.7))
        width = b.end - b.start
        ax.barh(
            row.num_devices - 1 - b.device,
            width,
            left=b.start,
            height=0.86,
            color=color,
            edgecolor="white",
            linewidth=0.4,
        )
        # Label a box only when the number fits inside it.
        text = b.label or str(b.mb)
        if width / end * 15 * 72 > 7 * (len(text) + 0.6):
            ax.text(
                b.start + width / 2,
                row.num_devices - 1 - b.device,
                text,
                ha="center",
                va="center",
                fontsize=6.5,
                color="white",
            )
    ax.set_yticks(range(row.num_devices))
    ax.set_yticklabels([f"d{d}" for d in reversed(range(row.num_devices))], fontsize=7)
    ax.set_xlim(0, end)
    ax.set_title(row.title, fontsize=8.5, loc="left")
    ax.tick_params(axis="x", labelsize=7)


def op_legend() -> list[Patch]:
    """Legend entries of the op colours and idle."""
    legend = [
        Patch(color=OP_COLORS[op], label=name)
        for op, name in (
            (Op.F, "F forward"),
            (Op.B, "B input grad"),
            (Op.W, "W weight grad"),
            (Op.BW, "BW full backward"),
        )
    ]
    legend.append(Patch(color=IDLE_COLOR, label="idle"))
    return legend


def row_heights(rows: Sequence[Row]) -> list[float]:
    """Figure inches each timeline needs."""
    return [max(r.num_devices, 1) * 0.32 + 0.45 for r in rows]


def plot_rows(rows: Sequence[Row], path: str | Path, *, time_label: str = "time") -> Path:
    """Draw stacked timelines sharing one time axis and save to ``path`` (PNG, SVG, ...)."""
    if not rows:
        raise ValueError("nothing to plot: no timelines given")
    end = max((b.end for r in rows for b in r.boxes), default=1.0) or 1.0
    heights = row_heights(rows)
    fig, axes = plt.subplots(
        len(rows),
        1,
        figsize=(15, sum(heights) + 0.6),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        sharex=True,
    )
    for ax, row in zip(axes[:, 0], rows, strict=True):
        draw_row(ax, row, end)
    axes[-1, 0].set_xlabel(time_label, fontsize=8)
    fig.legend(handles=op_legend(), loc="upper right", ncol=5, fontsize=7, frameon=False)
    return save(fig, path)


def save(fig: Figure, path: str | Path) -> Path:
    """Lay out, write and close ``fig``."""
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def plot_results(results: Sequence[SimResult], path: str | Path) -> Path:
    """One picture with every simulated schedule's timeline, real durations."""
    return plot_rows([boxes_of(r) for r in results], path)
