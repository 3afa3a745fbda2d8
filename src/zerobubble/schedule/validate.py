"""Static validation of a schedule.

Checks run from the cheapest and most specific to the most global, so the
error names the most precise cause: ranges, placement, duplicates, B/BW
conflicts, completeness, same-device order, cross-device deadlock, memory.
"""

from __future__ import annotations

import numpy as np

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.deps import pair_conflict
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.graph import CODE, Columns, Graph, build_graph
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.simulate import SimResult, simulate


def validate(
    schedule: Schedule,
    mem_limit: Number | None = None,
    costs: CostModel | None = None,
) -> SimResult:
    """Raise :class:`ScheduleError` if ``schedule`` cannot run; else return its simulation.

    Args:
        schedule: The schedule to check.
        mem_limit: Optional per-device activation-memory limit, in the units of
            ``costs`` (M_B of a whole device with the default costs).
        costs: Cost model for timing and memory (uniform F=B=W=1 by default).
    """
    if mem_limit is not None and mem_limit != mem_limit:  # NaN: every comparison is False
        raise ValueError("mem_limit is NaN; pass a number (or None for no memory check)")
    graph = check_structure(schedule)
    result = simulate(schedule, costs, graph=graph)  # raises DEADLOCK
    if mem_limit is not None:
        check_memory(result, mem_limit)
    return result


def check_structure(schedule: Schedule) -> Graph:
    """Every check that needs no timing: ranges, placement, completeness, local order.

    Returns the dependency graph it built, for the simulator to reuse.
    """
    S, M = schedule.num_stages, schedule.num_units
    placement = schedule.placement
    graph = build_graph(schedule)
    cols = graph.columns
    # Each check first runs on the arrays (when the graph has them); only a
    # schedule that fails it is walked action by action to name the first problem.
    if cols is None or not _placed_once(graph, cols, placement):
        _check_actions(graph, S, M, placement)
    if cols is None or not _backwards_consistent(cols):
        _check_backwards(graph)
    num_w = (
        int(np.count_nonzero(cols.op == CODE[Op.W]))
        if cols is not None
        else sum(1 for a in graph.flat if a.op is Op.W)
    )
    if len(graph.flat) != S * M * 2 + num_w:
        _check_complete(graph, S, M, placement)
    if cols is None or _has_local_order_problem(graph):
        _check_local_order(graph)
    if schedule.overlaps:
        _check_overlaps(schedule, graph)
    return graph


def _check_overlaps(schedule: Schedule, graph: Graph) -> None:
    """An overlapped pair runs as one block, its halves at once: they are of two stages
    (:func:`~zerobubble.schedule.deps.pair_conflict`) and its backward may not need its
    forward (a need through another device shows as a deadlock)."""
    for f, b in schedule.overlaps:
        g, h = graph.index[f], graph.index[b]
        conflict = None if g in graph.preds[h] else pair_conflict(f, b)
        if conflict is not None:
            d, i = graph.location(h)
            raise ScheduleError(Reason.OVERLAP, conflict, device=d, position=i, action=b)
        if g in graph.preds[h]:
            d, i = graph.location(h)
            raise ScheduleError(
                Reason.OVERLAP,
                f"it is overlapped with {f}, whose result it needs; pair {f} with the "
                "backward of another microbatch, or run the two in sequence",
                device=d,
                position=i,
                action=b,
            )


def _placed_once(graph: Graph, cols: Columns, placement: tuple[int, ...]) -> bool:
    """Every action on its stage's device, none twice (ranges hold: the columns exist)."""
    on_device = np.asarray(placement)[cols.stage] == np.asarray(graph.device)
    return bool(on_device.all()) and not cols.has_duplicates


def _backwards_consistent(cols: Columns) -> bool:
    """No BW next to a B, every W with its B, every B with its W."""
    op, s, j = cols.op, cols.stage, cols.mb
    has_b = cols.find(CODE[Op.B], s, j) >= 0
    has_w = cols.find(CODE[Op.W], s, j) >= 0
    bad = ((op == CODE[Op.BW]) & has_b) | ((op == CODE[Op.W]) & ~has_b)
    bad |= (op == CODE[Op.B]) & ~has_w
    return not bad.any()


def _has_local_order_problem(graph: Graph) -> bool:
    g = np.arange(len(graph.flat))
    device = np.asarray(graph.device)
    for dep in graph.deps:
        x = np.asarray(dep)
        later = x > g
        if np.any(device[x[later]] == device[later]):
            return True
    return False


def _check_actions(graph: Graph, S: int, M: int, placement: tuple[int, ...]) -> None:
    """Ranges, placement and duplicates, action by action."""
    index = graph.index
    for g, a in enumerate(graph.flat):
        if (
            type(a) is Action
            and type(a.op) is Op
            and 0 <= a.stage < S
            and 0 <= a.mb < M
            and placement[a.stage] == graph.device[g]
            and index[a] == g
        ):
            continue  # the common case; below, name the first problem precisely
        d, i = graph.location(g)
        if not isinstance(a, Action) or not isinstance(a.op, Op):
            raise ScheduleError(
                Reason.OUT_OF_RANGE, f"{a!r} is not an Action", device=d, position=i
            )
        if not 0 <= a.stage < S:
            raise ScheduleError(
                Reason.OUT_OF_RANGE,
                f"stage {a.stage} is outside [0, {S})",
                device=d,
                position=i,
                action=a,
            )
        if not 0 <= a.mb < M:
            raise ScheduleError(
                Reason.OUT_OF_RANGE,
                f"microbatch {a.mb} is outside [0, {M})",
                device=d,
                position=i,
                action=a,
            )
        if placement[a.stage] != d:
            raise ScheduleError(
                Reason.WRONG_DEVICE,
                f"stage {a.stage} is placed on device {placement[a.stage]}, not {d}",
                device=d,
                position=i,
                action=a,
            )
        first = index[a]
        if first != g:
            fd, fi = graph.location(first)
            raise ScheduleError(
                Reason.DUPLICATE,
                f"already scheduled at device {fd} position {fi}",
                device=d,
                position=i,
                action=a,
            )


def _check_backwards(graph: Graph) -> None:
    """B/BW conflicts and the W that needs a B, action by action."""
    index = graph.index
    for g, a in enumerate(graph.flat):
        op, s, j = a
        if op is Op.F:
            continue
        has_b = (Op.B, s, j) in index
        if (op is Op.BW and not has_b) or (op is Op.W and has_b):
            continue
        if op is Op.B and (Op.W, s, j) in index:
            continue
        d, i = graph.location(g)
        if op is Op.BW and has_b:
            fd, fi = graph.location(index[Op.B, s, j])
            raise ScheduleError(
                Reason.CONFLICT,
                f"stage {s} microbatch {j} also has a split B at device {fd} position {fi}; "
                "use either BW or B+W",
                device=d,
                position=i,
                action=a,
            )
        if op is Op.W and not has_b:
            uses_bw = (Op.BW, s, j) in index
            raise ScheduleError(
                Reason.MISSING,
                f"W without its B: stage {s} microbatch {j} has no B"
                + (" (it uses BW, which already computes the weight gradient)" if uses_bw else ""),
                device=d,
                position=i,
                action=a,
            )
        if op is Op.B and (Op.W, s, j) not in index:
            raise ScheduleError(
                Reason.MISSING,
                f"B without its W: stage {s} microbatch {j} never computes its weight gradient",
                device=d,
                position=i,
                action=a,
            )


def _check_complete(graph: Graph, S: int, M: int, placement: tuple[int, ...]) -> None:
    """Name the first (stage, microbatch) without its F or backward."""
    index = graph.index
    for s in range(S):
        for j in range(M):
            if (Op.F, s, j) not in index:
                raise ScheduleError(
                    Reason.MISSING,
                    f"stage {s} microbatch {j} has no F (expected on device {placement[s]})",
                )
            if (Op.B, s, j) not in index and (Op.BW, s, j) not in index:
                raise ScheduleError(
                    Reason.MISSING,
                    f"stage {s} microbatch {j} has no backward (B+W or BW) (expected on "
                    f"device {placement[s]})",
                )


def _check_local_order(graph: Graph) -> None:
    """Name the first action that depends on a later one of its own device."""
    for g, p in enumerate(graph.preds):
        for x in p:
            if x > g and graph.device[x] == graph.device[g]:
                d, i = graph.location(g)
                _, xi = graph.location(x)
                raise ScheduleError(
                    Reason.LOCAL_ORDER,
                    f"it depends on {graph.flat[x]}, which comes later on the same device "
                    f"(position {xi}); move it after position {xi}",
                    device=d,
                    position=i,
                    action=graph.flat[g],
                )


def check_memory(result: SimResult, mem_limit: Number) -> None:
    """Raise if any device's activation memory exceeds ``mem_limit``."""
    eps = 1e-9 * max(1.0, abs(float(mem_limit)))
    for d, curve in enumerate(result.memory):
        for i, level in enumerate(curve):
            if level > mem_limit + eps:
                raise ScheduleError(
                    Reason.MEMORY,
                    f"activation memory reaches {float(level):g} > limit {float(mem_limit):g} "
                    f"(device peak {float(result.peak_memory[d]):g}); raise the limit or pick a "
                    "schedule with fewer microbatches in flight",
                    device=d,
                    position=i,
                    action=result.schedule.actions[d][i],
                )
