"""Per-action execution trace: what ran where, when, on which parameter version.

The executor owns one :class:`Trace` per rank and records every instruction it
runs. Times are ``time.perf_counter_ns`` relative to an epoch all ranks take
right after a barrier (:func:`sync_epoch`), so events of different ranks share
one time axis. Traces export as JSON lines (one event per line, for checkers)
and as Chrome trace JSON (open in Perfetto: one process per rank, one thread
per track).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

import torch.distributed as dist

COMPUTE_OPS = ("F", "B", "W", "BW")
TRACKS = ("compute", "recv", "send", "optim")
"""Chrome-trace threads: compute actions, receives (post and wait), sends, and the
optimizer protocol (``opt_*`` events and ``replay``, see :mod:`zerobubble.optim`)."""


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One executed instruction.

    Attributes:
        iteration: Step index of the executor (0 for the first ``step``).
        rank: Pipeline rank that ran it.
        op: ``F``, ``B``, ``W``, ``BW`` or ``post_recv``, ``wait_recv``, ``send``,
            ``wait_sends``; ``replay`` (speculative work discarded); the optimizer
            protocol's ``opt_*`` events (:mod:`zerobubble.optim.events`).
        stage: Virtual stage (for a message: the stage on this rank's side).
        mb: Microbatch (None for ``wait_sends``).
        param_version: The caller's parameter version during this step.
        start_ns, end_ns: ``perf_counter_ns`` relative to the common epoch.
        mem_before, mem_after: Activation bytes this rank's stages hold around the event.
        peer: The other rank of a communication event.
        msg: Message id ``(kind, src stage, dst stage, mb)`` of a communication event.
    """

    iteration: int
    rank: int
    op: str
    stage: int | None
    mb: int | None
    param_version: int
    start_ns: int
    end_ns: int
    mem_before: int
    mem_after: int
    peer: int | None = None
    msg: tuple[str, int, int, int] | None = None

    @property
    def track(self) -> str:
        if self.op in COMPUTE_OPS:
            return "compute"
        if self.op.startswith("opt_") or self.op == "replay":
            return "optim"
        return "recv" if "recv" in self.op else "send"

    @classmethod
    def from_dict(cls, d: dict) -> TraceEvent:
        msg = d.get("msg")
        return cls(**{**d, "msg": tuple(msg) if msg is not None else None})


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


def write_jsonl(events: Iterable[TraceEvent], out: str | Path | IO[str]) -> None:
    """One JSON object per event and line."""
    if isinstance(out, str | Path):
        with open(out, "w") as f:
            write_jsonl(events, f)
        return
    for e in events:
        out.write(json.dumps(asdict(e)) + "\n")


def read_jsonl(path: str | Path) -> list[TraceEvent]:
    with open(path) as f:
        return [TraceEvent.from_dict(json.loads(line)) for line in f if line.strip()]


def chrome_trace(events: Iterable[TraceEvent]) -> dict:
    """Chrome trace-event JSON: process = rank, thread = track, times in microseconds."""
    out: list[dict] = []
    ranks: set[int] = set()
    for e in events:
        ranks.add(e.rank)
        name = e.op if e.mb is None else f"{e.op}{e.mb}"
        args = {
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
                "name": name,
                "cat": e.op,
                "ph": "X",
                "ts": e.start_ns / 1000,
                "dur": max(e.end_ns - e.start_ns, 0) / 1000,
                "pid": e.rank,
                "tid": TRACKS.index(e.track),
                "args": args,
            }
        )
    meta: list[dict] = []
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
