"""``auto``: search the placement (chunks per device, looped or V) and the schedule under it.

Which placement wins depends on the costs and the limit: more chunks per device
shrink the warm-up bubble (each chunk's F is 1/v of the device's) but add a
cross-device hop, and so ``comm``, per chunk; a V placement keeps the turn-around
on one device (no hop there) and drains memory early; under a tight limit the
per-chunk M_B granularity decides what fits. So the planner tries each
candidate placement with the same cost- and memory-aware search
(:func:`.auto.auto_schedule` with that placement's grid and handcrafted seeds)
and keeps the cheapest.

Candidates for ``max_chunks`` = V: looped (stage s on device s % P) for v = 1..V,
and for every even v <= V the zig-zag (V for v = 2: device d holds d and 2P-1-d;
each further pair of chunks repeats the V). Costs given as per-device totals
(``--costs``) are split over each placement's chunks; a per-stage costs file
fixes the stage count, so only placements with that many stages are tried.

Ties go to the lower peak memory, then to fewer chunks (fewer messages).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.ir import Schedule, looped_placement
from zerobubble.schedule.search.auto import (
    plateau_walk,
    polishes,
    resolve_costs,
    search_beating,
    search_inputs,
)
from zerobubble.schedule.simulate import simulate

#: Chunks per device the planner tries by default.
MAX_CHUNKS = 4

#: Placements whose unpolished cost is within this fraction of the best unpolished one
#: get the local search (polishing gains a few percent at most; it is the slow step).
POLISH_WITHIN = 0.02


@dataclass(frozen=True)
class Candidate:
    """One placement the planner tries."""

    label: str
    chunks: int
    placement: tuple[int, ...]
    looped: bool


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


def _plan_one(
    cand: Candidate,
    p: int,
    m: int,
    model: CostModel,
    limit: float,
    polish: bool,
    beat: float = math.inf,
) -> Schedule | None:
    """The search of :mod:`.auto` on one placement, with that placement's seeds
    (without the plateau walk: ``auto`` walks its winner only)."""
    grid, seeds, family = search_inputs(p, m, cand.chunks, looped=cand.looped)
    return search_beating(
        "auto",
        cand.placement,
        m,
        model,
        limit,
        grid,
        seeds,
        seed_orders=family,
        polish=polish,
        walk=False,
        beat=beat,
    )


def auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    max_chunks: int = MAX_CHUNKS,
) -> Schedule:
    """The cheapest schedule over placements (v = 1..``max_chunks``, looped or zig-zag).

    ``mem_limit`` is per device in M_B units of a whole device (as for zb-auto:
    one microbatch's activations over all of a device's layers); without it (here
    or in the costs file) it is P, 1F1B's peak. A per-stage costs file keeps only
    the placements with its stage count.
    """
    p, m = check_counts(num_devices, num_microbatches)
    spec = costs if costs is not None else CostSpec()
    if mem_limit is None:
        mem_limit = spec.mem_limit
    if spec.stage_costs is not None:
        stages = spec.stage_costs.num_stages
        if not any(len(c.placement) == stages for c in candidates(p, max_chunks)):
            raise ValueError(
                f"the costs file describes {stages} virtual stages, which is no placement of "
                f"{p} devices with 1..{max_chunks} chunks each; regenerate the profile for "
                f"a multiple of {p} stages (at most {max_chunks * p})"
            )
    return search_placements(
        p,
        m,
        spec.resolve,
        mem_limit,
        max_chunks=max_chunks,
        stages=(None if spec.stage_costs is None else spec.stage_costs.num_stages),
    )


def search_placements(
    num_devices: int,
    num_microbatches: int,
    cost_of: Callable[[tuple[int, ...]], CostModel],
    mem_limit: Number | None,
    *,
    max_chunks: int = MAX_CHUNKS,
    stages: int | None = None,
) -> Schedule:
    """The placement search behind ``auto``, with costs from ``cost_of(placement)``.

    ``cost_of`` lets a caller that knows per-layer costs cost each placement's
    stages itself; ``stages`` keeps only placements with that many stages.
    """
    p, m = check_counts(num_devices, num_microbatches)
    rough: list[tuple[tuple[float, float, int], Candidate, CostModel, float, Schedule]] = []
    refusals: list[str] = []
    for cand in candidates(p, max_chunks):
        if stages is not None and stages != len(cand.placement):
            continue
        model = cost_of(cand.placement)
        try:
            model, limit = resolve_costs(
                cand.placement, CostSpec(stage_costs=model), mem_limit, default=p
            )
        except ScheduleError as exc:
            refusals.append(f"{cand.label}: {exc}")
            continue
        # Passes that cannot come within POLISH_WITHIN of the best so far stop early.
        beat = min((r[0][0] for r in rough), default=math.inf) * (1 + POLISH_WITHIN)
        sched = _plan_one(cand, p, m, model, limit, polish=False, beat=beat)
        if sched is None:
            continue
        rough.append((_key(sched, model, cand), cand, model, limit, sched))
    if not rough:
        raise ScheduleError(
            Reason.MEMORY, "no placement fits the memory limit: " + "; ".join(refusals)
        )
    # Polish only the placements whose unpolished cost is near the best one's.
    floor = min(r[0][0] for r in rough)
    best: tuple[tuple[float, float, int], Schedule, CostModel, float] | None = None
    for key, cand, model, limit, sched in rough:
        if key[0] <= floor * (1 + POLISH_WITHIN) and polishes(len(sched)):
            polished = _plan_one(cand, p, m, model, limit, polish=True)
            assert polished is not None  # no cutoff: every grid finishes
            sched, key = polished, _key(polished, model, cand)
        if best is None or _less(key, best[0]):
            best = (key, sched, model, limit)
    assert best is not None
    return plateau_walk(best[1], best[2], best[3])


def _key(sched: Schedule, model: CostModel, cand: Candidate) -> tuple[float, float, int]:
    res = simulate(sched, model)
    return float(res.cost), float(max(res.peak_memory)), cand.chunks


def _less(x: tuple[float, float, int], y: tuple[float, float, int]) -> bool:
    """Cost first (relative tolerance 1e-9), then peak memory, then chunks."""
    tol = 1e-9 * max(1.0, abs(y[0]))
    if x[0] < y[0] - tol:
        return True
    if x[0] > y[0] + tol:
        return False
    return x[1:] < y[1:]
