"""DeepSeek's DualPipeV: DualPipe "cut in half" onto the V placement.

Device r holds stage r (phase 0, the way down) and stage 2P-1-r (phase 1,
the way back); microbatches enter at device 0 and the loss is on device 0.

Vocabulary. In DualPipe a "B" is a *full* backward chunk (our BW); only when
zero-bubble mode is on for that chunk is it an input-gradient backward (our
B) whose weight gradient is queued and run later by a "W" (our W), oldest
first. An overlapped "F&B" pair (one microbatch's forward computing while
another's backward communicates its all-to-all, and the other way round) is the
F followed by the BW on the same device. With ``overlap=True`` they are listed in
``Schedule.overlaps``: the pairs of the main step and of step 5, as DualPipe and
PyTorch's ``ScheduleDualPipeV`` (its ``OVERLAP_F_B`` actions) pair them. A runtime
that does not overlap runs them one after the other. The simulator times a pair as
one block that starts once both inputs are in: under a cost model with an all-to-all
time (``CostModel.a2a``) each one's hides behind the other's compute; without one,
pairing only costs the F its earlier start (1/2 more bubble at F = B = W).
"""

from __future__ import annotations

from collections import deque

from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement


def dualpipev(num_devices: int, num_microbatches: int, *, overlap: bool = False) -> Schedule:
    """DualPipeV, phase for phase as in DeepSeek's ``dualpipev.py``.

    The order equals PyTorch's ``ScheduleDualPipeV`` listing. At F = B = W
    (per-device totals 1, M_W = M_B/2) and M >= 2P: cost 3M + (P-1)/2,
    peak memory P + 1/2 (1F1B: 3M + 3(P-1) and P).

    DeepSeek requires M >= 2P. Any M >= 1 works here: the order is built for
    max(M, 2P) microbatches and the extra ones are dropped, which keeps every
    dependency satisfied (the figures above then no longer hold).

    ``overlap``: list DualPipe's overlapped F&B pairs in ``Schedule.overlaps``.
    """
    p, m = check_counts(num_devices, num_microbatches)
    n = max(m, 2 * p)
    actions = []
    pairs: list[tuple[Action, Action]] = []
    for r in range(p):
        o = _DualOrder(down=r, up=2 * p - 1 - r)
        # Step 1: nF0
        for _ in range(2 * (p - r - 1)):
            o.f(o.down)
        # Step 2: nF0F1
        for _ in range(r + 1):
            o.f(o.down)
            o.f(o.up)
        # Step 3: nB1W1F1 (zero bubble: the W fills the wait for the next F1)
        for _ in range(p - r - 1):
            o.b(o.up, split=True)
            o.w()
            o.f(o.up)
        # Step 4 (main step): nF0B1F1B0, two overlapped F&B pairs per round (the last
        # device runs its first F0 and B1 apart: the B1 waits for that F0's result)
        for i in range(n - 2 * p + r + 1):
            o.f(o.down)
            o.b(o.up, overlap=not (i == 0 and r == p - 1))
            o.f(o.up)
            o.b(o.down, overlap=True)
        # Step 5: nB1F1B0, the F1 and B0 overlapped
        for _ in range(p - r - 1):
            o.b(o.up)
            o.f(o.up)
            o.b(o.down, overlap=True)
        # Step 6: nB1B0 (the second half switches to zero bubble)
        half = (r + 1) // 2
        for i in range(r + 1):
            o.b(o.up, split=i > half or (i == half and r % 2 == 1))
            o.b(o.down, split=i >= half)
        # Step 7: nWB0 (zero bubble)
        for _ in range(p - r - 1):
            o.w()
            o.b(o.down, split=True)
        # Step 8: nW
        while o.pending:
            o.w()
        actions.append([a for a in o.actions if a.mb < m])
        pairs.extend((f, b) for f, b in o.pairs if f.mb < m and b.mb < m)
    return Schedule(
        "dualpipev",
        p,
        2 * p,
        m,
        v_placement(p),
        tuple(tuple(acts) for acts in actions),
        overlaps=tuple(pairs) if overlap else (),
    )


class _DualOrder:
    """One device's order, its microbatch counters and DualPipe's queue of deferred W."""

    def __init__(self, down: int, up: int) -> None:
        self.down, self.up = down, up
        self.actions: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []  # overlapped (F, BW)
        self.pending: deque[Action] = deque()
        self._fwd = {down: 0, up: 0}
        self._bwd = {down: 0, up: 0}  # shared by BW and B: both are "the backward"

    def f(self, stage: int) -> None:
        self.actions.append(Action(Op.F, stage, self._fwd[stage]))
        self._fwd[stage] += 1

    def b(self, stage: int, split: bool = False, overlap: bool = False) -> None:
        """A full backward (BW), or with ``split`` its input half (B) with its W queued;
        ``overlap``: overlapped with the F just before it."""
        j = self._bwd[stage]
        self._bwd[stage] += 1
        self.actions.append(Action(Op.B if split else Op.BW, stage, j))
        if overlap:
            self.pairs.append((self.actions[-2], self.actions[-1]))
        if split:
            self.pending.append(Action(Op.W, stage, j))

    def w(self) -> None:
        """Run the oldest deferred weight gradient."""
        self.actions.append(self.pending.popleft())
