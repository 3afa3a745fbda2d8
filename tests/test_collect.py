"""The train job's garbage collection: off inside steps, done at their boundaries."""

import gc
import weakref

import pytest

from zerobubble.runtime.launcher import launch
from zerobubble.train.collect import FULL_EVERY, StepCollector
from zerobubble.train.config import JobSection, ModelSection, ScheduleSection, TrainConfig
from zerobubble.train.job import run_job


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_a_cycle_made_during_a_step_lives_until_the_next_boundary() -> None:
    assert gc.isenabled()
    with StepCollector() as collector:
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
    with StepCollector() as collector:
        generations = [collector.boundary() for _ in range(2 * FULL_EVERY)]
    assert generations.count(2) == 2
    assert generations[FULL_EVERY - 1] == 2 and generations[-1] == 2
    assert collector.steps == 2 * FULL_EVERY


def test_the_collector_stays_off_when_it_was_off() -> None:
    gc.disable()
    try:
        with StepCollector():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_what_someone_else_froze_stays_frozen() -> None:
    gc.freeze()
    try:
        fresh = [_Node() for _ in range(1000)]  # made after the freeze: not frozen
        before = gc.get_freeze_count()  # frozen objects that die leave it: it only shrinks
        with StepCollector():
            assert gc.get_freeze_count() <= before  # froze nothing more (fresh stays young)
        assert gc.get_freeze_count() > 0  # and unfroze nothing
        del fresh
    finally:
        gc.unfreeze()


@pytest.mark.slow
def test_the_job_collects_once_before_every_step_it_runs(tmp_path) -> None:
    cfg = TrainConfig(
        model=ModelSection(n_layers=1, d_model=16, n_heads=2),
        schedule=ScheduleSection(devices=2, microbatches=4),
        job=JobSection(seq_len=8, microbatch_size=2, steps=2, baseline_steps=2, out=str(tmp_path)),
    )
    result = launch(run_job, 2, cfg, None, timeout=300)[0]
    cut_steps = 0 if result.balance.measured_equal is None else cfg.job.warmup + 2
    assert len(result.steps) == 2 * 3 + len(result.trials) * 3 + 3 * 3  # warm-up + 2 each
    assert result.collections == len(result.steps) + cut_steps
