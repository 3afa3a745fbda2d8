"""The Zero Bubble paper's handcrafted schedules: ZB-H1, ZB-H2 and ZB-V.

ZB-H1 and ZB-H2 share one shape. In the steady state device ``i`` repeats the
triple ``(F_x, B_{x-k(P-1-i)}, W_{x-k(P-1)})`` for x = 0, 1, ...: each op
trails the forward by a fixed lag, and an index outside [0, M) is simply not
emitted. Warm-up and cool-down fall out of that rule. With k = 1 the device
holds at most P microbatches (1F1B's memory) and the bubble is
(P-1)(F+B-W); k = 2 puts twice as many forwards in flight to fill the warm-up
and defers 2(P-1) W into the tail, for a bubble of (P-1)(F+B-2W), zero when
F = B = W. Both formulas hold for M >= P (H1) and M >= 2P (H2) when W <= F, B.
"""

from __future__ import annotations

from zerobubble.schedule.generators.common import DeviceOrder, check_counts
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement


def _lagged(p: int, m: int, k: int, name: str) -> Schedule:
    actions = []
    for i in range(p):
        lags = ((Op.F, 0), (Op.B, k * (p - 1 - i)), (Op.W, k * (p - 1)))
        acts = []
        for x in range(m + k * (p - 1)):
            for op, lag in lags:
                if 0 <= x - lag < m:
                    acts.append(Action(op, i, x - lag))
        actions.append(acts)
    return Schedule(name, p, p, m, tuple(range(p)), tuple(tuple(acts) for acts in actions))


def zb_h1(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's peak memory (P microbatches on device 0), a third of its bubble.

    Device i delays each W by i microbatches after its B, so the W fill the
    cool-down. Any P, M >= 1; cost 3M + P - 1 at F = B = W = 1 for M >= P
    (for M < P the warm-up cannot be filled: cost 3M + 2(P-1) - (M-1)).
    """
    p, m = check_counts(num_devices, num_microbatches)
    return _lagged(p, m, 1, "zb-h1")


def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H2: zero bubble at F = B = W for M >= 2P, with up to 2P-1 microbatches in flight.

    Any P, M >= 1; for P <= M < 2P the warm-up runs out of forwards and the
    cost equals ZB-H1's.
    """
    p, m = check_counts(num_devices, num_microbatches)
    return _lagged(p, m, 2, "zb-h2")


def zbv(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-V: two chunks per device in a V (device d holds stages d and 2P-1-d).

    Zero bubble at F = B = W for M >= 2P with peak memory P (1F1B's), because
    a microbatch's forward ends and its backward starts on device 0. Any M >= 1:
    the order is built for max(M, 2P-1) microbatches and the extra ones are
    dropped, which keeps every dependency satisfied.
    """
    p, m = check_counts(num_devices, num_microbatches)
    n = max(m, 2 * p - 1)
    actions = []
    for d in range(p):
        down, up = d, 2 * p - 1 - d  # first and second visit of the V
        o = DeviceOrder()
        # Warm-up 1: forwards of the down chunk until the V's turn reaches us.
        for _ in range(2 * (p - d) - 1):
            o.add(Op.F, down)
        # Warm-up 2: the turn has reached us; alternate up and down forwards.
        for _ in range(d):
            o.add(Op.F, up)
            o.add(Op.F, down)
        # Warm-up 3: the up chunk's own backwards start (loss side of the V).
        for _ in range(p - d):
            for op in (Op.F, Op.B, Op.W):
                o.add(op, up)
        # Steady state: one F (while any are left), B and W of each chunk per round.
        while o.count(Op.F, up) < o.count(Op.F, down) or o.count(Op.F, down) < n:
            if o.count(Op.F, down) < n:
                o.add(Op.F, down)
            o.add(Op.B, down)
            o.add(Op.W, down)
            for op in (Op.F, Op.B, Op.W):
                o.add(op, up)
        # Cool-down: backwards first, their W fill the tail.
        for _ in range(d):
            o.add(Op.B, down)
            o.add(Op.B, up)
        for _ in range(p - d):
            o.add(Op.B, down)
            o.add(Op.W, down)
        for stage in (up, down):
            while o.count(Op.W, stage) < o.count(Op.B, stage):
                o.add(Op.W, stage)
        actions.append([a for a in o.actions if a.mb < m])
    return Schedule("zbv", p, 2 * p, m, v_placement(p), tuple(tuple(acts) for acts in actions))
