"""Recording a rank's execution trace, and the ``torch.distributed`` side of traces.

The executor owns one :class:`Trace` per rank and records every instruction it
runs as a :class:`~zerobubble.schedule.trace_format.TraceEvent` (the format,
its JSON-lines and Chrome-trace writers live in the torch-free
:mod:`zerobubble.schedule.trace_format`). Times are ``time.perf_counter_ns``
relative to an epoch all ranks take right after a barrier (:func:`sync_epoch`),
so events of different ranks share one time axis; :func:`gather_traces`
collects every rank's events on one rank.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

import torch.distributed as dist

from zerobubble.schedule.program import (
    Compute,
    Instruction,
    PostRecv,
    ReduceGrads,
    Send,
    WaitRecv,
    WaitReduce,
    WaitSends,
)
from zerobubble.schedule.trace_format import TraceEvent, write_jsonl


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


TRACED = frozenset({Compute, PostRecv, WaitRecv, Send, WaitSends, ReduceGrads, WaitReduce})
"""The instruction kinds that record a trace event when executed."""

_MESSAGE_OP = {PostRecv: "post_recv", WaitRecv: "wait_recv", Send: "send"}


def instruction_event(ins: Instruction, common: dict[str, Any]) -> TraceEvent:
    """The trace event of an executed instruction of a :data:`TRACED` kind; ``common``
    holds the fields every event has (iteration, rank, version, times, held bytes)."""
    if isinstance(ins, Compute):
        a = ins.action
        return TraceEvent(op=a.op.value, stage=a.stage, mb=a.mb, **common)
    if isinstance(ins, ReduceGrads):
        return TraceEvent(op="reduce_grads", stage=ins.stage, mb=None, **common)
    if isinstance(ins, PostRecv | WaitRecv | Send):
        m = ins.msg
        here = m.src_stage if isinstance(ins, Send) else m.dst_stage
        msg_id = (m.kind.value, m.src_stage, m.dst_stage, m.mb)
        op = _MESSAGE_OP[type(ins)]
        return TraceEvent(op=op, stage=here, mb=m.mb, peer=ins.peer, msg=msg_id, **common)
    return TraceEvent(op=str(ins), stage=None, mb=None, **common)  # wait_sends, wait_reduce
