"""The dependency graph of a schedule, flattened for speed.

Actions get flat ids (device 0's first, then device 1's, ...). ``preds[g]``
lists the ids of the actions ``g`` depends on that the schedule contains; the
previous action on the same device is implicit. The validator and the
simulator share this so a 200k-action schedule is indexed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from zerobubble.schedule.ir import Action, Op, Schedule

_F, _B, _W, _BW = Op.F, Op.B, Op.W, Op.BW


@dataclass(frozen=True)
class Graph:
    """Flat view of a schedule's actions and their dependency edges."""

    offsets: tuple[int, ...]
    """Device d owns flat ids ``offsets[d] <= g < offsets[d + 1]``."""
    flat: tuple[Action, ...]
    device: tuple[int, ...]
    index: dict[Action, int]
    """First occurrence of each action."""
    preds: tuple[tuple[int, ...], ...]

    def location(self, g: int) -> tuple[int, int]:
        d = self.device[g]
        return d, g - self.offsets[d]


def build_graph(schedule: Schedule) -> Graph:
    flat: list[Action] = []
    device: list[int] = []
    offsets = [0]
    for d, acts in enumerate(schedule.actions):
        flat.extend(acts)
        device.extend([d] * len(acts))
        offsets.append(len(flat))
    index: dict[Action, int] = {}
    for g, a in enumerate(flat):
        index.setdefault(a, g)
    last = schedule.num_stages - 1
    get = index.get
    preds: list[tuple[int, ...]] = []
    append = preds.append
    # Plain tuples hash and compare equal to Actions (named tuples), so lookups
    # need no Action construction.
    for op, s, j in flat:
        if op is _F:
            p = get((_F, s - 1, j)) if s > 0 else None
            append(() if p is None else (p,))
        elif op is _W:
            p = get((_B, s, j))
            append(() if p is None else (p,))
        else:
            f = get((_F, s, j))
            nxt = None
            if s < last:
                nxt = get((_B, s + 1, j))
                if nxt is None:
                    nxt = get((_BW, s + 1, j))
            append(tuple(x for x in (f, nxt) if x is not None))
    return Graph(tuple(offsets), tuple(flat), tuple(device), index, tuple(preds))
