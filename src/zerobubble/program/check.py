"""The check of finished programs: every rank's instructions run in a model of the transport.

Model (gloo's, and NCCL's with one communicator per direction, see
:mod:`zerobubble.runtime.p2p.comm`): issuing a send or a receive post never blocks;
the k-th receive a device posts from a peer matches the k-th message that peer
sends to it; a wait for a receive blocks until its message was sent; the wait
for the sends blocks until every message sent has a posted receive. Collectives
over data-parallel replicas (gradient reduction, FSDP) are local steps: every
replica runs the same program, so mirror ranks meet at the same point.

Each instruction kind states its own step in this model
(:mod:`zerobubble.program.instructions`); this module runs them, reports
``COMM_ORDER`` for a mismatched match, ``MISSING`` for an input nobody delivered
or a protocol step out of place, ``DEADLOCK`` naming every stuck instruction, and
checks what only all ranks together show: that a plan's instructions are all
there, and that speculative replay gates can be reached and drain exactly the
stale messages.

This module is pure and torch-free.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from zerobubble.program.instructions import (
    Compute,
    Gate,
    Instruction,
    LoweredSchedule,
    Message,
    PostRecv,
    ReduceGrads,
    Send,
    ShardAction,
    VersionCheck,
    WaitRecv,
    WaitReduce,
)
from zerobubble.schedule.deps import Key
from zerobubble.schedule.errors import Reason, ScheduleError

if TYPE_CHECKING:
    from zerobubble.program.plan import ProgramPlan

__all__ = ["Model", "check_gates", "stale_messages", "validate_lowered", "validate_program"]


class Model:
    """The transport model's state while the programs run (what each ``step`` reads)."""

    def __init__(self, lowered: LoweredSchedule, *, checks: bool) -> None:
        sched = lowered.schedule
        self.schedule = sched
        self.programs = lowered.programs
        self.P = P = sched.num_devices
        self.checks = checks
        """Every compute must follow its :class:`VersionCheck`."""
        self.pc = [0] * P
        self.sent: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src, dst)
        self.posted: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src, dst)
        self.arrived: list[set[Message]] = [set() for _ in range(P)]
        self.made: list[set[Key]] = [set() for _ in range(P)]
        self.weights: list[Counter[int]] = [Counter() for _ in range(P)]
        self.reducing: list[set[int]] = [set() for _ in range(P)]
        self.waited_reduce = [False] * P
        self.sharded = [
            {i.stage for i in prog if isinstance(i, ShardAction)} for prog in self.programs
        ]
        self.gathered: list[set[int]] = [set() for _ in range(P)]
        self.scattered: list[set[int]] = [set() for _ in range(P)]
        self.gated = [False] * P
        self.checked: list[object] = [None] * P

    def fail(self, reason: Reason, d: int, msg: str) -> ScheduleError:
        """The error for device ``d``'s current instruction."""
        ins = self.programs[d][self.pc[d]]
        act = ins.action if isinstance(ins, Compute) else None
        return ScheduleError(
            reason, f"{ins} (rank {d}'s program): {msg}", device=d, position=self.pc[d], action=act
        )

    def match(self, src: int, dst: int, k: int, d: int) -> Message | None:
        """The k-th message src sent to dst, if sent yet; it must be the k-th posted one."""
        sent, posted = self.sent[src, dst], self.posted[src, dst]
        if len(sent) <= k or len(posted) <= k:
            return None
        if sent[k] != posted[k]:
            raise self.fail(
                Reason.COMM_ORDER,
                d,
                f"receive #{k} of device {dst} from device {src} is {posted[k]} but "
                f"device {src} sent {sent[k]}",
            )
        return sent[k]

    def run(self) -> None:
        """Advance every device as far as it can; raise on a stuck or unbalanced end."""
        progs, pc = self.programs, self.pc
        progressed = True
        while progressed:
            progressed = False
            for d in range(self.P):
                while pc[d] < len(progs[d]) and progs[d][pc[d]].step(self, d):
                    pc[d] += 1
                    progressed = True
        stuck = [d for d in range(self.P) if pc[d] < len(progs[d])]
        if stuck:
            parts = [f"device {d} at position {pc[d]} ({progs[d][pc[d]]})" for d in stuck]
            raise self.fail(
                Reason.DEADLOCK, stuck[0], "the programs cannot finish; stuck: " + "; ".join(parts)
            )
        for src, dst in sorted(set(self.sent) | set(self.posted)):
            n_sent, n_posted = len(self.sent[src, dst]), len(self.posted[src, dst])
            if n_sent != n_posted:
                raise ScheduleError(
                    Reason.COMM_ORDER,
                    f"device {dst} posted {n_posted} receives from device {src} "
                    f"but device {src} sent {n_sent} messages to it",
                    device=dst,
                )


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Run the programs in the transport model; raise ``ScheduleError`` if they cannot
    complete (no expectations about which passes ran)."""
    Model(lowered, checks=False).run()


def validate_program(lowered: LoweredSchedule, plan: ProgramPlan | None = None) -> None:
    """Validate finished programs: the transport model, then what ``plan`` asks for.

    With a plan, every kind its passes insert must be there (a reduction per stage and
    the wait for them with data-parallel reduction; an unshard and a reduce-scatter per
    stage with FSDP; a version check before every compute with the protocol; one gate
    per rank, reachable, draining exactly the stale messages, in speculative mode) and
    no kind it does not ask for. Raises ``ScheduleError`` naming the rank, the position
    and the reason.
    """
    checks = plan is not None and plan.protocol.checks
    if plan is not None:
        _check_kinds(lowered, plan)
    model = Model(lowered, checks=checks)
    model.run()
    if plan is None:
        return
    sched = lowered.schedule
    for d, prog in enumerate(lowered.programs):
        stages = set(sched.stages_of_device[d])
        end = len(prog) - 1
        if plan.grad_sync.reduces and not model.waited_reduce[d]:
            raise ScheduleError(
                Reason.MISSING,
                f"rank {d}'s program never waits for its gradient reductions (wait_reduce)",
                device=d,
                position=end,
            )
        if plan.grad_sync.shards and model.scattered[d] != stages:
            missing = sorted(stages - model.scattered[d])
            raise ScheduleError(
                Reason.MISSING,
                f"rank {d}'s program never reduce-scatters stages {missing} (FSDP)",
                device=d,
                position=end,
            )
    if plan.protocol.gates:
        check_gates(lowered)


def _check_kinds(lowered: LoweredSchedule, plan: ProgramPlan) -> None:
    """No instruction of a kind the plan's passes do not insert."""
    allowed: set[type] = set()
    if plan.grad_sync.reduces:
        allowed |= {ReduceGrads, WaitReduce}
    if plan.grad_sync.shards:
        allowed.add(ShardAction)
    if plan.protocol.checks:
        allowed.add(VersionCheck)
    if plan.protocol.gates:
        allowed.add(Gate)
    optional = {ReduceGrads, WaitReduce, ShardAction, VersionCheck, Gate}
    for d, prog in enumerate(lowered.programs):
        for i, ins in enumerate(prog):
            if type(ins) in optional and type(ins) not in allowed:
                raise ScheduleError(
                    Reason.CONFLICT,
                    f"{ins} (rank {d}'s program): the plan ({plan}) inserts no "
                    f"{type(ins).__name__}",
                    device=d,
                    position=i,
                )


# ---- replay gates ------------------------------------------------------------------------------


def stale_messages(
    programs: Sequence[Sequence[Instruction]], gates: Sequence[int]
) -> list[dict[int, tuple[Message, ...]]]:
    """``stale[d][peer]``: the messages ``peer`` sends device ``d`` before its gate (index
    ``gates[peer]``), in send order: what a replay must drain."""
    early: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for p, prog in enumerate(programs):
        for ins in prog[: gates[p]]:
            if isinstance(ins, Send):
                early[p, ins.peer].append(ins.msg)
    P = len(programs)
    return [{p: tuple(early[p, d]) for p in range(P) if early[p, d]} for d in range(P)]


def check_reachable(
    programs: Sequence[Sequence[Instruction]], gates: Sequence[int], name: str
) -> None:
    """Every device reaches its gate while every device stops at its own gate."""
    sent: dict[tuple[int, int], set[Message]] = defaultdict(set)
    pc = [0] * len(programs)
    progressed = True
    while progressed:
        progressed = False
        for d, prog in enumerate(programs):
            while pc[d] < gates[d]:
                ins = prog[pc[d]]
                if isinstance(ins, WaitRecv) and ins.msg not in sent[ins.peer, d]:
                    break
                if isinstance(ins, Send):
                    sent[d, ins.peer].add(ins.msg)
                pc[d] += 1
                progressed = True
    stuck = [d for d in range(len(pc)) if pc[d] < gates[d]]
    if stuck:
        d = stuck[0]
        ins = programs[d][pc[d]]
        what = "; ".join(f"device {x} at {programs[x][pc[x]]}" for x in stuck)
        raise ScheduleError(
            Reason.DEADLOCK,
            f"schedule {name!r} cannot replay speculative work: before their first backward "
            f"these devices wait for work another device does only after its own first "
            f"backward: {what}. Use conservative post-validation (speculative=False).",
            device=d,
            position=pc[d],
            action=ins.action if isinstance(ins, Compute) else None,
        )


def check_gates(lowered: LoweredSchedule) -> None:
    """One gate per rank; every rank reaches it with the others' pre-gate work alone; a
    receive posted before it matches a message its peer sends before *its* gate; and
    its drain is exactly the rest of those stale messages."""
    progs = lowered.programs
    gates = []
    for d, prog in enumerate(progs):
        at = [i for i, ins in enumerate(prog) if isinstance(ins, Gate)]
        if len(at) != 1:
            raise ScheduleError(
                Reason.MISSING,
                f"rank {d}'s program holds {len(at)} replay gates; speculative mode needs one",
                device=d,
                position=at[1] if at else 0,
            )
        gates.append(at[0])
    check_reachable(progs, gates, lowered.schedule.name)
    stale = stale_messages(progs, gates)
    for d, prog in enumerate(progs):
        posts: dict[int, list[Message]] = defaultdict(list)
        for ins in prog[: gates[d]]:
            if isinstance(ins, PostRecv):
                posts[ins.peer].append(ins.msg)
        expected = []
        for peer in sorted(set(stale[d]) | set(posts)):
            msgs, early = stale[d].get(peer, ()), posts.get(peer, [])
            if tuple(early) != msgs[: len(early)]:
                raise ScheduleError(
                    Reason.COMM_ORDER,
                    f"rank {d} posts receives {[str(m) for m in early]} from rank {peer} before "
                    f"its gate, but rank {peer} sends it {[str(m) for m in msgs]} before its "
                    "own: a replay could leave a posted receive waiting for a fresh message",
                    device=d,
                    position=gates[d],
                )
            expected += [(peer, m) for m in msgs[len(early) :]]
        gate = prog[gates[d]]
        assert isinstance(gate, Gate)
        if list(gate.drain) != expected:
            raise ScheduleError(
                Reason.MISSING,
                f"rank {d}'s replay gate drains {[(p, str(m)) for p, m in gate.drain]} but the "
                f"stale messages it has not posted are {[(p, str(m)) for p, m in expected]}",
                device=d,
                position=gates[d],
            )
