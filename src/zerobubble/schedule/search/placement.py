"""``auto``: search the placement (chunks per device, looped or V) and the schedule under it.

Which placement wins depends on the costs and the limit: more chunks per device
shrink the warm-up bubble (each chunk's F is 1/v of the device's) but add a
cross-device hop, and so ``comm``, per chunk; a V placement keeps the turn-around
on one device (no hop there) and drains memory early; under a tight limit the
per-chunk M_B granularity decides what fits. So the planner tries each
candidate placement with the same cost- and memory-aware search
(:func:`.auto.auto_schedule` with that placement's grid and handcrafted seeds),
and the fixed kinds of that placement that are not among the seeds, and keeps
the cheapest.

``auto`` is never worse than a kind it could have chosen, by construction: on
every placement it runs exactly zb-auto's (looped) or zbv-auto's (V) search, so
it gets their schedule or a better one (a pruned or unpolished shortcut lost
14% at the smallest feasible limit, where polishing gains most); instances too
large to polish skip only passes that cannot beat the best placement so far.
The exact searches (``optimal``, ``optimal-v``) are not among its choices.

Candidates for ``max_chunks`` = V: looped (stage s on device s % P) for v = 1..V,
and for every even v <= V the zig-zag (V for v = 2: device d holds d and 2P-1-d;
each further pair of chunks repeats the V). Costs given as per-device totals
(``--costs``) are split over each placement's chunks; a per-stage costs file
fixes the stage count, so only placements with that many stages are tried.

Ties go to the lower peak memory, then to fewer chunks (fewer messages). A layer
count (``max_stages``) keeps only placements with at most that many stages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators.classic import gpipe, one_f_one_b
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.generators.sequence import check_segments
from zerobubble.schedule.generators.v_family import one_f_one_b_v, v_half, v_min
from zerobubble.schedule.ir import Schedule, looped_placement
from zerobubble.schedule.search.auto import (
    SeedPick,
    deadline_after,
    expired,
    pick_seed,
    polishes,
    resolve_costs,
    search_beating,
    search_grid,
    search_inputs,
    split_backward,
)
from zerobubble.schedule.search.graph import ActionGraph
from zerobubble.schedule.search.paired import paired_candidates
from zerobubble.schedule.search.refine import Evaluator
from zerobubble.schedule.search.segmented import key_of, search_segments
from zerobubble.schedule.simulate import SimResult, simulate

#: Chunks per device the planner tries by default.
MAX_CHUNKS = 4

#: Fixed kinds by placement (looped?, chunks) that the search does not seed: ZB-H1,
#: ZB-H2, interleaved 1F1B, ZB-V and DualPipeV are seeds already (see search_inputs).
FIXED_KINDS: dict[tuple[bool, int], tuple[Callable[[int, int], Schedule], ...]] = {
    (True, 1): (gpipe, one_f_one_b),
    (False, 2): (v_half, v_min, one_f_one_b_v),
}


@dataclass(frozen=True)
class Candidate:
    """One placement the planner tries."""

    label: str
    chunks: int
    placement: tuple[int, ...]
    looped: bool


#: The best schedule so far with its key (cost, peak memory, chunks).
Best = tuple[tuple[float, float, int], Schedule]


def zigzag_placement(num_devices: int, chunks: int) -> tuple[int, ...]:
    """Chunk c of device d is stage c*P + d for even c and c*P + P-1-d for odd c."""
    if chunks < 2 or chunks % 2:
        raise ValueError(f"a zig-zag placement needs an even chunk count >= 2, got {chunks}")
    P = num_devices
    return tuple(s % P if (s // P) % 2 == 0 else P - 1 - s % P for s in range(chunks * P))


def candidates(num_devices: int, max_chunks: int = MAX_CHUNKS) -> list[Candidate]:
    """The placements ``auto`` tries, fewest chunks first."""
    if not isinstance(max_chunks, int) or max_chunks < 1:
        raise ValueError(f"max_chunks must be an integer >= 1, got {max_chunks!r}")
    out = []
    for v in range(1, max_chunks + 1):
        out.append(Candidate(f"looped-v{v}", v, looped_placement(num_devices, v), True))
        if v % 2 == 0 and num_devices > 1:
            out.append(Candidate(f"zigzag-v{v}", v, zigzag_placement(num_devices, v), False))
    return out


@dataclass(frozen=True)
class Prescan:
    """A bar for the placement search when no placement polishes: the seeds of its last
    looped placement (the most chunks), simulated before any placement is searched.

    Every placement's result and every fixed kind kept replaces the best so far only when
    cheaper, so the schedule returned costs at most any seed that fits (within rounding):
    at most this one. A placement searched with its beat lowered to just above that cost
    (a relative 1e-6, far above rounding) returns what it returned before when that was
    below the bar, and None where it returned something dearer, which a later placement
    displaced anyway; so the winner and every choice after it are unchanged, while the
    passes of the placements before it stop as soon as they cannot come under the bar
    instead of under their own best so far."""

    label: str
    ev: Evaluator
    pick: SeedPick

    @property
    def bar(self) -> float:
        best = self.pick.best
        return math.inf if best is None else best[1] * (1 + 1e-6)


def prescan(
    cands: list[Candidate],
    p: int,
    m: int,
    cost_of: Callable[[tuple[int, ...]], CostModel],
    mem_limit: Number | None,
) -> Prescan | None:
    """The :class:`Prescan` of these candidates (None: none looped, or it polishes, or its
    limit is infeasible)."""
    looped = [cand for cand in cands if cand.looped]
    if not looped or polishes(3 * len(looped[-1].placement) * m):
        return None
    cand = looped[-1]
    try:
        model, limit = resolve_costs(
            cand.placement, CostSpec(stage_costs=cost_of(cand.placement)), mem_limit, default=p
        )
    except ScheduleError:
        return None
    ev = Evaluator(ActionGraph(cand.placement, m), model)
    _, seeds, family = search_inputs(p, m, cand.chunks, looped=True)
    return Prescan(cand.label, ev, pick_seed(ev, limit, seeds, family))


def _plan_one(
    cand: Candidate,
    p: int,
    m: int,
    model: CostModel,
    limit: float,
    beat: float,
    ev: Evaluator,
    deadline: float | None,
    pick: SeedPick | None = None,
) -> Schedule | None:
    """zb-auto's / zbv-auto's whole search on one placement (:func:`.auto.auto_schedule`,
    with that placement's seeds, or their ``pick``); None if, unpolished, nothing beat
    ``beat``."""
    if pick is None:
        grid, seeds, family = search_inputs(p, m, cand.chunks, looped=cand.looped)
    else:
        grid, seeds, family = search_grid(p, cand.chunks, looped=cand.looped), [], ()
    return search_beating(
        "auto",
        cand.placement,
        m,
        model,
        limit,
        grid,
        seeds,
        seed_orders=family,
        beat=beat,
        evaluator=ev,
        deadline=deadline,
        pick=pick,
    )


def _fixed(
    fn: Callable[[int, int], Schedule],
    p: int,
    m: int,
    model: CostModel,
    limit: float,
    ev: Evaluator,
    beat: float,
) -> tuple[Schedule, SimResult] | None:
    """The fixed kind ``fn`` (each BW written as B then W: no slower) named ``auto``, with
    its simulation; None if it breaks the limit or costs more than ``beat`` (the best
    so far, which it then cannot displace). Only what could win is simulated in full:
    the evaluator rules out clear losers first, with a margin for rounding."""
    sched = split_backward(fn(p, m))
    sched = sched.with_actions(sched.actions, name="auto")
    tol = 1e-10 * max(1.0, abs(limit))  # the search's own tolerance
    orders = ev.graph.orders_of(sched.actions)
    if not all(ev.fits(o, limit + 2 * tol) for o in orders):
        return None
    if beat < math.inf and ev.cost_within(orders, beat) is None:
        return None
    res = simulate(sched, model)
    return (sched, res) if max(res.peak_memory) <= limit + tol else None


def auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    max_chunks: int = MAX_CHUNKS,
    max_stages: int | None = None,
    time_budget_s: float | None = None,
    overlap: bool = False,
    segments: int | None = None,
) -> Schedule:
    """The cheapest schedule over placements (v = 1..``max_chunks``, looped or zig-zag).

    ``mem_limit`` is per device in M_B units of a whole device (as for zb-auto:
    one microbatch's activations over all of a device's layers); without it (here
    or in the costs file) it is P, 1F1B's peak. A per-stage costs file keeps only
    the placements with its stage count; ``max_stages`` (the model's layer count:
    a stage holds one layer at least) only those with at most that many stages.

    ``time_budget_s`` makes the search anytime: once that many seconds have passed it
    returns the best schedule found so far (the first placement's first pass at least,
    so even a budget of 0 gives a valid schedule). Without it the search is a
    deterministic function of its inputs.

    ``overlap`` allows overlapped F&B pairs (:mod:`.paired`): on every placement with
    several stages per device and an all-to-all cost, the paired candidates compete with
    the plain schedule, which wins ties (a pair is formed only where it pays).

    ``segments`` (K) also considers cutting each microbatch's sequence into k = 2..K
    segments, on one stage per device and the V (:mod:`.segmented`); the schedule's
    :attr:`~zerobubble.schedule.ir.Schedule.segments` says which k won (1: none). Ties go
    to fewer segments.
    """
    deadline = deadline_after(time_budget_s)
    p, m = check_counts(num_devices, num_microbatches)
    if segments is not None:
        check_segments(segments)
        if overlap and segments > 1:
            raise ValueError(
                "auto: overlapped F&B pairs with sequence segments are not searched (the "
                "segment search compares unpaired schedules); pass overlap or segments, or "
                "pair a segment kind: generate('seq-zbv', P, M, segments=k, overlap=True)"
            )
    spec = costs if costs is not None else CostSpec()
    if mem_limit is None:
        mem_limit = spec.mem_limit
    stages = None if spec.stage_costs is None else spec.stage_costs.num_stages
    if stages is not None and all(len(c.placement) != stages for c in candidates(p, max_chunks)):
        raise ValueError(
            f"the costs file describes {stages} virtual stages, which is no placement of "
            f"{p} devices with 1..{max_chunks} chunks each; regenerate the profile for "
            f"a multiple of {p} stages (at most {max_chunks * p})"
        )
    plain = search_placements(
        p,
        m,
        spec.resolve,
        mem_limit,
        max_chunks=max_chunks,
        stages=stages,
        max_stages=max_stages,
        deadline=deadline,
        overlap=overlap,
    )
    if segments is None or segments < 2 or expired(deadline):
        return plain
    got = search_segments(
        p,
        m,
        segments,
        spec,
        mem_limit,
        max_chunks=max_chunks,
        stages=stages,
        max_stages=max_stages,
        deadline=deadline,
        beat=key_of(plain, spec.resolve(plain.placement)),
    )
    return plain if got is None else got[1]


def search_placements(
    num_devices: int,
    num_microbatches: int,
    cost_of: Callable[[tuple[int, ...]], CostModel],
    mem_limit: Number | None,
    *,
    max_chunks: int = MAX_CHUNKS,
    stages: int | None = None,
    max_stages: int | None = None,
    deadline: float | None = None,
    overlap: bool = False,
) -> Schedule:
    """The placement search behind ``auto``, with costs from ``cost_of(placement)``.

    ``cost_of`` lets a caller that knows per-layer costs cost each placement's
    stages itself; ``stages`` keeps only placements with that many stages,
    ``max_stages`` only those with at most that many. Past ``deadline`` (a
    :func:`time.monotonic` time) it returns the best schedule found so far.
    ``overlap``: each placement's paired candidates too (:func:`.paired.paired_candidates`).
    """
    p, m = check_counts(num_devices, num_microbatches)
    _check_max_stages(p, max_stages)
    best: Best | None = None
    refusals: list[str] = []
    searched: list[tuple[Candidate, CostModel, float, Schedule | None]] = []
    tried = [
        cand
        for cand in candidates(p, max_chunks)
        if (stages is None or stages == len(cand.placement))
        and (max_stages is None or len(cand.placement) <= max_stages)
    ]
    # Without pairs (which start from every placement's own schedule) and deterministic.
    pre = None if overlap or deadline is not None else prescan(tried, p, m, cost_of, mem_limit)
    for cand in tried:
        if best is not None and expired(deadline):
            break
        model = cost_of(cand.placement)
        try:
            model, limit = resolve_costs(
                cand.placement, CostSpec(stage_costs=model), mem_limit, default=p
            )
        except ScheduleError as exc:
            refusals.append(f"{cand.label}: {exc}")
            continue
        best, sched = _search_placement(cand, p, m, model, limit, best, deadline, pre)
        searched.append((cand, model, limit, sched))
    if overlap:
        best = _search_pairs(searched, m, best, deadline)
    if best is None:
        raise ScheduleError(
            Reason.MEMORY, "no placement fits the memory limit: " + "; ".join(refusals)
        )
    return best[1]


def _check_max_stages(p: int, max_stages: int | None) -> None:
    if max_stages is not None and (
        not isinstance(max_stages, int) or isinstance(max_stages, bool) or max_stages < p
    ):
        raise ValueError(
            f"auto: max_stages={max_stages!r} (the layer count) cannot give each of the "
            f"{p} devices a stage of one layer at least; pass a model of {p} layers or "
            "more, or use fewer devices"
        )


def _search_placement(
    cand: Candidate,
    p: int,
    m: int,
    model: CostModel,
    limit: float,
    best: Best | None,
    deadline: float | None,
    pre: Prescan | None = None,
) -> tuple[Best | None, Schedule | None]:
    """One placement's plain search, then the fixed kinds not among its seeds, each against
    the best so far (and the bar of ``pre``, unpolished). Returns the new best and the
    placement's own schedule (None if none)."""
    # Polished, a placement gets zb-auto's whole search (pruning could lose its
    # winner); unpolished only the cheapest pass counts, so passes that cannot
    # beat the best placement so far (or the prescan's bar) stop early.
    polished = polishes(3 * len(cand.placement) * m)
    bar = math.inf if pre is None or polished else pre.bar
    beat = math.inf if polished else min(bar, math.inf if best is None else best[0][0])
    mine = pre is not None and pre.label == cand.label
    ev = pre.ev if pre is not None and mine else Evaluator(ActionGraph(cand.placement, m), model)
    pick = pre.pick if pre is not None and mine else None
    sched = _plan_one(cand, p, m, model, limit, beat, ev, deadline, pick)
    if sched is not None:
        best = _keep(best, sched, simulate(sched, model), cand)
    for fn in FIXED_KINDS.get((cand.looped, cand.chunks), ()):
        if best is not None and expired(deadline):
            break
        so_far = math.inf if best is None else best[0][0]
        got = _fixed(fn, p, m, model, limit, ev, min(so_far, bar))
        if got is not None:
            best = _keep(best, *got, cand)
    return best, sched


def _search_pairs(
    searched: list[tuple[Candidate, CostModel, float, Schedule | None]],
    m: int,
    best: Best | None,
    deadline: float | None,
) -> Best | None:
    """With pairs, each placement's paired candidates after every plain search (which runs
    as without pairs), the zig-zags first: DualPipeV's own pairs there set the bar that
    prunes the other placements' pairing passes when they are too large to polish."""
    for cand, model, limit, sched in sorted(searched, key=lambda t: t[0].looped):
        if best is not None and expired(deadline):
            break
        for got in paired_candidates(
            "auto",
            cand.placement,
            m,
            model,
            limit,
            sched,
            looped=cand.looped,
            chunks=cand.chunks,
            deadline=deadline,
            beat=math.inf if best is None else best[0][0],
            paired_before=best is not None and bool(best[1].overlaps),
        ):
            best = _keep(best, *got, cand)
    return best


def _keep(best: Best | None, sched: Schedule, res: SimResult, cand: Candidate) -> Best:
    """The better of ``best`` and ``sched``: cost first (exactly: auto is never worse than
    a kind it could have chosen), then peak memory, then chunks; ties keep ``best``."""
    key = float(res.cost), float(max(res.peak_memory)), cand.chunks
    return (key, sched) if best is None or key < best[0] else best
