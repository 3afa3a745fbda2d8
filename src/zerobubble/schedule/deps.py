"""The dependency rule: what each action needs and what it produces.

Every consumer of dependencies (the graph the validator and simulator share,
the searches' graph, the automatic scheduler's pass and the exact search, the
fusing pass, the V-family generator, lowering, the trace checker and the
bubble breakdown) derives its edges from :data:`RULES` through :func:`needs`
and :func:`produces`, so a new dependency between the existing ops (a need in
a :class:`Rule`, with a new :class:`Kind` and its flow if the data is new) is
one entry here. :class:`~zerobubble.schedule.graph.Graph` stores at most two
needs per action and refuses to import beyond that.

A new action kind is an entry here and, outside the rule: its
:class:`~zerobubble.schedule.ir.Op` member, its duration and memory delta
(:class:`~zerobubble.schedule.costs.CostModel`), the validator's check of
which ops a complete schedule holds (every F its B+W or BW), the torch CSV
format's letter, the runtime's executor, and, for the searches, which
schedule F, B and W only (``search.graph.OPS``), a role in the automatic
scheduler's heuristic.

Edges are stated on plain keys, not on actions: an action produces data
(:class:`Key`: kind, producing stage, microbatch) and needs data; whichever
action of the schedule produces a key is the producer. That is how B(s) finds
the backward of stage s+1 whether the schedule runs it as B or as BW.

A kind *flows* to a neighbouring stage (``flow`` +1 or -1: a message when the
stages sit on different devices) or stays on its stage (``flow`` 0). A key
exists only when both the producing and the consuming stage exist: F(0) needs
no activation (it reads the batch), the last stage's F output feeds the loss,
stage 0's input gradient is dropped.

Sequence segments (:attr:`~zerobubble.schedule.ir.Schedule.segments`, k) add two
kinds that *step* to a neighbouring unit of the same microbatch on the same
stage (``step`` +1 or -1): a segment's forward reads the keys and values of the
segments before it (:attr:`Kind.KV`), and its backward sends gradients into them
(:attr:`Kind.KVGRAD`), so backwards run last segment first. Such a key exists
only inside one microbatch: the first segment reads no keys, the last receives
no key gradients. With k = 1 they never exist, so every other schedule is
unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import NamedTuple

from zerobubble.schedule.ir import Action, Op, Schedule


class Kind(enum.StrEnum):
    """What a key carries; the values of the two that travel are the trace's message kinds."""

    ACT = "act"
    """F(s)'s output activation, the input of F(s+1)."""
    GRAD = "grad"
    """The backward of s's input gradient, the output gradient of stage s-1's backward."""
    SAVED = "saved"
    """What F(s) keeps for the backward of s."""
    WSTATE = "wstate"
    """What B(s) keeps for W(s) (its inputs and output gradients)."""
    KV = "kv"
    """The keys and values of F(s)'s segment, read by F(s) of the microbatch's next segment."""
    KVGRAD = "kvgrad"
    """The gradients a segment's backward sends into the keys and values of the segments
    before it, read by the backward of the previous segment."""

    __hash__ = str.__hash__

    @property
    def flow(self) -> int:
        """Consuming stage minus producing stage."""
        return _FLOW[self]

    @property
    def travels(self) -> bool:
        """True for the kinds that cross a stage boundary (messages between devices)."""
        return _FLOW[self] != 0

    @property
    def step(self) -> int:
        """Consuming unit minus producing unit (segments of one microbatch; 0 for the rest)."""
        return _STEP.get(self, 0)

    @property
    def same_action(self) -> bool:
        """True for the kinds one action hands to a later op of its own (stage, unit)."""
        return _FLOW[self] == 0 and self.step == 0


_FLOW = {
    Kind.ACT: 1,
    Kind.GRAD: -1,
    Kind.SAVED: 0,
    Kind.WSTATE: 0,
    Kind.KV: 0,
    Kind.KVGRAD: 0,
}
_STEP = {Kind.KV: 1, Kind.KVGRAD: -1}


class Rule(NamedTuple):
    """The kinds an op needs (in the order the graphs store them) and produces."""

    needs: tuple[Kind, ...]
    produces: tuple[Kind, ...]


RULES: Mapping[Op, Rule] = {
    Op.F: Rule(needs=(Kind.ACT, Kind.KV), produces=(Kind.ACT, Kind.SAVED, Kind.KV)),
    Op.B: Rule(
        needs=(Kind.SAVED, Kind.GRAD, Kind.KVGRAD),
        produces=(Kind.GRAD, Kind.WSTATE, Kind.KVGRAD),
    ),
    Op.W: Rule(needs=(Kind.WSTATE,), produces=()),
    Op.BW: Rule(needs=(Kind.SAVED, Kind.GRAD, Kind.KVGRAD), produces=(Kind.GRAD, Kind.KVGRAD)),
}
"""The rule. F(s,j) needs F(s-1,j); B/BW(s,j) need F(s,j) and the backward of (s+1,j);
W(s,j) needs B(s,j). With segments, F(s,j) also needs F(s,j-1) and B/BW(s,j) the
backward of (s,j+1), inside one microbatch."""

MAX_NEEDS = max(len(r.needs) for r in RULES.values())
"""Dependencies per action at most (the graphs store this many per action)."""

PRODUCERS: Mapping[Kind, tuple[Op, ...]] = {
    k: tuple(op for op, r in RULES.items() if k in r.produces) for k in Kind
}
"""The ops that produce each kind, in :class:`Op` order (B before BW for GRAD)."""

LOCAL_PRODUCER: Mapping[Op, Op | None] = {
    op: next((PRODUCERS[k][0] for k in r.needs if k.same_action), None) for op, r in RULES.items()
}
"""The op whose same-stage output each op needs (B for W, F for B and BW, None for F):
what must have run on this stage and microbatch before it."""


class Key(NamedTuple):
    """One piece of data: its kind, the stage that produces it, the microbatch."""

    kind: Kind
    stage: int
    mb: int

    @property
    def consumer_stage(self) -> int:
        return self.stage + self.kind.flow

    @property
    def consumer_mb(self) -> int:
        return self.mb + self.kind.step


def same_microbatch(unit: int, other: int, segments: int) -> bool:
    """Whether two units (``mb`` fields) are segments of one microbatch."""
    return other >= 0 and unit // segments == other // segments


def needs(op: Op, stage: int, mb: int, num_stages: int, segments: int = 1) -> tuple[Key, ...]:
    """The keys ``op`` of ``stage`` on unit ``mb`` consumes, in :data:`RULES` order."""
    out = []
    for k in RULES[op].needs:
        src, j = stage - _FLOW[k], mb - k.step
        if 0 <= src < num_stages and (j == mb or same_microbatch(mb, j, segments)):
            out.append(Key(k, src, j))
    return tuple(out)


def produces(op: Op, stage: int, mb: int, num_stages: int, segments: int = 1) -> tuple[Key, ...]:
    """The keys ``op`` of ``stage`` on unit ``mb`` makes that some other action consumes."""
    out = []
    for k in RULES[op].produces:
        j = mb + k.step
        if 0 <= stage + _FLOW[k] < num_stages and (j == mb or same_microbatch(mb, j, segments)):
            out.append(Key(k, stage, mb))
    return tuple(out)


def producer(key: Key, backward_op: Mapping[tuple[int, int], Op] | None = None) -> Action:
    """The action that produces ``key``; ``backward_op`` picks among several (B or BW)."""
    ops = PRODUCERS[key.kind]
    op = ops[0]
    if len(ops) > 1 and backward_op is not None:
        op = backward_op.get((key.stage, key.mb), op)
    return Action(op, key.stage, key.mb)


def backward_ops(schedule: Schedule) -> dict[tuple[int, int], Op]:
    """Map (stage, mb) -> the backward op (B or BW) the schedule uses for it.

    The first occurrence wins; duplicates and conflicts are the validator's business.
    """
    found: dict[tuple[int, int], Op] = {}
    for acts in schedule.actions:
        for a in acts:
            if a.op.is_backward:
                found.setdefault((a.stage, a.mb), a.op)
    return found


def dependencies(
    action: Action,
    num_stages: int,
    backward_op: Mapping[tuple[int, int], Op],
    segments: int = 1,
) -> tuple[Action, ...]:
    """The actions that must finish before ``action`` may start (the producers of its needs)."""
    return tuple(
        producer(k, backward_op)
        for k in needs(action.op, action.stage, action.mb, num_stages, segments)
    )


def pair_conflict(forward: Action, backward: Action) -> str | None:
    """Why ``forward`` and ``backward`` may never run at once as an overlapped pair, or None.

    The rule is the stage: a runtime runs a pair's halves on two threads, and the two
    actions of one stage would share its module (a graph-level B/W split swaps the
    module's parameters for the duration of a forward, and W re-runs that forward), its
    weight-gradient store and its per-microbatch state. Two stages on one device (a V
    placement's two chunks, an interleaved rank's chunks) share none of these, so such a
    pair cannot race by construction. The other condition, that the backward not need
    the forward, depends on the whole schedule (the validator's graph checks it).
    """
    if forward.stage == backward.stage:
        return (
            f"{forward} and {backward} are actions of one stage, whose module, "
            "weight-gradient store and per-microbatch state two threads would then use at "
            "once; pair an F with a backward of another stage on its device (a V "
            "placement's other chunk), or run the two in sequence"
        )
    return None
