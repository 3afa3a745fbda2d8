"""Python's garbage collector at step boundaries, not inside a step.

CPython's cyclic collector runs whenever enough container objects have been
allocated, so with automatic collection a pause of a few milliseconds (a
young-generation pass) or of a hundred (a full pass over everything torch
imported) lands inside some step, on one rank: every rank waiting on that one
stalls, and a schedule's measured step time depends on where the pauses fell.
A training job therefore turns automatic collection off, freezes what exists
when the job starts (torch's and the library's modules) so that no later pass
walks it, and collects the young generations itself between steps, as
torchtitan and Megatron-LM do. Memory freed by reference counting (almost
all of a step's tensors and autograd graphs) is freed as before; only cyclic
garbage waits for the next boundary.
"""

from __future__ import annotations

import gc

FULL_EVERY = 50
"""Steps between full collections (a young-generation one before every other step):
cycles that survive into the oldest generation are freed this often."""


class StepCollector:
    """A context manager: automatic collection off (and what exists on entry frozen)
    inside the block, as it was after it; the block calls :meth:`boundary` before each
    step. Objects someone else froze stay frozen (then this one freezes nothing)."""

    def __init__(self) -> None:
        self.steps = 0
        """Boundaries collected so far: one per step run inside the block."""
        self._was_enabled = True
        self._froze = False

    def __enter__(self) -> StepCollector:
        self._was_enabled = gc.isenabled()
        self._froze = gc.get_freeze_count() == 0
        if self._froze:
            gc.collect()
            gc.freeze()
        gc.disable()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._froze:
            gc.unfreeze()
        if self._was_enabled:
            gc.enable()

    def boundary(self) -> int:
        """Collect before the next step: the young generations, or every
        :data:`FULL_EVERY` steps all of them. Returns the generation collected."""
        self.steps += 1
        generation = 2 if self.steps % FULL_EVERY == 0 else 1
        gc.collect(generation)
        return generation
