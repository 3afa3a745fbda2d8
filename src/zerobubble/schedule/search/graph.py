"""The F/B/W action graph of a split-backward schedule, shared by the searches.

Each (stage, microbatch) has an F, a B and a W. Besides the true dependencies
(:data:`~zerobubble.schedule.deps.RULES`) the searches order same-op same-stage actions by
microbatch (F(s,j) before F(s,j+1), likewise B and W). That loses nothing:
microbatches are interchangeable, so any schedule can be relabelled into one
whose every chain is in order without changing a single start time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.deps import PRODUCERS, needs, produces
from zerobubble.schedule.graph import CODE, action_code
from zerobubble.schedule.ir import Action, Op

OPS = (Op.F, Op.B, Op.W)

Deps = tuple[tuple[int, float], ...]
"""What one action waits for: ``(action, latency)`` pairs (:meth:`ActionGraph.dependencies`)."""
"""The ops of a split-backward schedule; their codes are 0, 1, 2, so ids are dense."""


def predecessors(op: Op, stage: int, num_stages: int) -> tuple[tuple[Op, int], ...]:
    """(op, stage) of the producers of ``op``'s needs on ``stage`` (any microbatch: its own),
    in :data:`~zerobubble.schedule.deps.RULES` order; B, not BW, where both would do (the
    searches have no BW)."""
    return tuple(
        (next(p for p in PRODUCERS[k.kind] if p in OPS), k.stage)
        for k in needs(op, stage, 0, num_stages)
    )


def direct_predecessors(num_stages: int) -> dict[tuple[Op, int], tuple[tuple[Op, int], ...]]:
    """:func:`predecessors` of every (op, stage), less each that another of them depends on
    anyway (B(s)'s F(s) where B(s+1) exists): one microbatch's graph, transitively reduced.

    With durations and latencies >= 0 a dropped need never arrives last and has run
    whenever the kept ones have, so readiness and arrival times (and their bounds)
    follow from these alone, with fewer checks.
    """
    nodes = [(op, s) for op in OPS for s in range(num_stages)]
    preds = {v: predecessors(*v, num_stages) for v in nodes}
    bit = {v: 1 << i for i, v in enumerate(nodes)}
    below: dict[tuple[Op, int], int] = {}  # bitset of every ancestor of each node
    indeg = {v: len(preds[v]) for v in nodes}
    succ: dict[tuple[Op, int], list[tuple[Op, int]]] = {v: [] for v in nodes}
    for v in nodes:
        for u in preds[v]:
            succ[u].append(v)
    order = [v for v in nodes if not indeg[v]]
    for v in order:
        below[v] = 0
        for u in preds[v]:
            below[v] |= bit[u] | below[u]
        for x in succ[v]:
            indeg[x] -= 1
            if not indeg[x]:
                order.append(x)
    return {
        v: tuple(u for u in ps if not any(below[w] & bit[u] for w in ps if w != u))
        for v, ps in preds.items()
    }


def consumer_stages(op: Op, stage: int, num_stages: int) -> tuple[int, ...]:
    """The stages whose actions consume what ``op`` of ``stage`` produces (each once)."""
    return tuple(dict.fromkeys(k.consumer_stage for k in produces(op, stage, 0, num_stages)))


@dataclass(frozen=True)
class ActionGraph:
    """All F/B/W actions of S stages and M microbatches, indexed 0..N-1.

    The index of an action is its :func:`~zerobubble.schedule.graph.action_code`.
    """

    placement: tuple[int, ...]
    num_microbatches: int

    @property
    def num_stages(self) -> int:
        return len(self.placement)

    @property
    def num_devices(self) -> int:
        return max(self.placement) + 1

    def __len__(self) -> int:
        return 3 * self.num_stages * self.num_microbatches

    def index(self, op: Op, stage: int, mb: int) -> int:
        return action_code(CODE[op], stage, mb, self.num_stages, self.num_microbatches)

    def orders_of(self, rows: Sequence[Sequence[Action]]) -> tuple[tuple[int, ...], ...]:
        """Per-device rows of actions as rows of indices (:meth:`index` of each, inlined:
        seeds of the placement search hold millions of actions)."""
        S, M = self.num_stages, self.num_microbatches
        base = {op: code * S for op, code in CODE.items()}
        return tuple(tuple((base[a.op] + a.stage) * M + a.mb for a in row) for row in rows)

    @cached_property
    def actions(self) -> tuple[Action, ...]:
        return tuple(
            Action(op, s, j)
            for op in OPS
            for s in range(self.num_stages)
            for j in range(self.num_microbatches)
        )

    def device(self, i: int) -> int:
        return self.placement[self.actions[i].stage]

    @cached_property
    def edges(self) -> tuple[tuple[int, int, bool], ...]:
        """``(before, after, crosses_devices)``: dependencies plus the in-order chains."""
        S, M, pl = self.num_stages, self.num_microbatches, self.placement
        out: list[tuple[int, int, bool]] = []
        rows = [
            [
                (CODE[op] * S + s, [(CODE[p] * S + t, pl[t] != pl[s]) for p, t in preds])
                for op in OPS
                for preds in [predecessors(op, s, S)]
            ]
            for s in range(S)
        ]
        for s in range(S):
            for j in range(M):
                for key, preds in rows[s]:
                    b = key * M + j
                    for src_key, cross in preds:
                        out.append((src_key * M + j, b, cross))
                if j + 1 < M:
                    for key, _ in rows[s]:
                        out.append((key * M + j, key * M + j + 1, False))
        return tuple(out)

    def dependencies(self, costs: CostModel) -> list[Deps]:
        """What each action waits for, as ``(action, latency)``: its in-order chain
        predecessor (same op and stage, the microbatch before), then its producers
        (their :meth:`~zerobubble.schedule.costs.CostModel.hop` across devices).
        :attr:`edges` by consumer, built by index arithmetic (the placement search needs
        it once per placement, for millions of actions). Tuples, not lists: tuples of
        numbers drop out of the garbage collector's tracking, and at those sizes its full
        collections, which walk every tracked object, cost more than building the table."""
        S, M, pl = self.num_stages, self.num_microbatches, self.placement
        deps: list[Deps] = [()] * len(self)
        for s in range(S):
            for op in OPS:
                key = CODE[op] * S + s
                preds = [
                    (CODE[prod] * S + src, float(costs.hop(prod, src)) if pl[src] != pl[s] else 0.0)
                    for prod, src in predecessors(op, s, S)
                ]
                base = key * M
                deps[base] = tuple((src * M, lat) for src, lat in preds)
                chain = range(base, base + M - 1)  # the microbatch before, for j = 1 .. M-1
                if not preds:
                    deps[base + 1 : base + M] = [((a, 0.0),) for a in chain]
                elif len(preds) == 1:
                    ((src, lat),) = preds
                    shift = src * M - base
                    deps[base + 1 : base + M] = [((a, 0.0), (a + 1 + shift, lat)) for a in chain]
                else:
                    deps[base + 1 : base + M] = [
                        ((a, 0.0), *((src * M + a + 1 - base, lat) for src, lat in preds))
                        for a in chain
                    ]
        return deps

    @cached_property
    def descendants(self) -> tuple[int, ...]:
        """Bitset of every action reachable from each action (transitive closure)."""
        succ: list[list[int]] = [[] for _ in range(len(self))]
        for a, b, _ in self.edges:
            succ[a].append(b)
        reach = [0] * len(self)
        for a in reversed(self.topological()):
            bits = 0
            for b in succ[a]:
                bits |= (1 << b) | reach[b]
            reach[a] = bits
        return tuple(reach)

    def topological(self) -> list[int]:
        """All actions, each after everything it depends on."""
        indeg = [0] * len(self)
        succ: list[list[int]] = [[] for _ in range(len(self))]
        for a, b, _ in self.edges:
            succ[a].append(b)
            indeg[b] += 1
        order = [i for i in range(len(self)) if indeg[i] == 0]
        for a in order:
            for b in succ[a]:
                indeg[b] -= 1
                if indeg[b] == 0:
                    order.append(b)
        return order

    def precedes(self, a: int, b: int) -> bool:
        """True if every schedule of this graph runs ``a`` before ``b``."""
        return bool(self.descendants[a] >> b & 1)

    @cached_property
    def by_device(self) -> tuple[tuple[int, ...], ...]:
        """Each device's actions in index order (by arithmetic: index ``(k * S + s) * M + j``,
        so each (op, stage) is a run of M indices)."""
        S, M = self.num_stages, self.num_microbatches
        held: list[list[int]] = [[] for _ in range(self.num_devices)]
        for key in range(len(OPS) * S):
            held[self.placement[key % S]].extend(range(key * M, key * M + M))
        return tuple(tuple(h) for h in held)


def durations(graph: ActionGraph, costs: CostModel) -> list[float]:
    """Each action's duration, by index (one lookup per op and stage)."""
    M = graph.num_microbatches
    return [
        x for op in OPS for s in range(graph.num_stages) for x in [float(costs.duration(op, s))] * M
    ]


def hops(graph: ActionGraph, costs: CostModel) -> list[float]:
    """Per action: from its end to when a consumer on another device may start
    (:meth:`~zerobubble.schedule.costs.CostModel.hop`)."""
    return [float(costs.hop(a.op, a.stage)) for a in graph.actions]


def memory_deltas(graph: ActionGraph, costs: CostModel) -> list[float]:
    """Each action's memory change, by index."""
    M = graph.num_microbatches
    return [
        x
        for op in OPS
        for s in range(graph.num_stages)
        for x in [float(costs.memory_delta(op, s))] * M
    ]


def min_feasible_limit(placement: Sequence[int], costs: CostModel) -> Number:
    """The smallest per-device memory limit under which any schedule exists.

    A microbatch's forwards on one device all stay alive until its backward
    reaches that device again, so each device must hold one microbatch's M_B
    for all its stages at once; running one microbatch at a time needs no more.
    Under recompute a B may rebuild more than its F kept (M_W > M_B): a stage then
    counts the larger of the two (an upper bound, exact with one stage per device).
    """
    need: dict[int, Number] = {}
    for s, d in enumerate(placement):
        need[d] = need.get(d, 0) + max(costs.mem_f[s], costs.mem_w[s])
    return max(need.values())
