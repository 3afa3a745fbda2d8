"""Replay gates: a fixed point in every rank's program where speculative work may be undone.

Speculative post-validation (:mod:`zerobubble.optim`) lets iteration k+1 start
on parameters that iteration k's validation may still reject. The validation
happens at a *gate*, placed at the same static position of every rank's
lowered program: right before the rank's first backward (the compute, or the
wait for the gradient it consumes). Before a gate a rank runs only forwards,
their activation messages and receive posts; so which work is speculative,
and which messages it sent or received, is known on every rank from the
schedule alone. If the validation rolls parameters back, every rank discards
its pre-gate work, drains the stale messages it is still owed (those its peers
sent before their gates) and replays the step from the start.

Two properties make that safe, and :func:`plan_gates` establishes both:

* a receive posted before the gate only ever matches a message its peer sends
  before *its* gate (other posts are moved right after the gate), so after a
  replay no posted buffer is waiting for a message that the peer will now
  send in another order;
* every rank reaches its gate using only the pre-gate work of the others
  (checked on a transport model), so no rank waits, at or before its gate, for
  something a peer would do only after validating.

:func:`insert_protocol` is the program pass that turns a plan into instructions
(:class:`~zerobubble.program.instructions.Gate`,
:class:`~zerobubble.program.instructions.VersionCheck`) that the executor interprets
without knowing why; the optimizer's hooks act on them. This module is pure and
torch-free.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zerobubble.program.check import check_reachable, stale_messages, validate_lowered
from zerobubble.program.instructions import (
    Compute,
    Gate,
    Instruction,
    LoweredSchedule,
    Message,
    MsgKind,
    PostRecv,
    VersionCheck,
    WaitRecv,
)

__all__ = ["GatePlan", "gate_position", "insert_protocol", "plan_gates"]


@dataclass(frozen=True)
class GatePlan:
    """Programs with a replay position, and what a replay must drain.

    Attributes:
        programs: ``programs[d]``: device d's program, receives that would wait
            for a peer's post-gate work moved right after the gate.
        gates: ``gates[d]``: index in ``programs[d]`` of the first instruction
            after the gate; instructions before it are speculative.
        stale: ``stale[d][peer]``: the messages ``peer`` sends device d before
            its own gate, in send order (what a replay must drain).
        posted: ``posted[d][peer]``: how many of them device d posts before its gate.
    """

    programs: tuple[tuple[Instruction, ...], ...]
    gates: tuple[int, ...]
    stale: tuple[dict[int, tuple[Message, ...]], ...]
    posted: tuple[dict[int, int], ...]


def gate_position(program: tuple[Instruction, ...]) -> int:
    """Index of the first instruction that belongs to the program's first backward."""
    for i, ins in enumerate(program):
        if isinstance(ins, Compute) and ins.action.op.is_backward:
            return i
        if isinstance(ins, WaitRecv) and ins.msg.kind is MsgKind.GRAD:
            return i
    raise ValueError("the program has no backward, so it has no replay gate")


def plan_gates(lowered: LoweredSchedule) -> GatePlan:
    """Place a gate in every device's program; raise ``ScheduleError`` if a replay could stall.

    The gated programs are checked with
    :func:`~zerobubble.program.check.validate_lowered`, and every device must
    reach its gate with only the other devices' pre-gate instructions
    (``Reason.DEADLOCK`` naming the stuck devices otherwise).
    """
    P = lowered.schedule.num_devices
    first = [gate_position(prog) for prog in lowered.programs]
    stale = stale_messages(lowered.programs, first)
    programs, gates, posted = [], [], []
    for d, prog in enumerate(lowered.programs):
        early = {m for msgs in stale[d].values() for m in msgs}
        keep: list[Instruction] = []
        moved: list[Instruction] = []
        for ins in prog[: first[d]]:
            late = isinstance(ins, PostRecv) and ins.msg not in early
            (moved if late else keep).append(ins)
        programs.append((*keep, *moved, *prog[first[d] :]))
        gates.append(len(keep))
        counts: dict[int, int] = defaultdict(int)
        for ins in keep:
            if isinstance(ins, PostRecv):
                counts[ins.peer] += 1
        posted.append(dict(counts))
    assert len(programs) == P
    plan = GatePlan(tuple(programs), tuple(gates), tuple(stale), tuple(posted))
    check_reachable(plan.programs, plan.gates, lowered.schedule.name)
    validate_lowered(LoweredSchedule(lowered.schedule, plan.programs))
    return plan


def insert_protocol(lowered: LoweredSchedule, *, speculative: bool) -> LoweredSchedule:
    """The optimizer's protocol pass: a :class:`VersionCheck` right before every compute
    and, with ``speculative``, the :class:`Gate` of :func:`plan_gates` (receive posts moved,
    the stale messages a replay drains named). A schedule whose ranks cannot reach their
    gates is refused here (``ScheduleError``), before any message."""
    if not speculative:
        programs, gates = lowered.programs, [-1] * len(lowered.programs)
        drains: list[tuple[tuple[int, Message], ...]] = [()] * len(programs)
    else:
        plan = plan_gates(lowered)
        programs, gates = plan.programs, list(plan.gates)
        drains = [
            tuple(
                (peer, msg)
                for peer, msgs in plan.stale[d].items()
                for msg in msgs[plan.posted[d].get(peer, 0) :]
            )
            for d in range(len(programs))
        ]
    out = []
    for prog, gate, drain in zip(programs, gates, drains, strict=True):
        items: list[Instruction] = []
        for i, ins in enumerate(prog):
            if i == gate:
                items.append(Gate(drain))
            if isinstance(ins, Compute):
                items.append(VersionCheck(ins.action))
            items.append(ins)
        if gate == len(prog):
            items.append(Gate(drain))
        out.append(items)
    return lowered.with_programs(out)
