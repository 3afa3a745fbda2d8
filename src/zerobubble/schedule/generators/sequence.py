"""Sequence-level pipelining (Seq1F1B): a microbatch's sequence streams through as k segments.

Each microbatch's sequence is cut into ``k`` segments (where:
:func:`~zerobubble.schedule.segments.balanced_cuts`); the pipeline's unit of work is one
segment, numbered ``u = mb * k + seg`` in an action's ``mb`` field
(:class:`~zerobubble.schedule.ir.Schedule`). Forwards go through the segments in order
(a segment reads the keys and values of the ones before it); backwards go in reverse (a
segment's backward sends gradients into those keys and values, which the earlier
segment's backward needs). Both orders are the dependency rule's
(:data:`~zerobubble.schedule.deps.RULES`).

Why it pays: the pipeline fills and drains in units of a segment, 1/k of a microbatch,
so at uniform costs the bubble shrinks k-fold, and device d holds ``P - d + k - 1``
segments in flight, ``(P - d + k - 1) / k`` microbatches' activations (plus the keys
and values the later segments read), where 1F1B holds ``P - d`` microbatches.

Three kinds: ``seq1f1b`` (1F1B over segments), ``seq-zb`` (ZB-H1 over segments) and
``seq-zbv`` (ZB-V over segments on the V placement: no bubble at seq-zb's peak once there
are enough units).
"""

from __future__ import annotations

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators.classic import merge_1f1b
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.generators.segment_list import (
    SegmentPass,
    SegPolicy,
    backward_units,
    forward_units,
)
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement
from zerobubble.schedule.simulate import simulate

__all__ = [
    "backward_units",
    "check_segments",
    "forward_units",
    "retail",
    "seq1f1b",
    "seq_zb",
    "seq_zbv",
    "zbv_warm_steady",
]


def check_segments(segments: int) -> int:
    if type(segments) is not int or segments < 1:
        raise ValueError(f"segments must be an integer >= 1, got {segments!r}")
    return segments


def seq1f1b(
    num_devices: int, num_microbatches: int, *, segments: int = 2, split_backward: bool = False
) -> Schedule:
    """Seq1F1B: 1F1B over segments, combined backward (BW) unless ``split_backward``.

    Device d warms up with ``P - 1 - d + k - 1`` forwards: the first backward of the
    last stage is the last segment of microbatch 0, after all k of its forwards. Any
    P, M, k >= 1; k = 1 is 1F1B. At uniform unit costs F = B = W = 1 the cost is
    ``3Mk + 3(P - 1)``: 1F1B's bubble in segments instead of microbatches.
    """
    p, m = check_counts(num_devices, num_microbatches)
    k = check_segments(segments)
    fwd_units, bwd_units = forward_units(m, k), backward_units(m, k)
    actions = []
    for d in range(p):
        warmup = min(p - 1 - d + k - 1, m * k)
        fwd = [Action(Op.F, d, u) for u in fwd_units]
        bwd = [(d, u) for u in bwd_units]
        actions.append(merge_1f1b(fwd, bwd, warmup, split_backward))
    return Schedule("seq1f1b", p, p, m, tuple(range(p)), tuple(map(tuple, actions)), k)


def seq_zb(num_devices: int, num_microbatches: int, *, segments: int = 2) -> Schedule:
    """ZB-H1 over segments: Seq1F1B's memory with the B/W split filling the drain.

    Device i repeats ZB-H1's triple: the next F, the B ``P - 1 - i + k - 1`` places
    behind it in backward order, the W ``P - 1 + k - 1`` places behind (so device i
    defers each W by i units after its B). At uniform unit costs F = B = W = 1 the
    cost is ``3Mk + P - 1`` once ``Mk >= P + k - 1``: ZB-H1's bubble in segments.
    """
    p, m = check_counts(num_devices, num_microbatches)
    k = check_segments(segments)
    units = m * k
    fwd_units, bwd_units = forward_units(m, k), backward_units(m, k)
    actions = []
    for i in range(p):
        lags = (
            (Op.F, 0, fwd_units),
            (Op.B, p - 1 - i + k - 1, bwd_units),
            (Op.W, p - 1 + k - 1, bwd_units),
        )
        acts = []
        for x in range(units + p - 1 + k - 1):
            for op, lag, order in lags:
                if 0 <= x - lag < units:
                    acts.append(Action(op, i, order[x - lag]))
        actions.append(tuple(acts))
    return Schedule("seq-zb", p, p, m, tuple(range(p)), tuple(actions), k)


def seq_zbv(num_devices: int, num_microbatches: int, *, segments: int = 2) -> Schedule:
    """ZB-V over segments: the V placement (device d holds stages d and 2P-1-d), seq-zb's
    peak memory, and no bubble at F = B = W once there are enough units.

    ZB-V's order over units (:func:`zbv_warm_steady`) up to each device's last F; from
    there its backwards and Ws are list-scheduled at uniform unit costs
    (:class:`.segment_list.SegmentPass`: a ready B first, else the oldest W, so the Ws
    fill the cool-down); of the two stage preferences for ready Bs, the cheaper. At
    F = B = W = 1 per microbatch: cost 3M (no bubble) once ``Mk >= 2P + k - 2``, and peak
    ``min(M, (P + k - 1) / k)`` microbatches' M_B (seq-zb's on device 0). Any P, M, k >= 1.
    """
    p, m = check_counts(num_devices, num_microbatches)
    k = check_segments(segments)
    placement = v_placement(p)
    costs = CostModel.from_device_totals(placement, segments=k)
    prefix = zbv_warm_steady(p, m, k)
    best: tuple[tuple[float, float], Schedule] | None = None
    for later in (True, False):
        sched = retail("seq-zbv", placement, m, k, prefix, costs, SegPolicy(later_first=later))
        key = _timing(sched, costs)
        if best is None or key < best[0]:
            best = key, sched
    assert best is not None
    return best[1]


def zbv_warm_steady(p: int, m: int, k: int) -> list[list[Action]]:
    """Each device's ZB-V order over units up to its last F (warm-up and steady state).

    F in unit order, B and W in backward order (microbatch by microbatch, each from its
    last segment), and ``k - 1`` more (up F, down F) pairs in the warm-up than ZB-V: a
    microbatch's first backward is its last segment's, so the loss side must run k units
    ahead. Built for enough whole microbatches to fill the warm-up; the extra ones are
    dropped, which keeps every dependency of the others.
    """
    mm = max(m, -(-(2 * p - 1 + k) // k))
    n = mm * k
    out = []
    for d in range(p):
        down, up = d, 2 * p - 1 - d  # first and second visit of the V
        o = _UnitOrder(mm, k)
        for _ in range(2 * (p - d) - 1):  # forwards of the down chunk until the V turns
            o.add(Op.F, down)
        for _ in range(d + k - 1):  # then up and down in turn, k - 1 pairs longer than ZB-V
            o.add(Op.F, up)
            o.add(Op.F, down)
        for _ in range(p - d):  # the up chunk's own backwards start
            for op in (Op.F, Op.B, Op.W):
                o.add(op, up)
        while o.count(Op.F, up) < n or o.count(Op.F, down) < n:  # steady: F, B, W per chunk
            if o.count(Op.F, down) < n:
                o.add(Op.F, down)
            o.add(Op.B, down)
            o.add(Op.W, down)
            if o.count(Op.F, up) < n:
                o.add(Op.F, up)
            o.add(Op.B, up)
            o.add(Op.W, up)
        real = [a for a in o.actions if a.mb < m * k]
        last_f = max(i for i, a in enumerate(real) if a.op is Op.F)
        out.append(real[: last_f + 1])
    return out


class _UnitOrder:
    """One device's action list, numbering units per (op, stage): F in forward order, B
    and W in backward order."""

    def __init__(self, num_microbatches: int, segments: int) -> None:
        bwd = backward_units(num_microbatches, segments)
        self.order = {Op.F: forward_units(num_microbatches, segments), Op.B: bwd, Op.W: bwd}
        self.actions: list[Action] = []
        self._next: dict[tuple[Op, int], int] = {}

    def add(self, op: Op, stage: int) -> None:
        i = self._next.get((op, stage), 0)
        self._next[op, stage] = i + 1
        self.actions.append(Action(op, stage, self.order[op][i]))

    def count(self, op: Op, stage: int) -> int:
        return self._next.get((op, stage), 0)


def retail(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    segments: int,
    prefix: list[list[Action]],
    costs: CostModel,
    policy: SegPolicy,
) -> Schedule:
    """``prefix`` (every F, in order) with the remaining B and W list-scheduled under
    ``costs``: a ready B first (``policy.later_first``: of the later stage), else the
    oldest pending W, in any gap."""
    policy = SegPolicy(later_first=policy.later_first, w_fill=True)
    p = max(placement) + 1
    rows = SegmentPass(
        placement, num_microbatches, segments, costs, float("inf"), policy, prefix
    ).run()
    assert rows is not None  # no F is left to block: every B and W can run
    return Schedule(
        name, p, len(placement), num_microbatches, placement, tuple(map(tuple, rows)), segments
    )


def _timing(schedule: Schedule, costs: CostModel) -> tuple[float, float]:
    res = simulate(schedule, costs)
    return float(res.cost), float(max(res.peak_memory))
