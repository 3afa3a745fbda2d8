"""The train job's garbage collection: off inside steps, done at their boundaries."""

import gc
import weakref

from zerobubble.train.collect import FULL_EVERY, collect_between_steps


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_cycle_made_during_a_step_lives_until_the_next_boundary() -> None:
    assert gc.isenabled()
    with collect_between_steps() as collector:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what existed before training is never walked again
        ref = _cycle()
        kept = [_Node() for _ in range(20_000)]  # enough to trigger automatic collection
        assert ref() is not None
        del kept
        assert collector.boundary() == 1
        assert ref() is None
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_every_full_every_th_boundary_collects_every_generation() -> None:
    with collect_between_steps() as collector:
        generations = [collector.boundary() for _ in range(2 * FULL_EVERY)]
    assert generations.count(2) == 2
    assert generations[FULL_EVERY - 1] == 2 and generations[-1] == 2


def test_the_collector_stays_off_when_it_was_off() -> None:
    gc.disable()
    try:
        with collect_between_steps():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
