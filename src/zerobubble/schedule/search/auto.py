"""The search of the automatic zero-bubble schedulers: ``zb-auto`` (one stage per device, or
interleaved with ``chunks``) and ``zbv-auto`` (V placement, two stages per device), whose
entry points are in :mod:`.fixed`.

Both run the same search, a deterministic pure function of its inputs:

1. one pass of the list-scheduling heuristic (:mod:`.greedy`) per point of a
   grid over its choices (looped multi-chunk placements add round-order passes);
2. the matching handcrafted schedules (ZB-H1 and ZB-H2, interleaved 1F1B and
   the interleaved zero-bubble family of :mod:`.templates`, or ZB-V and
   DualPipeV) join as candidates when they fit the memory limit, so the search
   never returns anything worse than them;
3. every distinct candidate, cheapest first, is polished by local search
   (:mod:`.refine`) within a shared budget of simulated actions; instances too
   large for the budget to cover REFINE_MIN_RUNS full simulations skip steps
   3 to 5, and there a pass stops as soon as it cannot beat the best one so far;
4. restarts: seeded random kicks of the best orders, polished again;
5. a plateau walk (moves that keep the cost but end the Bs sooner in sum) and a
   last polish, which shortens a critical backward chain held up by Ws on
   several devices at once (no single move helps there).

The placement search ``auto`` (:mod:`.placement`) runs this per placement.

The memory limit is per device, in the units of the cost model's ``mem_f``
(with the default costs: one microbatch's activations on a whole device,
M_B). A limit below one microbatch's M_B on some device cannot be met by any
schedule; the error names the smallest feasible limit.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from itertools import chain

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators.classic import interleaved_1f1b
from zerobubble.schedule.generators.dualpipe import dualpipev
from zerobubble.schedule.generators.zero_bubble import zb_h1, zb_h2, zbv
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.search.graph import ActionGraph, min_feasible_limit
from zerobubble.schedule.search.greedy import Policy, run_pass
from zerobubble.schedule.search.pairs import (
    PairEvaluator,
    decode,
    encode,
    perturb_pairs,
    refine_pairs,
)
from zerobubble.schedule.search.refine import Evaluator, perturb, refine
from zerobubble.schedule.search.templates import interleaved_family

#: Grid for one stage per device. Chosen from every combination of the choices
#: (f_first x f_overrun x w_overrun x inflight in {0, 1, 2}) as the smallest set
#: that keeps the best of the full grid on seeded random instances (bench_grid.py
#: --grid reruns that study). Ordered so that likely winners come first and prune
#: the rest.
GRID_1: tuple[Policy, ...] = (
    Policy(f_first=False, f_overrun=True, w_overrun=True, inflight=2),
    Policy(f_first=True, f_overrun=True, w_overrun=False, inflight=1),
    Policy(f_first=True, f_overrun=True, w_overrun=True, inflight=1),
    Policy(f_first=True, f_overrun=False, w_overrun=False, inflight=1),
    Policy(f_first=False, f_overrun=True, w_overrun=False, inflight=2),
    Policy(f_first=True, f_overrun=False, w_overrun=True, inflight=1),
    Policy(f_first=False, f_overrun=False, w_overrun=False, inflight=0),
)

#: Grid for several stages per device (V or looped placement), chosen the same way from
#: f_first x f_overrun x w_overrun x later_first x inflight in {0, 1}.
GRID_V: tuple[Policy, ...] = (
    Policy(f_first=True, f_overrun=True, w_overrun=True, later_first=True, inflight=1),
    Policy(f_first=False, f_overrun=True, w_overrun=True, later_first=True, inflight=0),
    Policy(f_first=True, f_overrun=True, w_overrun=False, later_first=True, inflight=1),
    Policy(f_first=False, f_overrun=True, w_overrun=True, later_first=False, inflight=0),
    Policy(f_first=True, f_overrun=False, w_overrun=True, later_first=True, inflight=0),
    Policy(f_first=True, f_overrun=False, w_overrun=False, later_first=True, inflight=1),
)

#: Extra passes for looped placements with several chunks: the interleaved round order,
#: each with rounds of P, ceil(P/2) and 1 microbatches (smaller rounds fit tighter limits).
GRID_ROUNDS: tuple[Policy, ...] = (
    Policy(f_first=True, f_overrun=False, w_overrun=True, inflight=1),
    Policy(f_first=False, f_overrun=True, w_overrun=False, inflight=0),
    Policy(f_first=False, f_overrun=True, w_overrun=True, inflight=0),
)


def round_grid(num_devices: int) -> tuple[Policy, ...]:
    """GRID_ROUNDS with every round size for P devices."""
    sizes = sorted({num_devices, (num_devices + 1) // 2, 1}, reverse=True)
    return tuple(replace(pol, rounds=g) for g in sizes for pol in GRID_ROUNDS)


#: Actions the local search may simulate, over all its trials and starting points.
REFINE_STEPS = 3_000_000
#: The local search runs only if its budget covers this many full simulations.
REFINE_MIN_RUNS = 200
#: Restarts of the local search from perturbed best orders, and the simulated actions
#: they may spend (so they matter on small instances and cost little on large ones).
KICKS = 400
KICK_STEPS = 3_000_000
#: The share of a kick's moves that are translated (:func:`.refine.perturb`: one move made
#: for every microbatch of an op and stage; a single move where that cannot be). Not in
#: the search with pairs, whose kicks move units.
KICK_TRANSLATE = 1.0
#: The plain search's kicks stop after this many kicks in a row found nothing cheaper (on
#: 54 small V instances and 24 with one stage per device, the longest such run before a
#: gain was 70 kicks). A kick that cannot be made (no legal move found) stops them too.
KICK_STALL = 100
#: Simulated actions for the plateau walk on the winner (and for its polish after).
PLATEAU_STEPS = 3_000_000
#: The search with pairs (``pairs=True``) is a second search of a placement beside the
#: plain one: each of its three budgets (polish, kicks, walk) is this many actions, a third
#: of the plain ones (auto --overlap at P=4, M=16: 38 s of CPU against auto's 28 s).
PAIR_STEPS = 1_000_000


def search_inputs(
    num_devices: int, num_microbatches: int, chunks: int, *, looped: bool
) -> tuple[tuple[Policy, ...], list[Schedule], Iterable[tuple[tuple[int, ...], ...]]]:
    """The grid, the handcrafted seeds and the seed orders for one placement kind.

    ``looped``: stage s on device s % P (ZB-H1/ZB-H2 and the interleaved family
    for one chunk; interleaved 1F1B, the interleaved family and the round-order
    passes for several); otherwise the zig-zag (ZB-V and DualPipeV for the V).
    """
    p, m, v = num_devices, num_microbatches, chunks
    grid = search_grid(p, v, looped=looped)
    if looped:
        family = interleaved_family(p, m, v)
        if v == 1:
            return grid, [zb_h1(p, m), zb_h2(p, m)], family
        return grid, [interleaved_1f1b(p, m, chunks=v, split_backward=True)], family
    if v == 2:
        return grid, [zbv(p, m), split_backward(dualpipev(p, m))], ()
    return grid, [], ()


def search_grid(num_devices: int, chunks: int, *, looped: bool) -> tuple[Policy, ...]:
    """The grid of :func:`search_inputs` alone (its seeds cost time to build)."""
    if not looped:
        return GRID_V
    return GRID_1 if chunks == 1 else GRID_V + round_grid(num_devices)


def split_backward(sched: Schedule) -> Schedule:
    """``sched`` with each BW written as B then W (same timing, searchable)."""
    acts = [
        [
            x
            for a in row
            for x in (
                (Action(Op.B, a.stage, a.mb), Action(Op.W, a.stage, a.mb))
                if a.op is Op.BW
                else (a,)
            )
        ]
        for row in sched.actions
    ]
    return sched.with_actions(acts)


def polishes(num_actions: int, steps: int = REFINE_STEPS) -> bool:
    """Whether the local search, given ``steps`` simulated actions, runs on an instance of
    this many F/B/W actions."""
    return steps // num_actions >= REFINE_MIN_RUNS


def resolve_costs(
    placement: tuple[int, ...], costs: CostSpec | None, mem_limit: Number | None, default: float
) -> tuple[CostModel, float]:
    """The cost model and the memory limit a generator should use.

    An explicit ``mem_limit`` wins over one carried by the costs file; without
    either the limit is ``default`` times one microbatch's M_B on the busiest device.
    """
    spec = costs if costs is not None else CostSpec()
    model = spec.resolve(placement)
    if mem_limit is None:
        mem_limit = spec.mem_limit
    unit = min_feasible_limit(placement, model)
    limit = default * unit if mem_limit is None else mem_limit
    try:
        limit_f = float(limit)
    except (TypeError, ValueError):
        raise ValueError(f"memory limit must be a number, got {limit!r}") from None
    if not math.isfinite(limit_f) or limit_f <= 0:
        raise ValueError(f"memory limit must be a finite number > 0, got {limit!r}")
    if limit_f < float(unit) * (1 - 1e-12):
        raise ScheduleError(
            Reason.MEMORY,
            f"memory limit {limit_f:g} is infeasible: the smallest feasible limit is "
            f"{float(unit):g} (one microbatch's M_B on every stage of the busiest device, "
            "which a microbatch holds until its backward returns); raise the limit to at "
            f"least {float(unit):g}",
        )
    return model, limit_f


def auto_schedule(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    costs: CostModel,
    mem_limit: float,
    grid: Sequence[Policy],
    seeds: Sequence[Schedule] = (),
    *,
    seed_orders: Iterable[tuple[tuple[int, ...], ...]] = (),
    polish: bool = True,
    walk: bool = True,
) -> Schedule:
    """Search for the cheapest schedule of ``placement`` x M within ``mem_limit``.

    ``seed_orders`` are more seeds, already as per-device ActionGraph indices.
    ``polish=False`` skips the local search (steps 3 to 5), ``walk=False`` step 5.
    Seeds that break the limit or deadlock are skipped.
    """
    sched = search_beating(
        name,
        placement,
        num_microbatches,
        costs,
        mem_limit,
        grid,
        seeds,
        seed_orders=seed_orders,
        polish=polish,
        walk=walk,
    )
    if sched is None:  # pragma: no cover - every grid has a policy that always finishes
        raise RuntimeError(f"no pass of the grid scheduled placement {placement}")
    return sched


def search_beating(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    costs: CostModel,
    mem_limit: float,
    grid: Sequence[Policy],
    seeds: Sequence[Schedule] = (),
    *,
    seed_orders: Iterable[tuple[tuple[int, ...], ...]] = (),
    polish: bool = True,
    walk: bool = True,
    beat: float = math.inf,
    evaluator: Evaluator | None = None,
    deadline: float | None = None,
    pairs: bool = False,
    pick: SeedPick | None = None,
) -> Schedule | None:
    """:func:`auto_schedule`, except that without polishing passes that cannot beat
    ``beat`` stop early; None when no pass or seed was kept (nothing beat ``beat``).

    The placement search passes its best cost so far, so a placement that cannot
    come near it costs only the start of its passes; and ``evaluator``, built for
    ``placement`` x M and ``costs``, which it shares with the fixed kinds it tries.
    Past ``deadline`` (a :func:`time.monotonic` time) it stops once it has a
    schedule and returns the best so far: the anytime mode, the only one whose
    result depends on the clock.

    ``pairs``: the search of overlapped F&B pairs (:mod:`.pairs`): orders carry pair
    codes (the grid's :attr:`~.greedy.Policy.pair` passes make them, seeds keep their
    pairs, a paired BW as a block of B and its W), are timed with each block as
    ``max(compute, all-to-all)``, and the local search forms and undoes pairs too; the
    schedule returned lists its pairs in :attr:`~zerobubble.schedule.ir.Schedule.overlaps`.

    ``pick``: the seeds already simulated (:func:`pick_seed`, with ``evaluator``), in place of
    ``seeds`` and ``seed_orders`` (pass none); only unpolished and without a deadline, where
    the seeds count only through their cheapest.
    """
    kind = PairEvaluator if pairs else Evaluator
    ev = evaluator or kind(ActionGraph(placement, num_microbatches), costs)
    graph = ev.graph
    budget = PAIR_STEPS if pairs else REFINE_STEPS
    polish = polish and polishes(len(graph), budget)
    converted = (encode(graph, seed) if pairs else graph.orders_of(seed.actions) for seed in seeds)
    found = _costed_candidates(
        ev,
        placement,
        num_microbatches,
        costs,
        mem_limit,
        grid,
        chain(converted, seed_orders),
        polish=polish,
        beat=beat,
        deadline=deadline,
        pick=pick,
    )
    if not found:
        return None
    ranked = sorted(found.items(), key=lambda item: item[1])
    if not polish:
        ranked = ranked[:1]
    winner, cost = [list(o) for o in ranked[0][0]], ranked[0][1]
    if polish:
        winner, cost = _polish(
            ev, costs, mem_limit, ranked, winner, cost, budget, deadline, pairs=pairs, walk=walk
        )
    return decode(name, graph, winner) if pairs else _schedule(name, graph, winner)


def _costed_candidates(
    ev: Evaluator,
    placement: tuple[int, ...],
    num_microbatches: int,
    costs: CostModel,
    mem_limit: float,
    grid: Sequence[Policy],
    candidates: Iterable[tuple[tuple[int, ...], ...]],
    *,
    polish: bool,
    beat: float,
    deadline: float | None,
    pick: SeedPick | None = None,
) -> dict[tuple[tuple[int, ...], ...], float]:
    """The grid's passes and the seeds' orders (``candidates``) that fit, each with its
    cost; without polishing only the best matters, so passes and seeds that cannot beat
    it (or ``beat``) are pruned. ``pick``: the seeds simulated already (then
    ``candidates`` is empty)."""
    limit = _with_tolerance(mem_limit)
    found: dict[tuple[tuple[int, ...], ...], float] = {}
    best = beat
    # Unpolished (and without a deadline), the seeds run first: the passes are the costlier
    # part, and the seeds' best cost (a little above it: the pass's own bound, which must
    # let through any pass at or below it) cuts them early; see _cheapest_seed for why the
    # winner is the very one of passes first.
    if pick is not None:
        if polish or deadline is not None:
            raise ValueError("seeds simulated beforehand serve only an unpolished search")
        seeded, candidates = pick.within(beat), ()
    elif polish or deadline is not None:
        seeded = None
    else:
        seeded = _cheapest_seed(ev, candidates, limit, beat)
    cap = math.inf if seeded is None else seeded[1] * (1 + 1e-6)
    for policy in grid:
        if found and expired(deadline):
            break
        cutoff = math.inf if polish else min(best, cap)
        cand = run_pass(placement, num_microbatches, costs, mem_limit, policy, cutoff)
        if cand is not None:
            found.setdefault(cand.orders, cand.cost)
            best = min(best, cand.cost)
    if seeded is not None:
        candidates = ()
        if not found or seeded[1] < min(found.values()):
            found[seeded[0]] = seeded[1]
    for orders in candidates:
        if found and expired(deadline):
            break
        if orders in found or not all(ev.fits(o, limit) for o in orders):
            continue
        if polish:
            spans = ev.spans([list(o) for o in orders])
            if spans is not None:
                found[orders] = max(spans)
            continue
        # Unpolished, only the first of the cheapest counts, and one dearer than ``beat``
        # loses to the placement that set it: stop simulating once neither can be.
        bar = min(found.values()) if found else beat * (1 + 1e-9)
        cost = ev.cost_within(orders, bar)
        if cost is not None and (cost < bar if found else cost <= bar):
            found[orders] = cost
    return found


def _polish(
    ev: Evaluator,
    costs: CostModel,
    mem_limit: float,
    ranked: list[tuple[tuple[tuple[int, ...], ...], float]],
    winner: list[list[int]],
    cost: float,
    budget: int,
    deadline: float | None,
    *,
    pairs: bool,
    walk: bool,
) -> tuple[list[list[int]], float]:
    """Steps 3 to 5 on the ``ranked`` candidates (the cheapest, ``winner`` at ``cost``,
    first): the local search on each while ``budget`` lasts, then kicks, then the walk."""
    graph = ev.graph
    polish_fn = refine_pairs if pairs else refine
    # No order runs faster than its busiest device's work back to back: a winner at that
    # floor is optimal, and as steps 3 to 5 keep only strictly cheaper orders they would
    # return this very winner after spending their whole budget, so each stops there.
    floor = ev.floor() if isinstance(ev, PairEvaluator) else work_floor(ev)
    for orders, _ in ranked:  # cheapest first; each may use what is left
        if budget <= 0 or expired(deadline) or at_floor(cost, floor):
            break
        polished, c, spent = polish_fn(
            graph, costs, mem_limit, [list(o) for o in orders], max_steps=budget, deadline=deadline
        )
        budget -= spent
        if c < cost:
            winner, cost = polished, c
    winner, cost = _kicks(graph, costs, mem_limit, winner, cost, floor, budget, deadline, pairs)
    if walk and not expired(deadline) and not at_floor(cost, floor):
        winner, cost = _walk(graph, costs, mem_limit, winner, cost, deadline, pairs=pairs)
    return winner, cost


def _kicks(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    winner: list[list[int]],
    cost: float,
    floor: float,
    budget: int,
    deadline: float | None,
    pairs: bool,
) -> tuple[list[list[int]], float]:
    """Iterated local search: kick the current orders out of their local optimum with a
    few random moves (seeded: the result stays a pure function) and polish again. The
    plain search's kicks are translated moves (each moves every microbatch of one op and
    stage at once, see refine.perturb) and it goes on from any polished kick that costs
    no more than the current orders, so it walks plateaus of equal cost; the best orders
    are kept. (The search with pairs kicks the best orders, and keeps only cheaper ones.)"""
    polish_fn = refine_pairs if pairs else refine
    rng = random.Random(0)
    kicks = 0
    budget = min(budget, PAIR_STEPS if pairs else KICK_STEPS)
    current, current_cost = winner, cost
    last_gain = 0  # the kick that last found cheaper orders (0: none yet)
    while budget > 0 and kicks < KICKS and not expired(deadline):
        if at_floor(cost, floor) or (not pairs and kicks - last_gain >= KICK_STALL):
            break
        kicks += 1
        moves = 1 + kicks % 4
        if pairs:
            start = perturb_pairs(graph, costs, mem_limit, winner, rng, moves=moves)
        else:
            start = perturb(graph, costs, mem_limit, current, rng, moves, KICK_TRANSLATE)
        if start is None:
            break
        polished, c, spent = polish_fn(
            graph, costs, mem_limit, start, max_steps=budget, deadline=deadline
        )
        budget -= spent
        if c < cost - 1e-12:
            winner, cost, last_gain = polished, c, kicks
        if not pairs and c <= current_cost + 1e-12 * max(1.0, abs(current_cost)):
            current, current_cost = polished, c
    return winner, cost


#: A seed's per-device orders and its cost.
Seeded = tuple[tuple[tuple[int, ...], ...], float]


@dataclass(frozen=True)
class SeedPick:
    """A placement's seeds simulated once without a bar (:func:`pick_seed`): ``best``, the
    first of the cheapest that fit and run, with its cost (None: none does)."""

    best: Seeded | None

    def within(self, beat: float) -> Seeded | None:
        """What :func:`_cheapest_seed` gives with this ``beat``: the first seed it keeps is
        the first that costs at most ``beat`` (and a relative 1e-9), then only a cheaper one
        replaces it, so it ends at the same first of the cheapest when that one costs at
        most ``beat``, and with None when none does."""
        if self.best is None or not self.best[1] <= beat * (1 + 1e-9):
            return None
        return self.best


def pick_seed(
    ev: Evaluator,
    mem_limit: float,
    seeds: Sequence[Schedule],
    seed_orders: Iterable[tuple[tuple[int, ...], ...]] = (),
) -> SeedPick:
    """The seeds of :func:`search_beating` (plain, not paired) simulated once, to be passed
    as its ``pick``: the placement search's bar needs a seed's cost before it gets there."""
    converted = (ev.graph.orders_of(seed.actions) for seed in seeds)
    limit = _with_tolerance(mem_limit)
    return SeedPick(_cheapest_seed(ev, chain(converted, seed_orders), limit, math.inf))


def _with_tolerance(mem_limit: float) -> float:
    """The memory limit as the search checks orders against it (rounding allowed)."""
    return mem_limit + 1e-10 * max(1.0, abs(mem_limit))


def _cheapest_seed(
    ev: Evaluator,
    candidates: Iterable[tuple[tuple[int, ...], ...]],
    limit: float,
    beat: float,
) -> Seeded | None:
    """The first of the cheapest seeds within ``limit`` that costs at most ``beat``, with
    its cost (None: none does), each seed simulated only while it can still win.

    :func:`search_beating` unpolished runs the grid's passes first and then each seed that
    beats every order so far, and returns the first of the cheapest: the last order kept.
    Each pass runs with the best cost so far as its cutoff and finishes only below it
    (its cutoff check is the device's span so far plus its work left, a lower bound on the
    span, which it reaches at the end), so kept passes cost less and less. A seed is kept
    if it costs less than every pass kept and every seed kept before it, so the winner is
    this function's seed if it costs less than the cheapest pass, else that pass. Running
    the passes after the seeds with the cutoff also capped at a little above this seed's
    cost S (a relative 1e-6, far above rounding) keeps that outcome: a pass at or below S
    meets only cutoffs it met before (a kept pass between S and the cap has a cost above
    S, and one cut by the cap costs more than S too), so it is kept exactly when it was,
    and one above S cannot win either way.
    """
    kept: Seeded | None = None
    for orders in candidates:
        if not all(ev.fits(o, limit) for o in orders):
            continue
        bar = beat * (1 + 1e-9) if kept is None else kept[1]
        cost = ev.cost_within(orders, bar)
        if cost is not None and (cost <= bar if kept is None else cost < bar):
            kept = orders, cost
    return kept


def work_floor(ev: Evaluator) -> float:
    """A lower bound on any order's cost: the busiest device's actions back to back (a
    device runs one action at a time, and its span covers every action it runs)."""
    dur = ev.dur
    return max((sum(map(dur.__getitem__, held)) for held in ev.graph.by_device), default=0.0)


def at_floor(cost: float, floor: float) -> bool:
    """Whether ``cost`` reached ``floor`` (within rounding): nothing can beat it."""
    return cost <= floor + 1e-12 * max(1.0, abs(floor))


def expired(deadline: float | None) -> bool:
    """Whether the anytime search's ``deadline`` (a :func:`time.monotonic` time) has passed."""
    return deadline is not None and time.monotonic() > deadline


def deadline_after(time_budget_s: float | None) -> float | None:
    """The monotonic deadline ``time_budget_s`` seconds from now (None: no budget)."""
    if time_budget_s is None:
        return None
    try:
        budget = float(time_budget_s)
    except (TypeError, ValueError):
        raise ValueError(f"time_budget_s must be a number, got {time_budget_s!r}") from None
    if not math.isfinite(budget) or budget < 0:
        raise ValueError(f"time_budget_s must be a finite number >= 0, got {time_budget_s!r}")
    return time.monotonic() + budget


def _schedule(name: str, graph: ActionGraph, orders: Sequence[Sequence[int]]) -> Schedule:
    return Schedule(
        name,
        graph.num_devices,
        graph.num_stages,
        graph.num_microbatches,
        graph.placement,
        tuple(tuple(graph.actions[i] for i in o) for o in orders),
    )


def _walk(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    orders: list[list[int]],
    cost: float,
    deadline: float | None = None,
    *,
    pairs: bool = False,
) -> tuple[list[list[int]], float]:
    """Plateau walk: moves that keep the cost but end the Bs sooner in sum, which
    shortens a critical backward chain one device at a time; then polish again."""
    polish_fn = refine_pairs if pairs else refine
    steps = PAIR_STEPS if pairs else PLATEAU_STEPS
    walked, _, _ = polish_fn(
        graph, costs, mem_limit, orders, max_steps=steps, plateau=True, deadline=deadline
    )
    walked, c, _ = polish_fn(graph, costs, mem_limit, walked, max_steps=steps, deadline=deadline)
    return (walked, c) if c < cost - 1e-12 else (orders, cost)


def plateau_walk(schedule: Schedule, costs: CostModel, mem_limit: float) -> Schedule:
    """Step 5 of the search on a finished schedule (the placement search runs it on
    its winner only); instances too large for the local search come back unchanged."""
    graph = ActionGraph(schedule.placement, schedule.num_microbatches)
    if not polishes(len(graph)):
        return schedule
    orders = [list(o) for o in graph.orders_of(schedule.actions)]
    spans = Evaluator(graph, costs).spans(orders)
    if spans is None:
        raise ValueError("plateau_walk() needs a schedule that runs; this one deadlocks")
    walked, _ = _walk(graph, costs, mem_limit, orders, max(spans))
    return _schedule(schedule.name, graph, walked)
