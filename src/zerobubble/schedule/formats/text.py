"""A compact, time-aligned text timeline for terminals.

Each device is one row; each action is drawn over the columns its simulated
duration covers, labelled ``F3`` (op and microbatch), ``F3.1`` for a microbatch's
segment 1 when its sequence runs in segments, with a chunk letter (``F3b``) when
the device holds several stages; an overlapped F&B pair is one block labelled
``F3a&BW1b``; ``.`` is idle time::

    d0 |F0 F1 F2 F3 B0 W0 F4 B1 W1 ...
    d1 |...F0 F1 F2 B0 F3 B1 W0 ...
"""

from __future__ import annotations

import math
from fractions import Fraction

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.ir import Action, Schedule
from zerobubble.schedule.simulate import SimResult, simulate


def label(schedule: Schedule, action: Action) -> str:
    """``F3`` (``F3.1`` for segment 1) or, on multi-chunk devices, ``F3a`` / ``F3b``."""
    k = schedule.segments
    text = (
        f"{action.op.value}{action.mb}"
        if k == 1
        else f"{action.op.value}{action.mb // k}.{action.mb % k}"
    )
    if schedule.chunks(schedule.placement[action.stage]) > 1:
        text += "abcdefghijklmnopqrstuvwxyz"[schedule.chunk_of_stage[action.stage] % 26]
    return text


def render(
    schedule: Schedule,
    costs: CostModel | None = None,
    *,
    result: SimResult | None = None,
    max_width: int = 2000,
) -> str:
    """Render the simulated timeline; rows are truncated to ``max_width`` columns."""
    res = result if result is not None else simulate(schedule, costs)
    partner = schedule.overlap_partner()
    labels = [[_block(schedule, a, partner.get(a)) for a in acts] for acts in schedule.actions]
    widest = max((len(x) for row in labels for x in row), default=1) + 1
    durations = [
        Fraction(e) - Fraction(s)
        for st, en in zip(res.start, res.end, strict=True)
        for s, e in zip(st, en, strict=True)
        if e > s
    ]
    shortest = min(durations, default=Fraction(1))
    scale = Fraction(widest) / shortest  # columns per time unit

    def col(t: Number) -> int:
        # Clamped past the row's end: durations 1e15 times the shortest would
        # otherwise ask for rows longer than memory holds.
        return min(math.floor(Fraction(t) * scale + Fraction(1, 2)), max_width + 1)

    lines = [
        f"{schedule.name}: P={schedule.num_devices} S={schedule.num_stages} "
        f"M={schedule.num_microbatches}"
        + (f" segments={schedule.segments}" if schedule.segments > 1 else "")
        + f" cost={float(res.cost):g} "
        f"bubble={res.bubble_rate:.1%}"
    ]
    for d, acts in enumerate(schedule.actions):
        row = []
        cursor = 0
        for i, _ in enumerate(acts):
            a, b = col(res.start[d][i]), col(res.end[d][i])
            if a > cursor:
                row.append("." * (a - cursor))
            cell = labels[d][i][: max(b - a - 1, 1)] if b - a > 0 else ""
            row.append(cell.ljust(b - a))
            cursor = max(cursor, b)
        text = "".join(row)
        if len(text) > max_width:
            text = text[: max_width - 1] + ">"
        lines.append(f"d{d:<{len(str(schedule.num_devices - 1))}} |{text}")
    return "\n".join(lines)


def render_order(schedule: Schedule) -> str:
    """Untimed listing: each device's actions in order (handy for diffs); an overlapped
    pair as one ``F3a&BW1b``."""
    return "\n".join(
        f"d{d}: " + " ".join(_block(schedule, a, b) for a, b in schedule.blocks(d))
        for d in range(schedule.num_devices)
    )


def _block(schedule: Schedule, a: Action, partner: Action | None) -> str:
    """``a``'s label, joined by ``&`` to its overlapped partner's if it has one."""
    return label(schedule, a) + ("" if partner is None else f"&{label(schedule, partner)}")
