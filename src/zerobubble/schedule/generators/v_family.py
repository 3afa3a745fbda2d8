"""V-shaped building-block schedules: V-Min, V-Half and 1F1B-V.

From "Pipeline Parallelism with Controllable Memory" (Qi et al., 2024). All
three use the V placement (device d holds stages d and 2P-1-d) and are built
the paper's way: a *building block* says where one microbatch's passes sit
on each device; it is repeated every 6 slots and then reordered.

Slots. With uniform costs a chunk's F, B and W take one slot each (half of a
per-device F) and a combined BW two. Per microbatch a device runs 2 F and
2 B + 2 W (or 2 BW): 6 slots. So the block repeats with period 6, and a
device is never idle in steady state as long as its passes fall on distinct
slots modulo 6 (checked when a schedule is built).

Lifespan argument. A chunk's activations live from its F to the end of its
backward. In steady state the number of microbatches alive in a chunk is
its lifespan divided by the period, rounded up or down, and a chunk F holds
1/2 of a device's microbatch, so a block whose chunk lifespans sum to L slots
peaks at about L/12 (1F1B's block: L = 12P, peak P). The blocks below shorten
L by running each microbatch's V as a tight chain (P >= 2; g is a gap that
keeps the passes of a device apart modulo 6):

* V-Min: every hop along the V takes one slot. The F's reach the turn after
  P slots and device 0 after 2P; the B's come back the same way:
  L = 4P + 2 + 2g per device, peak about P/3.
* V-Half: the down-going F and the up-going B hop two slots, the other two
  hops one: L = 6P + 1 + 2g, peak about P/2. The slack costs memory but
  leaves room for W, so fewer bubbles than V-Min.
* 1F1B-V: combined backwards. Six slots per period leave no gap-free
  backward chain, so BW hops 2, 2, 5 slots in turn: L <= 8P + 9, peak about
  2P/3.

The W of a block are not placed by it: they run lazily, each B's W in the
first free slot after it, oldest first (the leftovers after the last pass).
In steady state a block leaves two free slots per period, one per W.

Reorder (the paper's "squeeze", done as in its official code). The tiled
blocks leave warm-up and cool-down sparse. The steady state, from the end of
microbatch 0's V (its stage-0 backward) to the last stage-0 F, keeps the
tiling. Outside it, walking the F, B and BW in slot order, each moves to the
earliest free slot after its dependencies; W are re-run lazily afterwards, so
a B never waits behind a W, the W slips instead. Only an F is held back: it
stays if, with the W it displaces, the device's memory would rise above the
tiled block's peak somewhere on the way (a B or BW moving up frees more than
the W it may delay holds). Memory is counted with M_W = M_B / 2 (the cost
model's default). The slot order is the device order; real durations only
time it.

Speed. The steady state repeats every period, microbatches shifted by one,
and the reorder never reaches back more than a period into it. So the order
is built for just enough microbatches to hold a few steady periods (about
P + 9 for V-Half), and the rest of the periods are spliced in: generating
V-Half at P = 64, M = 512 costs what M = 73 does.

The closed forms in the generators' docstrings were read off exact
simulations (F = B = W) and checked for every P <= 24; tests/test_v_family.py
asserts them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import pairwise, repeat

from zerobubble.schedule.deps import RULES, Kind
from zerobubble.schedule.generators.common import check_counts, emit_backward
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement

_PERIOD = 6
_WIDTH = {Op.F: 1, Op.B: 1, Op.W: 1, Op.BW: 2}  # slots a pass occupies
# Memory in quarters of a device's microbatch activations: a chunk F holds 2,
# B frees the half W does not need.
_MEM = {Op.F: 2, Op.B: -1, Op.BW: -2}
_MEM_W = -1

# One pass of a building block: (op, virtual stage, slot of microbatch 0).
Block = Sequence[tuple[Op, int, int]]


def v_min_block(num_devices: int) -> list[Block]:
    """V-Min's block: every hop one slot; g = 2 extra slots before the backwards when 3 | P.

    Device i: F(down) at i, F(up) at 2P-1-i, B(up) at 2P+g+i, B(down) at
    4P+g-1-i. Without the gap, 3 | P would put B(up) on F(down)'s slot modulo 6.
    """
    p = num_devices
    g = 2 if p % 3 == 0 else 0
    return [
        (
            (Op.F, i, i),
            (Op.F, 2 * p - 1 - i, 2 * p - 1 - i),
            (Op.B, 2 * p - 1 - i, 2 * p + g + i),
            (Op.B, i, 4 * p + g - 1 - i),
        )
        for i in range(p)
    ]


def v_half_block(num_devices: int) -> list[Block]:
    """V-Half's block: F(down) and B(up) hop two slots; g = 3 extra slots when P is even.

    Device i: F(down) at 2i, F(up) at 3P-2-i, B(up) at 3P-1+g+2i, B(down) at
    6P-2+g-i. Without the gap, even P would put B(down) on F(up)'s slot modulo 6.
    """
    p = num_devices
    g = 3 if p % 2 == 0 else 0
    return [
        (
            (Op.F, i, 2 * i),
            (Op.F, 2 * p - 1 - i, 3 * p - 2 - i),
            (Op.B, 2 * p - 1 - i, 3 * p - 1 + g + 2 * i),
            (Op.B, i, 6 * p - 2 + g - i),
        )
        for i in range(p)
    ]


def one_f_one_b_v_block(num_devices: int) -> list[Block]:
    """1F1B-V's block: walk the V chain, each pass at the earliest slot free modulo 6.

    Forwards hop one slot. Each BW takes the earliest two adjacent slots after
    its dependency that its device's other passes leave free modulo 6, which
    makes the backward chain hop 2, 2, 5 slots in turn (when 3 | P its first
    and last hops stretch to 4 and 7).
    """
    p = num_devices
    used: list[set[int]] = [set() for _ in range(p)]
    blocks: list[list[tuple[Op, int, int]]] = [[] for _ in range(p)]
    chain = (
        [(i, Op.F, i) for i in range(p)]
        + [(i, Op.F, 2 * p - 1 - i) for i in reversed(range(p))]
        + [(i, Op.BW, 2 * p - 1 - i) for i in range(p)]
        + [(i, Op.BW, i) for i in reversed(range(p))]
    )
    ready = 0
    for d, op, stage in chain:
        cells = range(_WIDTH[op])
        t = ready
        while any((t + k) % _PERIOD in used[d] for k in cells):
            t += 1
        used[d].update((t + k) % _PERIOD for k in cells)
        blocks[d].append((op, stage, t))
        ready = t + _WIDTH[op]
    return [tuple(block) for block in blocks]


def _check_block(blocks: Sequence[Block]) -> None:
    """Every device's passes must cover distinct slots modulo the period; B and BW do not mix."""
    if {Op.B, Op.BW} <= {op for block in blocks for op, _, _ in block}:
        raise AssertionError("a building block uses either B (and W) or BW")
    for d, block in enumerate(blocks):
        cells = [(t + k) % _PERIOD for op, _, t in block for k in range(_WIDTH[op])]
        if len(set(cells)) != len(cells):
            raise AssertionError(f"building block collides with itself on device {d}: {block}")


class _Device:
    """One device's slots during the reorder; those below ``front`` are settled.

    ``cell[s]`` is (memory delta, 1 if a B) of the pass in slot s (a BW's second
    slot is (0, 0)), None if free; ``level[s]`` and ``queue[s]`` are memory and W
    waiting to run after slot s, with W run lazily (see :func:`_with_w`);
    ``free`` lists the settled free slots in order.
    """

    __slots__ = ("cap", "cell", "free", "front", "level", "placed", "queue")

    def __init__(self, horizon: int, cap: int) -> None:
        self.cell: list[tuple[int, int] | None] = [None] * horizon
        self.level = [0] * horizon
        self.queue = [0] * horizon
        self.free: list[int] = []
        self.front = 0
        self.cap = cap
        self.placed: list[tuple[int, Action]] = []

    def settle(self, hi: int) -> None:
        """Settle the slots from ``front`` up to ``hi``: a free slot runs the oldest waiting W."""
        lo, cell, level, queue = self.front, self.cell, self.level, self.queue
        lv, q = (level[lo - 1], queue[lo - 1]) if lo else (0, 0)
        for s in range(lo, hi):
            c = cell[s]
            if c is None:
                self.free.append(s)
                if q:
                    q -= 1
                    lv += _MEM_W
            else:
                lv += c[0]
                q += c[1]
            level[s] = lv
            queue[s] = q
        self.front = max(lo, hi)

    def slot_for(self, op: Op, ready: int, t0: int) -> int:
        """The earliest free slot from ``ready`` for a pass now at ``t0`` (t0 if none fits).

        Only an F can raise memory: a B or BW moving up frees its memory
        earlier, which outweighs the W it may delay.
        """
        free = self.free
        i = bisect_left(free, ready)
        if i == len(free):
            return t0
        if op is Op.B:
            return free[i]
        if op is Op.BW:  # needs the next slot free too (its own old slot counts)
            while i < len(free) and free[i] + 1 < t0 and free[i + 1 : i + 2] != [free[i] + 1]:
                i += 1
            return free[i] if i < len(free) else t0
        # F: over [h, t0) memory rises by its own 2, and by a W's 1 until the first
        # slot that had nothing to run (if h ran a W). The first part is monotone in h.
        level, room = self.level, self.cap - _MEM[Op.F]
        lo, hi = i, len(free)
        if max(level[free[i] : t0]) > room:
            while lo < hi:
                mid = (lo + hi) // 2
                if max(level[free[mid] : t0]) <= room:
                    hi = mid
                else:
                    lo = mid + 1
        for k in range(lo, len(free)):
            h = free[k]
            if not self._ran_w(h) or max(level[h : self._idle_after(k, t0)]) < room:
                return h
        return t0

    def _ran_w(self, s: int) -> bool:
        """Whether free slot ``s`` runs a W (so far)."""
        return s > 0 and self.queue[s - 1] > 0

    def _idle_after(self, k: int, t0: int) -> int:
        """The first free slot after ``free[k]`` that runs no W (so far), else ``t0``."""
        free, queue = self.free, self.queue
        for idx in range(k + 1, len(free)):
            if not queue[free[idx] - 1]:
                return free[idx]
        return t0

    def place(self, op: Op, t: int, t0: int) -> None:
        """Put a pass of ``op`` in slot t (<= t0, its tiled slot, which is ``front``)."""
        w, delta = _WIDTH[op], _MEM[op]
        if t < t0:
            free = self.free
            k = bisect_left(free, t)
            ran = int(self._ran_w(t))
            # Over [t, t0) memory changes by delta (less the W t ran) and the W
            # waiting by the one t no longer runs plus a B's own; each later free
            # slot that ran nothing now runs one of those.
            # (No W waits in a block of BW, so a BW's second slot changes nothing.)
            dl, dq = delta + ran, ran + (op is Op.B)
            level, queue = self.level, self.queue
            bounds = [t]
            idx = k + 1
            while len(bounds) <= dq and idx < len(free):
                if not queue[free[idx] - 1]:
                    bounds.append(free[idx])
                idx += 1
            bounds.append(t0)
            for x, y in pairwise(bounds):
                if dl:
                    level[x:y] = [v + dl for v in level[x:y]]
                if dq:
                    queue[x:y] = [v + dq for v in queue[x:y]]
                    dl, dq = dl + _MEM_W, dq - 1
            del free[k : bisect_left(free, t + w)]
        self.cell[t] = (delta, 1 if op is Op.B else 0)
        if w == 2:
            self.cell[t + 1] = (0, 0)
        self.settle(t0 + w)


def _reorder(blocks: Sequence[Block], m: int) -> list[list[tuple[int, Action]]]:
    """Tile the blocks for ``m`` microbatches and reorder; each device's (slot, pass), W included.

    Passes are walked in slot order, so on a device every slot below the
    current pass is settled.
    """
    p = len(blocks)
    num_stages = 2 * p
    first_end = _first_end(blocks)
    last_start = _PERIOD * (m - 1)  # the last F of stage 0 (its block slot is 0)
    tiled = sorted(
        (t + _PERIOD * j, d, op, s, j)
        for d, block in enumerate(blocks)
        for op, s, t in block
        for j in range(m)
    )
    horizon = tiled[-1][0] + 2
    devices = [_Device(horizon, 0) for _ in blocks]
    for t, d, op, _, _ in tiled:  # the tiling's own peak is each device's cap
        devices[d].cell[t] = (_MEM[op], 1 if op is Op.B else 0)
        if op is Op.BW:
            devices[d].cell[t + 1] = (0, 0)
    for d, dev in enumerate(devices):
        dev.settle(horizon)
        devices[d] = _Device(horizon, max(dev.level))
    # The dependency rule (deps.RULES), its keys as list indices (no tuples to build).
    # One segment per microbatch here: the kinds that step between segments never occur.
    need = {op: [(k, k.flow) for k in r.needs if not k.step] for op, r in RULES.items()}
    made = {op: [k for k in r.produces if not k.step] for op, r in RULES.items()}
    ready_at = {kind: [0] * (num_stages * m) for kind in Kind}  # [stage * m + mb]: ready time
    kind_end: dict[tuple[Op, int], int] = {}  # keeps each (op, stage) in microbatch order
    for t0, d, op, stage, mb in tiled:
        dev = devices[d]
        dev.settle(t0)
        t = t0
        if not first_end <= t0 <= last_start:  # the steady state keeps the tiling
            ready = kind_end.get((op, stage), 0)
            for kind, flow in need[op]:
                if 0 <= stage - flow < num_stages:
                    ready = max(ready, ready_at[kind][(stage - flow) * m + mb])
            t = dev.slot_for(op, ready, t0)
        dev.place(op, t, t0)
        kind_end[op, stage] = t + _WIDTH[op]
        for kind in made[op]:
            ready_at[kind][stage * m + mb] = t + _WIDTH[op]
        dev.placed.append((t, Action(op, stage, mb)))
    return [_with_w(sorted(dev.placed)) for dev in devices]


def _with_w(placed: list[tuple[int, Action]]) -> list[tuple[int, Action]]:
    """Insert each B's W, oldest first, in the free slots after it (then after the last pass)."""
    out: list[tuple[int, Action]] = []
    pending: deque[Action] = deque()
    nxt = 0
    for t, a in placed:
        while pending and nxt < t:
            out.append((nxt, pending.popleft()))
            nxt += 1
        out.append((t, a))
        if a.op is Op.B:
            pending.append(Action(Op.W, a.stage, a.mb))
        nxt = t + _WIDTH[a.op]
    out.extend((nxt + k, w) for k, w in enumerate(pending))
    return out


def _actions(ops: Sequence[Op], stages: Sequence[int], mbs: Iterable[int]) -> list[Action]:
    """Build many Actions at C speed."""
    return list(map(tuple.__new__, repeat(Action), zip(ops, stages, mbs, strict=True)))


def _splice(order: list[tuple[int, Action]], cut: int, k: int) -> list[Action]:
    """Repeat the steady period starting at slot ``cut`` k more times (microbatches shift by k)."""
    lo = bisect_left(order, (cut,))
    hi = bisect_left(order, (cut + _PERIOD,))
    period = [a for _, a in order[lo:hi]]
    nxt = [a for _, a in order[hi : bisect_left(order, (cut + 2 * _PERIOD,))]]
    if nxt != [Action(op, s, j + 1) for op, s, j in period]:
        raise AssertionError(f"no steady state at slot {cut}: {period} then {nxt}")
    ops, stages, mbs = zip(*period, strict=True)
    tail = [a for _, a in order[lo:]]
    tops, tstages, tmbs = zip(*tail, strict=True)
    return (
        [a for _, a in order[:lo]]
        + _actions(ops * k, stages * k, [j + i for i in range(k) for j in mbs])
        + _actions(tops, tstages, [j + k for j in tmbs])
    )


def _block_orders(blocks: Sequence[Block], m: int) -> list[list[Action]]:
    """Each device's order for ``m`` microbatches.

    The steady state repeats every period with microbatches shifted by one,
    and the reorder never looks further back than a period into it, so the
    order is built for just enough microbatches to hold a few steady periods
    and the rest are spliced in.
    """
    # Built for ``base`` microbatches, the last stage-0 F comes 5 periods after ``cut``:
    # the period spliced in and the next (checked against it) lie well inside the
    # steady state, clear of the W the warm-up left waiting and of the cool-down.
    cut = _first_end(blocks) + 2 * _PERIOD
    base = -(-cut // _PERIOD) + 6
    if m <= base:
        return [[a for _, a in order] for order in _reorder(blocks, m)]
    return [_splice(order, cut, m - base) for order in _reorder(blocks, base)]


def _first_end(blocks: Sequence[Block]) -> int:
    """The slot of microbatch 0's last pass, the backward of stage 0 (on device 0)."""
    return next(t for op, s, t in blocks[0] if op.is_backward and s == 0)


def _block_schedule(name: str, p: int, m: int, blocks: Sequence[Block]) -> Schedule:
    _check_block(blocks)
    orders = _block_orders(blocks, m)
    return Schedule(name, p, 2 * p, m, v_placement(p), tuple(tuple(acts) for acts in orders))


def v_min(num_devices: int, num_microbatches: int) -> Schedule:
    """V-Min: a third of 1F1B's activation memory (plus a constant), B/W split.

    Any P, M >= 1. At F = B = W (per-device totals 1, M_W = M_B/2) and M >= P
    (M >= 4 for P = 3): peak (P+4)//3, less 1/2 when P % 3 == 2 (1F1B: P);
    bubble 2P - 5/2, or 2P - 3 when 3 | P (0 for P = 1), so cost 3M + 2P - 5/2
    (1F1B: 3M + 3P - 3).
    """
    p, m = check_counts(num_devices, num_microbatches)
    return _block_schedule("v-min", p, m, v_min_block(p))


def v_half(num_devices: int, num_microbatches: int) -> Schedule:
    """V-Half: half of 1F1B's activation memory (plus one), B/W split.

    Any P, M >= 1. At F = B = W and M >= P (M >= 2P for P = 4, 6): peak
    P//2 + 1; bubble 3*((P-1)//2) - 1/2 (0 for P = 1, 1/2 for P = 2), about
    3P/2 as in the paper; cost 3M plus the bubble.
    """
    p, m = check_counts(num_devices, num_microbatches)
    return _block_schedule("v-half", p, m, v_half_block(p))


def one_f_one_b_v(
    num_devices: int, num_microbatches: int, *, split_backward: bool = False
) -> Schedule:
    """1F1B-V: V placement, combined backward, two thirds of 1F1B's memory.

    Any P, M >= 1. At F = B = W and M >= 2P: peak 2P//3 + 1; bubble 5P/2 - c
    with c = 7/2, 5/2, 3 for P % 3 = 0, 1, 2 (0 for P = 1); cost 3M plus the
    bubble. ``split_backward=True`` writes each BW as B immediately followed by
    W: same order and peak, and the gradient leaves a W earlier.
    """
    p, m = check_counts(num_devices, num_microbatches)
    sched = _block_schedule("1f1b-v", p, m, one_f_one_b_v_block(p))
    if not split_backward:
        return sched
    return sched.with_actions(
        [
            [
                x
                for a in acts
                for x in (emit_backward(a.stage, a.mb, True) if a.op is Op.BW else [a])
            ]
            for acts in sched.actions
        ]
    )
