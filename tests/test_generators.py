"""Closed forms of the classic and handcrafted zero-bubble schedules (exact arithmetic)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from conftest import exact_costs
from generated import generated
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.ir import Op, looped_placement, v_placement
from zerobubble.schedule.validate import validate

GRID = [(p, m) for p in (2, 3, 4, 8) for m in (p, 2 * p, 3 * p + 1, 4 * p)]


def run(kind, p, m, **kw):
    costs_kw = {k: kw.pop(k) for k in ("F", "B", "W", "comm") if k in kw}
    sched = generate(kind, p, m, **kw)
    return validate(sched, costs=exact_costs(sched, **costs_kw))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_1f1b_and_gpipe(p, m):
    r = run("1f1b", p, m)
    assert r.cost == 3 * (m + p - 1)
    assert r.peak_memory[0] == p
    g = run("gpipe", p, m)
    assert g.cost == 3 * (m + p - 1)
    assert g.peak_memory[0] == m


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1(p, m):
    r = run("zb-h1", p, m)
    assert r.cost == 3 * m + (p - 1)
    assert max(r.peak_memory) == p  # 1F1B's peak, reached on device 0
    assert r.peak_memory[0] == p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p])
def test_zb_h2_zero_bubble(p, m):
    r = run("zb-h2", p, m)
    assert r.cost == 3 * m
    assert r.bubble_time == 0
    assert max(r.peak_memory) == 2 * p - 1


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m >= 2 * p])
def test_zbv_zero_bubble_at_1f1b_memory(p, m):
    r = run("zbv", p, m)
    assert r.cost == 3 * m
    assert max(r.peak_memory) == p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if m % p == 0])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble(p, m, v):
    r = run("interleaved-1f1b", p, m, chunks=v)
    assert r.bubble_time == Fraction(3 * (p - 1), v)
    # Megatron's warm-up of 2(P-1) + (v-1)P chunk forwards, plus the first steady one.
    assert r.peak_memory[0] == Fraction(min(2 * (p - 1) + (v - 1) * p + 1, m * v), v)


@pytest.mark.parametrize(
    ("F", "B", "W"),
    [(2, 2, 1), (1, 1, Fraction(1, 2)), (3, 2, 1), (1, 2, 1), (2, 1, 1), (1, 3, 1), (1, 1, 1)],
)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_unequal_cost_bubble_formulas(F, B, W, p):
    """The paper's formulas hold whenever W <= F and W <= B (and M large enough)."""
    m = 4 * p
    h1 = run("zb-h1", p, m, F=F, B=B, W=W)
    assert h1.bubble_time == (p - 1) * (F + B - W)
    h2 = run("zb-h2", p, m, F=F, B=B, W=W)
    assert h2.bubble_time == (p - 1) * (F + B - 2 * W)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_small_m_documented_values(p):
    """What each schedule reaches for M < P (F=B=W=1): the docs quote these."""
    for m in range(1, p):
        assert run("1f1b", p, m).cost == 3 * (m + p - 1)
        assert run("zb-h1", p, m).cost == 3 * m + 2 * (p - 1) - (m - 1)
        assert run("zb-h2", p, m).cost == run("zb-h1", p, m).cost
        assert run("zbv", p, m).cost == 3 * m + 2 * (p - 1) - (m - 1)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "interleaved-1f1b"])
def test_split_backward_sends_gradients_before_w(kind):
    fused = generate(kind, 4, 9)
    split = generate(kind, 4, 9, split_backward=True)
    assert not fused.uses_split_backward and split.uses_split_backward
    a, b = validate(fused, costs=exact_costs(fused)), validate(split, costs=exact_costs(split))
    # The gradient leaves after B instead of after B+W: the backward chain shortens
    # by W per hop, so the drain is (P-1)W shorter for the single-chunk baselines.
    if kind == "interleaved-1f1b":
        assert b.cost < a.cost
    else:
        assert b.cost == a.cost - 3
    # B then W right away: each BW became exactly [B, W].
    for d in range(4):
        expanded = []
        for act in fused.actions[d]:
            expanded += (
                [(Op.B, act.stage, act.mb), (Op.W, act.stage, act.mb)]
                if act.op is Op.BW
                else [(act.op, act.stage, act.mb)]
            )
        assert [(x.op, x.stage, x.mb) for x in split.actions[d]] == expanded


def test_placements():
    assert generate("interleaved-1f1b", 3, 3, chunks=2).placement == looped_placement(3, 2)
    assert looped_placement(3, 2) == (0, 1, 2, 0, 1, 2)
    assert generate("zbv", 3, 6).placement == v_placement(3) == (0, 1, 2, 2, 1, 0)


#: Small and odd (P, M) points for every kind. The exact (MILP) kinds take P=5 at M=P
#: instead of M=2P+1, where optimal-v's solve alone is about 40 s of CPU; their M=2P+1
#: schedules are validated at P <= 4 by test_passes' every-kind sweep.
EXACT_KINDS = ("optimal", "optimal-v")
ODD_CASES = [
    (kind, p, p if p == 5 and kind in EXACT_KINDS else m)
    for kind in GENERATORS
    for p, m in [(1, 1), (1, 3), (2, 1), (3, 2), (4, 3), (5, 11)]
]


#: ``auto`` takes at most two chunks here, as in the every-kind sweeps (test_lowering,
#: test_replay, test_executor), whose schedules at these sizes it then shares: its default of
#: four (seconds a solve at every size) is validated by test_fuzz_schedule and test_deps.
AUTO_OPTS = {"chunks": 2}


@pytest.mark.parametrize(("kind", "p", "m"), ODD_CASES)
def test_every_kind_valid_for_small_and_odd_cases(kind, p, m):
    try:
        sched = generated(kind, p, m, **(AUTO_OPTS if kind == "auto" else {}))
    except ValueError as exc:  # a documented precondition: the message must say what to change
        assert str(exc)
        return
    validate(sched)
    assert (sched.num_devices, sched.num_microbatches) == (p, m)


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_bad_counts_are_rejected(bad):
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        generate("1f1b", bad, 4)
    with pytest.raises(ValueError, match="must be an integer >= 1"):
        generate("zb-h1", 4, bad)


def test_unknown_kind_and_option():
    with pytest.raises(ValueError, match="unknown schedule kind 'zb-h9'"):
        generate("zb-h9", 4, 4)
    with pytest.raises(ValueError, match="does not take option 'chunks'"):
        generate("zb-h1", 4, 4, chunks=2)
    with pytest.raises(ValueError, match="chunks >= 2"):
        generate("interleaved-1f1b", 4, 4, chunks=1)


def test_generators_are_pure():
    a, b = generate("zbv", 4, 8), generate("zbv", 4, 8)
    assert a == b and a is not b
    with pytest.raises(AttributeError):
        a.num_devices = 3  # frozen


def test_the_kind_table_is_fixed_and_read_only():
    from zerobubble.schedule import generators

    assert [g.name for g in generators._KINDS] == list(GENERATORS)  # no name given twice
    assert not hasattr(generators, "register")
    with pytest.raises(TypeError):
        GENERATORS["mine"] = GENERATORS["1f1b"]  # type: ignore[index]
