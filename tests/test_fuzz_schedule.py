"""Schedule mutation fuzz: valid schedules of every generator kind, mutated by swapping,
dropping, duplicating, moving or relabelling actions and by changing the placement, must be
accepted or rejected exactly as an independent judge written here decides.

The judge re-derives validity from the definition of a schedule (docs/architecture.md:
every F once, every backward as BW or as B+W, each on its stage's device, and an order in
which every device can run its list given F(s,j) <- F(s-1,j), B/BW(s,j) <- F(s,j) and the
backward of (s+1,j), W(s,j) <- B(s,j)); it uses nothing from the validator or from
``schedule.ir``'s dependency helpers. It returns every applicable reason; the validator
must raise one of them (it reports structure before order, see validate.py).

A covering design over (kind, size), not the product: the kinds that are made directly run
at every size in SIZES, P = 2, 3 and 4; the searching kinds (seconds of solving per size)
at P = 3, M = 4 only, which keeps P >= 3 and their V-shaped and multi-chunk placements
(auto's is 12 stages) and is the size test_placement_search generates auto at. The
mutations and the judge depend on a schedule's shape, not on the search that made it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generated import generated
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import GENERATORS
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.validate import validate

KINDS = sorted(GENERATORS)
SIZES = [(2, 3), (3, 4), (4, 5)]  # P >= 3 includes every V-shaped kind at P = 3 and 4
SEARCHING = frozenset({"auto", "optimal", "optimal-v", "zb-auto", "zbv-auto"})
"""The kinds that solve a search (up to 9 s each per size); they run at SEARCH_SIZES."""
SEARCH_SIZES = [(3, 4)]


def sizes(kind: str) -> list[tuple[int, int]]:
    return SEARCH_SIZES if kind in SEARCHING else SIZES


FAST = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
LONG = settings(FAST, max_examples=200)
"""200 draws per kind (it was 400, halved for the suite's time budget), each of one to three
of the seven mutations: about 400 mutations per kind, so each mutation still meets each of a
kind's sizes about twenty times on average."""
MUTATIONS = ("swap", "swap_devices", "drop", "duplicate", "move", "relabel", "placement")
STRUCTURE = {Reason.OUT_OF_RANGE, Reason.WRONG_DEVICE, Reason.DUPLICATE}


# ---- the independent judge -----------------------------------------------------------------


def judge(sched: Schedule) -> set[Reason]:
    """Every reason that applies to ``sched``; empty iff it can run."""
    S, M = sched.num_stages, sched.num_units
    flat = [(d, i, a) for d, acts in enumerate(sched.actions) for i, a in enumerate(acts)]
    found: set[Reason] = set()
    for d, _, a in flat:
        if not (0 <= a.stage < S and 0 <= a.mb < M):
            found.add(Reason.OUT_OF_RANGE)
        elif sched.placement[a.stage] != d:
            found.add(Reason.WRONG_DEVICE)
    if any(n > 1 for n in Counter(a for _, _, a in flat).values()):
        found.add(Reason.DUPLICATE)
    ops: dict[tuple[int, int], set[Op]] = {(s, j): set() for s in range(S) for j in range(M)}
    for _, _, a in flat:
        if (a.stage, a.mb) in ops:
            ops[a.stage, a.mb].add(a.op)
    for have in ops.values():
        if {Op.B, Op.BW} <= have:  # both ways of computing the input gradient
            found.add(Reason.CONFLICT)
        if (
            Op.F not in have
            or not have & {Op.B, Op.BW}
            or (Op.B in have) != (Op.W in have)  # a half of the split without the other
        ):
            found.add(Reason.MISSING)
    if found:
        return found
    return order_problems(sched, ops)


def needs(a: Action, S: int, ops: dict[tuple[int, int], set[Op]], k: int = 1) -> list[Action]:
    """What ``a`` waits for, from the definition of the passes: with ``k`` segments per
    microbatch, a forward also waits for its segment's predecessor and a backward for its
    successor's backward (units ``j`` and ``j -+ 1`` of one microbatch)."""
    s, j = a.stage, a.mb
    if a.op is Op.F:
        out = [Action(Op.F, s - 1, j)] if s > 0 else []
        if j % k:
            out.append(Action(Op.F, s, j - 1))
        return out
    if a.op is Op.W:
        return [Action(Op.B, s, j)]
    out = [Action(Op.F, s, j)]
    if s + 1 < S:
        out.append(Action(Op.BW if Op.BW in ops[s + 1, j] else Op.B, s + 1, j))
    if (j + 1) % k:
        out.append(Action(Op.BW if Op.BW in ops[s, j + 1] else Op.B, s, j + 1))
    return out


def order_problems(sched: Schedule, ops: dict[tuple[int, int], set[Op]]) -> set[Reason]:
    """Run the devices as a token game: a device may run its next action once everything
    that action needs has run somewhere. Stuck before the end: deadlock (and a local-order
    problem if the culprit waits for a later action of its own device)."""
    S = sched.num_stages
    where = {a: (d, i) for d, acts in enumerate(sched.actions) for i, a in enumerate(acts)}
    local = any(
        where[n][0] == d and where[n][1] > i
        for a, (d, i) in where.items()
        for n in needs(a, S, ops, sched.segments)
    )
    done: set[Action] = set()
    nxt = [0] * sched.num_devices
    moved = True
    while moved:
        moved = False
        for d, acts in enumerate(sched.actions):
            if nxt[d] < len(acts) and all(
                n in done for n in needs(acts[nxt[d]], S, ops, sched.segments)
            ):
                done.add(acts[nxt[d]])
                nxt[d] += 1
                moved = True
    if len(done) == len(where):
        assert not local, "a local-order problem must block some device"
        return set()
    return {Reason.DEADLOCK, Reason.LOCAL_ORDER} if local else {Reason.DEADLOCK}


# ---- mutations -----------------------------------------------------------------------------


@st.composite
def mutated(draw, kind: str) -> tuple[Schedule, list[str]]:
    """A schedule of ``kind`` after one to three random mutations, and what they were."""
    p, m = draw(st.sampled_from(sizes(kind)))
    sched = generated(kind, p, m)
    acts = [list(x) for x in sched.actions]
    placement = list(sched.placement)
    done: list[str] = []

    def pick() -> tuple[int, int]:
        d = draw(st.sampled_from([d for d, a in enumerate(acts) if a]))
        return d, draw(st.integers(0, len(acts[d]) - 1))

    def slot(d: int) -> int:
        return draw(st.integers(0, len(acts[d])))

    for _ in range(draw(st.integers(1, 3))):
        what = draw(st.sampled_from(MUTATIONS))
        done.append(what)
        if what == "swap":
            d, i = pick()
            k = draw(st.integers(0, len(acts[d]) - 1))
            acts[d][i], acts[d][k] = acts[d][k], acts[d][i]
        elif what == "swap_devices":
            (d, i), (e, k) = pick(), pick()
            acts[d][i], acts[e][k] = acts[e][k], acts[d][i]
        elif what == "drop":
            d, i = pick()
            del acts[d][i]
        elif what == "duplicate":
            d, i = pick()
            e = draw(st.integers(0, p - 1))
            acts[e].insert(slot(e), acts[d][i])
        elif what == "move":
            d, i = pick()
            a = acts[d].pop(i)
            e = draw(st.integers(0, p - 1))
            acts[e].insert(slot(e), a)
        elif what == "relabel":
            d, i = pick()
            a = acts[d][i]
            field = draw(st.sampled_from(["op", "stage", "mb"]))
            if field == "op":
                a = a._replace(op=draw(st.sampled_from([o for o in Op if o is not a.op])))
            elif field == "stage":
                a = a._replace(stage=a.stage + draw(st.sampled_from([-1, 1])))
            else:
                a = a._replace(mb=a.mb + draw(st.sampled_from([-1, 1])))
            acts[d][i] = a
        else:  # placement: a stage changes device, its actions following or not
            s = draw(st.integers(0, sched.num_stages - 1))
            old, new = placement[s], draw(st.integers(0, p - 1))
            placement[s] = new
            if draw(st.booleans()):
                moving = [a for a in acts[old] if a.stage == s]
                acts[old] = [a for a in acts[old] if a.stage != s]
                for a in moving:  # in their old order, at random places of the new device
                    acts[new].insert(draw(st.integers(len(acts[new]) // 2, len(acts[new]))), a)
                done[-1] = "placement+actions"
    out = Schedule(
        sched.name, p, sched.num_stages, m, tuple(placement), acts, segments=sched.segments
    )
    return out, done


def check(sched: Schedule, done: list[str]) -> None:
    want = judge(sched)
    if not want:
        validate(sched)
        return
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    e = err.value
    assert e.reason in want, f"{done}: validator says {e}, the judge {sorted(want)}"
    if e.reason in STRUCTURE | {Reason.CONFLICT, Reason.LOCAL_ORDER}:
        # tied to one action: the message names where it is
        assert e.device is not None and e.action is not None, str(e)
        assert f"{e.action} at device {e.device} position {e.position}" in str(e)


@pytest.mark.parametrize("kind", KINDS)
@FAST
@given(data=st.data())
def test_mutated_schedules_are_judged_like_the_independent_judge(kind, data):
    check(*data.draw(mutated(kind)))


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@LONG
@given(data=st.data())
def test_mutated_schedules_are_judged_like_the_independent_judge_long(kind, data):
    check(*data.draw(mutated(kind)))


@pytest.mark.parametrize(("kind", "p", "m"), [(k, p, m) for k in KINDS for p, m in sizes(k)])
def test_every_base_schedule_is_valid_for_the_judge_and_the_validator(kind, p, m):
    sched = generated(kind, p, m)
    assert judge(sched) == set()
    validate(sched)


def test_the_searching_kinds_are_registered():
    """SEARCHING names registered kinds (a renamed kind would drop out of the design)."""
    assert set(GENERATORS) >= SEARCHING


def test_the_judge_catches_each_kind_of_mistake():
    """The judge itself can fail: one hand-made mistake per reason on a V schedule."""
    sched = generated("zbv", 3, 4)
    acts = [list(x) for x in sched.actions]
    f0 = Action(Op.F, 0, 0)

    def with_(change) -> set[Reason]:
        a = [list(x) for x in acts]
        change(a)
        return judge(sched.with_actions(a))

    assert with_(lambda a: a[0].append(Action(Op.F, 0, 9))) >= {Reason.OUT_OF_RANGE}
    assert with_(lambda a: a[1].append(f0)) >= {Reason.WRONG_DEVICE}
    assert with_(lambda a: a[0].append(f0)) >= {Reason.DUPLICATE}
    assert with_(lambda a: a[0].remove(f0)) == {Reason.MISSING}
    assert with_(lambda a: a[0].append(Action(Op.BW, 0, 0))) == {Reason.CONFLICT}
    assert with_(lambda a: a[0].insert(0, a[0].pop(a[0].index(Action(Op.W, 0, 0))))) == {
        Reason.DEADLOCK,
        Reason.LOCAL_ORDER,
    }
    # device 1 starts with the backward of stage 1 before stage 1's forward arrives
    first_b = next(i for i, a in enumerate(acts[1]) if a.op is not Op.F)
    assert with_(lambda a: a[1].insert(0, a[1].pop(first_b))) >= {Reason.DEADLOCK}
