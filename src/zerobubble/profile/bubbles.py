"""Where a measured pipeline iteration's idle time goes, per device, summing exactly.

Input: the :class:`~zerobubble.trace.format.TraceEvent` list of every rank.
Ranks' times are first put on one clock using the messages between them
(:func:`zerobubble.trace.clocks.clock_offsets`). All quantities are integer
nanoseconds, so the parts add up exactly.

Definitions (one iteration, device = rank ``d``):

* compute events ``c_1 .. c_n`` of ``d`` in execution order, ``[s_i, e_i]``;
  ``busy_d`` is the length of their union: ``Σ (e_i - s_i)``, except that the two
  halves of an overlapped F&B pair (:mod:`~zerobubble.runtime.overlap`), whose events
  may overlap in time, count their common time once.
* window ``[T0, T1]``: the first compute start and the last compute end over
  all devices. **Idle time** ``idle_d = (T1 - T0) - busy_d``: the gaps
  ``[T0, s_1]``, ``[e_i, s_{i+1}]`` and ``[e_n, T1]``. The measured **bubble
  rate** is ``Σ_d idle_d / (P · (T1 - T0))``.
* A gap ``[lo, hi]`` before compute ``c`` is cut at two instants: ``p``, when
  the producer of ``c``'s input on *another* device finished (F(s-1, j) for
  F(s, j); the backward of (s+1, j) for B/BW(s, j): the rule of
  :mod:`zerobubble.schedule.deps`; found through the message ids), and
  ``a``, when ``d``'s wait for that message returned. Inputs made on ``d``
  itself (and W, whose only input is its own B) have ``p = a = -inf``.
  With ``p' = clamp(p, lo, hi)`` and ``a' = clamp(max(a, p'), lo, hi)``:

  - ``[lo, p']`` is a **dependency** wait (the schedule's next action has no
    input yet), except for the part that is a **memory stall**: if the next
    F in ``d``'s order after ``c`` already had its input (its producer ended
    at ``r``, or ``T0`` on stage 0) and starting it would have raised ``d``'s
    held activation bytes (``c``'s ``mem_before``) plus that F's measured
    ``M_B`` over ``mem_budget``, then ``[max(lo, r), p']`` is a memory stall
    (ready but over the limit). Without a budget there are no memory stalls.
  - ``[p', a']`` is a **communication** stall: the input existed but had not
    arrived (the sender's issue delay, transfer, and the wait itself).
  - ``[a', hi]`` is **host/launch overhead**: the device had its input and
    was free but did not compute (Python, posting receives, sends, tracing).
* The trailing gap ``[e_n, T1]`` (nothing left to run) is a dependency wait.
* **Load imbalance** is carved out of the dependency waits: a device with
  less compute than the busiest one must idle ``busy_max - busy_d`` in a
  window the busiest device fills, so ``imbalance_d = min(busy_max - busy_d,
  dependency_d)`` moves from dependency to imbalance.

So ``dependency + memory + comm + imbalance + overhead == idle_d`` exactly.

Data parallelism: a rank's ``wait_reduce`` (the wait for its stages' gradient
all-reduces over ``dp``, after its last compute) is reported apart, as
``reduce_wait_ns``: the reduction time the compute did not hide. It is not one
of the idle parts: it starts after the rank's last compute, so the part of it
inside the window is already counted in the trailing dependency wait, and the
rest lies after the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from zerobubble.program.instructions import MsgKind
from zerobubble.schedule.deps import Key, needs, produces
from zerobubble.schedule.ir import Action, Op
from zerobubble.trace.clocks import clock_offsets
from zerobubble.trace.format import EventOp, MessageId, TraceEvent

CATEGORIES = ("dependency", "memory", "comm", "imbalance", "overhead")
"""The parts of a device's idle time, in the order pictures stack them."""


@dataclass(frozen=True)
class DeviceBubbles:
    """Busy and idle time of one device in one iteration, idle split by cause (ns)."""

    rank: int
    busy_ns: int
    idle_ns: int
    dependency_ns: int
    memory_ns: int
    comm_ns: int
    imbalance_ns: int
    overhead_ns: int
    peak_memory: int
    """Largest activation bytes held around any event of the iteration."""
    reduce_wait_ns: int = 0
    """Time in ``wait_reduce``: the dp gradient reduction that outlasted the compute."""

    def parts(self) -> dict[str, int]:
        """The idle time by category (sums to ``idle_ns``)."""
        return {c: getattr(self, f"{c}_ns") for c in CATEGORIES}


@dataclass(frozen=True)
class IterationBubbles:
    """One measured iteration: its window and every device's breakdown."""

    iteration: int
    start_ns: int
    end_ns: int
    devices: tuple[DeviceBubbles, ...]

    @property
    def window_ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def bubble_rate(self) -> float:
        """Idle share of the devices' time in the window: Σ idle / (P · window)."""
        total = len(self.devices) * self.window_ns
        return sum(d.idle_ns for d in self.devices) / total if total else 0.0

    @property
    def peak_memory(self) -> int:
        return max(d.peak_memory for d in self.devices)

    def totals(self) -> dict[str, int]:
        """Each category summed over devices."""
        return {c: sum(d.parts()[c] for d in self.devices) for c in CATEGORIES}


def iterations(events: Sequence[TraceEvent]) -> list[int]:
    """The iteration numbers present, in order."""
    return sorted({e.iteration for e in events})


def analyze_iteration(
    events: Sequence[TraceEvent],
    iteration: int,
    *,
    mem_budget: int | None = None,
    overlaps: Iterable[tuple[Action, Action]] = (),
) -> IterationBubbles:
    """Decompose iteration ``iteration``'s idle time (see the module docstring).

    ``events`` are every rank's events, each rank's in execution order; other
    iterations only help align the clocks. ``mem_budget`` (bytes per device) enables
    memory stalls. ``overlaps``: the schedule's overlapped F&B pairs, the only compute
    events that may overlap in time.
    """
    pairs = {frozenset(pair) for pair in overlaps}
    offsets = clock_offsets(events)
    mine = [
        replace(e, start_ns=e.start_ns + offsets[e.rank], end_ns=e.end_ns + offsets[e.rank])
        for e in events
        if e.iteration == iteration
    ]
    ranks = sorted({e.rank for e in mine})
    per_rank = {r: [e for e in mine if e.rank == r] for r in ranks}
    computes = {r: [e for e in evs if isinstance(e.op, Op)] for r, evs in per_rank.items()}
    if not mine or any(not c for c in computes.values()):
        raise ValueError(f"iteration {iteration}: every rank needs compute events in the trace")
    num_stages = 1 + max(_action(c).stage for cs in computes.values() for c in cs)
    made: dict[Key, TraceEvent] = {}  # the compute that produced each key
    for e in mine:
        if (act := e.action) is not None:
            made.update(dict.fromkeys(produces(*act, num_stages), e))
    gaps = _Gaps(
        iteration=iteration,
        num_stages=num_stages,
        made=made,
        arrivals={(e.rank, e.msg): e.end_ns for e in mine if e.op is EventOp.WAIT_RECV},
        t0=min(c[0].start_ns for c in computes.values()),
        t1=max(c.end_ns for cs in computes.values() for c in cs),
        mem_budget=mem_budget,
        pairs=pairs,
    )
    raw: dict[int, dict[str, int]] = {}
    busy: dict[int, int] = {}
    for r in ranks:
        raw[r], busy[r] = gaps.split(r, computes[r])
    busiest = max(busy.values())
    devices = []
    for r in ranks:
        parts = raw[r]
        imbalance = min(busiest - busy[r], parts["dependency"])
        parts["dependency"] -= imbalance
        parts["imbalance"] = imbalance
        devices.append(
            DeviceBubbles(
                rank=r,
                busy_ns=busy[r],
                idle_ns=(gaps.t1 - gaps.t0) - busy[r],
                **{f"{k}_ns": v for k, v in parts.items()},
                peak_memory=max(max(e.mem_before, e.mem_after) for e in per_rank[r]),
                reduce_wait_ns=sum(
                    e.end_ns - e.start_ns for e in per_rank[r] if e.op is EventOp.WAIT_REDUCE
                ),
            )
        )
    return IterationBubbles(iteration, gaps.t0, gaps.t1, tuple(devices))


@dataclass(frozen=True)
class _Gaps:
    """What splitting one iteration's idle gaps needs to know of every rank's events."""

    iteration: int
    num_stages: int
    made: dict[Key, TraceEvent]
    """The compute that produced each key."""
    arrivals: dict[tuple[int, MessageId | None], int]
    """When each rank's wait for each message ended."""
    t0: int
    t1: int
    mem_budget: int | None
    pairs: set[frozenset[Action]]
    """The overlapped F&B pairs, the only computes that may overlap in time."""

    def producer(self, c: TraceEvent) -> tuple[TraceEvent | None, MessageId | None]:
        """The compute whose output ``c`` consumes from another stage, and the message id."""
        for k in needs(*_action(c), self.num_stages):
            if k.kind.travels:
                return self.made.get(k), (MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
        return None, None

    def split(self, r: int, cs: list[TraceEvent]) -> tuple[dict[str, int], int]:
        """Rank ``r``'s idle time between its computes ``cs`` by category (imbalance not
        yet taken out of dependency), and its busy time."""
        parts = dict.fromkeys(CATEGORIES, 0)
        busy = 0
        lo = self.t0
        for i, c in enumerate(cs):
            hi = c.start_ns
            if hi < lo:
                if i == 0 or frozenset((cs[i - 1].action, c.action)) not in self.pairs:
                    raise ValueError(
                        f"rank {r}: compute events overlap at {c.op}(s{c.stage},mb{c.mb}) of "
                        f"iteration {self.iteration}; only an overlapped F&B pair's may; check "
                        "the trace with `zerobubble check-trace`"
                    )
                busy += max(0, c.end_ns - lo)  # the pair's common time counts once
                lo = max(lo, c.end_ns)
                continue
            busy += c.end_ns - c.start_ns
            p = a = lo
            prod, msg = self.producer(c)
            if prod is not None and prod.rank != r:
                p = min(max(prod.end_ns, lo), hi)
                a = min(max(self.arrivals.get((r, msg), prod.end_ns), p), hi)
            stall = _memory_stall(
                c, cs[i + 1 :], lo, p, self.made, self.num_stages, self.t0, self.mem_budget
            )
            parts["memory"] += stall
            parts["dependency"] += p - lo - stall
            parts["comm"] += a - p
            parts["overhead"] += hi - a
            lo = c.end_ns
        parts["dependency"] += self.t1 - lo
        return parts, busy


def _memory_stall(
    c: TraceEvent,
    later: Sequence[TraceEvent],
    lo: int,
    p: int,
    made: dict[Key, TraceEvent],
    num_stages: int,
    t0: int,
    mem_budget: int | None,
) -> int:
    """Length of ``[lo, p]`` during which the next F was ready but would exceed the budget."""
    if mem_budget is None or p <= lo:
        return 0
    nxt = next((e for e in later if e.op is Op.F), None)
    if nxt is None:
        return 0
    ready = t0
    for k in needs(*_action(nxt), num_stages):
        up = made.get(k)
        if up is None:
            return 0
        ready = max(ready, up.end_ns)
    m_b = nxt.mem_after - nxt.mem_before
    if c.mem_before + m_b <= mem_budget:
        return 0
    return max(0, p - max(lo, ready))


def _action(c: TraceEvent) -> Action:
    """The action of ``c``, one of the compute events the analysis picked out."""
    a = c.action
    if a is None:
        raise ValueError(f"{c.op} event of rank {c.rank} is not a compute event")
    return a
