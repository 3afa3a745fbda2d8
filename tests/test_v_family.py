"""V-Min, V-Half, 1F1B-V and DualPipeV: validity, exact closed forms, and PyTorch's DualPipeV.

All figures are exact (Fraction costs, per-device totals F = B = W = 1, M_W = M_B/2):
1F1B's peak is P and its cost 3M + 3(P-1); ideal is 3M, so cost = 3M + bubble.
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

from conftest import exact_costs
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.generators.v_family import (
    _block_orders,
    _first_end,
    _reorder,
    _splice,
    one_f_one_b_v_block,
    v_half_block,
    v_min_block,
)
from zerobubble.schedule.ir import Action, Op, Schedule, v_placement
from zerobubble.schedule.validate import validate

KINDS = ("v-min", "v-half", "1f1b-v", "dualpipev")
GRID = [(p, m) for p in (2, 3, 4, 8) for m in sorted({1, p, 2 * p, 3 * p + 1, 4 * p})]
half = Fraction(1, 2)


def run(kind, p, m, **kw):
    sched = generate(kind, p, m, **kw)
    return validate(sched, costs=exact_costs(sched))


# ---- closed forms at F = B = W = 1 (steady state: M >= P, or M >= 2P where noted) ----------


def v_min_peak(p):
    return (p + 4) // 3 - (half if p % 3 == 2 else 0)


def v_min_bubble(p):
    return 0 if p == 1 else 2 * p - (3 if p % 3 == 0 else 5 * half)


def v_half_peak(p):
    return p // 2 + 1


def v_half_bubble(p):
    return {1: 0, 2: half}.get(p, 3 * ((p - 1) // 2) - half)


def v1_peak(p):
    return 2 * p // 3 + 1


def v1_bubble(p):
    return 0 if p == 1 else 5 * p * half - (7 * half, 5 * half, 3)[p % 3]


def dualpipev_peak(p):
    return p + half


def dualpipev_bubble(p):
    return (p - 1) * half


CLOSED = {  # kind -> (smallest M the form holds for, peak(P), bubble(P))
    "v-min": (lambda p: 4 if p == 3 else p, v_min_peak, v_min_bubble),
    "v-half": (lambda p: 2 * p if p in (4, 6) else p, v_half_peak, v_half_bubble),
    "1f1b-v": (lambda p: 2 * p, v1_peak, v1_bubble),
    "dualpipev": (lambda p: 2 * p, dualpipev_peak, dualpipev_bubble),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_valid_and_closed_forms_on_grid(kind, p, m):
    r = run(kind, p, m)
    min_m, peak, bubble = CLOSED[kind]
    if m >= min_m(p):
        assert max(r.peak_memory) == peak(p)
        assert r.bubble_time == bubble(p)
        assert r.cost == 3 * m + bubble(p)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("p", [1, 5, 6, 7, 9, 12])
def test_closed_forms_beyond_the_grid(kind, p):
    """The same forms on other P (every residue mod 2 and mod 3), at the smallest M they claim."""
    min_m, peak, bubble = CLOSED[kind]
    r = run(kind, p, min_m(p))
    assert (max(r.peak_memory), r.bubble_time) == (peak(p), bubble(p))


@pytest.mark.parametrize("p", [2, 3, 4, 8, 16])
def test_memory_against_1f1b(p):
    """V-Min ~ 1/3, V-Half ~ 1/2, 1F1B-V ~ 2/3 of 1F1B's peak, each within one microbatch."""
    m = 2 * p
    base = max(run("1f1b", p, m).peak_memory)
    assert base == p
    assert max(run("v-min", p, m).peak_memory) <= Fraction(base, 3) + 1
    assert max(run("v-half", p, m).peak_memory) <= Fraction(base, 2) + 1
    assert max(run("1f1b-v", p, m).peak_memory) <= Fraction(2 * base, 3) + 1
    # ... and all of them with less bubble than 1F1B's 3(P-1) (V-Half ~ 1/2, V-Min ~ 2/3).
    for kind in ("v-min", "v-half", "1f1b-v"):
        assert run(kind, p, m).bubble_time < 3 * (p - 1)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_one_microbatch_runs_the_v_chain(p):
    """M = 1: the cost is the chain of 4P chunk passes plus what trails it on device 0."""
    assert run("v-min", p, 1).cost == 2 * p + half  # 4P passes of 1/2, then W(down)
    assert run("v-half", p, 1).cost == 2 * p + half  # W(up) runs while the B come back
    assert run("1f1b-v", p, 1).cost == 3 * p  # 2P F of 1/2 and 2P BW of 1
    assert run("dualpipev", p, 1).cost == 5 * p * half + half


# ---- building blocks --------------------------------------------------------------------


def lifespans(block):
    """Slots from each chunk's F start to its backward's end, summed over the device's chunks."""
    start = {s: t for op, s, t in block if op is Op.F}
    end = {s: t + (2 if op is Op.BW else 1) for op, s, t in block if op is not Op.F}
    return sum(end[s] - start[s] for s in start)


def collision_free(blocks):
    for block in blocks:
        cells = [(t + k) % 6 for op, _, t in block for k in range(2 if op is Op.BW else 1)]
        if sorted(cells) != sorted(set(cells)):
            return False
    return True


@pytest.mark.parametrize("p", range(1, 40))
def test_blocks_fill_the_period_and_have_the_documented_lifespans(p):
    vmin, vhalf, v1 = v_min_block(p), v_half_block(p), one_f_one_b_v_block(p)
    assert collision_free(vmin) and collision_free(vhalf) and collision_free(v1)
    g_min, g_half = (2 if p % 3 == 0 else 0), (3 if p % 2 == 0 else 0)
    assert {lifespans(b) for b in vmin} == {4 * p + 2 + 2 * g_min}
    assert {lifespans(b) for b in vhalf} == {6 * p + 1 + 2 * g_half}
    assert max(lifespans(b) for b in v1) == 8 * p + (9, 1, 5)[p % 3]
    for up in (True, False):  # the backward chain's 2, 2, 5 rhythm (ends stretch when 3 | P)
        ts = sorted(t for block in v1 for op, s, t in block if op is Op.BW and (s >= p) == up)
        hops = [b - a for a, b in itertools.pairwise(ts)]
        inner = hops[1:] if up else hops[:-1]
        assert set(inner) <= {2, 5}
        assert all(sum(inner[k : k + 3]) == 9 for k in range(len(inner) - 2))


def test_colliding_block_is_caught():
    from zerobubble.schedule.generators.v_family import _check_block

    with pytest.raises(AssertionError, match="collides with itself on device 0"):
        _check_block([((Op.F, 0, 0), (Op.F, 1, 6))])


# ---- reorder and splice -----------------------------------------------------------------


@pytest.mark.parametrize(
    "block", [v_min_block, v_half_block, one_f_one_b_v_block], ids=["min", "half", "1f1b-v"]
)
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_spliced_orders_equal_the_full_reorder(block, p):
    """Beyond a few steady periods the order is spliced; it must be what reordering all gives."""
    blocks = block(p)
    base = -(-(_first_end(blocks) + 12) // 6) + 6
    for m in (base + 1, base + 5):
        assert _block_orders(blocks, m) == [[a for _, a in o] for o in _reorder(blocks, m)]


def test_splice_refuses_an_order_without_a_steady_state():
    order = [(t, Action(Op.F, 0, t)) for t in range(0, 24, 2)]  # one F every 2 slots: not 1/period
    with pytest.raises(AssertionError, match="no steady state at slot 6"):
        _splice(order, 6, 3)


@pytest.mark.parametrize("kind", ["v-min", "v-half", "1f1b-v"])
def test_closed_forms_at_scale(kind):
    """P = 24, M = 100 is built from a shorter reorder plus spliced periods: forms still exact."""
    _, peak, bubble = CLOSED[kind]
    r = run(kind, 24, 100)
    assert (max(r.peak_memory), r.cost) == (peak(24), 300 + bubble(24))


# ---- 1F1B-V's split backward ------------------------------------------------------------


@pytest.mark.parametrize(("p", "m"), [(3, 7), (4, 8)])
def test_1f1b_v_split_backward_is_b_then_w(p, m):
    fused = generate("1f1b-v", p, m)
    split = generate("1f1b-v", p, m, split_backward=True)
    assert not fused.uses_split_backward and split.uses_split_backward
    for d in range(p):
        expanded = []
        for a in fused.actions[d]:
            if a.op is Op.BW:
                expanded += [Action(Op.B, a.stage, a.mb), Action(Op.W, a.stage, a.mb)]
            else:
                expanded.append(a)
        assert list(split.actions[d]) == expanded
    a, b = validate(fused, costs=exact_costs(fused)), validate(split, costs=exact_costs(split))
    # Same peak; the gradient leaves after B instead of B+W, so never slower.
    assert max(a.peak_memory) == max(b.peak_memory) and b.cost <= a.cost


# ---- DualPipeV against PyTorch's listing ------------------------------------------------


def from_torch(p, m):
    """PyTorch's DualPipeV listing in our IR: F->F, I->B, W->W, B->BW, OVERLAP_F_B -> its parts."""
    ours = {"F": Op.F, "I": Op.B, "W": Op.W, "B": Op.BW}
    rows = []
    for rank_ops in get_schedule_ops("DualPipeV", p, m):
        row = []
        for a in rank_ops:
            if a is None:
                continue
            for x in a.sub_actions or (a,):
                row.append(
                    Action(ours[x.computation_type.value], x.stage_index, x.microbatch_index)
                )
        rows.append(row)
    return Schedule("torch:DualPipeV", p, 2 * p, m, v_placement(p), rows)


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p])
def test_dualpipev_matches_pytorch(p, m):
    ours, theirs = generate("dualpipev", p, m), from_torch(p, m)
    a = validate(ours, costs=exact_costs(ours))
    b = validate(theirs, costs=exact_costs(theirs))
    assert a.cost <= b.cost and max(a.peak_memory) == max(b.peak_memory)
    assert ours.actions == theirs.actions  # phase for phase the same order


def test_dualpipev_phases_on_the_last_rank():
    """P=2, M=4, rank 1 (stages 1 and 2): DeepSeek's steps 2, 4, 5, 6, 8 in our vocabulary."""
    sched = generate("dualpipev", 2, 4)
    got = [str(a) for a in sched.actions[1]]
    assert got == [
        # Step 2: nF0F1 (rank + 1 = 2 rounds)
        "F(s1,mb0)", "F(s2,mb0)", "F(s1,mb1)", "F(s2,mb1)",
        # Step 4: nF0B1F1B0 (M - 2P + rank + 1 = 1 round; the first pair is not overlapped)
        "F(s1,mb2)", "BW(s2,mb0)", "F(s2,mb2)", "BW(s1,mb0)",
        "F(s1,mb3)", "BW(s2,mb1)", "F(s2,mb3)", "BW(s1,mb1)",
        # Step 6: nB1B0, the second half zero-bubble (rank 1 is odd: both split at i = 1)
        "BW(s2,mb2)", "BW(s1,mb2)", "B(s2,mb3)", "B(s1,mb3)",
        # Step 8: nW, oldest first
        "W(s2,mb3)", "W(s1,mb3)",
    ]  # fmt: skip


# ---- registry and preconditions ---------------------------------------------------------


def test_registered_with_their_options():
    assert {k: GENERATORS[k].options for k in KINDS} == {
        "v-min": frozenset(),
        "v-half": frozenset(),
        "1f1b-v": frozenset({"split_backward"}),
        "dualpipev": frozenset({"overlap"}),
    }
    assert GENERATORS["1f1b-v"].baseline and not GENERATORS["v-half"].baseline
    for kind in KINDS:
        sched = generate(kind, 3, 6)
        assert sched.name == kind and sched.placement == v_placement(3)
        assert sched == generate(kind, 3, 6)  # pure


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("p", "m"), [(0, 4), (4, 0), (-1, 4), (4, 2.5)])
def test_bad_counts_are_rejected(kind, p, m):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        generate(kind, p, m)


@pytest.mark.parametrize("kind", ["v-min", "v-half", "dualpipev"])
def test_options_they_do_not_take_are_rejected(kind):
    with pytest.raises(ValueError, match=f"schedule kind '{kind}' does not take option"):
        generate(kind, 4, 8, split_backward=True)
