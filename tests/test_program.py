"""The builder's finished programs: every kind validated as it runs, mutations refused."""

from __future__ import annotations

import pytest

from generated import SLOW_SOLVES, generated
from zerobubble.program.builder import build_programs
from zerobubble.program.check import validate_program
from zerobubble.program.instructions import (
    Compute,
    Gate,
    LoweredSchedule,
    ReduceGrads,
    ShardAction,
    ShardOp,
    VersionCheck,
    WaitReduce,
)
from zerobubble.program.plan import GradSync, ProgramPlan, Protocol
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.generators import GENERATORS, generate

PLANS = [
    ProgramPlan(),
    ProgramPlan(grad_sync=GradSync.REDUCE, protocol=Protocol.CHECKED),
    ProgramPlan(grad_sync=GradSync.FSDP, protocol=Protocol.CHECKED),
    ProgramPlan(grad_sync=GradSync.REDUCE, protocol=Protocol.SPECULATIVE),
    ProgramPlan(fuse_local_backward=False, protocol=Protocol.SPECULATIVE),
]


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_kind_builds_a_valid_final_program_under_every_plan(p: int) -> None:
    built = refused = 0
    for kind, gen in GENERATORS.items():
        if (kind, p, 2 * p + 1) in SLOW_SOLVES:
            continue
        opts = {"chunks": 2} if "chunks" in gen.options else {}
        try:
            # M = 2P + 1: the size the every-kind sweeps of test_lowering, test_passes and
            # test_replay take, so the searching kinds are not solved again here.
            sched = generated(kind, p, 2 * p + 1, **opts)
        except ValueError:
            continue
        for plan in PLANS:
            try:
                lowered = build_programs(sched, plan)
            except ScheduleError as e:  # only a gate no rank can reach may refuse
                assert plan.protocol.gates and e.reason is Reason.DEADLOCK, (kind, plan, e)
                refused += 1
                continue
            built += 1
            for prog in lowered.programs:
                kinds = {type(i) for i in prog}
                assert (ReduceGrads in kinds) == plan.grad_sync.reduces
                assert (ShardAction in kinds) == plan.grad_sync.shards
                assert (VersionCheck in kinds) == plan.protocol.checks
                assert sum(isinstance(i, Gate) for i in prog) == int(plan.protocol.gates)
    assert built > 60 and refused < built


def _mutated(lowered: LoweredSchedule, d: int, prog: list) -> LoweredSchedule:
    programs = list(lowered.programs)
    programs[d] = tuple(prog)
    return LoweredSchedule(lowered.schedule, tuple(programs))


def test_a_dropped_reduce_is_refused_naming_rank_position_and_reason() -> None:
    plan = ProgramPlan(grad_sync=GradSync.REDUCE, protocol=Protocol.CHECKED)
    lowered = build_programs(generate("zbv", 4, 8), plan)
    prog = list(lowered.programs[2])
    at = next(i for i, x in enumerate(prog) if isinstance(x, ReduceGrads))
    del prog[at]
    wait = next(i for i, x in enumerate(prog) if isinstance(x, WaitReduce))
    with pytest.raises(ScheduleError) as err:
        validate_program(_mutated(lowered, 2, prog), plan)
    e = err.value
    assert e.reason is Reason.MISSING and e.device == 2 and e.position == wait
    assert "rank 2's program" in str(e) and "only" in str(e)


def test_a_swapped_unshard_is_refused_naming_rank_position_and_reason() -> None:
    plan = ProgramPlan(grad_sync=GradSync.FSDP)
    lowered = build_programs(generate("zbv", 4, 8), plan)
    prog = list(lowered.programs[1])
    at = next(i for i, x in enumerate(prog) if x == ShardAction(ShardOp.UNSHARD, 1))
    prog[at], prog[at + 1] = prog[at + 1], prog[at]  # the unshard now follows the first F
    assert isinstance(prog[at], Compute)
    with pytest.raises(ScheduleError) as err:
        validate_program(_mutated(lowered, 1, prog), plan)
    e = err.value
    assert e.reason is Reason.MISSING and e.device == 1 and e.position == at
    assert "stage 1's parameters are not gathered" in str(e) and "rank 1" in str(e)


def test_a_wrong_drain_or_missing_version_check_is_refused() -> None:
    plan = ProgramPlan(protocol=Protocol.SPECULATIVE)
    lowered = build_programs(generate("1f1b", 3, 6), plan)
    prog = list(lowered.programs[2])
    g = next(i for i, x in enumerate(prog) if isinstance(x, Gate))
    gate = prog[g]
    assert isinstance(gate, Gate) and gate.drain == ()  # it posts every stale one before
    prog[g] = Gate(((1, prog[0].msg),))  # a drain of a message it already posted
    with pytest.raises(ScheduleError, match="rank 2's replay gate drains"):
        validate_program(_mutated(lowered, 2, prog), plan)
    prog = list(lowered.programs[0])
    c = next(i for i, x in enumerate(prog) if isinstance(x, VersionCheck))
    del prog[c]
    with pytest.raises(ScheduleError, match="runs without its version check") as err:
        validate_program(_mutated(lowered, 0, prog), plan)
    assert err.value.device == 0 and err.value.position == c


def test_an_instruction_the_plan_does_not_ask_for_is_refused() -> None:
    lowered = build_programs(generate("zb-h1", 2, 4), ProgramPlan(grad_sync=GradSync.REDUCE))
    with pytest.raises(ScheduleError, match="inserts no ReduceGrads") as err:
        validate_program(lowered, ProgramPlan())
    assert err.value.reason is Reason.CONFLICT and err.value.device == 0
