"""The dependency graph of a schedule, flattened for speed.

Actions get flat ids (device 0's first, then device 1's, ...). ``dep1[g]`` and
``dep2[g]`` are the ids of the actions ``g`` depends on that the schedule
contains (-1 where there is none); the previous action on the same device is
implicit. The validator and the simulator share this so a 200k-action
schedule is indexed once.

When every action is a well-formed, in-range :class:`Action` (the common
case), the graph also carries :class:`Columns`: the actions as integer arrays,
so whole-schedule checks run in numpy. Anything else is indexed through a
dict, slower but without assumptions, so the validator can name the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain

import numpy as np

from zerobubble.schedule.ir import Action, Op, Schedule

_F, _B, _W, _BW = Op.F, Op.B, Op.W, Op.BW
CODE = {_F: 0, _B: 1, _W: 2, _BW: 3}
"""Integer code of each op in :attr:`Columns.op`."""


@dataclass(frozen=True)
class Columns:
    """The actions as arrays: op code, stage, microbatch, and a sorted key index."""

    op: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    num_stages: int
    num_microbatches: int
    order: np.ndarray
    """Flat ids sorted by key (stable, so the first occurrence of a key comes first)."""
    sorted_keys: np.ndarray

    def key(self, op: int | np.ndarray, stage: np.ndarray, mb: np.ndarray) -> np.ndarray:
        return (op * self.num_stages + stage) * self.num_microbatches + mb

    def find(self, op: int | np.ndarray, stage: np.ndarray, mb: np.ndarray) -> np.ndarray:
        """Flat id of the first occurrence of each (op, stage, mb), -1 where absent."""
        keys = self.key(op, stage, mb)
        if not len(self.sorted_keys):
            return np.full(len(keys), -1, dtype=np.int64)
        pos = np.searchsorted(self.sorted_keys, keys)
        pos = np.minimum(pos, len(self.sorted_keys) - 1)
        return np.where(self.sorted_keys[pos] == keys, self.order[pos], -1)

    @cached_property
    def has_duplicates(self) -> bool:
        return bool(np.any(self.sorted_keys[1:] == self.sorted_keys[:-1]))


@dataclass(frozen=True)
class Graph:
    """Flat view of a schedule's actions and their dependency edges."""

    offsets: tuple[int, ...]
    """Device d owns flat ids ``offsets[d] <= g < offsets[d + 1]``."""
    flat: tuple[Action, ...]
    device: list[int]
    dep1: list[int]
    dep2: list[int]
    columns: Columns | None
    """The array view, when every action is a well-formed in-range Action."""

    @cached_property
    def index(self) -> dict[Action, int]:
        """First occurrence of each action."""
        n = len(self.flat)
        return dict(zip(reversed(self.flat), range(n - 1, -1, -1), strict=True))

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        """The dependencies of each action, as ids (the first of B/BW's is its F)."""
        return tuple(
            tuple(x for x in pair if x >= 0) for pair in zip(self.dep1, self.dep2, strict=True)
        )

    def location(self, g: int) -> tuple[int, int]:
        d = self.device[g]
        return d, g - self.offsets[d]


def build_graph(schedule: Schedule) -> Graph:
    flat = tuple(chain.from_iterable(schedule.actions))
    lengths = [len(acts) for acts in schedule.actions]
    offsets = (0, *accumulate(lengths))
    device = list(chain.from_iterable([d] * k for d, k in enumerate(lengths)))
    columns = _columns(flat, schedule.num_stages, schedule.num_microbatches)
    if columns is None:
        dep1, dep2 = _deps_by_dict(flat, schedule.num_stages)
    else:
        dep1, dep2 = _deps_by_columns(columns)
    return Graph(offsets, flat, device, dep1, dep2, columns)


def _columns(flat: tuple[Action, ...], num_stages: int, num_microbatches: int) -> Columns | None:
    """The array view of ``flat``, or None if any entry is malformed or out of range."""
    if not flat:
        return None
    if set(map(type, flat)) != {Action}:
        return None
    ops, stages, mbs = zip(*flat, strict=True)
    if set(map(type, ops)) != {Op} or set(map(type, stages)) | set(map(type, mbs)) != {int}:
        return None
    stage = np.array(stages, dtype=np.int64)
    mb = np.array(mbs, dtype=np.int64)
    if stage.min() < 0 or stage.max() >= num_stages or mb.min() < 0 or mb.max() >= num_microbatches:
        return None
    op = np.fromiter(map(CODE.__getitem__, ops), dtype=np.int64, count=len(ops))
    keys = (op * num_stages + stage) * num_microbatches + mb
    order = np.argsort(keys, kind="stable")
    return Columns(op, stage, mb, num_stages, num_microbatches, order, keys[order])


def _deps_by_columns(c: Columns) -> tuple[list[int], list[int]]:
    n = len(c.op)
    dep1 = np.full(n, -1, dtype=np.int64)
    dep2 = np.full(n, -1, dtype=np.int64)
    sel = (c.op == CODE[_F]) & (c.stage > 0)
    dep1[sel] = c.find(CODE[_F], c.stage[sel] - 1, c.mb[sel])
    sel = c.op == CODE[_W]
    dep1[sel] = c.find(CODE[_B], c.stage[sel], c.mb[sel])
    sel = (c.op == CODE[_B]) | (c.op == CODE[_BW])
    dep1[sel] = c.find(CODE[_F], c.stage[sel], c.mb[sel])
    sel &= c.stage < c.num_stages - 1
    s, j = c.stage[sel] + 1, c.mb[sel]
    nxt = c.find(CODE[_B], s, j)
    dep2[sel] = np.where(nxt >= 0, nxt, c.find(CODE[_BW], s, j))
    return dep1.tolist(), dep2.tolist()


def _deps_by_dict(flat: tuple[Action, ...], num_stages: int) -> tuple[list[int], list[int]]:
    index: dict[Action, int] = {}
    for g, a in enumerate(flat):
        index.setdefault(a, g)
    last = num_stages - 1
    get = index.get
    dep1: list[int] = []
    dep2: list[int] = []
    # Plain tuples hash and compare equal to Actions (named tuples), so lookups
    # need no Action construction.
    for op, s, j in flat:
        f = nxt = None
        if op is _F:
            f = get((_F, s - 1, j)) if s > 0 else None
        elif op is _W:
            f = get((_B, s, j))
        else:
            f = get((_F, s, j))
            if s < last:
                nxt = get((_B, s + 1, j))
                if nxt is None:
                    nxt = get((_BW, s + 1, j))
        dep1.append(-1 if f is None else f)
        dep2.append(-1 if nxt is None else nxt)
    return dep1, dep2
