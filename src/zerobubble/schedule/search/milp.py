"""Exact schedule search: a mixed-integer program solved by HiGHS (scipy.optimize.milp).

The model (the ZB paper's ILP, tightened):

* variables: the end time ``e_a`` of every F/B/W action, one binary ``y_ab``
  ("a runs before b") per pair of actions on one device whose order the
  graph leaves open, and the cost ``C``;
* dependencies and in-order chains (see :mod:`.graph`):
  ``e_b >= e_a + dur_b (+ a's hop across devices: comm less a's host tail)``;
* one action at a time per device, big-M disjunctions on ``y``;
* memory: after each F (where a device's memory peaks) the sum of the
  deltas of the actions ordered before it, a linear function of ``y``, stays
  within the limit;
* cost: device d's first action is the one all its others depend on
  (F(first stage, 0)); executed as soon as possible it starts at a constant
  ``T0_d`` (its dependencies, each the first action of another device, reach
  it uncontended), so ``C >= e_last - T0_d``. Fixing
  that start makes the optimum equal to the best cost ``simulate`` can give
  any order (as-soon-as-possible times are the least solution of these
  constraints);
* tightening: the heuristic's cost is an upper-bound cut (scipy's milp has no
  warm start), which also bounds every ``e`` and so every big-M; per action,
  "busy before" and "busy after" cuts (``e_a - dur_a >= T0_d + sum dur_c y_ca``
  and ``T0_d + C >= e_a + sum dur_c y_ac``) give the relaxation the device
  load; ``y`` is monotone along the in-order chains.

Durations must be positive (with zero-length actions an order is not
determined by times).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_array

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.ir import Op, Schedule, looped_placement, v_placement
from zerobubble.schedule.search.auto import auto_schedule, resolve_costs, search_inputs
from zerobubble.schedule.search.graph import (
    ActionGraph,
    durations,
    hops,
    memory_deltas,
    min_feasible_limit,
)
from zerobubble.schedule.simulate import simulate

log = logging.getLogger(__name__)

#: Branch-and-bound nodes HiGHS may solve in the ``optimal`` generators: a work limit,
#: so the same input gives the same schedule and gap on any machine at any load (a
#: wall-clock limit of 60 s proved 2 of 8 small V instances, depending on the load).
DEFAULT_NODE_LIMIT = 1000
#: Seconds HiGHS may spend on the root node (presolve, the root LP, its cuts and
#: heuristics), which no node limit covers: a solve first runs with a node limit of 1 and
#: this time limit, and only a root that finished in time goes on to the node limit,
#: repeated without a time limit (so the result stays a function of the input). HiGHS's
#: clock is the wall clock.
DEFAULT_ROOT_TIME_LIMIT = 60.0
#: Largest instance (F/B/W actions) the exact search accepts.
MAX_ACTIONS = 600


@dataclass(frozen=True)
class OptimalResult:
    """Outcome of :func:`solve_optimal`.

    Attributes:
        schedule: The best schedule found (the MILP's, or the incumbent if the
            MILP found nothing better).
        cost: Its simulated cost.
        lower_bound: A proven lower bound on the cost of any schedule of this
            placement under the limit (the MILP's dual bound).
        gap: ``(cost - lower_bound) / cost``; 0 means proven optimal.
        proven: True if HiGHS closed the gap to its tolerance.
        nodes: Branch-and-bound nodes HiGHS solved (None when it does not say: it
            found no schedule of its own before a limit).
        stopped: Why the search ended unproven (``"node limit"``, ``"root time limit"``
            (the root node did not finish within ``root_time_limit``), ``"time limit"``
            or HiGHS's message); None when proven.
    """

    schedule: Schedule
    cost: float
    lower_bound: float
    gap: float
    proven: bool
    nodes: int | None = None
    stopped: str | None = None

    def summary(self) -> str:
        """One line for people: the cost, whether it is proven, else the gap and why."""
        nodes = "" if self.nodes is None else f", {self.nodes} nodes"
        if self.proven:
            return (
                f"{self.schedule.name}: cost {self.cost:g}, proven optimal (gap {self.gap:.2g}, "
                f"the tolerance){nodes}"
            )
        limit = "node limit" if self.stopped == "node limit" else "time limit"
        return (
            f"{self.schedule.name}: cost {self.cost:g}, not proven optimal: lower bound "
            f"{self.lower_bound:g}, gap {self.gap:.2%} (stopped at the {self.stopped}{nodes}; "
            f"a larger {limit} may close it)"
        )


class _Rows:
    """Sparse constraint rows ``lb <= sum(coef * x) <= ub``."""

    def __init__(self) -> None:
        self.r: list[int] = []
        self.c: list[int] = []
        self.v: list[float] = []
        self.lb: list[float] = []
        self.ub: list[float] = []

    def add(self, terms: dict[int, float], lb: float, ub: float) -> None:
        row = len(self.lb)
        for col, val in terms.items():
            if val != 0:
                self.r.append(row)
                self.c.append(col)
                self.v.append(val)
        self.lb.append(lb)
        self.ub.append(ub)

    def constraint(self, ncols: int) -> LinearConstraint:
        a = coo_array((self.v, (self.r, self.c)), shape=(len(self.lb), ncols)).tocsr()
        return LinearConstraint(a, np.array(self.lb), np.array(self.ub))


def first_actions(graph: ActionGraph) -> list[int]:
    """Each device's first action in every schedule: the one all its other actions depend on.

    Needs stages 0..P-1 on distinct devices (true of looped and V placements):
    then each device has one, F(first stage, 0), and all that it depends on are
    the first actions of other devices.
    """
    P = graph.num_devices
    if sorted(graph.placement[:P]) != list(range(P)):
        raise ValueError(
            "the exact search needs stages 0..P-1 on distinct devices (looped or V placement)"
        )
    out = []
    for held in graph.by_device:
        mask = sum(1 << i for i in held)
        out.append(next(a for a in held if (graph.descendants[a] | 1 << a) & mask == mask))
    return out


def first_starts(graph: ActionGraph, costs: CostModel) -> list[float]:
    """``T0_d``: when device d's first action (:func:`first_actions`) starts as soon as possible.

    Its dependencies are first actions too, so they run uncontended: ``T0`` is the
    longest chain of dependencies (durations plus ``comm`` across devices) into it.
    """
    first = first_actions(graph)
    dur = durations(graph, costs)
    hop = hops(graph, costs)
    start = dict.fromkeys(first, 0.0)
    for a, b, cross in _by_source(graph.edges, graph.topological()):
        if a in start and b in start:
            start[b] = max(start[b], start[a] + (dur[a] + (hop[a] if cross else 0.0)))
    return [start[a] for a in first]


def solve_optimal(
    incumbent: Schedule,
    costs: CostModel,
    mem_limit: Number | None,
    *,
    node_limit: int = DEFAULT_NODE_LIMIT,
    time_limit: float | None = None,
    root_time_limit: float | None = DEFAULT_ROOT_TIME_LIMIT,
    rel_gap: float = 1e-6,
    name: str = "optimal",
) -> OptimalResult:
    """Minimise the cost of a split-backward schedule exactly (up to ``rel_gap``).

    Args:
        incumbent: A valid schedule within the limit (the heuristic's). It fixes the
            placement and M; its cost is the upper-bound cut, and it is returned if
            the solver finds nothing better.
        costs: Per-stage costs; every duration must be > 0.
        mem_limit: Per-device memory limit in the units of ``costs`` (None: unbounded).
        node_limit: Branch-and-bound nodes HiGHS may solve; the result then carries the
            gap it proved. A work limit: the result is the same on every run.
        time_limit: Seconds HiGHS may spend, on top of the node limit (None: none).
            Reaching it makes the result depend on the machine's speed and load.
        root_time_limit: Seconds HiGHS may spend on the root node, which the node limit
            does not bound (None: unbounded). The solve first stops after the root (a node
            limit of 1) within this time; a root that finished is solved again with
            ``node_limit`` and no time limit, so wherever the root finishes in time the
            result is the same on every run (it costs the root twice when the node limit
            is more than 1 and the root proves nothing). A root that did not finish
            returns the incumbent with the best bound known (HiGHS's, else the LP
            relaxation's within the same time, else the busiest device's work).
        rel_gap: Relative optimality tolerance.
        name: Name of the returned schedule.
    """
    placement = incumbent.placement
    graph = ActionGraph(placement, incumbent.num_microbatches)
    _check_size(len(graph))
    dur = durations(graph, costs)
    if min(dur) <= 0:
        raise ValueError("the exact search needs every F, B and W duration to be > 0")
    _check_memory_limit(placement, costs, mem_limit)
    incumbent = incumbent.with_actions(incumbent.actions, name=name)
    inc_cost = float(simulate(incumbent, costs).cost)
    _check_solver_limits(node_limit, time_limit, root_time_limit)
    model = _build(graph, costs, dur, mem_limit, inc_cost)
    root_limit = min(
        math.inf if time_limit is None else time_limit,
        math.inf if root_time_limit is None else root_time_limit,
    )
    res, stopped_early = _solve_root_then_nodes(model, node_limit, time_limit, root_limit, rel_gap)
    best, best_cost = incumbent, inc_cost
    if res.x is not None:
        cand = _extract(graph, dur, res.x, incumbent)
        cand_cost = float(simulate(cand, costs).cost)
        if cand_cost < best_cost - 1e-9 * max(1.0, best_cost):
            best, best_cost = cand, cand_cost
    bound = min(_lower_bound(res, model, graph, dur, best_cost, root_limit, rel_gap), best_cost)
    gap = (best_cost - bound) / best_cost if best_cost > 0 else 0.0
    # Stopped early with a bound that meets the schedule's cost, it is proven all the same.
    proven = res.status in (0, 2) or gap <= rel_gap
    stopped = None if proven else stopped_early or _why_stopped(str(res.message))
    if not proven:
        log.warning("exact search stopped (%s) with a gap of %.2f%%", stopped, 100 * gap)
    nodes = res.get("mip_node_count")
    return OptimalResult(
        best, best_cost, bound, gap, proven, None if nodes is None else int(nodes), stopped
    )


def _check_memory_limit(
    placement: tuple[int, ...], costs: CostModel, mem_limit: Number | None
) -> None:
    floor = min_feasible_limit(placement, costs)
    if mem_limit is not None and mem_limit < floor:
        raise ScheduleError(
            Reason.MEMORY,
            f"memory limit {float(mem_limit):g} is infeasible: the smallest feasible limit "
            f"is {float(floor):g} (one microbatch's M_B on every stage of the busiest device)",
        )


def _check_solver_limits(
    node_limit: int, time_limit: float | None, root_time_limit: float | None
) -> None:
    if not isinstance(node_limit, int) or isinstance(node_limit, bool) or node_limit < 1:
        raise ValueError(f"node_limit must be an integer >= 1, got {node_limit!r}")
    for what, x in (("time_limit", time_limit), ("root_time_limit", root_time_limit)):
        if x is not None and not (isinstance(x, (int, float)) and x > 0 and not math.isnan(x)):
            raise ValueError(f"{what} must be a number of seconds > 0 (or None), got {x!r}")


def _solve_root_then_nodes(
    model: _Model, node_limit: int, time_limit: float | None, root_limit: float, rel_gap: float
) -> tuple[Any, str | None]:
    """The root first, within its time (a node limit of 1: HiGHS stops after the root), then,
    if it finished and proved nothing, the whole search up to ``node_limit``. Returns HiGHS's
    result and "root time limit" / "time limit" when the clock stopped it (else None)."""
    res = _solve(model, 1, root_limit, rel_gap)
    stopped_early = None
    if _timed_out(res):
        stopped_early = "time limit" if root_limit == time_limit else "root time limit"
    elif res.status not in (0, 2) and node_limit > 1:  # the root finished and proved nothing
        res = _solve(model, node_limit, time_limit, rel_gap)
        if _timed_out(res):
            stopped_early = "time limit"
    return res, stopped_early


def _lower_bound(
    res: Any,
    model: _Model,
    graph: ActionGraph,
    dur: list[float],
    best_cost: float,
    root_limit: float,
    rel_gap: float,
) -> float:
    """The lower bound HiGHS's result proves (before capping it at the best cost)."""
    if res.status == 0:  # solved to rel_gap
        return float(res.fun) * (1 - rel_gap)
    if res.status == 2:  # nothing beats the cut: the incumbent is optimal
        return best_cost
    if res.get("mip_dual_bound") is not None and math.isfinite(res.mip_dual_bound):
        return float(res.mip_dual_bound)
    # Stopped before HiGHS found a schedule of its own: it reports no bound. The LP
    # relaxation's, or the busiest device's work (a span covers the device's work), which
    # needs no solver: a root stopped in presolve has no LP either.
    return max(_relaxation_bound(model, root_limit), _work_bound(graph, dur))


def _why_stopped(message: str) -> str:
    """HiGHS reports its node limit as "Solution limit reached" (scipy's status 4)."""
    if "Solution limit" in message:
        return "node limit"
    if "Time limit" in message:
        return "time limit"
    return message


def _solve(model: _Model, node_limit: int, time_limit: float | None, rel_gap: float) -> Any:
    """HiGHS on ``model`` (scipy's ``milp``) with a node limit and, if finite, a time limit."""
    options: dict[str, object] = {"node_limit": node_limit, "mip_rel_gap": rel_gap, "disp": False}
    if time_limit is not None and math.isfinite(time_limit):
        options["time_limit"] = time_limit
    return milp(
        model.objective,
        constraints=model.rows.constraint(model.ncols),
        integrality=model.integrality,
        bounds=Bounds(model.lo, model.hi),
        options=options,
    )


def _timed_out(res: Any) -> bool:
    return _why_stopped(str(res.message)) == "time limit"


def _relaxation_bound(model: _Model, time_limit: float = math.inf) -> float:
    """The LP relaxation's optimum: a lower bound on every schedule (weaker than the
    one HiGHS proved, which it does not report when it found no solution itself); 0 if
    the LP did not finish within ``time_limit``."""
    options: dict[str, object] = {"disp": False}
    if math.isfinite(time_limit):
        options["time_limit"] = time_limit
    res = milp(
        model.objective,
        constraints=model.rows.constraint(model.ncols),
        integrality=np.zeros(model.ncols),
        bounds=Bounds(model.lo, model.hi),
        options=options,
    )
    return float(res.fun) if res.status == 0 else 0.0


def _work_bound(graph: ActionGraph, dur: list[float]) -> float:
    """The busiest device's work: no schedule's cost (a device's span) is below it."""
    return max(sum(dur[a] for a in held) for held in graph.by_device)


def optimal(
    num_devices: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    v_shape: bool = False,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
) -> Schedule:
    """The exact optimum of one placement under a memory limit, by MILP.

    The schedule of :func:`optimal_search` (see there), which also says whether it is
    proven optimal and the gap otherwise.
    """
    return optimal_search(
        num_devices,
        num_microbatches,
        chunks=chunks,
        v_shape=v_shape,
        costs=costs,
        mem_limit=mem_limit,
    ).schedule


def optimal_search(
    num_devices: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    v_shape: bool = False,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    node_limit: int = DEFAULT_NODE_LIMIT,
    root_time_limit: float | None = DEFAULT_ROOT_TIME_LIMIT,
) -> OptimalResult:
    """The exact optimum of one placement under a memory limit, by MILP, with its proof.

    The placement is looped with ``chunks`` per device (one stage per device by
    default), or the V with ``v_shape`` (two chunks). Without ``mem_limit`` the
    limit is 2P microbatches' M_B (ZB-2p's budget). Small instances only
    (3·S·M <= MAX_ACTIONS); HiGHS may spend ``root_time_limit`` seconds on the root
    node and then solve ``node_limit`` branch-and-bound nodes (a work limit: where the
    root finishes in time, the same input gives the same result on every run) and the
    best schedule found is returned (the heuristic's if nothing better) with the gap
    proven (:func:`solve_optimal`).
    """
    p, m = check_counts(num_devices, num_microbatches)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    if v_shape and chunks not in (1, 2):
        raise ValueError(f"the V placement has 2 chunks per device, got chunks={chunks}")
    v = 2 if v_shape else chunks
    _check_size(3 * v * p * m)
    placement = v_placement(p) if v_shape else looped_placement(p, v)
    model, limit = resolve_costs(placement, costs, mem_limit, default=2 * p)
    grid, seeds, family = search_inputs(p, m, v, looped=not v_shape)
    incumbent = auto_schedule("auto", placement, m, model, limit, grid, seeds, seed_orders=family)
    name = "optimal-v" if v_shape else "optimal"
    return solve_optimal(
        incumbent, model, limit, node_limit=node_limit, root_time_limit=root_time_limit, name=name
    )


def _check_size(actions: int) -> None:
    if actions > MAX_ACTIONS:
        raise ValueError(
            f"the exact search is for small instances (at most {MAX_ACTIONS} F/B/W actions, "
            f"this one has {actions}); use zb-auto or zbv-auto for larger ones"
        )


@dataclass
class _Model:
    objective: np.ndarray
    rows: _Rows
    integrality: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    ncols: int


def _build(
    graph: ActionGraph,
    costs: CostModel,
    dur: list[float],
    mem_limit: Number | None,
    upper: float,
) -> _Model:
    n = len(graph)
    hop = hops(graph, costs)
    t0 = first_starts(graph, costs)
    lo, hi = _end_bounds(graph, dur, hop, t0, upper)
    pair, ncols = _open_pairs(graph)
    cost_col = n  # columns: e_0..e_{n-1}, C, then the y
    rows = _Rows()
    for a, b, cross in graph.edges:
        rows.add({b: 1.0, a: -1.0}, dur[b] + (hop[a] if cross else 0.0), math.inf)
    for (a, b), y in pair.items():
        big_ab = hi[a] + dur[b] - lo[b]  # y=1: a first, so e_b >= e_a + dur_b
        rows.add({b: 1.0, a: -1.0, y: -big_ab}, dur[b] - big_ab, math.inf)
        big_ba = hi[b] + dur[a] - lo[a]  # y=0: b first
        rows.add({a: 1.0, b: -1.0, y: big_ba}, dur[a], math.inf)
    _add_device_rows(rows, graph, costs, dur, t0, pair, cost_col, mem_limit)
    _add_chain_rows(rows, graph, pair)
    objective = np.zeros(ncols)
    objective[cost_col] = 1.0
    integrality = np.zeros(ncols)
    integrality[n + 1 :] = 1
    lo_all = np.concatenate([lo, [0.0], np.zeros(ncols - n - 1)])
    hi_all = np.concatenate([hi, [upper], np.ones(ncols - n - 1)])
    return _Model(objective, rows, integrality, lo_all, hi_all, ncols)


def _end_bounds(
    graph: ActionGraph, dur: list[float], hop: list[float], t0: list[float], upper: float
) -> tuple[list[float], list[float]]:
    """Bounds on end times: earliest from the graph, latest from the cost cut."""
    n = len(graph)
    dev = [graph.device(i) for i in range(n)]
    first = set(first_actions(graph))
    order = graph.topological()
    lo = [0.0] * n
    for i in order:  # all the device's work that must come first fits after T0
        ahead = sum(dur[j] for j in graph.by_device[dev[i]] if graph.precedes(j, i))
        lo[i] = t0[dev[i]] + ahead + dur[i]
    for a, b, cross in _by_source(graph.edges, order):
        lo[b] = max(lo[b], lo[a] + dur[b] + (hop[a] if cross else 0.0))
    hi = [0.0] * n
    tail = [0.0] * n  # work on the same device that must follow
    for i in range(n):
        tail[i] = sum(dur[j] for j in graph.by_device[dev[i]] if graph.precedes(i, j))
        hi[i] = t0[dev[i]] + upper - tail[i]
    for i in first:
        lo[i] = hi[i] = t0[dev[i]] + dur[i]
    return lo, hi


def _open_pairs(graph: ActionGraph) -> tuple[dict[tuple[int, int], int], int]:
    """A binary ordering variable's column for each open pair of each device, and the
    number of columns (after e_0..e_{n-1} and C)."""
    pair: dict[tuple[int, int], int] = {}
    ncols = len(graph) + 1
    for held in graph.by_device:
        for x, a in enumerate(held):
            for b in held[x + 1 :]:
                if not graph.precedes(a, b) and not graph.precedes(b, a):
                    pair[a, b] = ncols
                    ncols += 1
    return pair, ncols


def _before(
    graph: ActionGraph, pair: dict[tuple[int, int], int], a: int, b: int
) -> tuple[float, dict[int, float]]:
    """``[a before b]`` as constant + linear terms."""
    if graph.precedes(a, b):
        return 1.0, {}
    if graph.precedes(b, a):
        return 0.0, {}
    if (a, b) in pair:
        return 0.0, {pair[a, b]: 1.0}
    return 1.0, {pair[b, a]: -1.0}


def _add_device_rows(
    rows: _Rows,
    graph: ActionGraph,
    costs: CostModel,
    dur: list[float],
    t0: list[float],
    pair: dict[tuple[int, int], int],
    cost_col: int,
    mem_limit: Number | None,
) -> None:
    """Per action, the "busy before" and "busy after" cuts and, after each F, the memory
    limit on what is ordered before it."""
    deltas = memory_deltas(graph, costs)
    for d, held in enumerate(graph.by_device):
        for x in held:
            head_c, head = 0.0, {x: 1.0}
            tail_c, tail_t = 0.0, {cost_col: 1.0, x: -1.0}
            mem_c, mem = deltas[x], dict[int, float]()
            for c in held:
                if c == x:
                    continue
                k, terms = _before(graph, pair, c, x)
                head_c += dur[c] * k
                mem_c += deltas[c] * k
                for col, val in terms.items():
                    head[col] = head.get(col, 0.0) - dur[c] * val
                    mem[col] = mem.get(col, 0.0) + deltas[c] * val
                k, terms = _before(graph, pair, x, c)
                tail_c += dur[c] * k
                for col, val in terms.items():
                    tail_t[col] = tail_t.get(col, 0.0) - dur[c] * val
            # e_x - dur_x - T0 >= work before x;  T0 + C - e_x >= work after x
            rows.add(head, t0[d] + dur[x] + head_c, math.inf)
            rows.add(tail_t, tail_c - t0[d], math.inf)
            if mem_limit is not None and graph.actions[x].op is Op.F and mem:
                rows.add(mem, -math.inf, float(mem_limit) - mem_c + 1e-9)


def _add_chain_rows(rows: _Rows, graph: ActionGraph, pair: dict[tuple[int, int], int]) -> None:
    """y is monotone along the in-order chains: a later b / an earlier a keeps "a before b"."""
    chain_next = {a: b for a, b, _ in graph.edges if _same_chain(graph, a, b)}
    for a, b in pair:
        for u, v in ((a, chain_next.get(b)), (chain_next.get(a), b)):
            if u is None or v is None:
                continue
            k1, t1 = _before(graph, pair, a, b) if u == a else _before(graph, pair, u, v)
            k2, t2 = _before(graph, pair, u, v) if u == a else _before(graph, pair, a, b)
            row = dict(t1)  # before(lhs) - before(rhs) <= 0
            for col, val in t2.items():
                row[col] = row.get(col, 0.0) - val
            if row:
                rows.add(row, -math.inf, k2 - k1)


def _same_chain(graph: ActionGraph, a: int, b: int) -> bool:
    x, y = graph.actions[a], graph.actions[b]
    return x.op == y.op and x.stage == y.stage and y.mb == x.mb + 1


def _by_source(
    edges: tuple[tuple[int, int, bool], ...], order: list[int]
) -> list[tuple[int, int, bool]]:
    rank = {v: k for k, v in enumerate(order)}
    return sorted(edges, key=lambda e: rank[e[0]])


def _extract(graph: ActionGraph, dur: list[float], x: np.ndarray, like: Schedule) -> Schedule:
    """Each device's actions sorted by their start times in the MILP solution."""
    acts = []
    for held in graph.by_device:
        ordered = sorted(held, key=lambda i: (x[i] - dur[i], x[i], i))
        acts.append([graph.actions[i] for i in ordered])
    return like.with_actions(acts)
