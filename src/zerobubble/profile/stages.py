"""Per-virtual-stage costs measured in a real pipeline run, and point-to-point latency.

Stage costs come from the executor's trace: every F, B, W and BW event is
one :class:`~zerobubble.runtime.stage.StageChunk` op on real data, timed
where it ran, so B and W are the real split passes and each stage runs next
to the others' traffic. Activation memory comes from the same events: an F
raises the rank's held bytes by its rise, and what is still held after B (F's
rise plus B's change) is M_W. A split B can hold more than F did (it stores the
output gradients W needs, received frames included, and frees less than that), so
M_B, the memory an F is charged for until B, is the larger of the two: the model
charges a microbatch the most it holds at any point before W, and a plan within
its limit stays within it when run. Memory is the largest value observed (it can
differ by a few KB between microbatches, and a plan must not exceed its limit);
times are medians. Warm-up iterations are skipped.

An op also costs host time that is not inside its event: after it, the rank
records it, sends its output, posts receives, and dispatches the next op.
That **host tail** (everything from the op's end to the next compute's start
except waiting for a message) is measured per op too; a planner should count
it, since the device cannot compute meanwhile.

A stage that holds expert layers under expert parallelism also waits for their token
all-to-alls inside its F and its backward. With the ep groups' waits recorded
(:func:`~zerobubble.parallel.ep.timing_waits`), :func:`all_to_all_ms` charges each compute
event the part of the waits of its rank that fall inside it; per stage the median over F
and over backward events is its all-to-all time (:attr:`StageProfile.a2a_f`,
:attr:`StageProfile.a2a_b`), which the cost model takes apart from compute
(:meth:`~zerobubble.profile.costs_file.Profile.cost_model`). Without an all-to-all (no
expert layer, or every expert on one process: ep = 1) both are 0.

Latency is a ping-pong between the two ranks of each stage boundary with a
message of the boundary's size: one-way latency = round trip / 2. The traced
messages measure it as the schedule pays it (:func:`message_latency`): from the
end of the op that produced a message to the return of the consumer's wait for
it, over the messages whose consumer was already waiting. The producer's host
tail (which includes its send) overlaps that time, so the simulator starts a
message's latency at the end of the producer's compute, not of its host tail.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerobubble.profile.stats import OpStats
from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.ir import Op
from zerobubble.trace.clocks import clock_offsets
from zerobubble.trace.format import COMPUTE_OPS, TraceEvent

HOST_OPS = ("send", "post_recv")
"""Events that are host work of the op before them (a wait_recv is waiting, not work:
only the host time around it counts)."""


@dataclass(frozen=True)
class StageProfile:
    """Measured costs of each virtual stage (times in milliseconds, memory in bytes).

    ``None`` marks an op the profiled run never executed (W and B in a run
    without B/W split, BW in a split run).
    """

    f: tuple[OpStats, ...]
    b: tuple[OpStats | None, ...]
    w: tuple[OpStats | None, ...]
    bw: tuple[OpStats | None, ...]
    mem_b: tuple[int, ...]
    """Largest bytes a microbatch holds from its F until B (M_B): the rise over F, or (without
    ``recompute``) the bytes held after B where B raises them."""
    mem_w: tuple[int | None, ...]
    """Largest bytes held after B until W (M_W); <= M_B unless ``recompute``; None without
    split B."""
    host: dict[str, tuple[float | None, ...]]
    """Median host tail (ms) of each op (keys F, B, W, BW) per stage; None if it never ran."""
    recompute: bool = False
    """The stages checkpointed activations: F kept only their inputs and B rebuilt the
    state W needs, so M_W may exceed M_B."""
    a2a_f: tuple[float, ...] = ()
    """Median ms each stage's F waited for expert all-to-alls (:func:`all_to_all_ms`);
    empty: not measured (none, as 0)."""
    a2a_b: tuple[float, ...] = ()
    """The same of each stage's backward (B, or BW)."""

    @property
    def num_stages(self) -> int:
        return len(self.f)

    @property
    def a2a(self) -> tuple[float, ...]:
        """Per stage, the all-to-all time the cost model charges each F and each backward
        (:attr:`~zerobubble.schedule.costs.CostModel.a2a`, one figure for both): the smaller
        of the two medians, so a pair never hides more than either side waited, and never
        more than the op's own median compute (0 where not measured)."""
        if not self.a2a_f:
            return (0.0,) * self.num_stages
        out = []
        for s in range(self.num_stages):
            back = self.b[s] if self.b[s] is not None else self.bw[s]
            cap = min(self.f[s].median, back.median if back is not None else 0.0)
            out.append(min(self.a2a_f[s], self.a2a_b[s], cap))
        return tuple(out)

    def stage_time(self, s: int) -> float:
        """Median F + B + W (or F + BW) of stage ``s``: the per-microbatch work to balance."""
        b, w, bw = self.b[s], self.w[s], self.bw[s]
        back = b.median + w.median if b is not None and w is not None else _median(bw)
        return self.f[s].median + back


def _median(s: OpStats | None) -> float:
    if s is None:
        raise ValueError("the profile has neither B and W nor BW for a stage")
    return s.median


def stage_profile(
    events: Sequence[TraceEvent],
    num_stages: int,
    *,
    skip_iterations: int = 1,
    recompute: bool = False,
) -> StageProfile:
    """Summarise a traced run; iterations below ``skip_iterations`` are warm-up and dropped.

    ``recompute``: the run checkpointed activations: M_B is F's rise alone (the checkpointed
    inputs) and M_W, what B rebuilds for W, may exceed it.
    """
    kept = [e for e in events if e.iteration >= skip_iterations]
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    tails = _host_tails(kept)
    rise: dict[tuple[int, int, int], int] = {}  # (iteration, stage, mb) -> F's rise
    mem_b: dict[int, list[int]] = defaultdict(list)
    mem_w: dict[int, list[int]] = defaultdict(list)
    for e in kept:
        a = e.action
        if a is None:
            continue
        samples[a.op, a.stage].append((e.end_ns - e.start_ns) / 1e6)
        delta = e.mem_after - e.mem_before
        if a.op == "F":
            rise[e.iteration, a.stage, a.mb] = delta
            mem_b[a.stage].append(delta)
        elif a.op == "B" and (e.iteration, a.stage, a.mb) in rise:
            after_b = rise[e.iteration, a.stage, a.mb] + delta
            mem_w[a.stage].append(after_b)
            if not recompute:  # B may raise what F left: M_B covers both
                mem_b[a.stage].append(after_b)
    missing = [s for s in range(num_stages) if not samples.get(("F", s))]
    if missing:
        raise ValueError(
            f"no measured F of stages {missing} (after skipping {skip_iterations} warm-up "
            "iterations); run more iterations or trace every rank"
        )

    def stats(op: str, s: int) -> OpStats | None:
        got = samples.get((op, s))
        return OpStats.of(got) if got else None

    mb = tuple(max(max(mem_b[s]), 0) for s in range(num_stages))
    return StageProfile(
        f=tuple(OpStats.of(samples["F", s]) for s in range(num_stages)),
        b=tuple(stats("B", s) for s in range(num_stages)),
        w=tuple(stats("W", s) for s in range(num_stages)),
        bw=tuple(stats("BW", s) for s in range(num_stages)),
        mem_b=mb,
        mem_w=tuple(max(max(mem_w[s]), 0) if mem_w[s] else None for s in range(num_stages)),
        host={
            op: tuple(
                statistics.median(tails[op, s]) if tails.get((op, s)) else None
                for s in range(num_stages)
            )
            for op in COMPUTE_OPS
        },
        recompute=recompute,
    )


def all_to_all_ms(
    events: Sequence[TraceEvent],
    waits: Mapping[int, Sequence[tuple[int, int]]],
    num_stages: int,
    *,
    skip_iterations: int = 1,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per stage, the median ms its F events and its backward (B or BW) events spent in
    all-to-all waits: ``waits[rank]`` are that rank's waits (``(start_ns, end_ns)`` on the
    events' clock: ``perf_counter_ns`` less the rank's trace epoch), and each event is
    charged the part of them inside it. An op that never waited counts 0; a stage that ran
    no such event gets 0. The profiled runs have no overlapped pairs, so a rank's waits
    belong to the one compute they fall in."""
    got: dict[tuple[bool, int], list[float]] = defaultdict(list)
    spans: dict[int, list[tuple[int, int]]] = {r: sorted(w) for r, w in waits.items()}
    for e in events:
        a = e.action
        if a is None or e.iteration < skip_iterations or a.op is Op.W:
            continue
        inside = 0
        for lo, hi in spans.get(e.rank, ()):
            if lo >= e.end_ns:
                break
            inside += max(0, min(hi, e.end_ns) - max(lo, e.start_ns))
        got[a.op is Op.F, a.stage].append(inside / 1e6)

    def median(forward: bool, s: int) -> float:
        xs = got.get((forward, s))
        return statistics.median(xs) if xs else 0.0

    return (
        tuple(median(True, s) for s in range(num_stages)),
        tuple(median(False, s) for s in range(num_stages)),
    )


def _host_tails(events: Sequence[TraceEvent]) -> dict[tuple[str, int], list[float]]:
    """Per (op, stage): ms from each compute's end to the next compute's start, waits excluded."""
    by_rank: dict[int, list[TraceEvent]] = defaultdict(list)
    for e in events:
        by_rank[e.rank].append(e)
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    for evs in by_rank.values():
        for i, c in enumerate(evs):
            a = c.action
            if a is None:
                continue
            tail, prev = 0, c.end_ns
            for nxt in evs[i + 1 :]:
                if nxt.iteration != c.iteration:
                    break
                tail += nxt.start_ns - prev
                if nxt.op in HOST_OPS:
                    tail += nxt.end_ns - nxt.start_ns
                elif nxt.op != "wait_recv":
                    break  # the next compute, or the end of the step
                prev = nxt.end_ns
            out[a.op, a.stage].append(tail / 1e6)
    return out


def message_latency(*runs: Sequence[TraceEvent], skip_iterations: int = 0) -> dict[int, OpStats]:
    """Per stage boundary ``s -> s+1`` that crosses ranks (its activations and the
    gradients back), over the traced ``runs`` (each one executor's events of every
    rank): ms from the end of a message's producing op to the return of the receiver's
    wait, over the messages the receiver waited for from before that end (so the return
    is the arrival). Each run's clocks are aligned first
    (:func:`~zerobubble.trace.clocks.clock_offsets`); iterations below
    ``skip_iterations`` are warm-up. Boundaries without such a message are absent."""
    samples: dict[int, list[float]] = defaultdict(list)
    for run in runs:
        kept = [e for e in run if e.iteration >= skip_iterations]
        for s, ms in _message_delays(kept):
            samples[s].append(ms)
    return {s: OpStats.of(xs) for s, xs in sorted(samples.items())}


def _message_delays(events: Sequence[TraceEvent]) -> list[tuple[int, float]]:
    """(boundary, ms) of every message of one run whose receiver waited (see above)."""
    offset = clock_offsets(events)
    made: dict[tuple[int, MsgKind, int, int], TraceEvent] = {}
    for e in events:
        a = e.action
        if a is not None and a.op != Op.W:  # W sends nothing
            kind = MsgKind.ACT if a.op == Op.F else MsgKind.GRAD
            made[e.iteration, kind, a.stage, a.mb] = e
    out = []
    for w in events:
        if w.op != "wait_recv" or w.msg is None:
            continue
        carried, src, dst, mb = w.msg
        p = made.get((w.iteration, MsgKind(carried), src, mb))
        if p is None or p.rank == w.rank:
            continue
        done = p.end_ns + offset.get(p.rank, 0)
        if w.start_ns + offset.get(w.rank, 0) < done:
            out.append((min(src, dst), (w.end_ns + offset.get(w.rank, 0) - done) / 1e6))
    return out


def boundary_pairs(placement: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(stage s, device of s, device of s+1)`` for every boundary that crosses devices."""
    return [
        (s, placement[s], placement[s + 1])
        for s in range(len(placement) - 1)
        if placement[s] != placement[s + 1]
    ]


def p2p_latency(
    pairs: Sequence[tuple[int, int]],
    nbytes: int,
    *,
    iters: int = 10,
    warmup: int = 2,
    device: torch.device | str = "cpu",
    group: dist.ProcessGroup | None = None,
) -> dict[tuple[int, int], OpStats]:
    """One-way latency (ms) of a ``nbytes`` message for each rank pair, by ping-pong.

    A collective: every rank of ``group`` calls it with the same arguments and
    gets the same result. For each distinct pair ``(a, b)``, ``a`` sends to
    ``b`` and ``b`` sends it back, ``warmup + iters`` times; ``a`` times each
    round trip and halves it.
    """
    me = dist.get_rank(group)
    buf = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)
    mine: dict[tuple[int, int], OpStats] = {}
    for a, b in dict.fromkeys((min(p), max(p)) for p in pairs):
        if me not in (a, b):
            continue
        times = []
        for i in range(warmup + iters):
            if me == a:
                t0 = time.perf_counter()
                dist.send(buf, b, group=group)
                dist.recv(buf, b, group=group)
                if i >= warmup:
                    times.append((time.perf_counter() - t0) / 2 * 1e3)
            else:
                dist.recv(buf, a, group=group)
                dist.send(buf, a, group=group)
        if me == a:
            mine[a, b] = OpStats.of(times)
    gathered: list[dict | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    out: dict[tuple[int, int], OpStats] = {}
    for part in gathered:
        out.update(part or {})
    return {(a, b): out[min(a, b), max(a, b)] for a, b in pairs}
