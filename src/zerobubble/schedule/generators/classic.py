"""Schedules that predate the B/W split: GPipe, 1F1B and interleaved 1F1B.

They run a combined backward (BW). ``split_backward=True`` replaces each BW
by B immediately followed by W (same timing, finer memory accounting and the
same action vocabulary as the zero-bubble schedules).
"""

from __future__ import annotations

from zerobubble.schedule.generators.common import check_counts, emit_backward
from zerobubble.schedule.ir import Action, Op, Schedule, looped_placement


def gpipe(num_devices: int, num_microbatches: int, *, split_backward: bool = False) -> Schedule:
    """All forwards, then all backwards (in microbatch order).

    Any P >= 1, M >= 1. Peak memory M (every microbatch is in flight at once).
    """
    p, m = check_counts(num_devices, num_microbatches)
    actions = []
    for d in range(p):
        acts = [Action(Op.F, d, j) for j in range(m)]
        for j in range(m):
            acts += emit_backward(d, j, split_backward)
        actions.append(acts)
    return Schedule("gpipe", p, p, m, tuple(range(p)), tuple(tuple(acts) for acts in actions))


def one_f_one_b(
    num_devices: int, num_microbatches: int, *, split_backward: bool = False
) -> Schedule:
    """1F1B (PipeDream-Flush): warm up with P-1-d forwards, then alternate F and BW.

    Any P >= 1, M >= 1. Same bubble as GPipe, but at most min(P-d, M)
    microbatches are in flight on device d.
    """
    p, m = check_counts(num_devices, num_microbatches)
    actions = []
    for d in range(p):
        warmup = min(p - 1 - d, m)
        acts = [Action(Op.F, d, j) for j in range(warmup)]
        for j in range(m - warmup):  # steady: one F, one backward
            acts.append(Action(Op.F, d, warmup + j))
            acts += emit_backward(d, j, split_backward)
        for j in range(m - warmup, m):  # cool-down
            acts += emit_backward(d, j, split_backward)
        actions.append(acts)
    return Schedule("1f1b", p, p, m, tuple(range(p)), tuple(tuple(acts) for acts in actions))


def interleaved_1f1b(
    num_devices: int,
    num_microbatches: int,
    *,
    chunks: int = 2,
    split_backward: bool = False,
) -> Schedule:
    """Megatron's interleaved 1F1B with ``chunks`` (v) model chunks per device.

    Looped placement: stage s lives on device s % P. Microbatches go through the
    chunks in groups of P (the last group may be smaller), so any M >= 1 works;
    the textbook bubble (P-1)(F+B+W)/v holds when M is a multiple of P.
    """
    p, m = check_counts(num_devices, num_microbatches)
    if chunks < 2:
        raise ValueError(
            f"interleaved-1f1b needs chunks >= 2 (got {chunks}); use 1f1b for one chunk"
        )
    v = chunks
    groups = _groups(p, m)
    order = [(c, j) for g in groups for c in range(v) for j in g]  # (chunk, mb) visit order
    actions = []
    for d in range(p):
        # Megatron's warm-up: enough forwards that the first backward of the last
        # chunk can arrive without stalling, capped by the work available.
        warmup = min((p - d - 1) * 2 + (v - 1) * len(groups[0]), m * v)
        fwd = [Action(Op.F, c * p + d, j) for c, j in order]
        bwd = [((v - 1 - c) * p + d, j) for c, j in order]
        actions.append(merge_1f1b(fwd, bwd, warmup, split_backward))
    return Schedule(
        "interleaved-1f1b",
        p,
        p * v,
        m,
        looped_placement(p, v),
        tuple(tuple(acts) for acts in actions),
    )


def _groups(p: int, m: int) -> list[range]:
    """Split microbatches into max(1, M // P) consecutive groups of near-equal size.

    Each group goes through all chunks before the next group starts; groups of
    at least P microbatches keep the last chunk fed (larger groups come first).
    """
    n = max(1, m // p)
    base, extra = divmod(m, n)
    out, lo = [], 0
    for k in range(n):
        hi = lo + base + (1 if k < extra else 0)
        out.append(range(lo, hi))
        lo = hi
    return out


def merge_1f1b(
    fwd: list[Action], bwd: list[tuple[int, int]], warmup: int, split: bool
) -> list[Action]:
    """Warm-up forwards, then one F / one backward, then the remaining backwards.

    A backward whose forward has not been emitted yet pulls that forward in
    first, so the device order always respects F(s,j) -> backward(s,j).
    """
    acts = list(fwd[:warmup])
    emitted = {(a.stage, a.mb) for a in acts}
    nf = warmup
    for s, j in bwd:
        if nf < len(fwd):
            acts.append(fwd[nf])
            emitted.add((fwd[nf].stage, fwd[nf].mb))
            nf += 1
        while (s, j) not in emitted:
            acts.append(fwd[nf])
            emitted.add((fwd[nf].stage, fwd[nf].mb))
            nf += 1
        acts += emit_backward(s, j, split)
    return acts
