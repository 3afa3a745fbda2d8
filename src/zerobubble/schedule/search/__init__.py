"""Cost- and memory-aware schedule search (torch-free).

* :func:`zb_auto` / :func:`zbv_auto` — the ZB paper's automatic scheduler
  (one stage per device, or the V placement) under a per-device memory limit;
* :func:`optimal` / :func:`solve_optimal` — the exact optimum by MILP, used to
  certify the heuristic on small instances.
"""

from zerobubble.schedule.search.auto import auto_schedule, resolve_costs
from zerobubble.schedule.search.fixed import zb_auto, zbv_auto
from zerobubble.schedule.search.graph import ActionGraph, min_feasible_limit
from zerobubble.schedule.search.greedy import Policy, run_pass
from zerobubble.schedule.search.milp import OptimalResult, optimal, optimal_search, solve_optimal

__all__ = [
    "ActionGraph",
    "OptimalResult",
    "Policy",
    "auto_schedule",
    "min_feasible_limit",
    "optimal",
    "optimal_search",
    "resolve_costs",
    "run_pass",
    "solve_optimal",
    "zb_auto",
    "zbv_auto",
]
