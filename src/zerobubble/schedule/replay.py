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

The optimizer layer turns a plan into instructions (:class:`Gate`,
:class:`VersionCheck`) that the executor interprets without knowing why. This
module is pure and torch-free.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action
from zerobubble.schedule.lowering import (
    Compute,
    Instruction,
    LoweredSchedule,
    Message,
    MsgKind,
    PostRecv,
    Send,
    WaitRecv,
    validate_lowered,
)

__all__ = ["Gate", "GatePlan", "VersionCheck", "gate_position", "plan_gates"]


@dataclass(frozen=True)
class Gate:
    """Instruction: the replay gate. The caller validates here and may ask for a replay.

    On a replay the interpreter posts ``drain`` (the stale messages peers sent before
    their gates that this rank had not posted yet), waits for every posted receive,
    discards the step's work and runs the program again from its start (passing the
    gate without stopping).
    """

    drain: tuple[tuple[int, Message], ...]
    """``(peer, message)`` in the order to post them."""

    def __str__(self) -> str:
        return f"replay gate ({len(self.drain)} stale messages to drain on a replay)"


@dataclass(frozen=True)
class VersionCheck:
    """Instruction before a compute: the caller records (F) or checks (B, W, BW) the
    parameter version its microbatch runs on."""

    action: Action

    def __str__(self) -> str:
        return f"version check of {self.action}"


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
    :func:`~zerobubble.schedule.lowering.validate_lowered`, and every device must
    reach its gate with only the other devices' pre-gate instructions
    (``Reason.DEADLOCK`` naming the stuck devices otherwise).
    """
    P = lowered.schedule.num_devices
    first = [gate_position(prog) for prog in lowered.programs]
    early: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src, dst) -> pre-gate sends
    for d, prog in enumerate(lowered.programs):
        for ins in prog[: first[d]]:
            if isinstance(ins, Send):
                early[d, ins.peer].append(ins.msg)
    programs, gates, stale, posted = [], [], [], []
    for d, prog in enumerate(lowered.programs):
        keep: list[Instruction] = []
        moved: list[Instruction] = []
        for ins in prog[: first[d]]:
            late = isinstance(ins, PostRecv) and ins.msg not in early[ins.peer, d]
            (moved if late else keep).append(ins)
        programs.append((*keep, *moved, *prog[first[d] :]))
        gates.append(len(keep))
        stale.append({p: tuple(early[p, d]) for p in range(P) if early[p, d]})
        counts: dict[int, int] = defaultdict(int)
        for ins in keep:
            if isinstance(ins, PostRecv):
                counts[ins.peer] += 1
        posted.append(dict(counts))
    plan = GatePlan(tuple(programs), tuple(gates), tuple(stale), tuple(posted))
    _check_reachable(plan, lowered.schedule.name)
    validate_lowered(LoweredSchedule(lowered.schedule, plan.programs))
    return plan


def _check_reachable(plan: GatePlan, name: str) -> None:
    """Every device reaches its gate while every device stops at its own gate."""
    sent: dict[tuple[int, int], set[Message]] = defaultdict(set)
    pc = [0] * len(plan.programs)
    progressed = True
    while progressed:
        progressed = False
        for d, prog in enumerate(plan.programs):
            while pc[d] < plan.gates[d]:
                ins = prog[pc[d]]
                if isinstance(ins, WaitRecv) and ins.msg not in sent[ins.peer, d]:
                    break
                if isinstance(ins, Send):
                    sent[d, ins.peer].add(ins.msg)
                pc[d] += 1
                progressed = True
    stuck = [d for d in range(len(pc)) if pc[d] < plan.gates[d]]
    if stuck:
        d = stuck[0]
        ins = plan.programs[d][pc[d]]
        what = "; ".join(f"device {x} at {plan.programs[x][pc[x]]}" for x in stuck)
        raise ScheduleError(
            Reason.DEADLOCK,
            f"schedule {name!r} cannot replay speculative work: before their first backward "
            f"these devices wait for work another device does only after its own first "
            f"backward: {what}. Use conservative post-validation (speculative=False).",
            device=d,
            position=pc[d],
            action=ins.action if isinstance(ins, Compute) else None,
        )
