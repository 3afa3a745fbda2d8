"""The fixed-placement searches ``zb-auto`` and ``zbv-auto``: :func:`.auto.auto_schedule` on
one placement, and with ``overlap`` the paired candidates of that placement beside it
(:mod:`.paired`).

Their own module, above both :mod:`.auto` (the search) and :mod:`.paired` (which builds on
the search), so that neither imports the other back.
"""

from __future__ import annotations

from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.generators.common import check_counts
from zerobubble.schedule.ir import Schedule, looped_placement, v_placement
from zerobubble.schedule.search.auto import auto_schedule, resolve_costs, search_inputs
from zerobubble.schedule.search.paired import paired_candidates
from zerobubble.schedule.simulate import simulate

__all__ = ["zb_auto", "zbv_auto"]


def zb_auto(
    num_devices: int,
    num_microbatches: int,
    *,
    chunks: int = 1,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    overlap: bool = False,
) -> Schedule:
    """Automatic zero-bubble schedule under a memory limit.

    One stage per device by default (the paper's ZB-1p / ZB-2p); ``chunks`` > 1
    uses the interleaved (looped) placement, stage s on device s % P, like
    PyTorch's InterleavedZeroBubble. Without ``mem_limit`` (here or in the costs
    file) the limit is P microbatches' M_B, 1F1B's and ZB-H1's peak: ZB-1p.
    Pass 2P for ZB-2p. ``overlap`` allows overlapped F&B pairs where they pay (with
    ``chunks`` > 1 and an all-to-all cost; see ``auto``).
    """
    p, m = check_counts(num_devices, num_microbatches)
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    placement = looped_placement(p, chunks)
    model, limit = resolve_costs(placement, costs, mem_limit, default=p)
    grid, seeds, family = search_inputs(p, m, chunks, looped=True)
    sched = auto_schedule("zb-auto", placement, m, model, limit, grid, seeds, seed_orders=family)
    return _with_pairs(sched, model, limit, looped=True, chunks=chunks) if overlap else sched


def zbv_auto(
    num_devices: int,
    num_microbatches: int,
    *,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    overlap: bool = False,
) -> Schedule:
    """Automatic ZB-V: V placement (device d holds stages d and 2P-1-d) under a memory limit.

    Without ``mem_limit`` the limit is P microbatches' M_B per device, ZB-V's own peak.
    ``overlap`` allows overlapped F&B pairs where they pay (an all-to-all cost; see ``auto``).
    """
    p, m = check_counts(num_devices, num_microbatches)
    placement = v_placement(p)
    model, limit = resolve_costs(placement, costs, mem_limit, default=p)
    grid, seeds, _ = search_inputs(p, m, 2, looped=False)
    sched = auto_schedule("zbv-auto", placement, m, model, limit, grid, seeds)
    return _with_pairs(sched, model, limit, looped=False, chunks=2) if overlap else sched


def _with_pairs(
    plain: Schedule, costs: CostModel, mem_limit: float, *, looped: bool, chunks: int
) -> Schedule:
    """The cheapest of ``plain`` and the paired candidates of its placement
    (:func:`.paired.paired_candidates`); ``plain`` on ties (cost, then peak memory)."""
    res = simulate(plain, costs)
    best = (float(res.cost), float(max(res.peak_memory))), plain
    for sched, got in paired_candidates(
        plain.name,
        plain.placement,
        plain.num_microbatches,
        costs,
        mem_limit,
        plain,
        looped=looped,
        chunks=chunks,
    ):
        key = float(got.cost), float(max(got.peak_memory))
        if key < best[0]:
            best = key, sched
    return best[1]
