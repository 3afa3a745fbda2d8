"""The schedule intermediate representation.

A schedule is *only* an ordered list of compute actions per device plus the
facts needed to interpret them (how many stages, where each stage lives, how
many microbatches). Dependencies are never stored: they follow from the ops
themselves (see :mod:`zerobubble.schedule.deps`), so a schedule cannot disagree with its
own dependency graph.

Everything here is immutable and torch-free.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple


class Op(enum.StrEnum):
    """A compute pass of one virtual stage on one microbatch."""

    F = "F"
    """Forward."""
    B = "B"
    """Backward for the stage input only (the critical-path half of backward)."""
    W = "W"
    """Backward for the weights only (can be deferred until the optimizer step)."""
    BW = "BW"
    """Combined backward, for schedules that do not split B and W."""

    # Enum hashes through a Python-level method; the str hash is equivalent here
    # (names equal values) and runs in C, which matters for large schedules.
    __hash__ = str.__hash__

    @property
    def is_backward(self) -> bool:
        """True for the ops that consume the output gradient (B and BW)."""
        return self is Op.B or self is Op.BW

    @property
    def adds_weight_grad(self) -> bool:
        """True for the ops that add to the stage's parameter gradients (W and BW): after a
        stage's last one of a step its gradients are complete (reduce, reduce-scatter)."""
        return self is Op.W or self is Op.BW


class Action(NamedTuple):
    """One op of one virtual stage on one microbatch.

    A named tuple rather than a dataclass: schedules hold hundreds of
    thousands of actions and tuple hashing/comparison runs in C.
    """

    op: Op
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.op.value}(s{self.stage},mb{self.mb})"


def F(stage: int, mb: int) -> Action:
    return Action(Op.F, stage, mb)


def B(stage: int, mb: int) -> Action:
    return Action(Op.B, stage, mb)


def W(stage: int, mb: int) -> Action:
    return Action(Op.W, stage, mb)


def BW(stage: int, mb: int) -> Action:
    return Action(Op.BW, stage, mb)


@dataclass(frozen=True)
class Schedule:
    """An immutable pipeline schedule.

    Attributes:
        name: Human-readable name (usually the generator kind).
        num_devices: P, the number of pipeline ranks.
        num_stages: S, the number of virtual stages in model order.
        num_microbatches: M.
        placement: ``placement[s]`` is the device that holds virtual stage ``s``.
        actions: ``actions[d]`` is device ``d``'s ordered list of actions.
        segments: k, the sequence segments of each microbatch (Seq1F1B-style pipelining,
            :mod:`zerobubble.schedule.segments`). An action's ``mb`` field numbers a
            *unit*, microbatch ``u // k``'s segment ``u % k``; there are ``M * k`` units
            (:attr:`num_units`). With the default k = 1 units are microbatches.
        overlaps: Overlapped F&B pairs ``(f, b)`` (DualPipe's, PyTorch's ``OVERLAP_F_B``): an
            F and, right after it on the same device, the backward (B or BW) of another
            stage and microbatch, run as one block so that each one's communication (a
            mixture of experts' all-to-all) hides behind the other's compute. In order
            they mean F then b, which is how a runtime without an overlap runs them;
            the simulator times the pair as one block (see
            :attr:`~zerobubble.schedule.costs.CostModel.a2a`).
    """

    name: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    placement: tuple[int, ...]
    actions: tuple[tuple[Action, ...], ...]
    segments: int = 1
    overlaps: tuple[tuple[Action, Action], ...] = ()

    def __post_init__(self) -> None:
        # Normalise containers so a caller passing lists still gets an immutable value.
        object.__setattr__(self, "placement", tuple(int(d) for d in self.placement))
        object.__setattr__(self, "actions", tuple(tuple(acts) for acts in self.actions))
        if self.num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {self.num_devices}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_microbatches < 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        if type(self.segments) is not int or self.segments < 1:
            raise ValueError(f"segments must be an int >= 1, got {self.segments!r}")
        if len(self.placement) != self.num_stages:
            raise ValueError(
                f"placement has {len(self.placement)} entries but num_stages={self.num_stages}"
            )
        if len(self.actions) != self.num_devices:
            raise ValueError(
                f"actions has {len(self.actions)} device lists but num_devices={self.num_devices}"
            )
        for s, d in enumerate(self.placement):
            if not 0 <= d < self.num_devices:
                raise ValueError(f"placement[{s}]={d} is not a device in [0, {self.num_devices})")
        pairs = tuple(sorted((Action(*f), Action(*b)) for f, b in self.overlaps))
        object.__setattr__(self, "overlaps", pairs)
        if pairs:
            self._check_overlaps()

    def _check_overlaps(self) -> None:
        """Each pair: an F directly followed on its device by a B or BW, each action in
        at most one pair."""
        where = {(a, d): i for d, acts in enumerate(self.actions) for i, a in enumerate(acts)}
        used: set[Action] = set()
        for f, b in self.overlaps:
            if f.op is not Op.F or b.op not in (Op.B, Op.BW):
                raise ValueError(
                    f"overlap ({f}, {b}) must pair an F with the B or BW that follows it"
                )
            d = self.placement[f.stage] if 0 <= f.stage < self.num_stages else -1
            i = where.get((f, d))
            if i is None or where.get((b, d)) != i + 1:
                raise ValueError(
                    f"overlap ({f}, {b}): {b} must come right after {f} on the device that "
                    "holds both"
                )
            if f in used or b in used:
                raise ValueError(f"overlap ({f}, {b}): an action is in two overlapped pairs")
            used.update((f, b))

    # ---- derived views -------------------------------------------------------------------

    @property
    def num_units(self) -> int:
        """M * k: the range of an action's ``mb`` field (microbatches when k = 1)."""
        return self.num_microbatches * self.segments

    def unit(self, mb: int, segment: int) -> int:
        """The ``mb`` field of microbatch ``mb``'s segment ``segment``."""
        return mb * self.segments + segment

    def microbatch_of(self, unit: int) -> int:
        """The microbatch a unit belongs to."""
        return unit // self.segments

    def segment_of(self, unit: int) -> int:
        """The segment (0 = the sequence's start) a unit is."""
        return unit % self.segments

    @cached_property
    def stages_of_device(self) -> tuple[tuple[int, ...], ...]:
        """``stages_of_device[d]``: the virtual stages held by ``d``, in model order."""
        held: list[list[int]] = [[] for _ in range(self.num_devices)]
        for s, d in enumerate(self.placement):
            held[d].append(s)
        return tuple(tuple(h) for h in held)

    @cached_property
    def chunk_of_stage(self) -> tuple[int, ...]:
        """Local chunk index of each stage on its device (0 = earliest in model order)."""
        chunk = [0] * self.num_stages
        for stages in self.stages_of_device:
            for i, s in enumerate(stages):
                chunk[s] = i
        return tuple(chunk)

    def chunks(self, device: int) -> int:
        """How many virtual stages ``device`` holds (v for uniform placements)."""
        return len(self.stages_of_device[device])

    @property
    def uses_split_backward(self) -> bool:
        """True if any action is a split B or W."""
        return any(a.op in (Op.B, Op.W) for acts in self.actions for a in acts)

    def split_stages(self, device: int | None = None) -> frozenset[int]:
        """The stages (of ``device``, or of every device) whose backward runs split: they
        have a B, so their chunk must split the backward to gain from the schedule."""
        acts = self.actions if device is None else (self.actions[device],)
        return frozenset(a.stage for row in acts for a in row if a.op is Op.B)

    def __iter__(self) -> Iterator[tuple[int, int, Action]]:
        """Yield ``(device, position, action)`` for every action."""
        for d, acts in enumerate(self.actions):
            for i, a in enumerate(acts):
                yield d, i, a

    def __len__(self) -> int:
        return sum(len(acts) for acts in self.actions)

    def with_actions(
        self,
        actions: Sequence[Iterable[Action]],
        name: str | None = None,
        overlaps: Iterable[tuple[Action, Action]] | None = None,
    ) -> Schedule:
        """A copy with other per-device action lists (used by mutation tests and passes).

        ``overlaps`` defaults to this schedule's pairs that are still an F directly
        followed by its partner on the new lists (a pass that moves them apart runs them
        one after the other)."""
        rows = tuple(tuple(a) for a in actions)
        if overlaps is None:
            after = {a: row[i + 1] for row in rows for i, a in enumerate(row[:-1])}
            overlaps = tuple((f, b) for f, b in self.overlaps if after.get(f) == b)
        return Schedule(
            name=self.name if name is None else name,
            num_devices=self.num_devices,
            num_stages=self.num_stages,
            num_microbatches=self.num_microbatches,
            placement=self.placement,
            actions=rows,
            segments=self.segments,
            overlaps=tuple(overlaps),
        )

    def overlap_partner(self) -> dict[Action, Action]:
        """Each overlapped F's backward partner (see :attr:`overlaps`)."""
        return dict(self.overlaps)

    def blocks(self, device: int) -> list[tuple[Action, Action | None]]:
        """``device``'s actions as the blocks they run in: an overlapped F with its
        backward, every other action alone (``None``)."""
        partner = self.overlap_partner()
        paired = set(partner.values())
        return [(a, partner.get(a)) for a in self.actions[device] if a not in paired]


# ---- placements ----------------------------------------------------------------------------


def looped_placement(num_devices: int, chunks: int) -> tuple[int, ...]:
    """Interleaved (cyclic) placement: stage ``s`` lives on device ``s % P``."""
    return tuple(s % num_devices for s in range(num_devices * chunks))


def v_placement(num_devices: int) -> tuple[int, ...]:
    """V placement: device ``d`` holds stages ``d`` and ``2P-1-d``."""
    p = num_devices
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))
