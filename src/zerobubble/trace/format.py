"""The execution-trace format: one event per executed instruction, as JSON lines.

Torch-free, so traces can be read and checked without the runtime
(``zerobubble check-trace``). The runtime records events
(:mod:`zerobubble.runtime.recorder`); this module says what an event is, parses
its op and message kind into enums when it is built or read, and refuses a
malformed line with the field, the problem and the fix.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import IO, Any

from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.ir import Action, Op
from zerobubble.schedule.textfile import decode

COMPUTE_OPS = tuple(Op)
"""The ops of compute events (the schedule's :class:`Op`)."""


class EventOp(enum.StrEnum):
    """The ops of the executor's non-compute events."""

    POST_RECV = "post_recv"
    WAIT_RECV = "wait_recv"
    SEND = "send"
    WAIT_SENDS = "wait_sends"
    REPLAY = "replay"
    """Speculative work of this iteration on this rank was discarded and is run again."""
    REDUCE_GRADS = "reduce_grads"
    """The launch of a stage's asynchronous gradient all-reduce over ``dp`` (its ``stage``)."""
    WAIT_REDUCE = "wait_reduce"
    """The wait for every gradient reduction of the step, before the optimizer's tail."""
    UNSHARD = "unshard"
    """FSDP: the all-gather of a stage's parameters (its ``stage``)."""
    REDUCE_SCATTER = "reduce_scatter"
    """FSDP: the reduce-scatter of a stage's gradients over ``dp`` (its ``stage``)."""

    __hash__ = str.__hash__


MESSAGE_OPS = (EventOp.POST_RECV, EventOp.WAIT_RECV, EventOp.SEND)


class OptOp(enum.StrEnum):
    """The events of the optimizer protocol (:class:`zerobubble.optim.trainer.PipelineTrainer`).

    Each carries the iteration whose gradients it acts on. Other ``opt_*`` names are
    accepted as optimizer events too (``check-trace --opt-op``) and stay strings.
    """

    REDUCE = "opt_reduce"
    PREFIX = "opt_prefix"
    PROVISIONAL = "opt_provisional"
    DEFER = "opt_defer"
    VALIDATE = "opt_validate"
    ROLLBACK = "opt_rollback"
    SKIP = "opt_skip"
    STEP = "opt_step"
    COMMIT = "opt_commit"

    __hash__ = str.__hash__


EventKind = Op | EventOp | OptOp | str
"""An event's op once parsed: a str only for an op this module does not know."""

MessageId = tuple[MsgKind | str, int, int, int]
"""A message's ``(kind, src stage, dst stage, mb)``; the kind a str only when unknown."""

_PARSE: dict[str, EventKind] = {str(k): k for k in (*Op, *EventOp, *OptOp)}
_MSG_KINDS: dict[str, MsgKind] = {str(k): k for k in MsgKind}

TRACKS = ("compute", "recv", "send", "optim", "reduce")
"""Chrome-trace threads: compute actions, receives (post and wait), sends, the
optimizer protocol (:class:`OptOp` events and ``replay``), and the data-parallel
gradient reduction (``reduce_grads``, ``wait_reduce``, FSDP's ``unshard`` and
``reduce_scatter``)."""
_TRACK: dict[EventKind, str] = {
    **{op: "compute" for op in Op},
    EventOp.POST_RECV: "recv",
    EventOp.WAIT_RECV: "recv",
    EventOp.SEND: "send",
    EventOp.WAIT_SENDS: "send",
    EventOp.REPLAY: "optim",
    EventOp.REDUCE_GRADS: "reduce",
    EventOp.WAIT_REDUCE: "reduce",
    EventOp.UNSHARD: "reduce",
    EventOp.REDUCE_SCATTER: "reduce",
    **{op: "optim" for op in OptOp},
}


def event_name(
    op: EventKind, stage: int | None = None, mb: int | None = None, msg: MessageId | None = None
) -> str:
    """The one name of an event: its Chrome-trace span and the ``torch.profiler`` range
    the runtime opens around the work (``zb.F s1 mb3``, ``zb.send act s1->s2 mb3``,
    ``zb.opt_step``), so that a Kineto trace and ours line up name for name."""
    name = f"zb.{op}"
    if msg is not None:
        name += f" {msg[0]} s{msg[1]}->s{msg[2]}"
    elif stage is not None:
        name += f" s{stage}"
    return name if mb is None else f"{name} mb{mb}"


def is_opt_op(op: EventKind) -> bool:
    """True for optimizer events: the :class:`OptOp` ones and any other ``opt_*`` name."""
    return isinstance(op, OptOp) or (type(op) is str and op.startswith("opt_"))


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One executed instruction.

    Attributes:
        iteration: Step index of the executor (0 for the first ``step``).
        rank: Pipeline rank that ran it.
        op: An :class:`Op` (compute), an :class:`EventOp` (messages, ``wait_sends``,
            ``replay``) or an :class:`OptOp` (optimizer protocol); a plain str only for
            an op this module does not know (the trace checker reports it).
        stage: Virtual stage (for a message: the stage on this rank's side).
        mb: Microbatch (None for ``wait_sends``).
        param_version: The caller's parameter version during this step.
        start_ns, end_ns: ``perf_counter_ns`` relative to the common epoch.
        mem_before, mem_after: Activation bytes this rank's stages hold around the event.
        peer: The other rank of a communication event.
        msg: Message id ``(kind, src stage, dst stage, mb)`` of a communication event,
            its kind a :class:`MsgKind`.
    """

    iteration: int
    rank: int
    op: EventKind
    stage: int | None
    mb: int | None
    param_version: int
    start_ns: int
    end_ns: int
    mem_before: int
    mem_after: int
    peer: int | None = None
    msg: MessageId | None = None

    def __post_init__(self) -> None:
        # The executor passes strings; parse them once here so readers compare enums.
        object.__setattr__(self, "op", _PARSE.get(self.op, self.op))
        m = self.msg
        if m is not None and type(m[0]) is not MsgKind:
            object.__setattr__(self, "msg", (_MSG_KINDS.get(m[0], m[0]), *m[1:]))

    @property
    def action(self) -> Action | None:
        """The action a compute event ran; None for any other event.

        Raises ValueError for a compute event without integer stage and mb, which
        ``check-trace`` reports as malformed.
        """
        if not isinstance(self.op, Op):
            return None
        if not (isinstance(self.stage, int) and isinstance(self.mb, int)):
            raise ValueError(
                f"rank {self.rank}, iteration {self.iteration}: {self.op} event has "
                f"stage={self.stage!r}, mb={self.mb!r}; a compute event needs integer stage and "
                "mb (find it with `zerobubble check-trace`)"
            )
        return Action(self.op, self.stage, self.mb)

    @property
    def message(self) -> MessageId:
        """The id of a message event's message.

        Raises ValueError for an event without one, which ``check-trace`` reports when it
        is a message event.
        """
        if self.msg is None:
            raise ValueError(
                f"rank {self.rank}, iteration {self.iteration}: {self.op} event has no msg; "
                "a message event needs msg (kind, src, dst, mb) (find it with "
                "`zerobubble check-trace`)"
            )
        return self.msg

    @property
    def name(self) -> str:
        """See :func:`event_name`."""
        return event_name(self.op, self.stage, self.mb, self.msg)

    @property
    def track(self) -> str:
        return _TRACK.get(self.op) or ("optim" if is_opt_op(self.op) else "send")

    @classmethod
    def from_dict(cls, d: object) -> TraceEvent:
        """An event from its JSON object; raises :class:`TraceFormatError` naming the field."""
        if not isinstance(d, dict):
            raise TraceFormatError(
                None, f"is a JSON {_json_type(d)}, not an object", "write one event object"
            )
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise TraceFormatError(unknown[0], "is not an event field", "remove it")
        for name, (kinds, optional) in _SCHEMA.items():
            if name not in d:
                if optional:
                    continue
                raise TraceFormatError(name, "is missing", "add it")
            value = d[name]
            if value is None and optional:
                continue
            if not _is(value, kinds):
                raise TraceFormatError(
                    name, f"is {json.dumps(value)}", f"write {_describe_kinds(kinds, optional)}"
                )
        msg = d.get("msg")
        if msg is not None:
            if len(msg) != 4 or not isinstance(msg[0], str) or not all(map(_is_int, msg[1:])):
                raise TraceFormatError(
                    "msg",
                    f"is {json.dumps(msg)}",
                    'write [kind, src stage, dst stage, mb], e.g. ["act", 0, 1, 3], or null',
                )
            msg = tuple(msg)
        return cls(**{**d, "msg": msg})


class TraceFormatError(ValueError):
    """A JSON value that is not a trace event; ``field`` is None for the whole line."""

    def __init__(self, field: str | None, problem: str, fix: str) -> None:
        what = "the line" if field is None else f"field {field!r}"
        super().__init__(f"{what} {problem}; {fix}")
        self.field = field


_FIELDS = {f.name for f in fields(TraceEvent)}
_INT = "integer"
_SCHEMA: dict[str, tuple[tuple[str, ...], bool]] = {
    # field: (accepted JSON types, may be null or absent)
    "iteration": ((_INT,), False),
    "rank": ((_INT,), False),
    "op": (("string",), False),
    "stage": ((_INT,), True),
    "mb": ((_INT,), True),
    "param_version": ((_INT,), False),
    "start_ns": ((_INT,), False),
    "end_ns": ((_INT,), False),
    "mem_before": ((_INT,), False),
    "mem_after": ((_INT,), False),
    "peer": ((_INT,), True),
    "msg": (("array",), True),
}


def _is_int(v: object) -> bool:
    return type(v) is int


def _is(v: object, kinds: tuple[str, ...]) -> bool:
    checks = {_INT: _is_int, "string": lambda x: isinstance(x, str), "array": _is_list}
    return any(checks[k](v) for k in kinds)


def _is_list(v: object) -> bool:
    return isinstance(v, list | tuple)


def _describe_kinds(kinds: tuple[str, ...], optional: bool) -> str:
    text = " or ".join(f"an {k}" if k[0] in "aeiou" else f"a {k}" for k in kinds)
    return text + (" or null" if optional else "")


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, list):
        return "array"
    if isinstance(v, str):
        return "string"
    return "number" if isinstance(v, int | float) else type(v).__name__


def write_jsonl(events: Iterable[TraceEvent], out: str | Path | IO[str]) -> None:
    """One JSON object per event and line."""
    if isinstance(out, str | Path):
        with open(out, "w") as f:
            write_jsonl(events, f)
        return
    for e in events:
        out.write(json.dumps(asdict(e)) + "\n")


def read_jsonl_lines(path: str | Path) -> tuple[list[TraceEvent], list[int]]:
    """The events of a JSONL trace and the line number of each.

    Raises ``ValueError`` naming the file, the line, the field and the fix for
    anything that is not an event.
    """
    events: list[TraceEvent] = []
    lines: list[int] = []
    with open(path, "rb") as f:  # decoded line by line: a bad byte names its line
        for n, raw in enumerate(f, 1):
            text = decode(raw, path, "trace", line=n)
            if not text.strip():
                continue
            try:
                value = json.loads(text, parse_constant=_no_constant)
            except ValueError as exc:
                raise ValueError(
                    f"{path}:{n}: not valid JSON ({exc}); write one JSON object per line, "
                    "as zerobubble.trace.format.write_jsonl does"
                ) from None
            try:
                events.append(TraceEvent.from_dict(value))
            except TraceFormatError as exc:
                raise ValueError(f"{path}:{n}: not a trace event: {exc}") from None
            lines.append(n)
    return events, lines


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def read_jsonl(path: str | Path) -> list[TraceEvent]:
    """The events of a JSONL trace (see :func:`read_jsonl_lines`)."""
    return read_jsonl_lines(path)[0]


def chrome_trace(events: Iterable[TraceEvent]) -> dict[str, Any]:
    """Chrome trace-event JSON: process = rank, thread = track, times in microseconds."""
    out: list[dict[str, Any]] = []
    ranks: set[int] = set()
    for e in events:
        ranks.add(e.rank)
        args: dict[str, object] = {
            "iteration": e.iteration,
            "stage": e.stage,
            "mb": e.mb,
            "param_version": e.param_version,
            "mem_before": e.mem_before,
            "mem_after": e.mem_after,
        }
        if e.peer is not None:
            args |= {"peer": e.peer, "msg": list(e.msg) if e.msg else None}
        out.append(
            {
                "name": e.name,
                "cat": e.op,
                "ph": "X",
                "ts": e.start_ns / 1000,
                "dur": max(e.end_ns - e.start_ns, 0) / 1000,
                "pid": e.rank,
                "tid": TRACKS.index(e.track),
                "args": args,
            }
        )
    meta: list[dict[str, Any]] = []
    for r in sorted(ranks):
        meta.append({"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}})
        for tid, track in enumerate(TRACKS):
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": track}}
            )
    return {"traceEvents": meta + out, "displayTimeUnit": "ms"}


def write_chrome_trace(events: Iterable[TraceEvent], path: str | Path) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events), f)
