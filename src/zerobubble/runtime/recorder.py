"""Recording a rank's execution trace, and the ``torch.distributed`` side of traces.

The executor owns one :class:`Trace` per rank and records every instruction it
runs as a :class:`~zerobubble.trace.format.TraceEvent` (the format,
its JSON-lines and Chrome-trace writers live in the torch-free
:mod:`zerobubble.trace.format`). Times are ``time.perf_counter_ns``
relative to an epoch all ranks take right after a barrier (:func:`sync_epoch`),
so events of different ranks share one time axis; :func:`gather_traces`
collects every rank's events on one rank.

While a ``torch.profiler`` records, the work of every event also runs inside a
``record_function`` range of the event's name
(:func:`~zerobubble.trace.format.event_name`): see :func:`profiled`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zerobubble.program.instructions import (
    Compute,
    Instruction,
    PostRecv,
    ReduceGrads,
    Send,
    ShardAction,
    WaitRecv,
    WaitReduce,
    WaitSends,
)
from zerobubble.trace.format import TraceEvent, write_jsonl


class Trace:
    """Events recorded by one rank, in execution order."""

    def __init__(self, rank: int, epoch_ns: int) -> None:
        self.rank = rank
        self.epoch_ns = epoch_ns
        self.events: list[TraceEvent] = []

    def now(self) -> int:
        """Nanoseconds since the common epoch."""
        return time.perf_counter_ns() - self.epoch_ns

    def record(self, event: TraceEvent) -> None:
        self.events.append(event)

    def clear(self) -> None:
        self.events.clear()

    def write_jsonl(self, out: str | Path | IO[str]) -> None:
        """Write the events as JSON lines."""
        write_jsonl(self.events, out)


def sync_epoch(group: dist.ProcessGroup | None = None) -> int:
    """A ``perf_counter_ns`` value all ranks take at (nearly) the same instant."""
    dist.barrier(group=group)
    return time.perf_counter_ns()


def gather_traces(
    trace: Trace, group: dist.ProcessGroup | None = None, dst: int = 0
) -> list[TraceEvent] | None:
    """Collect every rank's events on group rank ``dst`` (others get None).

    A collective: every rank of ``group`` must call it.
    """
    me = dist.get_rank(group)
    payload = [asdict(e) for e in trace.events]
    bucket: list | None = [None] * dist.get_world_size(group) if me == dst else None
    dist.gather_object(payload, bucket, group=group, group_dst=dst)
    if bucket is None:
        return None
    events = [TraceEvent.from_dict(d) for part in bucket for d in part]
    return sorted(events, key=lambda e: (e.start_ns, e.rank))


TRACED = frozenset(
    {Compute, PostRecv, WaitRecv, Send, WaitSends, ReduceGrads, WaitReduce, ShardAction}
)
"""The instruction kinds that record a trace event when executed (and open a profiler
range). The others do no work of their own: a version check compares two counters, and
the gate's validation is the optimizer's events."""

_MESSAGE_OP = {PostRecv: "post_recv", WaitRecv: "wait_recv", Send: "send"}


def instruction_event(ins: Instruction, common: dict[str, Any]) -> TraceEvent:
    """The trace event of an executed instruction of a :data:`TRACED` kind; ``common``
    holds the fields every event has (iteration, rank, version, times, held bytes)."""
    if isinstance(ins, Compute):
        a = ins.action
        return TraceEvent(op=a.op.value, stage=a.stage, mb=a.mb, **common)
    if isinstance(ins, ReduceGrads):
        return TraceEvent(op="reduce_grads", stage=ins.stage, mb=None, **common)
    if isinstance(ins, ShardAction):
        return TraceEvent(op=ins.op.value, stage=ins.stage, mb=None, **common)
    if isinstance(ins, PostRecv | WaitRecv | Send):
        m = ins.msg
        here = m.src_stage if isinstance(ins, Send) else m.dst_stage
        msg_id = (m.kind.value, m.src_stage, m.dst_stage, m.mb)
        op = _MESSAGE_OP[type(ins)]
        return TraceEvent(op=op, stage=here, mb=m.mb, peer=ins.peer, msg=msg_id, **common)
    return TraceEvent(op=str(ins), stage=None, mb=None, **common)  # wait_sends, wait_reduce


_COMMON = ("iteration", "rank", "param_version", "start_ns", "end_ns", "mem_before", "mem_after")


def instruction_name(ins: Instruction) -> str | None:
    """The name of the event ``ins`` records (None for a kind outside :data:`TRACED`):
    taken from that very event, so the profiler range and the trace cannot disagree."""
    if type(ins) not in TRACED:
        return None
    return instruction_event(ins, dict.fromkeys(_COMMON, 0)).name


def profiling() -> bool:
    """True while a ``torch.profiler`` (or autograd profiler) records on this thread.

    The callers test it before opening a range: a ``record_function`` costs 10-40 us even
    with no profiler running (torch 2.13, CPU), this test 0.1-0.2 us.
    """
    return torch.autograd._profiler_enabled()


@contextlib.contextmanager
def profiled(name: str) -> Iterator[None]:
    """A ``record_function`` range named ``name`` around the block while a profiler
    records; nothing otherwise."""
    if not profiling():
        yield
        return
    with record_function(name):
        yield
