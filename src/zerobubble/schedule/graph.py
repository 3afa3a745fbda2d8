"""The dependency graph of a schedule, flattened for speed.

Actions get flat ids (device 0's first, then device 1's, ...). ``deps[n][g]``
is the id of the action that produces ``g``'s n-th need in
:data:`~zerobubble.schedule.deps.RULES` order, where the schedule contains one
(-1 where there is none); the previous action on the same device is implicit.
The validator and the simulator share this so a 200k-action schedule is
indexed once.

When every action is a well-formed, in-range :class:`Action` (the common
case), the graph also carries :class:`Columns`: the actions as integer arrays,
so whole-schedule checks run in numpy. Anything else is indexed through a
dict, slower but without assumptions, so the validator can name the problem.

:func:`action_code` is the one integer encoding of an action, shared with the
searches' graph (:mod:`zerobubble.schedule.search.graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate, chain
from typing import TypeVar

import numpy as np

from zerobubble.schedule.deps import MAX_NEEDS, PRODUCERS, RULES, Kind
from zerobubble.schedule.ir import Action, Op, Schedule

CODE = {op: i for i, op in enumerate(Op)}
"""Integer code of each op (F 0, B 1, W 2, BW 3), in :attr:`Columns.op`."""

_I = TypeVar("_I", int, np.ndarray)


def action_code(op: int | _I, stage: _I, mb: _I, num_stages: int, num_mbs: int) -> _I:
    """The integer of action (op code, stage, mb): ``(op * S + stage) * M + mb``.

    Dense and ordered by (op, stage, mb), so ids of F, B and W alone are ``0 .. 3SM-1``.
    """
    # numpy's stubs type array arithmetic as Any; the annotation restores the array type.
    code: _I = (op * num_stages + stage) * num_mbs + mb
    return code


if MAX_NEEDS != 3:  # pragma: no cover - a rule change the simulator's loop must follow
    raise ImportError(f"the simulator reads 3 dependencies per action; the rule has {MAX_NEEDS}")


@dataclass(frozen=True)
class Columns:
    """The actions as arrays: op code, stage, unit, and a sorted key index."""

    op: np.ndarray
    stage: np.ndarray
    mb: np.ndarray
    num_stages: int
    num_microbatches: int
    """The range of ``mb``: the schedule's units (:attr:`Schedule.num_units`)."""
    segments: int
    order: np.ndarray
    """Flat ids sorted by key (stable, so the first occurrence of a key comes first)."""
    sorted_keys: np.ndarray

    def key(self, op: int | np.ndarray, stage: np.ndarray, mb: np.ndarray) -> np.ndarray:
        return action_code(op, stage, mb, self.num_stages, self.num_microbatches)

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
    deps: tuple[list[int], ...]
    """One list per need slot (:data:`~zerobubble.schedule.deps.MAX_NEEDS`)."""
    columns: Columns | None
    """The array view, when every action is a well-formed in-range Action."""

    @cached_property
    def index(self) -> dict[tuple[Op, int, int], int]:
        """First occurrence of each action; plain ``(op, stage, mb)`` tuples look it up too."""
        n = len(self.flat)
        return dict(zip(reversed(self.flat), range(n - 1, -1, -1), strict=True))

    @cached_property
    def preds(self) -> tuple[tuple[int, ...], ...]:
        """The dependencies of each action, as ids (the first of B/BW's is its F)."""
        return tuple(tuple(x for x in row if x >= 0) for row in zip(*self.deps, strict=True))

    def location(self, g: int) -> tuple[int, int]:
        d = self.device[g]
        return d, g - self.offsets[d]


def build_graph(schedule: Schedule) -> Graph:
    flat = tuple(chain.from_iterable(schedule.actions))
    lengths = [len(acts) for acts in schedule.actions]
    offsets = (0, *accumulate(lengths))
    device = list(chain.from_iterable([d] * k for d, k in enumerate(lengths)))
    k = schedule.segments
    columns = _columns(flat, schedule.num_stages, schedule.num_units, k)
    if columns is None:
        deps = _deps_by_dict(flat, schedule.num_stages, k)
    else:
        deps = _deps_by_columns(columns)
    return Graph(offsets, flat, device, deps, columns)


def _columns(
    flat: tuple[Action, ...], num_stages: int, num_microbatches: int, segments: int
) -> Columns | None:
    """The array view of ``flat``, or None if any entry is malformed or out of range."""
    if not flat:
        return None
    if set(map(type, flat)) != {Action}:
        return None
    ops, stages, mbs = zip(*flat, strict=True)
    if set(map(type, ops)) != {Op} or set(map(type, stages)) | set(map(type, mbs)) != {int}:
        return None
    # In range before any array: an index from a file may not fit an int64.
    if min(stages) < 0 or max(stages) >= num_stages or min(mbs) < 0 or max(mbs) >= num_microbatches:
        return None
    stage = np.array(stages, dtype=np.int64)
    mb = np.array(mbs, dtype=np.int64)
    op = np.fromiter(map(CODE.__getitem__, ops), dtype=np.int64, count=len(ops))
    keys = action_code(op, stage, mb, num_stages, num_microbatches)
    order = np.argsort(keys, kind="stable")
    return Columns(op, stage, mb, num_stages, num_microbatches, segments, order, keys[order])


_NEED_GROUPS: tuple[tuple[tuple[Kind, ...], tuple[int, ...]], ...] = tuple(
    (needs, tuple(CODE[op] for op, r in RULES.items() if r.needs == needs))
    for needs in dict.fromkeys(r.needs for r in RULES.values())
)
"""The ops' codes grouped by what they need (B and BW need the same), for one pass each."""


def _deps_by_columns(c: Columns) -> tuple[list[int], ...]:
    n = len(c.op)
    deps = [np.full(n, -1, dtype=np.int64) for _ in range(MAX_NEEDS)]
    for kinds, codes in _NEED_GROUPS:
        sel = c.op == codes[0]
        for code in codes[1:]:
            sel |= c.op == code
        ids = np.flatnonzero(sel)
        stage, mb = c.stage[ids], c.mb[ids]
        for slot, kind in enumerate(kinds):
            if kind.step and c.segments == 1:
                continue  # no unit has a neighbouring segment
            at, src, j = ids, stage - kind.flow, mb - kind.step
            if kind.flow:
                keep = (src >= 0) & (src < c.num_stages)
                at, src, j = at[keep], src[keep], j[keep]
            if kind.step:
                keep = (j >= 0) & (j // c.segments == (j + kind.step) // c.segments)
                at, src, j = at[keep], src[keep], j[keep]
            first, *others = PRODUCERS[kind]
            found = c.find(CODE[first], src, j)
            for prod in others:  # the first producer op the schedule has
                miss = np.flatnonzero(found < 0)
                found[miss] = c.find(CODE[prod], src[miss], j[miss])
            deps[slot][at] = found
    return tuple(d.tolist() for d in deps)


_PLAN = {op: tuple((k.flow, k.step, PRODUCERS[k]) for k in r.needs) for op, r in RULES.items()}
"""Per op: for each need, its flow, its step and the ops that may produce it."""


def _deps_by_dict(
    flat: tuple[Action, ...], num_stages: int, segments: int
) -> tuple[list[int], ...]:
    index: dict[tuple[Op, int, int], int] = {}
    for g, a in enumerate(flat):
        index.setdefault(a, g)
    get = index.get
    deps: list[list[int]] = [[] for _ in range(MAX_NEEDS)]
    # Plain tuples hash and compare equal to Actions (named tuples), so lookups
    # need no Action construction.
    for op, s, j in flat:
        found = [-1] * MAX_NEEDS
        if type(op) is Op and type(s) is int and type(j) is int:
            for slot, (flow, step, prods) in enumerate(_PLAN[op]):
                src, unit = s - flow, j - step
                if not 0 <= src < num_stages:
                    continue
                if step and (unit < 0 or unit // segments != j // segments):
                    continue
                for prod in prods:
                    hit = get((prod, src, unit))
                    if hit is not None:
                        found[slot] = hit
                        break
        for slot in range(MAX_NEEDS):
            deps[slot].append(found[slot])
    return tuple(deps)
