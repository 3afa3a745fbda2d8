"""Generate, validate and simulate several schedule kinds under one cost model."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from zerobubble.schedule.costs import CostSpec, Number
from zerobubble.schedule.generators import GENERATORS, generate
from zerobubble.schedule.simulate import SimResult
from zerobubble.schedule.validate import validate


@dataclass(frozen=True)
class Entry:
    """One kind's outcome: a simulation, or why the kind cannot express this case."""

    kind: str
    result: SimResult | None = None
    error: str | None = None


def compare(
    num_devices: int,
    num_microbatches: int,
    spec: CostSpec | None = None,
    kinds: Iterable[str] | None = None,
    *,
    mem_limit: Number | None = None,
    chunks: int = 2,
) -> list[Entry]:
    """Every requested kind (all registered ones by default), validated and simulated.

    ``mem_limit`` is passed to the kinds that take one (the others report
    their own peak); ``chunks`` applies to kinds that take a chunk count.
    """
    spec = spec or CostSpec()
    limit = mem_limit if mem_limit is not None else spec.mem_limit
    entries = []
    for kind in kinds or GENERATORS:
        gen = GENERATORS.get(kind)
        if gen is None:
            raise ValueError(f"unknown schedule kind {kind!r}; choose from {', '.join(GENERATORS)}")
        try:
            sched = generate(
                kind,
                num_devices,
                num_microbatches,
                chunks=chunks if "chunks" in gen.options else None,
                costs=spec,
                mem_limit=limit if "mem_limit" in gen.options else None,
            )
            costs = spec.resolve(sched.placement, sched.segments)
            entries.append(Entry(kind, validate(sched, costs=costs)))
        except ValueError as exc:  # includes ScheduleError
            entries.append(Entry(kind, error=str(exc)))
    return entries
