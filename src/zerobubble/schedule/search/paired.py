"""The searches with overlapped F&B pairs (``overlap=True``): the paired candidates of one
placement, each timed exactly.

A placement with several stages per device and an all-to-all cost gets, beside the plain
search's schedule (which the caller keeps: pairs are formed only where they pay):

* the fixed kinds of the placement with their pairs, as ``generate(kind, overlap=True,
  costs=..., mem_limit=...)`` makes them: DualPipeV's own pairs (the V), and the pairs
  that :func:`~zerobubble.schedule.passes.overlap_where_it_pays` forms on ZB-V, V-Half,
  V-Min and 1F1B-V (the V) or on interleaved 1F1B (looped, v chunks), where that pass is
  affordable (:data:`PASS_MAX_ACTIONS`); so ``auto`` is never worse than any of them;
* the search of :func:`~.auto.search_beating` with ``pairs=True``: list-scheduling passes
  that pair (:attr:`~.greedy.Policy.pair`), those fixed kinds and the plain schedule (with
  and without the pass's pairs) as seeds, and the local search that forms, undoes and
  moves pairs (:mod:`.pairs`); on instances too large for that local search (more than
  ``PAIR_STEPS / REFINE_MIN_RUNS`` = 5,000 actions) only where no paired schedule exists
  yet (no fixed kind of the placement fits, and the best so far has no pairs).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from zerobubble.schedule.costs import CostModel
from zerobubble.schedule.generators.classic import interleaved_1f1b
from zerobubble.schedule.generators.dualpipe import dualpipev
from zerobubble.schedule.generators.v_family import one_f_one_b_v, v_half, v_min
from zerobubble.schedule.generators.zero_bubble import zbv
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.passes import overlap_where_it_pays
from zerobubble.schedule.search.auto import (
    GRID_V,
    PAIR_STEPS,
    polishes,
    round_grid,
    search_beating,
)
from zerobubble.schedule.search.graph import ActionGraph
from zerobubble.schedule.search.greedy import Policy
from zerobubble.schedule.search.pairs import PairEvaluator, can_pair
from zerobubble.schedule.simulate import SimResult, simulate

#: The largest schedule (actions) the pair pass runs on inside the search: it simulates the
#: whole schedule once per candidate pair, so its time grows with the square of this.
PASS_MAX_ACTIONS = 2000

#: The V's fixed kinds whose pairs come from the pass (DualPipeV has its own).
V_KINDS: tuple[Callable[[int, int], Schedule], ...] = (zbv, v_half, v_min, one_f_one_b_v)


def pair_grid(num_devices: int, *, looped: bool, chunks: int) -> tuple[Policy, ...]:
    """The list scheduler's grid with pairs: the multi-stage grid (and the round orders of
    a looped placement), each with and without a W right after a block."""
    base = GRID_V + (round_grid(num_devices) if looped and chunks > 1 else ())
    return tuple(replace(pol, pair=True, pair_then_w=w) for w in (True, False) for pol in base)


def paired_kinds(
    num_devices: int, num_microbatches: int, chunks: int, *, looped: bool
) -> list[Schedule]:
    """The fixed kinds of the placement that pair: DualPipeV with its pairs, then (to get
    the pass's pairs) ZB-V and the V family on the V, interleaved 1F1B on a looped one."""
    p, m = num_devices, num_microbatches
    if looped:
        return [interleaved_1f1b(p, m, chunks=chunks)] if chunks > 1 else []
    if chunks != 2:
        return []
    return [dualpipev(p, m, overlap=True), *(fn(p, m) for fn in V_KINDS)]


def paired_candidates(
    name: str,
    placement: tuple[int, ...],
    num_microbatches: int,
    costs: CostModel,
    mem_limit: float,
    plain: Schedule | None,
    *,
    looped: bool,
    chunks: int,
    deadline: float | None = None,
    beat: float = math.inf,
    paired_before: bool = False,
) -> list[tuple[Schedule, SimResult]]:
    """The paired schedules of one placement within ``mem_limit``, named ``name``, each with
    its simulation (see the module docstring); none where no pair can hide anything, or
    where no order of the placement, paired or not, can cost less than ``beat`` (the best
    cost so far: its floor, :meth:`~.pairs.PairEvaluator.floor`, is above it).
    ``plain`` is the plain search's schedule of the placement (None if it had none);
    ``paired_before``: the best so far has pairs (then, on an instance too large to polish,
    no pairing pass runs)."""
    if not can_pair(placement, costs):
        return []
    ev = PairEvaluator(ActionGraph(placement, num_microbatches), costs)
    if ev.floor() > beat + 1e-9 * max(1.0, abs(beat)):
        return []
    p = max(placement) + 1
    tol = 1e-10 * max(1.0, abs(mem_limit))
    out: list[tuple[Schedule, SimResult]] = []
    seeds: list[Schedule] = []
    for sched in paired_kinds(p, num_microbatches, chunks, looped=looped):
        if sched.placement != placement:  # pragma: no cover - the kinds match their placement
            continue
        if not sched.overlaps:  # the pass's pairs, where it is affordable
            if len(sched) > PASS_MAX_ACTIONS:
                continue
            sched = overlap_where_it_pays(sched, costs, mem_limit)
        res = simulate(sched, costs)
        if max(res.peak_memory) <= mem_limit + tol:
            named = sched.with_actions(sched.actions, name=name, overlaps=sched.overlaps)
            out.append((named, res))
            seeds.append(sched)
    if (out or paired_before) and not polishes(len(ev.graph), PAIR_STEPS):
        # Too large for the pairing polish: unpolished, the pairing passes lose to the
        # fixed kinds' pairs (docs/search.md), so they run only where no paired schedule
        # exists yet.
        return out
    if plain is not None:
        seeds.append(plain)
        if len(plain) <= PASS_MAX_ACTIONS:
            seeds.append(overlap_where_it_pays(plain, costs, mem_limit))
    found = search_beating(
        name,
        placement,
        num_microbatches,
        costs,
        mem_limit,
        pair_grid(p, looped=looped, chunks=chunks),
        seeds,
        pairs=True,
        evaluator=ev,
        deadline=deadline,
        # Unpolished (large instances), passes that cannot beat the best so far stop early.
        beat=min([beat, *(float(res.cost) for _, res in out)]),
    )
    if found is not None:
        out.append((found, simulate(found, costs)))
    return out
