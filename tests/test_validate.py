"""The validator: precise reasons, plus property tests against an independent oracle."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zerobubble.schedule.deps import backward_ops, dependencies
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.validate import validate

# ---- random valid schedules ----------------------------------------------------------------


def random_schedule(seed: int) -> Schedule:
    """A random valid schedule: random placement, random B/W split, random topological order."""
    rng = random.Random(seed)
    p = rng.randint(1, 4)
    s = rng.randint(p, 3 * p)
    m = rng.randint(1, 5)
    placement = list(range(p)) + [rng.randrange(p) for _ in range(s - p)]
    rng.shuffle(placement)
    split = {(st_, j): rng.random() < 0.6 for st_ in range(s) for j in range(m)}
    todo = set()
    for st_ in range(s):
        for j in range(m):
            todo.add(Action(Op.F, st_, j))
            if split[st_, j]:
                todo |= {Action(Op.B, st_, j), Action(Op.W, st_, j)}
            else:
                todo.add(Action(Op.BW, st_, j))
    bw = {(a.stage, a.mb): a.op for a in todo if a.op.is_backward}
    done: set[Action] = set()
    actions: list[list[Action]] = [[] for _ in range(p)]
    while todo:
        ready = sorted(a for a in todo if all(d in done for d in dependencies(a, s, bw)))
        a = rng.choice(ready)
        todo.remove(a)
        done.add(a)
        actions[placement[a.stage]].append(a)
    return Schedule("random", p, s, m, tuple(placement), actions)


def oracle(sched: Schedule) -> Reason | None:
    """Independent, brute-force judgement of order problems (structure assumed complete)."""
    pos = {a: (d, i) for d, i, a in sched}
    bw = backward_ops(sched)
    for d, i, a in sched:
        for dep in dependencies(a, sched.num_stages, bw):
            dd, di = pos[dep]
            if dd == d and di > i:
                return Reason.LOCAL_ORDER
    # Cycle check by repeated elimination of runnable device heads.
    heads = [0] * sched.num_devices
    finished: set[Action] = set()
    progress = True
    while progress:
        progress = False
        for d, acts in enumerate(sched.actions):
            while heads[d] < len(acts) and all(
                x in finished for x in dependencies(acts[heads[d]], sched.num_stages, bw)
            ):
                finished.add(acts[heads[d]])
                heads[d] += 1
                progress = True
    return None if len(finished) == len(sched) else Reason.DEADLOCK


SEEDS = st.integers(min_value=0, max_value=10**9)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(SEEDS)
def test_random_valid_schedules_are_accepted(seed):
    validate(random_schedule(seed))


@SETTINGS
@given(SEEDS, st.randoms(use_true_random=False))
def test_dropping_an_action_is_missing(seed, rng):
    sched = random_schedule(seed)
    d = rng.choice([d for d, acts in enumerate(sched.actions) if acts])
    acts = [list(x) for x in sched.actions]
    dropped = acts[d].pop(rng.randrange(len(acts[d])))
    with pytest.raises(ScheduleError) as err:
        validate(sched.with_actions(acts))
    assert err.value.reason is Reason.MISSING
    assert f"stage {dropped.stage} microbatch {dropped.mb}" in str(err.value)


@SETTINGS
@given(SEEDS, st.randoms(use_true_random=False))
def test_duplicating_an_action_is_duplicate(seed, rng):
    sched = random_schedule(seed)
    d = rng.choice([d for d, acts in enumerate(sched.actions) if acts])
    acts = [list(x) for x in sched.actions]
    a = rng.choice(acts[d])
    acts[d].insert(rng.randrange(len(acts[d]) + 1), a)
    with pytest.raises(ScheduleError) as err:
        validate(sched.with_actions(acts))
    assert err.value.reason is Reason.DUPLICATE
    assert err.value.action == a and err.value.device == d


@SETTINGS
@given(SEEDS, st.randoms(use_true_random=False))
def test_moving_an_action_to_another_device_is_wrong_device(seed, rng):
    sched = random_schedule(seed)
    if sched.num_devices < 2:
        return
    d = rng.choice([d for d, acts in enumerate(sched.actions) if acts])
    e = rng.choice([x for x in range(sched.num_devices) if x != d])
    acts = [list(x) for x in sched.actions]
    a = acts[d].pop(rng.randrange(len(acts[d])))
    acts[e].insert(rng.randrange(len(acts[e]) + 1), a)
    with pytest.raises(ScheduleError) as err:
        validate(sched.with_actions(acts))
    assert err.value.reason is Reason.WRONG_DEVICE
    assert (err.value.action, err.value.device) == (a, e)


@SETTINGS
@given(SEEDS, st.randoms(use_true_random=False))
def test_swapping_two_actions_matches_the_oracle(seed, rng):
    """Swap two actions of one device: accepted iff the oracle finds no order problem."""
    sched = random_schedule(seed)
    d = rng.choice([d for d, acts in enumerate(sched.actions) if len(acts) >= 2])
    acts = [list(x) for x in sched.actions]
    i, k = sorted(rng.sample(range(len(acts[d])), 2))
    acts[d][i], acts[d][k] = acts[d][k], acts[d][i]
    mutated = sched.with_actions(acts)
    expected = oracle(mutated)
    if expected is None:
        validate(mutated)
    else:
        with pytest.raises(ScheduleError) as err:
            validate(mutated)
        assert err.value.reason is expected


def test_swap_across_dependency_examples():
    sched = generate("1f1b", 2, 2)
    # On device 0: F0 F1 BW0 BW1 -> swap F0 and BW0 (same-device dependency).
    acts = [list(x) for x in sched.actions]
    acts[0][0], acts[0][2] = acts[0][2], acts[0][0]
    with pytest.raises(ScheduleError, match=r"local_order.*BW\(s0,mb0\) at device 0 position 0"):
        validate(sched.with_actions(acts))
    # On device 1: F0 BW0 F1 BW1 -> put F1 (needs device 0's F1) after BW1 ... still fine;
    # instead make device 0 run BW0 before F1 while device 1 wants F1 before BW0's grad.
    acts = [list(x) for x in sched.actions]
    acts[1] = [Action(Op.F, 1, 0), Action(Op.F, 1, 1), Action(Op.BW, 1, 0), Action(Op.BW, 1, 1)]
    acts[0] = [Action(Op.F, 0, 0), Action(Op.BW, 0, 0), Action(Op.F, 0, 1), Action(Op.BW, 0, 1)]
    with pytest.raises(ScheduleError) as err:
        validate(sched.with_actions(acts))
    assert err.value.reason is Reason.DEADLOCK
    msg = str(err.value)
    assert "device 0 at position 1 (BW(s0,mb0)) waits for BW(s1,mb0) at device 1 position 2" in msg
    assert "device 1 at position 1 (F(s1,mb1)) waits for F(s0,mb1) at device 0 position 2" in msg


def test_out_of_range_and_conflicts():
    sched = generate("zb-h1", 2, 2)
    acts = [list(x) for x in sched.actions]
    acts[1].append(Action(Op.F, 1, 5))
    with pytest.raises(
        ScheduleError,
        match=r"out_of_range.*F\(s1,mb5\) at device 1 position 6: "
        r"microbatch 5 is outside \[0, 2\)",
    ):
        validate(sched.with_actions(acts))
    acts = [list(x) for x in sched.actions]
    acts[0].append(Action(Op.BW, 0, 0))
    with pytest.raises(ScheduleError) as err:
        validate(sched.with_actions(acts))
    assert err.value.reason is Reason.CONFLICT
    acts = [list(x) for x in sched.actions]
    acts[0].remove(Action(Op.W, 0, 1))
    with pytest.raises(ScheduleError, match="B without its W: stage 0 microbatch 1"):
        validate(sched.with_actions(acts))


def test_memory_limit():
    sched = generate("zb-h2", 4, 8)
    validate(sched, mem_limit=7)
    with pytest.raises(ScheduleError) as err:
        validate(sched, mem_limit=6)
    e = err.value
    assert e.reason is Reason.MEMORY and e.device == 0
    assert e.action == Action(Op.F, 0, 6) and e.position == 6
    assert "reaches 7 > limit 6" in str(e)


def test_schedule_constructor_checks():
    with pytest.raises(ValueError, match="placement has 1 entries but num_stages=2"):
        Schedule("x", 1, 2, 1, (0,), [[]])
    with pytest.raises(ValueError, match=r"placement\[1\]=3 is not a device"):
        Schedule("x", 2, 2, 1, (0, 3), [[], []])
    with pytest.raises(ValueError, match="actions has 1 device lists but num_devices=2"):
        Schedule("x", 2, 2, 1, (0, 1), [[]])
