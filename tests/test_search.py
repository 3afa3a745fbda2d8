"""Schedule search: zb-auto, zbv-auto and the exact MILP."""

from __future__ import annotations

import dataclasses
import itertools
import random
from fractions import Fraction

import pytest

from zerobubble.schedule.costs import CostModel, CostSpec
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import (
    GENERATORS,
    generate,
    interleaved_1f1b,
    zb_h1,
    zb_h2,
    zbv,
)
from zerobubble.schedule.ir import Action, Op, Schedule, looped_placement, v_placement
from zerobubble.schedule.search import (
    ActionGraph,
    greedy,
    min_feasible_limit,
    optimal_search,
    run_pass,
    solve_optimal,
    zb_auto,
    zbv_auto,
)
from zerobubble.schedule.search.auto import GRID_1, GRID_V
from zerobubble.schedule.search.graph import OPS, direct_predecessors, predecessors
from zerobubble.schedule.search.milp import first_actions, first_starts
from zerobubble.schedule.simulate import simulate
from zerobubble.schedule.validate import validate


def realistic(rng: random.Random, num_stages: int, per_stage: float = 1.0) -> CostModel:
    """Uneven per-stage costs shaped like a profile: B ~ 1.2 F, W ~ 0.55 F, heavier ends.

    The first stage carries the embedding and the last the head and loss.
    """
    f = [rng.uniform(0.8, 1.2) * per_stage for _ in range(num_stages)]
    b = [rng.uniform(0.9, 1.4) * per_stage for _ in range(num_stages)]
    w = [rng.uniform(0.4, 0.9) * per_stage for _ in range(num_stages)]
    f[0] += rng.uniform(0, 0.3) * per_stage
    b[0] += rng.uniform(0, 0.3) * per_stage
    f[-1] += rng.uniform(0.2, 0.6) * per_stage
    b[-1] += rng.uniform(0.2, 0.6) * per_stage
    mem = [Fraction(1) * Fraction(per_stage).limit_denominator(4)] * num_stages
    return CostModel.per_stage(
        f, b, w, comm=rng.uniform(0, 0.1) * per_stage, mem_f=mem, mem_w=[x / 2 for x in mem]
    )


def exact(placement, F=1, B=1, W=1, comm=0) -> CostModel:
    return CostModel.from_device_totals(
        placement, Fraction(F), Fraction(B), Fraction(W), Fraction(comm)
    )


def _orders_of(schedule: Schedule) -> list[list[int]]:
    g = ActionGraph(schedule.placement, schedule.num_microbatches)
    return [[g.index(a.op, a.stage, a.mb) for a in acts] for acts in schedule.actions]


# ---- the exact search ----------------------------------------------------------------------


def _local_orders(device: int, m: int) -> list[list[Action]]:
    """Every order of one device's F/B/W keeping F(j) < B(j) < W(j); chains unordered."""
    out: list[list[Action]] = []

    def extend(prefix: list[Action], done: list[int]) -> None:  # done[j]: ops of j placed
        if len(prefix) == 3 * m:
            out.append(list(prefix))
            return
        for j in range(m):
            if done[j] < 3:
                prefix.append(Action((Op.F, Op.B, Op.W)[done[j]], device, j))
                done[j] += 1
                extend(prefix, done)
                done[j] -= 1
                prefix.pop()

    extend([], [0] * m)
    return out


@pytest.mark.parametrize(("P", "M", "seed"), [(2, 2, 0), (2, 2, 1), (1, 3, 2)])
def test_milp_equals_brute_force(P, M, seed):
    """The MILP optimum is the best cost ``simulate`` gives ANY order, not only in-order ones.

    This checks the model (disjunctions, memory via ordering binaries, fixed first
    starts) and the symmetry breaking (microbatches of one op and stage in order).
    """
    rng = random.Random(seed)
    costs = CostModel.per_stage(
        [rng.uniform(0.5, 2) for _ in range(P)],
        [rng.uniform(0.5, 2) for _ in range(P)],
        [rng.uniform(0.3, 1.5) for _ in range(P)],
        comm=rng.uniform(0, 0.3),
    )
    per_device = [_local_orders(d, M) for d in range(P)]
    for limit in (1, 1.5, 2):
        best = float("inf")
        for combo in itertools.product(*per_device):
            sched = Schedule("x", P, P, M, tuple(range(P)), combo)
            try:
                res = simulate(sched, costs)
            except ScheduleError:  # deadlock
                continue
            if max(res.peak_memory) <= limit + 1e-12:
                best = min(best, res.cost)
        incumbent = zb_auto(P, M, costs=CostSpec(stage_costs=costs), mem_limit=limit)
        opt = solve_optimal(incumbent, costs, limit)
        assert opt.proven
        assert opt.cost == pytest.approx(best, rel=1e-9)
        assert best * (1 - 2e-6) <= opt.lower_bound <= best
        validate(opt.schedule, limit, costs)


def test_optimal_generator_at_equal_costs():
    assert simulate(generate("optimal", 3, 6)).cost == 18  # default limit 2P: 3M
    assert simulate(generate("optimal", 3, 6, mem_limit=3)).cost == 20  # ZB-H1's 3M+P-1


def test_optimal_rejects_large_instances():
    with pytest.raises(ValueError, match="small instances"):
        generate("optimal", 16, 64)


# ---- the heuristic's pass is its own simulator ---------------------------------------------


@pytest.mark.parametrize("v_shape", [False, True])
def test_pass_times_equal_simulate(v_shape):
    """A pass's spans are bitwise the simulator's for the order it emits."""
    rng = random.Random(7)
    for P, M in [(2, 3), (3, 5), (4, 8)]:
        placement = v_placement(P) if v_shape else looped_placement(P, 1)
        costs = realistic(rng, len(placement), 0.5 if v_shape else 1.0)
        if M == 5:  # host tails (a message leaves before its producer's end) on one size
            costs = dataclasses.replace(
                costs,
                host_f=tuple(x * rng.uniform(0, 0.3) for x in costs.f),
                host_b=tuple(x * rng.uniform(0, 0.3) for x in costs.b),
                host_w=tuple(x * rng.uniform(0, 0.3) for x in costs.w),
            )
        g = ActionGraph(placement, M)
        for policy in GRID_V if v_shape else GRID_1:
            limit = float(min_feasible_limit(placement, costs)) * P
            p = run_pass(placement, M, costs, limit, policy)
            sched = Schedule(
                "x", P, len(placement), M, placement, [[g.actions[i] for i in o] for o in p.orders]
            )
            res = validate(sched, limit, costs)
            assert p.span == res.span
            assert p.peak == tuple(float(x) for x in res.peak_memory)


# ---- zb-auto --------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2, 3, 4, 6])
def test_zb_auto_equal_costs(P):
    """F=B=W: at limit 2P zero bubble (3M) once M >= 2P; at limit P ZB-H1's 3M+P-1 or better.

    M = P (no steady state) and M = 2P (the threshold of zero bubble) at every P; M = 3P, a
    longer steady state of the same bounds, at P = 2 and 3 only (M = 12 at P = 4 and 18 at
    P = 6 took seconds of search each for the bounds M = 2P already checks there)."""
    for M in (P, 2 * P, 3 * P) if P <= 3 else (P, 2 * P):
        costs = exact(looped_placement(P, 1))
        two = validate(zb_auto(P, M, mem_limit=2 * P), 2 * P, costs)
        if M >= 2 * P:
            assert two.cost == 3 * M
        assert two.cost <= simulate(zb_h2(P, M), costs).cost
        one = validate(zb_auto(P, M), P, costs)  # default limit: P
        assert one.cost <= 3 * M + P - 1
        assert max(one.peak_memory) <= P


# bench/bench_optimality.py certifies the full grid: P in 1..4, M in 1..6, limits P and 2P,
# 10 seeds of these costs = 480 instances, all proven; worst ratio to the MILP's lower bound
# 1.000001 (zb-auto equals the MILP optimum on all 480; never above zb-h1 / zb-h2). With
# --harsh costs (stages up to 4x apart) all 480 are within 1% too, worst 1.0066 (seed 9,
# P=4, M=6, limit 4). This is a seeded subset of the same instances (same rng seeding)
# that runs in seconds, plus the harsh instances that needed the perturbed restarts: each
# (P, M) once, the seeds alternating (each seed at P = 3 and P = 4), not every (P, M, seed).
NEAR_OPTIMAL_CASES = [
    (P, M, i % 2) for i, (P, M) in enumerate([(2, 5), (3, 4), (3, 6), (4, 5), (4, 6)])
]


@pytest.mark.parametrize(("P", "M", "seed"), NEAR_OPTIMAL_CASES)
def test_zb_auto_within_one_percent_of_milp(P, M, seed):
    """zb-auto <= 1.01 x the MILP's proven lower bound, and never above zb-h1 / zb-h2.

    Random uneven per-stage costs (``realistic``, seeded by (P, M, seed)); memory
    limits P (ZB-1p, compared with ZB-H1) and 2P (ZB-2p, compared with ZB-H2).
    Worst ratio on the ten-case subset this was cut from: 1.000001 (the MILP's bound is 1e-6
    below its optimum).
    """
    rng = random.Random(1000 * P + 10 * M + seed)
    costs = realistic(rng, P)
    spec = CostSpec(stage_costs=costs)
    for limit, hand in ((P, zb_h1(P, M)), (2 * P, zb_h2(P, M))):
        sched = zb_auto(P, M, costs=spec, mem_limit=limit)
        res = validate(sched, limit, costs)
        opt = solve_optimal(sched, costs, limit, time_limit=30)
        assert opt.proven
        assert res.cost <= 1.01 * opt.lower_bound
        assert res.cost <= simulate(hand, costs).cost + 1e-12


def harsh(rng: random.Random, num_stages: int) -> CostModel:
    """Stages up to 4x apart (bench_optimality.py --harsh)."""
    return CostModel.per_stage(
        [rng.uniform(0.5, 2) for _ in range(num_stages)],
        [rng.uniform(0.5, 2) for _ in range(num_stages)],
        [rng.uniform(0.3, 1.5) for _ in range(num_stages)],
        comm=rng.uniform(0, 0.3),
    )


@pytest.mark.parametrize(("P", "M", "seed"), [(3, 6, 7), (4, 6, 9), (4, 6, 0)])
def test_zb_auto_within_one_percent_of_milp_under_harsh_costs(P, M, seed):
    """The hardest harsh instances (one local optimum was 1.44% above before restarts)."""
    costs = harsh(random.Random(1000 * P + 10 * M + seed), P)
    sched = zb_auto(P, M, costs=CostSpec(stage_costs=costs), mem_limit=P)
    res = validate(sched, P, costs)
    opt = solve_optimal(sched, costs, P, time_limit=30)
    assert opt.proven
    assert res.cost <= 1.01 * opt.lower_bound


def test_optimal_v_is_reproducible_under_a_node_limit_and_reports_its_gap(capsys, monkeypatch):
    """A work limit, not a wall-clock one: the same input gives the same schedule, bound
    and gap on every run; the result and the CLI say what was proven. (With 60 s of
    wall clock it proved 2 of 8 small V instances, depending on the machine's load.)
    The second run is the CLI's own (its result caught on the way out), so one solve
    checks both the reproducibility and what the CLI prints."""
    from zerobubble.cli import main
    from zerobubble.schedule.search import milp

    spec = CostSpec(F=1, B=2, W=1, comm=1.0)
    a = optimal_search(3, 4, v_shape=True, costs=spec, mem_limit=2, node_limit=1)
    runs = []
    real = milp.optimal_search

    def spy(*args, **kwargs):
        runs.append(real(*args, **kwargs))
        return runs[-1]

    monkeypatch.setattr(milp, "optimal_search", spy)
    argv = "schedule optimal-v -p 3 -m 4 --costs F=1,B=2,W=1,comm=1.0 --mem-limit 2"
    assert main([*argv.split(), "--node-limit", "1"]) == 0
    assert a.summary() in capsys.readouterr().out.splitlines()
    [b] = runs
    assert a.schedule == b.schedule and a.schedule.name == "optimal-v"
    assert (a.cost, a.lower_bound, a.gap, a.nodes, a.stopped) == (
        b.cost,
        b.lower_bound,
        b.gap,
        b.nodes,
        b.stopped,
    )
    assert not a.proven and a.stopped == "node limit" and a.nodes == 1 and a.cost == 32.5
    assert a.lower_bound == pytest.approx(30.5, rel=1e-9)
    assert a.gap == pytest.approx(2 / 32.5, rel=1e-9)
    line = "optimal-v: cost 32.5, not proven optimal: lower bound 30.5, gap 6.15% (stopped at "
    assert a.summary().startswith(line)
    proven = optimal_search(2, 4, v_shape=True, costs=spec, node_limit=1)
    assert proven.proven and proven.gap == pytest.approx(1e-6) and proven.stopped is None
    assert (
        proven.summary()
        == "optimal-v: cost 17.5, proven optimal (gap 1e-06, the tolerance), 1 nodes"
    )


def test_zb_auto_is_deterministic():
    costs = CostSpec(stage_costs=realistic(random.Random(3), 4))
    a = zb_auto(4, 8, costs=costs, mem_limit=6)
    b = zb_auto(4, 8, costs=costs, mem_limit=6)
    assert a == b


# ---- zbv-auto -------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [2, 3, 4])
def test_zbv_auto_equal_costs_zero_bubble(P):
    placement = v_placement(P)
    for M in (2 * P, 3 * P):
        res = validate(zbv_auto(P, M), P, exact(placement))
        assert res.cost == 3 * M
        assert max(res.peak_memory) <= P


@pytest.mark.parametrize("seed", range(3))
def test_zbv_auto_uneven_no_worse_than_zbv(seed):
    rng = random.Random(seed)
    for P, M in [(2, 4), (3, 6), (4, 8)]:
        costs = realistic(rng, 2 * P, 0.5)
        hand = simulate(zbv(P, M), costs)
        limit = max(hand.peak_memory)
        res = validate(
            zbv_auto(P, M, costs=CostSpec(stage_costs=costs), mem_limit=limit), limit, costs
        )
        assert res.cost <= hand.cost + 1e-12


# ---- memory limits --------------------------------------------------------------------------


def test_infeasible_limit_names_the_smallest_feasible_one():
    with pytest.raises(ScheduleError, match="smallest feasible limit is 1 ") as err:
        zb_auto(4, 8, mem_limit=Fraction(1, 2))
    assert err.value.reason is Reason.MEMORY
    costs = CostModel.per_stage([1] * 6, [1] * 6, [1] * 6, mem_f=[1, 2, 3, 1, 1, 1])
    # V placement of P=3: device 1 holds stages 1 and 4 (2 + 1), device 2 stages 2 and 3 (3 + 1).
    with pytest.raises(ScheduleError, match="smallest feasible limit is 4 "):
        zbv_auto(3, 6, costs=CostSpec(stage_costs=costs), mem_limit=3.5)
    with pytest.raises(ValueError, match="finite number > 0"):
        zb_auto(2, 2, mem_limit=-1)


@pytest.mark.parametrize("v_shape", [False, True])
def test_smallest_feasible_limit_is_schedulable(v_shape):
    rng = random.Random(11)
    for P, M in [(2, 3), (3, 5), (4, 6)]:
        placement = v_placement(P) if v_shape else looped_placement(P, 1)
        base = realistic(rng, len(placement))
        costs = CostModel.per_stage(
            base.f, base.b, base.w, base.comm, mem_f=[rng.choice([1, 2, 3]) for _ in placement]
        )
        limit = min_feasible_limit(placement, costs)
        fn = zbv_auto if v_shape else zb_auto
        validate(fn(P, M, costs=CostSpec(stage_costs=costs), mem_limit=limit), limit, costs)


# ---- registry -------------------------------------------------------------------------------


def test_registered_kinds_take_costs_and_mem_limit():
    # chunks: interleaved; overlap: the searches pair where it pays
    assert GENERATORS["zb-auto"].options == frozenset({"costs", "mem_limit", "chunks", "overlap"})
    assert GENERATORS["optimal"].options == frozenset({"costs", "mem_limit", "chunks"})
    # chunks: at most v; max_stages: the layer count; segments: at most K per microbatch
    assert GENERATORS["auto"].options == frozenset(
        {"costs", "mem_limit", "chunks", "max_stages", "time_budget_s", "overlap", "segments"}
    )
    assert GENERATORS["zbv-auto"].options == frozenset({"costs", "mem_limit", "overlap"})
    assert GENERATORS["optimal-v"].options == frozenset({"costs", "mem_limit"})
    with pytest.raises(ValueError, match="does not take option 'chunks'"):
        generate("zbv-auto", 4, 8, chunks=2)


@pytest.mark.parametrize("chunks", [2, 3])
def test_zb_auto_interleaved(chunks):
    """chunks > 1: looped placement; beats split interleaved 1F1B, works at the tightest limit."""
    rng = random.Random(chunks)
    for P, M in [(2, 4), (4, 8)]:
        placement = looped_placement(P, chunks)
        base = realistic(rng, len(placement), 1 / chunks)
        costs = CostModel.per_stage(
            base.f, base.b, base.w, base.comm, mem_f=[rng.choice([1, 2]) for _ in placement]
        )
        spec = CostSpec(stage_costs=costs)
        hand = interleaved_1f1b(P, M, chunks=chunks, split_backward=True)
        limit = max(simulate(hand, costs).peak_memory)
        sched = generate("zb-auto", P, M, chunks=chunks, costs=spec, mem_limit=limit)
        assert sched.placement == placement
        assert validate(sched, limit, costs).cost <= simulate(hand, costs).cost
        tight = min_feasible_limit(placement, costs)
        validate(zb_auto(P, M, chunks=chunks, costs=spec, mem_limit=tight), tight, costs)


def test_mem_limit_from_costs_file_and_explicit_override():
    costs = realistic(random.Random(5), 4)
    from_file = CostSpec(stage_costs=costs, mem_limit=4)
    tight = generate("zb-auto", 4, 12, costs=from_file)
    loose = generate("zb-auto", 4, 12, costs=from_file, mem_limit=8)
    assert max(simulate(tight, costs).peak_memory) <= 4
    assert max(simulate(loose, costs).peak_memory) > 4
    assert simulate(loose, costs).cost < simulate(tight, costs).cost


def test_default_costs_are_uniform():
    assert simulate(generate("zb-auto", 4, 8)).cost == 27  # ZB-1p = ZB-H1 at F=B=W
    assert simulate(generate("zbv-auto", 4, 8)).cost == 24


def test_incremental_timing_equals_full_simulation():
    """The local search re-simulates only what a move can affect; check it against a full run."""
    from zerobubble.schedule.search.refine import Evaluator

    rng = random.Random(4)
    P, M = 4, 6
    costs = realistic(rng, P)
    costs = dataclasses.replace(  # host tails: a message leaves before its producer ends
        costs, host_f=tuple(x * rng.uniform(0, 0.3) for x in costs.f)
    )
    g = ActionGraph(looped_placement(P, 1), M)
    ev = Evaluator(g, costs)
    orders = _orders_of(zb_h1(P, M))
    base = ev.timing(orders)
    checked = 0
    for _ in range(300):
        d = rng.randrange(P)
        i, k = sorted(rng.sample(range(len(orders[d])), 2))
        trial = [list(o) for o in orders]
        trial[d].insert(i, trial[d].pop(k))
        full = ev.timing(trial)
        part = ev.timing(trial, base, d, i)
        assert (full is None) == (part is None)
        if full is not None:
            assert part.spans == full.spans
            assert part.end == full.end
            sched = Schedule("x", P, P, M, g.placement, [[g.actions[i] for i in o] for o in trial])
            assert tuple(full.spans) == tuple(float(x) for x in simulate(sched, costs).span)
            checked += 1
    assert checked > 20


# ---- the searches follow the dependency rule (schedule.deps) --------------------------------


def test_direct_predecessors_drop_only_implied_needs():
    """B(s)'s F(s) is implied by B(s+1) (through F(s+1)); the last B keeps it."""
    assert direct_predecessors(3) == {
        (Op.F, 0): (),
        (Op.F, 1): ((Op.F, 0),),
        (Op.F, 2): ((Op.F, 1),),
        (Op.B, 0): ((Op.B, 1),),
        (Op.B, 1): ((Op.B, 2),),
        (Op.B, 2): ((Op.F, 2),),
        (Op.W, 0): ((Op.B, 0),),
        (Op.W, 1): ((Op.B, 1),),
        (Op.W, 2): ((Op.B, 2),),
    }
    assert predecessors(Op.B, 1, 3) == ((Op.F, 1), (Op.B, 2))


@pytest.mark.parametrize("v_shape", [False, True])
def test_pass_is_the_same_on_the_unreduced_rule(monkeypatch, v_shape):
    """The pass on every need of the rule (several per B: its bounds recurse) emits
    bitwise what it does on the reduced needs."""
    rng = random.Random(11)
    cases = []
    for P, M in [(2, 3), (3, 7), (4, 9)]:
        placement = v_placement(P) if v_shape else looped_placement(P, 2)
        costs = realistic(rng, len(placement), 0.5)
        limit = float(min_feasible_limit(placement, costs)) * P
        for policy in GRID_V:
            cases.append((placement, M, costs, limit, policy))
    reduced = [run_pass(*c) for c in cases]
    monkeypatch.setattr(
        greedy,
        "direct_predecessors",
        lambda S: {(op, s): predecessors(op, s, S) for op in OPS for s in range(S)},
    )
    assert [run_pass(*c) for c in cases] == reduced
    assert all(p is not None for p in reduced)


def test_first_starts_follow_the_forward_chain():
    """T0 of each device: the uncontended chain of dependencies into its first action."""
    costs = CostModel.per_stage([1, 2, 4], [1, 1, 1], [1, 1, 1], comm=0.5)
    g = ActionGraph((0, 1, 2), 2)
    assert first_actions(g) == [g.index(Op.F, s, 0) for s in range(3)]
    assert first_starts(g, costs) == [0.0, 1.5, 4.0]
    v = ActionGraph(v_placement(2), 2)  # device 0 holds stages 0 and 3, device 1 stages 1, 2
    vcosts = CostModel.per_stage([3, 1, 1, 1], [1] * 4, [1] * 4, comm=0.25)
    assert first_actions(v) == [v.index(Op.F, 0, 0), v.index(Op.F, 1, 0)]
    assert first_starts(v, vcosts) == [0.0, 3.25]
    with pytest.raises(ValueError, match="distinct devices"):
        first_actions(ActionGraph((0, 0, 1), 2))


def test_a_seed_at_the_work_floor_is_returned_without_polishing(monkeypatch):
    """ZB-V at P=3, M=6 with F = B = W per device has no bubble: its cost is the busiest
    device's work back to back (3M = 18), which no order can beat, so the local search
    (which keeps only strictly cheaper orders) is skipped; at the smallest feasible memory
    limit zero bubble is out of reach and the search polishes."""
    from zerobubble.schedule.search import auto as auto_mod
    from zerobubble.schedule.search.refine import Evaluator

    calls = []
    real = auto_mod.refine
    monkeypatch.setattr(auto_mod, "refine", lambda *a, **k: calls.append(1) or real(*a, **k))
    sched = zbv_auto(3, 6)
    assert simulate(sched).cost == 18 and calls == []
    costs = CostSpec().resolve(sched.placement)
    assert auto_mod.work_floor(Evaluator(ActionGraph(sched.placement, 6), costs)) == 18
    assert auto_mod.at_floor(18 + 1e-13, 18) and not auto_mod.at_floor(18.001, 18)
    tight = zbv_auto(3, 6, mem_limit=float(min_feasible_limit(sched.placement, costs)))
    assert simulate(tight).cost > 18 and calls


def test_zbv_auto_reaches_the_proven_optimum_of_issue_46():
    """P=3, M=6, F=1, B=2, W=1, comm=1 per device, limit 1.5 on the V: the search stopped
    at 66.5, whose steady state differs from the optimum's on every device (no one move,
    nor two, is cheaper, and changing one device's periods alone costs the same or more).
    Kicks of translated moves (one move for every microbatch of an op and stage), going on
    from kicks that cost no more, reach 64.5, the optimum ``optimal-v --node-limit 5000``
    proves (80 s of CPU; ``bench_optimality.py --check``). ``auto`` runs this search on the
    V, so it finds 64.5 or less."""
    sched = zbv_auto(3, 6, costs=CostSpec(F=1, B=2, W=1, comm=1), mem_limit=1.5)
    res = validate(
        sched, mem_limit=1.5, costs=CostSpec(F=1, B=2, W=1, comm=1).resolve(sched.placement)
    )
    assert res.cost == 64.5 and max(res.peak_memory) <= 1.5


def test_translated_kicks_move_every_microbatch_and_are_seeded():
    """A translated move moves each microbatch of one op and stage the same number of
    places (those that can); the caller's seeded generator makes a kick the same on every
    run, and ``translate=0`` draws exactly the moves it drew before translated moves."""
    from zerobubble.schedule.search.refine import Evaluator, _translated, perturb

    sched = zbv(3, 6)
    costs = CostSpec().resolve(sched.placement)
    graph = ActionGraph(sched.placement, 6)
    orders = [list(o) for o in graph.orders_of(sched.actions)]
    ev = Evaluator(graph, costs)
    lst = orders[0]
    w0 = graph.index(Op.W, 0, 0)  # device 0 holds stages 0 and 5; W(0, j) for j = 0..5
    new = _translated(ev, lst, w0 + 3, 1)  # any microbatch names the chain
    assert new is not None and sorted(new) == sorted(lst)
    shift = [new.index(w0 + j) - lst.index(w0 + j) for j in range(6)]
    assert shift.count(1) >= 2 and set(shift) <= {0, 1}  # each W(0, j) one place later, or kept
    kicks = [perturb(graph, costs, 10, orders, random.Random(7), 2, 1.0) for _ in range(2)]
    assert kicks[0] == kicks[1] and kicks[0] is not None and kicks[0] != orders
    plain = perturb(graph, costs, 10, orders, random.Random(7), 2)
    assert plain == perturb(graph, costs, 10, orders, random.Random(7), 2, 0.0)


def test_milp_root_time_limit_returns_the_incumbent_with_its_gap():
    """No node limit bounds HiGHS's root node (presolve, root LP, cuts): at P=4, M=8 with
    two looped chunks it takes seconds, and larger roots took minutes. A root that does
    not finish within ``root_time_limit`` returns the incumbent, unproven, with the best
    bound known (here the busiest device's work, 32, at least) and its gap."""
    import time

    costs = CostSpec(F=1, B=2, W=1, comm=0.1)
    inc = split_backward_of(interleaved_1f1b(4, 8, chunks=2))
    model = costs.resolve(inc.placement)
    t0 = time.monotonic()
    res = solve_optimal(inc, model, 8, root_time_limit=0.2)
    assert time.monotonic() - t0 < 20  # the root alone takes longer (several seconds)
    assert not res.proven and res.stopped == "root time limit" and res.nodes is None
    assert res.cost == float(simulate(inc, model).cost) == pytest.approx(37.5)
    assert 32 <= res.lower_bound < res.cost
    assert res.gap == pytest.approx((res.cost - res.lower_bound) / res.cost)
    assert "stopped at the root time limit" in res.summary()


def test_milp_past_the_root_is_reproducible():
    """Where the root finishes in time the solve goes on to its node limit without a clock
    (the root again, then the nodes), so two runs give the same schedule, bound and nodes."""
    spec = CostSpec(F=1, B=2, W=1, comm=1)
    placement = v_placement(2)
    model = spec.resolve(placement)
    seed = run_pass(placement, 4, model, 1, GRID_V[0])  # the list scheduler's pass
    assert seed is not None
    graph = ActionGraph(placement, 4)
    rows = tuple(tuple(graph.actions[i] for i in o) for o in seed.orders)
    inc = Schedule("pass", 2, 4, 4, placement, rows)
    a, b = (solve_optimal(inc, model, 1, node_limit=5) for _ in range(2))
    assert a.schedule == b.schedule and a.stopped == b.stopped == "node limit"
    assert (a.cost, a.lower_bound, a.nodes) == (b.cost, b.lower_bound, b.nodes)
    assert a.nodes == 5 and a.cost == 33 and a.lower_bound == pytest.approx(31.62585034, rel=1e-8)


def split_backward_of(sched: Schedule) -> Schedule:
    from zerobubble.schedule.search.auto import split_backward

    return split_backward(sched)
