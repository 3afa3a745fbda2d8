"""V-shaped building-block schedules: V-Min, V-Half and 1F1B-V.

From "Pipeline Parallelism with Controllable Memory" (Qi et al., 2024). All
three use the V placement (device d holds stages d and 2P-1-d) and are built
the paper's way: a *building block* says where one microbatch's passes sit
on each device; it is repeated every 6 slots and then squeezed.

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

The W of a block are not placed by it: each fills the first free slot after
its B (first come, first served), which keeps their extra memory (the M_W
part held from B to W) to a slot or two.

Squeeze. The tiled blocks leave warm-up and cool-down sparse. Walking the
passes in slot order, each moves to the earliest free slot after its
dependencies, unless (for an F) that would lift the device's memory above
the block's own peak somewhere on the way; moving B, W or BW up only frees
memory. Memory is counted with M_W = M_B / 2 (the cost model's default). The
squeezed slot order is the device order; real durations only time it.

The closed forms in the generators' docstrings were read off exact
simulations (F = B = W) and checked for every P <= 24; tests/test_v_family.py
asserts them.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence

import numpy as np

from zerobubble.schedule.generators.common import check_counts, emit_backward
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement

_PERIOD = 6
_WIDTH = {Op.F: 1, Op.B: 1, Op.W: 1, Op.BW: 2}  # slots a pass occupies
# Memory in quarters of a device's microbatch activations: a chunk F holds 2,
# B frees the half W does not need.
_MEM = {Op.F: 2, Op.B: -1, Op.W: -1, Op.BW: -2}

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
    return blocks


def _check_block(blocks: Sequence[Block]) -> None:
    """Every device's passes must cover distinct slots modulo the period."""
    for d, block in enumerate(blocks):
        cells = [(t + k) % _PERIOD for op, _, t in block for k in range(_WIDTH[op])]
        if len(set(cells)) != len(cells):
            raise AssertionError(f"building block collides with itself on device {d}: {block}")


def _tile(blocks: Sequence[Block], m: int) -> list[dict[Action, int]]:
    """Start slot of every pass: the block repeated for microbatches 0..M-1, plus the W.

    Blocks with a split backward (all passes one slot wide) leave two slots per
    period free; each W takes the first free slot after its B (first come,
    first served), the leftovers follow the last pass.
    """
    starts: list[dict[Action, int]] = []
    for block in blocks:
        at = {t + _PERIOD * j: Action(op, stage, j) for op, stage, t in block for j in range(m)}
        if not any(op is Op.B for op, _, _ in block):
            starts.append({a: t for t, a in at.items()})
            continue
        placed: dict[Action, int] = {}
        pending: deque[Action] = deque()
        t, last = 0, max(at)
        while t <= last or pending:
            a = at.get(t)
            if a is not None:
                placed[a] = t
                if a.op is Op.B:
                    pending.append(Action(Op.W, a.stage, a.mb))
            elif pending:
                placed[pending.popleft()] = t
            t += 1
        starts.append(placed)
    return starts


def _squeeze(starts: list[dict[Action, int]], num_stages: int) -> list[list[Action]]:
    """Move passes to earlier free slots without raising any device's peak; return the orders.

    Passes are visited in slot order, so on a device every slot below the
    current pass is settled: taken, or in that device's sorted ``free`` list.
    """
    horizon = max(t + 2 for placed in starts for t in placed.values())
    busy = [[False] * horizon for _ in starts]
    # level[d][k]: memory once every pass starting at or before slot k ran. Passes
    # move by up to ~P slots each, so its range updates are vectorised.
    level = np.zeros((len(starts), horizon), dtype=np.int64)
    for d, placed in enumerate(starts):
        for a, t in placed.items():
            busy[d][t] = True
            if a.op is Op.BW:
                busy[d][t + 1] = True
            level[d, t] += _MEM[a.op]
    np.cumsum(level, axis=1, out=level)
    cap = level.max(axis=1).tolist()
    free: list[list[int]] = [[] for _ in starts]
    settled = [0] * len(starts)  # slots below this are in ``free`` or taken
    backward = {(a.stage, a.mb): a.op for placed in starts for a in placed if a.op.is_backward}
    end: dict[tuple[Op, int, int], int] = {}  # where each settled pass ends
    orders: list[list[tuple[int, Action]]] = [[] for _ in starts]
    kind_end: dict[tuple[Op, int], int] = {}  # keeps each (op, stage) in microbatch order
    for t0, d, a in sorted((t, d, a) for d, placed in enumerate(starts) for a, t in placed.items()):
        row, mem, holes = busy[d], level[d], free[d]
        for k in range(settled[d], t0):
            if not row[k]:
                holes.append(k)
        settled[d] = t0
        op, stage, mb = a
        w, delta = _WIDTH[op], _MEM[op]
        # ir.dependencies' rules, on plain tuples (they hash like Actions, build faster).
        ready = kind_end.get((op, stage), 0)
        if op is Op.F:
            if stage:
                ready = max(ready, end[Op.F, stage - 1, mb])
        elif op is Op.W:
            ready = max(ready, end[Op.B, stage, mb])
        else:
            ready = max(ready, end[Op.F, stage, mb])
            if stage + 1 < num_stages:
                ready = max(ready, end[backward[stage + 1, mb], stage + 1, mb])
        i = bisect_left(holes, ready)
        if i < len(holes) and holes[i] < t0:
            if delta > 0:  # an F moved up holds its memory longer: stay under the cap
                over = np.flatnonzero(mem[holes[i] : t0] > cap[d] - delta)
                if over.size:
                    i = bisect_left(holes, holes[i] + int(over[-1]) + 1, i)
            for t in holes[i:]:
                if t >= t0:
                    break
                # A BW needs the next slot too (its own old slot t0 counts as free).
                if w == 2 and t + 1 < t0 and row[t + 1]:
                    continue
                holes.remove(t)
                if w == 2 and t + 1 < t0:
                    holes.remove(t + 1)
                row[t0 : t0 + w] = [False] * w
                row[t : t + w] = [True] * w
                mem[t:t0] += delta
                t0 = t
                break
        end[a] = t0 + w
        orders[d].append((t0, a))
        kind_end[op, stage] = t0 + w
    return [[a for _, a in sorted(order)] for order in orders]


def _block_schedule(name: str, p: int, m: int, blocks: Sequence[Block]) -> Schedule:
    _check_block(blocks)
    return Schedule(name, p, 2 * p, m, v_placement(p), _squeeze(_tile(blocks, m), 2 * p))


def v_min(num_devices: int, num_microbatches: int) -> Schedule:
    """V-Min: a third of 1F1B's activation memory (plus a constant), B/W split.

    Any P, M >= 1. At F = B = W (per-device totals 1, M_W = M_B/2) and M >= P:
    peak (P+4)//3, less 1/2 when P % 3 == 2 (1F1B: P); bubble 2P - 5/2
    (3 for P = 3, 0 for P = 1), so cost 3M + 2P - 5/2 (1F1B: 3M + 3P - 3).
    """
    p, m = check_counts(num_devices, num_microbatches)
    return _block_schedule("v-min", p, m, v_min_block(p))


def v_half(num_devices: int, num_microbatches: int) -> Schedule:
    """V-Half: half of 1F1B's activation memory (plus one), B/W split.

    Any P, M >= 1. At F = B = W and M >= P: peak P//2 + 1; bubble 7(P-1)/4
    for odd P, (7P-10)/4 for even P; cost 3M plus the bubble.
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
