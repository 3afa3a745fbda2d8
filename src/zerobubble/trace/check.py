"""Offline checker of an executed pipeline's JSON-lines trace.

A schedule is validated before it runs; this checks what actually ran. Each
rank's events are taken in file order (the executor records them in
execution order, and :func:`~zerobubble.runtime.recorder.gather_traces` keeps
it). Times of different ranks share an epoch only up to the barrier skew, so
they are compared up to a clock offset per rank pair
(:mod:`zerobubble.trace.clocks`), with ``tolerance_ns`` to spare. Which
compute feeds which follows :mod:`zerobubble.schedule.deps`, like everywhere else.

Checks, in this order (the first family with a violation is reported, at
its earliest event):

1. ``event``: known ops, complete fields, each rank's events sequential in time.
2. ``backward``: per iteration every F(s, j) is followed on its rank by B then
   W, or by BW, exactly once; every (stage, microbatch) of the iteration has an F.
   ``reduce``: with data parallelism (``reduce_grads`` events), per iteration and
   rank every stage's reduction starts once, after its every W and BW, and one
   ``wait_reduce`` follows them all, before the rank's optimizer acts on the
   iteration's gradients.
3. ``messages``: every message id is sent once and received (posted, then
   waited) once, between the ranks that run its two stages.
4. ``message order``: for each rank pair, receives are posted in send order
   (the transport matches messages in order).
5. ``edge``: every cross-stage dependency is respected: a consumer runs after
   its local producer, or after waiting for the message whose send follows
   its producer on the other rank. With ``segments=k`` (a segment schedule's
   trace, whose ``mb`` are units) also the segments' order on each stage:
   forwards from the sequence's start, backwards from its end.
6. ``clock``: some clock offset between each pair of ranks makes every
   message between them arrive after it was sent (so, with 5, every consumer
   starts after its producer ended).
7. ``version``: all compute of one microbatch in one iteration saw one
   parameter version.
8. ``optimizer``: no compute of iteration k runs on a rank after that rank's
   first optimizer action on iteration k's gradients (skipped, with a note,
   when the trace has no optimizer events).
9. ``commit``: when the trace has ``opt_commit`` events, every rank commits
   each iteration exactly once, at parameter version ``iteration + 1``; with
   ``conservative=True`` no forward of iteration k+1 starts on a rank before
   that rank committed iteration k (post-validation's conservative mode).
10. ``memory``: held activation bytes never exceed ``mem_budget``.

Optimizer events follow :mod:`zerobubble.optim`'s protocol: ops ``opt_*``,
each carrying the iteration whose gradients it acts on; ``opt_reduce`` and
``opt_prefix`` read them (the norm), ``opt_step``, ``opt_provisional``,
``opt_skip`` and ``opt_defer`` apply them. A ``replay``
event discards its rank's earlier work of that iteration (speculation undone),
so checks 2-7 ignore those events.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.deps import LOCAL_PRODUCER, Key, needs, produces
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.trace.clocks import pair_bounds
from zerobubble.trace.format import (
    COMPUTE_OPS,
    MESSAGE_OPS,
    EventKind,
    EventOp,
    MessageId,
    OptOp,
    TraceEvent,
    is_opt_op,
    read_jsonl_lines,
)

OTHER_OPS = (
    EventOp.WAIT_SENDS,
    EventOp.REPLAY,
    EventOp.REDUCE_GRADS,
    EventOp.WAIT_REDUCE,
    EventOp.UNSHARD,
    EventOp.REDUCE_SCATTER,
)
DEFAULT_OPT_OPS: tuple[EventKind, ...] = (
    OptOp.REDUCE,
    OptOp.PREFIX,
    OptOp.PROVISIONAL,
    OptOp.STEP,
    OptOp.SKIP,
    OptOp.DEFER,
)
"""Optimizer events that read or apply an iteration's gradients (no compute of it may
follow): the norm's all-reduce or prefix state, and every kind of step."""
DEFAULT_TOLERANCE_NS = 1_000_000
"""Slack of the cross-rank causality check (clocks of different hosts may drift)."""

CHECKS = (
    "event",
    "backward",
    "reduce",
    "messages",
    "message order",
    "edge",
    "clock",
    "version",
    "optimizer",
    "commit",
    "memory",
)


@dataclass(frozen=True)
class Violation:
    """One broken rule, located as precisely as the trace allows.

    Attributes:
        check: Which family of :data:`CHECKS` it breaks.
        iteration, rank: Where (None when the violation has no single event).
        index: Position of the event among its rank's events (0-based, file order).
        line: Line of the event in the JSONL file (1-based), when read from a file.
        event: Short name of the event, e.g. ``F(s1,mb0)`` or ``send act(s0->s1,mb2)``.
        why: What is wrong and what it should have been.
    """

    check: str
    iteration: int | None
    rank: int | None
    index: int | None
    line: int | None
    event: str
    why: str

    def __str__(self) -> str:
        where = []
        if self.rank is not None:
            where.append(f"rank {self.rank}")
        if self.index is not None:
            where.append(f"event #{self.index}")
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.iteration is not None:
            where.append(f"iteration {self.iteration}")
        return f"[{self.check}] {', '.join(where)}: {self.event}: {self.why}"


@dataclass(frozen=True)
class TraceReport:
    """All violations found (earliest first within the first failing family), plus notes."""

    violations: tuple[Violation, ...]
    notes: tuple[str, ...]
    num_events: int
    ranks: tuple[int, ...]
    iterations: tuple[int, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def first(self) -> Violation | None:
        return self.violations[0] if self.violations else None


@dataclass(frozen=True)
class _Ev:
    """An event with its position: index among its rank's events, file line."""

    e: TraceEvent
    index: int
    line: int | None

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.e.iteration, self.e.start_ns, self.e.rank, self.index)


def describe(e: TraceEvent) -> str:
    """``F(s1,mb0)``, ``send act(s0->s1,mb2)``, ``wait_sends``..."""
    if isinstance(e.op, Op):
        return f"{e.op}(s{e.stage},mb{e.mb})"
    if e.msg is not None:
        return f"{e.op} {_msg(e.msg)}"
    return e.op


def _msg(m: MessageId) -> str:
    return f"{m[0]}(s{m[1]}->s{m[2]},mb{m[3]})"


def load_trace(path: str | Path) -> tuple[list[TraceEvent], list[int]]:
    """Read a JSONL trace; returns the events and their line numbers.

    Raises ``ValueError`` naming the file, line and field of anything that is not an event.
    """
    events, lines = read_jsonl_lines(path)
    if not events:
        raise ValueError(f"{path}: no events; is this a zerobubble JSONL trace?")
    return events, lines


def check_trace(
    events: Sequence[TraceEvent],
    *,
    lines: Sequence[int] | None = None,
    mem_budget: int | None = None,
    tolerance_ns: int = DEFAULT_TOLERANCE_NS,
    opt_ops: Iterable[EventKind] = DEFAULT_OPT_OPS,
    conservative: bool = False,
    segments: int = 1,
    overlaps: Iterable[tuple[Action, Action]] = (),
    schedule: Schedule | None = None,
) -> TraceReport:
    """Check a trace of every rank; see the module docstring for the rules.

    ``overlaps``: the schedule's overlapped F&B pairs, whose two events may overlap in time
    (the runtime runs them at once). ``schedule``: the run's schedule; its pairs are
    ``overlaps`` too, and every index of the trace must fit its sizes.

    Raises ValueError (:func:`check_sizes`) for an index no run of the trace can have.
    """
    if type(segments) is not int or segments < 1:
        raise ValueError(f"segments must be an integer >= 1, got {segments!r}")
    check_sizes(events, lines=lines, schedule=schedule)
    if schedule is not None:
        overlaps = (*overlaps, *schedule.overlaps)
    opt_ops = tuple(opt_ops)
    counters: Counter[int] = Counter()
    evs: list[_Ev] = []
    for i, e in enumerate(events):
        evs.append(_Ev(e, counters[e.rank], lines[i] if lines is not None else None))
        counters[e.rank] += 1
    notes: list[str] = []
    kept = _without_replayed(evs)
    dropped = sum(ev.e.op is not EventOp.REPLAY for ev in evs) - len(kept)
    if dropped:
        notes.append(f"{dropped} event(s) of replayed (discarded) work not checked")
    families: tuple[Callable[[], _Found], ...] = (
        lambda: _check_events(evs, opt_ops, frozenset(overlaps)),
        lambda: _check_backward(kept),
        lambda: _check_reduce(evs, kept, opt_ops),
        lambda: _check_messages(kept),
        lambda: _check_message_order(kept),
        lambda: _check_edges(kept, segments),
        lambda: _check_clocks(kept, tolerance_ns),
        lambda: _check_versions(kept),
        lambda: _check_optimizer(evs, opt_ops, notes),
        lambda: _check_commits(evs, conservative),
        lambda: _check_memory(evs, mem_budget, notes),
    )
    found: list[Violation] = []
    for family in families:
        got = family()
        if got:
            found = [v for _, v in sorted(got, key=lambda kv: kv[0])]
            break
    return TraceReport(
        tuple(found),
        tuple(notes),
        len(events),
        tuple(sorted(counters)),
        tuple(sorted({e.iteration for e in events})),
    )


def check_sizes(
    events: Sequence[TraceEvent],
    *,
    lines: Sequence[int] | None = None,
    schedule: Schedule | None = None,
) -> None:
    """Refuse an index that no run of this trace can have, before any check sizes its work
    by one: against ``schedule``'s sizes when given (stages, units, devices), else against
    the trace's own size (a run's stage and microbatch indices are below its number of
    events: every one of them has an event). Raises ValueError naming the line, the field,
    the value and the limit. Ranks name no size without a schedule and are not bounded."""
    n = len(events)
    if schedule is not None:
        of = f"the schedule {schedule.name!r}"
        limits = {
            "stage": (schedule.num_stages, f"{of} has {schedule.num_stages} stages"),
            "mb": (schedule.num_units, f"{of} has {schedule.num_units} units per step"),
            "rank": (schedule.num_devices, f"{of} has {schedule.num_devices} devices"),
        }
    else:
        own = f"a trace of {n} events has fewer stages and microbatches than events"
        limits = {"stage": (n, own), "mb": (n, own)}
    for i, e in enumerate(events):
        fields: list[tuple[str, str, object]] = [
            ("stage", "stage", e.stage),
            ("mb", "mb", e.mb),
            ("rank", "rank", e.rank),
            ("rank", "peer", e.peer),
        ]
        if e.msg is not None and len(e.msg) == 4:
            kinds = ("stage", "stage", "mb")
            fields += [(k, f"msg[{j}]", e.msg[j]) for j, k in zip((1, 2, 3), kinds, strict=True)]
        for kind, field, value in fields:
            if kind not in limits or type(value) is not int:
                continue
            limit, why = limits[kind]
            if value >= limit:
                where = f"line {lines[i]}" if lines is not None else f"event #{i}"
                raise ValueError(
                    f"{where}: field {field!r} = {value} is out of range: it must be in "
                    f"[0, {limit}) ({why}); fix the trace, or pass the run's own --schedule"
                )


_Found = list[tuple[tuple[int, int, int, int], Violation]]
"""Violations with their sort key (:attr:`_Ev.key`)."""


def _v(check: str, ev: _Ev, why: str) -> tuple[tuple[int, int, int, int], Violation]:
    e = ev.e
    return ev.key, Violation(check, e.iteration, e.rank, ev.index, ev.line, describe(e), why)


def _without_replayed(evs: Sequence[_Ev]) -> list[_Ev]:
    """Drop each rank's events of an iteration that precede its ``replay`` of that iteration."""
    last_replay: dict[tuple[int, int], int] = {}
    for ev in evs:
        if ev.e.op is EventOp.REPLAY:
            last_replay[ev.e.rank, ev.e.iteration] = ev.index
    return [
        ev
        for ev in evs
        if ev.e.op is not EventOp.REPLAY
        and ev.index > last_replay.get((ev.e.rank, ev.e.iteration), -1)
    ]


def _by_rank(evs: Sequence[_Ev]) -> dict[int, list[_Ev]]:
    out: dict[int, list[_Ev]] = defaultdict(list)
    for ev in evs:
        out[ev.e.rank].append(ev)
    return out


def _by_iteration(evs: Sequence[_Ev]) -> dict[int, list[_Ev]]:
    out: dict[int, list[_Ev]] = defaultdict(list)
    for ev in evs:
        out[ev.e.iteration].append(ev)
    return out


# ---- 1. events --------------------------------------------------------------------------------


def _check_events(
    evs: Sequence[_Ev], opt_ops: tuple[EventKind, ...], overlaps: frozenset[tuple[Action, Action]]
) -> _Found:
    known = (*COMPUTE_OPS, *MESSAGE_OPS, *OTHER_OPS, *opt_ops)
    out: _Found = []
    for rank_evs in _by_rank(evs).values():
        prev: _Ev | None = None
        last_iteration = 0
        for ev in rank_evs:
            e = ev.e
            if e.op not in known and not is_opt_op(e.op):
                why = f"unknown op {e.op!r}; expected one of {', '.join(known)} or opt_*"
                out.append(_v("event", ev, why))
            elif isinstance(e.op, Op) and not (_nat(e.stage) and _nat(e.mb)):
                out.append(_v("event", ev, "a compute event needs integer stage and mb >= 0"))
            elif e.op in MESSAGE_OPS and (
                e.msg is None
                or len(e.msg) != 4
                or not isinstance(e.msg[0], MsgKind)
                or e.peer is None
            ):
                out.append(
                    _v("event", ev, "a message event needs msg (kind, src, dst, mb) and peer")
                )
            if e.end_ns < e.start_ns:
                out.append(
                    _v("event", ev, f"ends ({e.end_ns} ns) before it starts ({e.start_ns} ns)")
                )
            if prev is not None:
                p = prev.e
                paired = (p.action, e.action) in overlaps or (e.action, p.action) in overlaps
                if e.start_ns < p.end_ns and not paired:
                    out.append(
                        _v(
                            "event",
                            ev,
                            f"starts at {e.start_ns} ns, before the previous event of its rank "
                            f"({describe(p)}, event #{prev.index}) ended at {p.end_ns} ns; a "
                            "rank runs its events one after another",
                        )
                    )
            # Optimizer events name the iteration whose gradients they act on, which may
            # lie behind the compute around them (post-validation), so only pipeline
            # events must not go back in iteration.
            if not is_opt_op(e.op):
                if e.iteration < last_iteration:
                    out.append(
                        _v("event", ev, f"iteration {e.iteration} after iteration {last_iteration}")
                    )
                last_iteration = max(last_iteration, e.iteration)
            prev = ev
    return out


def _nat(x: object) -> bool:
    return isinstance(x, int) and x >= 0


# ---- 2b. data-parallel reductions -----------------------------------------------------------


def _check_reduce(
    evs: Sequence[_Ev], kept: Sequence[_Ev], opt_ops: tuple[EventKind, ...]
) -> _Found:
    """Each stage's reduction after its last weight gradient, all waited before the optimizer."""
    out: _Found = []
    reduced: dict[tuple[int, int], dict[int, _Ev]] = defaultdict(dict)  # (rank, it) -> stage
    waited: dict[tuple[int, int], _Ev] = {}
    for ev in kept:
        e, where = ev.e, (ev.e.rank, ev.e.iteration)
        if e.op is EventOp.REDUCE_GRADS:
            if e.stage is None or not _nat(e.stage):
                out.append(_v("reduce", ev, "a reduce_grads event needs an integer stage >= 0"))
            elif e.stage in reduced[where]:
                out.append(_v("reduce", ev, f"stage {e.stage}'s gradients reduced twice"))
            elif where in waited:
                out.append(_v("reduce", ev, "starts after the iteration's wait_reduce"))
            else:
                reduced[where][e.stage] = ev
        elif e.op is EventOp.WAIT_REDUCE:
            waited[where] = ev
        elif e.op in (Op.W, Op.BW) and e.stage is not None and e.stage in reduced.get(where, {}):
            first = reduced[where][e.stage]
            why = (
                f"adds to stage {e.stage}'s gradients after their reduction started "
                f"(event #{first.index}); the reduction must follow the stage's last W or BW"
            )
            out.append(_v("reduce", ev, why))
    for where, stages in reduced.items():
        if where not in waited:
            last = max(stages.values(), key=lambda ev: ev.index)
            out.append(_v("reduce", last, "no wait_reduce follows the iteration's reductions"))
    for ev in evs:
        e = ev.e
        if (e.op in opt_ops or is_opt_op(e.op)) and (e.rank, e.iteration) in reduced:
            wait = waited.get((e.rank, e.iteration))
            if wait is not None and ev.index < wait.index:
                why = f"reads the gradients before their wait_reduce (event #{wait.index})"
                out.append(_v("reduce", ev, why))
    return out


# ---- 2. every F has its backward ------------------------------------------------------------


def _check_backward(evs: Sequence[_Ev]) -> _Found:
    out: _Found = []
    for it, it_evs in _by_iteration(evs).items():
        state: dict[tuple[int, int], tuple[Op, _Ev]] = {}
        owner: dict[int, int] = {}
        for rank_evs in _by_rank(it_evs).values():
            for ev in rank_evs:
                a = ev.e.action
                if a is None:
                    continue
                if owner.setdefault(a.stage, ev.e.rank) != ev.e.rank:
                    out.append(
                        _v(
                            "backward",
                            ev,
                            f"stage {a.stage} runs on rank {owner[a.stage]} too; a stage lives "
                            "on one rank",
                        )
                    )
                    continue
                key = (a.stage, a.mb)
                cur = state.get(key)
                want = LOCAL_PRODUCER[a.op]
                have = cur[0] if cur else None
                if have != want:
                    out.append(_v("backward", ev, _order_problem(a.op, have, cur)))
                state[key] = (a.op, ev)
        for (_s, _mb), (have, ev) in state.items():
            if have is Op.F:
                why = "never gets its backward (no B and W, nor BW, follows it)"
                out.append(_v("backward", ev, why))
            elif have is Op.B:
                out.append(_v("backward", ev, "never gets its W (its weight gradient is lost)"))
        actions = [a for a in (ev.e.action for ev in it_evs) if a is not None]
        stages = sorted({a.stage for a in actions})
        mbs = sorted({a.mb for a in actions})
        if stages and mbs:
            # The first few missing only: walking every pair would be the product of two
            # indices (at most len(state) + _MAX_MISSING pairs are visited this way).
            pairs = ((s, j) for s in range(stages[-1] + 1) for j in range(mbs[-1] + 1))
            for s, j in islice((p for p in pairs if p not in state), _MAX_MISSING):
                out.append(
                    (
                        (it, 1 << 62, -1, 0),
                        Violation(
                            "backward",
                            it,
                            owner.get(s),
                            None,
                            None,
                            f"F(s{s},mb{j})",
                            f"missing: iteration {it} has stages 0..{stages[-1]} and "
                            f"microbatches 0..{mbs[-1]} but never runs this F",
                        ),
                    )
                )
    return out


_MAX_MISSING = 100
"""Missing forwards reported per iteration (the first ones, in stage and microbatch order)."""


def _order_problem(op: Op, have: Op | None, cur: tuple[Op, _Ev] | None) -> str:
    """Why ``op`` cannot follow ``have`` (the last op of this stage and microbatch)."""
    at = f" (event #{cur[1].index})" if cur else ""
    if op is Op.F:
        return f"runs a second time; the first {have} of this microbatch is earlier{at}"
    if op is Op.W:
        if have is Op.F:
            return f"runs but its B has not run before it on this rank (F is{at}); W needs B's work"
        if have is None:
            return "runs without its F and B on this rank"
        return f"runs after {have}{at}, which already produced the weight gradient"
    if have is None:
        return f"runs without its F on this rank: {op} needs the forward's saved state"
    return f"is a second backward of this microbatch (the first, {have}, is earlier{at})"


# ---- 3. messages one to one -----------------------------------------------------------------


def _check_messages(evs: Sequence[_Ev]) -> _Found:
    out: _Found = []
    for _it, it_evs in _by_iteration(evs).items():
        owner = {e.e.stage: e.e.rank for e in it_evs if isinstance(e.e.op, Op)}
        by_msg: dict[MessageId, dict[EventKind, list[_Ev]]] = defaultdict(lambda: defaultdict(list))
        for ev in it_evs:
            if ev.e.op in MESSAGE_OPS:
                by_msg[ev.e.message][ev.e.op].append(ev)
        for msg, ops in by_msg.items():
            sends, posts = ops[EventOp.SEND], ops[EventOp.POST_RECV]
            waits = ops[EventOp.WAIT_RECV]
            name = _msg(msg)
            for dup in (sends[1:], posts[1:], waits[1:]):
                for ev in dup:
                    first = ops[ev.e.op][0]
                    why = (
                        f"{name} appears twice (first at rank {first.e.rank} event "
                        f"#{first.index}); each message is sent and received exactly once"
                    )
                    out.append(_v("messages", ev, why))
            if not sends:
                for ev in posts[:1] or waits[:1]:
                    out.append(_v("messages", ev, f"{name} is received but never sent"))
                continue
            send = sends[0]
            src_rank, dst_rank = owner.get(msg[1]), owner.get(msg[2])
            if src_rank is not None and send.e.rank != src_rank:
                why = f"sent by rank {send.e.rank} but stage {msg[1]} runs on rank {src_rank}"
                out.append(_v("messages", send, why))
            if dst_rank is not None and send.e.peer != dst_rank:
                why = f"sent to rank {send.e.peer} but stage {msg[2]} runs on rank {dst_rank}"
                out.append(_v("messages", send, why))
            if not posts or not waits:
                missing = "posted" if not posts else "waited for"
                out.append(_v("messages", send, f"{name} is sent but never {missing}"))
                continue
            post, wait = posts[0], waits[0]
            for ev in (post, wait):
                if ev.e.rank != send.e.peer or ev.e.peer != send.e.rank:
                    why = (
                        f"received by rank {ev.e.rank} from rank {ev.e.peer}, but rank "
                        f"{send.e.rank} sent it to rank {send.e.peer}"
                    )
                    out.append(_v("messages", ev, why))
            if post.e.rank == wait.e.rank and wait.index < post.index:
                why = f"waited for before its receive was posted (event #{post.index})"
                out.append(_v("messages", wait, why))
    return out


def _check_message_order(evs: Sequence[_Ev]) -> _Found:
    out: _Found = []
    for _it, it_evs in _by_iteration(evs).items():
        sent: dict[tuple[int | None, int | None], list[_Ev]] = defaultdict(list)
        posted: dict[tuple[int | None, int | None], list[_Ev]] = defaultdict(list)
        for rank_evs in _by_rank(it_evs).values():
            for ev in rank_evs:
                if ev.e.op is EventOp.SEND:
                    sent[ev.e.rank, ev.e.peer].append(ev)
                elif ev.e.op is EventOp.POST_RECV:
                    posted[ev.e.peer, ev.e.rank].append(ev)
        for pair, posts in posted.items():
            sends = sent.get(pair, [])
            for k, (s, p) in enumerate(zip(sends, posts, strict=False)):
                if s.e.msg != p.e.msg:
                    why = (
                        f"receive #{k} from rank {pair[0]}, but rank {pair[0]}'s send #{k} to "
                        f"rank {pair[1]} is {_msg(s.e.message)} (event #{s.index}); messages "
                        "between two ranks are matched in order"
                    )
                    out.append(_v("message order", p, why))
                    break
    return out


# ---- 5. dependency edges ------------------------------------------------------------------


def _check_edges(evs: Sequence[_Ev], segments: int) -> _Found:
    out: _Found = []
    for _it, it_evs in _by_iteration(evs).items():
        computes = [(ev, a) for ev in it_evs if (a := ev.e.action) is not None]
        if not computes:
            continue
        msgs = {(ev.e.op, ev.e.rank, ev.e.message): ev for ev in it_evs if ev.e.op in MESSAGE_OPS}
        num_stages = 1 + max(a.stage for _, a in computes)
        made: dict[Key, _Ev] = {}
        for ev, a in reversed(computes):  # the first producer of a key wins
            made.update(dict.fromkeys(produces(*a, num_stages, segments), ev))
        for ev, a in computes:
            for k in needs(*a, num_stages, segments):
                if not (k.kind.travels or k.kind.step):
                    continue  # same-stage order is the backward check's
                prod = made.get(k)
                if prod is None:
                    continue  # reported by the backward check
                if not k.kind.travels:  # an earlier or later segment on the same stage
                    if prod.index > ev.index:
                        out.append(_v("edge", ev, _runs_after(prod)))
                    continue
                msg = (MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
                problem = _edge_problem(ev, prod, msg, msgs)
                if problem:
                    out.append(_v("edge", ev, problem))
    return out


def _edge_problem(
    ev: _Ev, prod: _Ev, msg: MessageId, msgs: dict[tuple[EventKind, int, MessageId], _Ev]
) -> str | None:
    e, p = ev.e, prod.e
    pname = f"{describe(p)} (rank {p.rank} event #{prod.index})"
    if p.rank == e.rank:
        return _runs_after(prod) if prod.index > ev.index else None
    wait = msgs.get((EventOp.WAIT_RECV, e.rank, msg))
    send = msgs.get((EventOp.SEND, p.rank, msg))
    if wait is None or send is None:
        return f"its input {_msg(msg)} from {pname} crosses ranks but was never " + (
            "received here" if wait is None else "sent"
        )
    if wait.index > ev.index:
        return (
            f"runs before its input {_msg(msg)} arrived: the wait_recv is event #{wait.index}, "
            "after it"
        )
    if send.index < prod.index:
        return f"its input {_msg(msg)} was sent (event #{send.index}) before {pname} made it"
    return None


def _runs_after(prod: _Ev) -> str:
    p = prod.e
    where = f"rank {p.rank} event #{prod.index}"
    return f"consumes the output of {describe(p)} ({where}), which runs after it"


def _check_clocks(evs: Sequence[_Ev], tolerance_ns: int) -> _Found:
    located = {id(ev.e): ev for ev in evs}
    out: _Found = []
    for (a, b), (lo, hi) in pair_bounds([ev.e for ev in evs]).items():
        if lo is None or hi is None or lo.value <= hi.value + tolerance_ns:
            continue
        wait = max((located[id(lo.wait)], located[id(hi.wait)]), key=lambda ev: ev.key)
        why = (
            f"no clock offset between ranks {a} and {b} makes both {_msg(lo.send.message)} "
            f"(rank {a} -> {b}, iteration {lo.send.iteration}) and {_msg(hi.send.message)} "
            f"(rank {b} -> {a}, iteration {hi.send.iteration}) arrive after they were sent: "
            f"they disagree by {(lo.value - hi.value) / 1e3:.0f} µs "
            f"(tolerance {tolerance_ns / 1e3:.0f} µs)"
        )
        out.append(_v("clock", wait, why))
    return out


# ---- 7. parameter versions ------------------------------------------------------------------


def _check_versions(evs: Sequence[_Ev]) -> _Found:
    out: _Found = []
    groups: dict[tuple[int, int], list[_Ev]] = defaultdict(list)
    for ev in evs:
        if (a := ev.e.action) is not None:
            groups[ev.e.iteration, a.mb].append(ev)
    for (it, mb), group in groups.items():
        counts = Counter(ev.e.param_version for ev in group)
        if len(counts) == 1:
            continue
        first = min(group, key=lambda ev: ev.key).e.param_version
        ref = max(counts, key=lambda v: (counts[v], v == first))
        for ev in group:
            if ev.e.param_version != ref:
                why = (
                    f"ran on parameter version {ev.e.param_version} but the other "
                    f"{counts[ref]} compute events of microbatch {mb} in iteration {it} ran on "
                    f"version {ref}; a microbatch must see one version along the pipeline"
                )
                out.append(_v("version", ev, why))
    return out


# ---- 8. optimizer step after the last W ----------------------------------------------------


def _check_optimizer(
    evs: Sequence[_Ev], opt_ops: tuple[EventKind, ...], notes: list[str]
) -> _Found:
    if not any(ev.e.op in opt_ops for ev in evs):
        notes.append(
            f"no optimizer events ({', '.join(opt_ops)}) in the trace: the check that no W "
            "runs after its optimizer step was skipped"
        )
        return []
    out: _Found = []
    for rank_evs in _by_rank(evs).values():
        stepped: dict[int, _Ev] = {}  # iteration -> first optimizer action on its gradients
        for ev in rank_evs:
            e = ev.e
            if e.op in opt_ops:
                stepped.setdefault(e.iteration, ev)
            elif isinstance(e.op, Op) and e.iteration in stepped:
                step = stepped[e.iteration]
                why = (
                    f"runs after rank {e.rank}'s optimizer action {step.e.op} (event "
                    f"#{step.index}) on iteration {e.iteration}'s gradients"
                )
                out.append(_v("optimizer", ev, why))
    return out


# ---- 9. commits ---------------------------------------------------------------------------


def _check_commits(evs: Sequence[_Ev], conservative: bool) -> _Found:
    commits = [ev for ev in evs if ev.e.op is OptOp.COMMIT]
    if not commits:
        return []
    out: _Found = []
    ranks = sorted({ev.e.rank for ev in evs})
    per: dict[tuple[int, int], list[_Ev]] = defaultdict(list)
    for ev in commits:
        per[ev.e.iteration, ev.e.rank].append(ev)
    for it in sorted({ev.e.iteration for ev in commits}):
        for rank in ranks:
            got = per.get((it, rank), [])
            for extra in got[1:]:
                out.append(_v("commit", extra, f"iteration {it} is committed twice on this rank"))
            for ev in got[:1]:
                if ev.e.param_version != it + 1:
                    why = (
                        f"commits iteration {it} as parameter version {ev.e.param_version}; "
                        f"every rank must commit it as version {it + 1}"
                    )
                    out.append(_v("commit", ev, why))
            if not got:
                last = max((ev for ev in commits if ev.e.iteration == it), key=lambda v: v.key)
                why = f"iteration {it} is committed on rank {last.e.rank} but never on rank {rank}"
                out.append(_v("commit", last, why))
    if conservative:
        for rank_evs in _by_rank(evs).values():
            committed = {ev.e.iteration for ev in rank_evs if ev.e.op is OptOp.COMMIT}
            seen: set[int] = set()
            for ev in rank_evs:
                if ev.e.op is OptOp.COMMIT:
                    seen.add(ev.e.iteration)
                elif ev.e.op is Op.F and ev.e.iteration - 1 in committed - seen:
                    why = (
                        f"starts before iteration {ev.e.iteration - 1} is committed on this rank "
                        "(conservative post-validation validates before the next forward)"
                    )
                    out.append(_v("commit", ev, why))
    return out


# ---- 10. memory ---------------------------------------------------------------------------


def _check_memory(evs: Sequence[_Ev], budget: int | None, notes: list[str]) -> _Found:
    if budget is None:
        notes.append("no memory budget given (--mem-budget BYTES): memory not checked")
        return []
    out: _Found = []
    for ev in evs:
        held = max(ev.e.mem_before, ev.e.mem_after)
        if held > budget:
            why = f"holds {held} bytes of activations, over the budget of {budget} bytes"
            out.append(_v("memory", ev, why))
    return out
