"""Local search that polishes a schedule's per-device orders.

The heuristic applies one policy to every device and every moment; on small
instances the best order often differs from it in a few places. This pass
moves one action at a time to a nearby position on its device (up to
``window`` places), keeps a move if it lowers the cost (ties broken by the sum
of device spans, which rewards progress off the critical device), and stops
when no move helps or after ``max_evals`` trial simulations (a count, not a
clock, so the result is deterministic). Moves never cross an action's
same-device predecessors or successors, never exceed the memory limit, and a
move that deadlocks is rejected by the simulation.
"""

from __future__ import annotations

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.search.graph import ActionGraph, durations, memory_deltas

_EPS = 1e-9


class Evaluator:
    """Fast simulation of per-device orders of ActionGraph indices."""

    def __init__(self, graph: ActionGraph, costs: CostModel) -> None:
        n = len(graph)
        comm = float(costs.comm)
        self.num_devices = graph.num_devices
        self.dur = durations(graph, costs)
        self.delta = memory_deltas(graph, costs)
        self.deps: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        self.local_pred: list[set[int]] = [set() for _ in range(n)]
        self.local_succ: list[set[int]] = [set() for _ in range(n)]
        for a, b, cross in graph.edges:
            self.deps[b].append((a, comm if cross else 0.0))
            if not cross:
                self.local_pred[b].add(a)
                self.local_succ[a].add(b)

    def spans(self, orders: list[list[int]]) -> list[float] | None:
        """Per-device spans of the as-soon-as-possible execution, None on deadlock."""
        deps, dur = self.deps, self.dur
        P = self.num_devices
        end = [-1.0] * len(dur)
        pos = [0] * P
        free = [0.0] * P
        first = [0.0] * P
        todo = sum(len(o) for o in orders)
        while todo:
            progressed = False
            for d in range(P):
                lst = orders[d]
                i = start_i = pos[d]
                t_free = free[d]
                n = len(lst)
                while i < n:
                    a = lst[i]
                    t = t_free
                    for dep, lat in deps[a]:
                        e = end[dep]
                        if e < 0:
                            break
                        e += lat
                        if e > t:
                            t = e
                    else:
                        if i == 0:
                            first[d] = t
                        t_free = end[a] = t + dur[a]
                        i += 1
                        continue
                    break
                if i != start_i:
                    todo -= i - start_i
                    pos[d] = i
                    free[d] = t_free
                    progressed = True
            if not progressed:
                return None
        return [free[d] - first[d] if orders[d] else 0.0 for d in range(P)]

    def fits(self, order: list[int], limit: float) -> bool:
        level = 0.0
        delta = self.delta
        for a in order:
            level += delta[a]
            if level > limit:
                return False
        return True


def _key(spans: list[float]) -> tuple[float, float]:
    return max(spans), sum(spans)


def _better(x: tuple[float, float], y: tuple[float, float]) -> bool:
    if x[0] < y[0] - _EPS * max(1.0, y[0]):
        return True
    return x[0] <= y[0] + _EPS * max(1.0, y[0]) and x[1] < y[1] - _EPS * max(1.0, y[1])


def refine(
    graph: ActionGraph,
    costs: CostModel,
    mem_limit: float,
    orders: list[list[int]],
    *,
    max_evals: int,
    window: int = 6,
) -> tuple[list[list[int]], float]:
    """Improve ``orders`` (a valid schedule within ``mem_limit``); returns it and its cost."""
    ev = Evaluator(graph, costs)
    orders = [list(o) for o in orders]
    spans = ev.spans(orders)
    if spans is None:
        raise ValueError("refine() needs a schedule that runs; this one deadlocks")
    best = _key(spans)
    limit = mem_limit + 1e-10 * max(1.0, abs(mem_limit))
    steps = [s for k in range(1, window + 1) for s in (-k, k)]
    evals = 0
    improved = True
    while improved and evals < max_evals:
        improved = False
        for d in range(ev.num_devices):
            lst = orders[d]
            i = 0
            while i < len(lst) and evals < max_evals:
                a = lst[i]
                for step in steps:
                    k = i + step
                    if not 0 <= k < len(lst):
                        continue
                    if step < 0:
                        if not ev.local_pred[a].isdisjoint(lst[k:i]):
                            continue
                        new = [*lst[:k], a, *lst[k:i], *lst[i + 1 :]]
                    else:
                        if not ev.local_succ[a].isdisjoint(lst[i + 1 : k + 1]):
                            continue
                        new = [*lst[:i], *lst[i + 1 : k + 1], a, *lst[k + 1 :]]
                    if not ev.fits(new, limit):
                        continue
                    orders[d] = new
                    evals += 1
                    trial = ev.spans(orders)
                    if trial is not None and _better(_key(trial), best):
                        best = _key(trial)
                        lst = new
                        improved = True
                        break
                    orders[d] = lst
                else:
                    i += 1
    return orders, best[0]
