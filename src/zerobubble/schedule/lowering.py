"""Lowering: a compute schedule becomes per-device programs with explicit messages.

A :class:`~zerobubble.schedule.ir.Schedule` only orders compute. To run it, every
dependency that crosses devices (an F's activation feeding the next stage's F,
a backward's input gradient feeding the previous stage's backward) must become
a message: the producer sends it asynchronously right after computing it, the
consumer posts the receive early and waits on it right before the compute
that needs it. Edges between stages on the same device need no message.

Point-to-point transports (NCCL, and gloo without tags) match messages between
two ranks strictly in order, so for every ordered pair of devices the receiver
must post its receives in the order the sender sends. The pass guarantees it
by construction (receives are hoisted when a device consumes messages in
another order than its peer produces them); :func:`check_comm_order` verifies
it on any program, and :func:`validate_lowered` runs the programs in a model
of the transport (sends buffered, receives posted ahead) to refuse anything
that could deadlock.

This module is pure and torch-free.
"""

from __future__ import annotations

import enum
from collections import Counter, defaultdict
from dataclasses import dataclass

from zerobubble.schedule.deps import Key, Kind, needs, producer, produces
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action, Op, Schedule


class MsgKind(enum.StrEnum):
    """What a message carries: the :class:`~zerobubble.schedule.deps.Kind` values that travel."""

    ACT = Kind.ACT.value
    """The output activation of F(s, j), consumed by F(s+1, j)."""
    GRAD = Kind.GRAD.value
    """The input gradient of B/BW(s, j), consumed by B/BW(s-1, j)."""

    __hash__ = str.__hash__


@dataclass(frozen=True, slots=True, order=True)
class Message:
    """A tensor crossing a stage boundary; its fields are its stable id."""

    kind: MsgKind
    src_stage: int
    dst_stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind.value}(s{self.src_stage}->s{self.dst_stage},mb{self.mb})"


@dataclass(frozen=True, slots=True)
class Compute:
    """Run one compute action (F, B, W or BW) of a stage held by this device."""

    action: Action

    def __str__(self) -> str:
        return str(self.action)


@dataclass(frozen=True, slots=True)
class PostRecv:
    """Post a non-blocking receive of ``msg`` from device ``peer`` (it lands in the background)."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"post_recv {self.msg} from device {self.peer}"


@dataclass(frozen=True, slots=True)
class WaitRecv:
    """Block until the posted receive of ``msg`` from ``peer`` has completed."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"wait_recv {self.msg} from device {self.peer}"


@dataclass(frozen=True, slots=True)
class Send:
    """Start an asynchronous send of ``msg`` to device ``peer`` (never waited on here)."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"send {self.msg} to device {self.peer}"


@dataclass(frozen=True, slots=True)
class WaitSends:
    """Block until every send this device started has completed (end of a step)."""

    def __str__(self) -> str:
        return "wait_sends"


@dataclass(frozen=True, slots=True)
class ReduceGrads:
    """Start an asynchronous sum of ``stage``'s parameter gradients over the data-parallel
    replicas (inserted by :func:`zerobubble.schedule.dp.insert_grad_reduce` right after
    the stage's last W or BW of the step)."""

    stage: int

    def __str__(self) -> str:
        return f"reduce_grads s{self.stage}"


@dataclass(frozen=True, slots=True)
class WaitReduce:
    """Block until every gradient reduction this device started has completed."""

    def __str__(self) -> str:
        return "wait_reduce"


Instruction = Compute | PostRecv | WaitRecv | Send | WaitSends | ReduceGrads | WaitReduce


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with one program of instructions per device.

    Attributes:
        schedule: The compute schedule it was lowered from.
        programs: ``programs[d]`` is device ``d``'s instruction list.
    """

    schedule: Schedule
    programs: tuple[tuple[Instruction, ...], ...]

    def messages(self, device: int) -> tuple[Message, ...]:
        """Messages device ``device`` receives, in the order it posts them."""
        return tuple(i.msg for i in self.programs[device] if isinstance(i, PostRecv))


# ---- messages of an action -------------------------------------------------------------------


def input_message(action: Action, num_stages: int) -> Message | None:
    """The tensor ``action`` consumes from a neighbouring stage, if any (local or not)."""
    for k in needs(action.op, action.stage, action.mb, num_stages):
        if k.kind.travels:
            return Message(MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
    return None


def output_message(action: Action, num_stages: int) -> Message | None:
    """The tensor ``action`` produces for a neighbouring stage, if any (local or not)."""
    for k in produces(action.op, action.stage, action.mb, num_stages):
        if k.kind.travels:
            return Message(MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
    return None


def message_key(msg: Message) -> Key:
    """The dependency key a message carries."""
    return Key(Kind(msg.kind.value), msg.src_stage, msg.mb)


def producer_of(msg: Message) -> Action:
    """The compute action that produces ``msg`` (B for a gradient; BW has the same output)."""
    return producer(message_key(msg))


# ---- the pass ----------------------------------------------------------------------------------


def lower(schedule: Schedule, *, recv_lookahead: int = 2) -> LoweredSchedule:
    """Lower a valid compute schedule to per-device programs with SEND/RECV.

    Placement rule (deterministic): each cross-device input is received with a
    :class:`PostRecv` placed ``recv_lookahead`` compute actions before the
    compute that consumes it (at the program start when fewer precede it) and a
    :class:`WaitRecv` right before that compute; when a device consumes a peer's
    messages in another order than the peer sends them, the earlier-sent
    receives are hoisted so that posts follow the sender's order. Each output
    that crosses devices gets a :class:`Send` right after its compute, and every
    program ends with :class:`WaitSends` if it sent anything.

    The schedule must already pass :func:`zerobubble.schedule.validate.validate`
    (the executor checks that first). The result is checked with
    :func:`check_comm_order` before it is returned.
    """
    if recv_lookahead < 0:
        raise ValueError(f"recv_lookahead must be >= 0, got {recv_lookahead}")
    S = schedule.num_stages
    place = schedule.placement

    # Send order of every ordered device pair: the producer's compute order.
    sends: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for d, acts in enumerate(schedule.actions):
        for a in acts:
            out = output_message(a, S)
            if out is not None and place[out.dst_stage] != d:
                sends[d, place[out.dst_stage]].append(out)

    programs = []
    for d, acts in enumerate(schedule.actions):
        consumer_at: dict[Message, int] = {}
        for i, a in enumerate(acts):
            m = input_message(a, S)
            if m is not None and place[m.src_stage] != d:
                consumer_at[m] = i
        # post_at[i]: receives posted just before compute i, as (peer, send index, msg).
        post_at: dict[int, list[tuple[int, int, Message]]] = defaultdict(list)
        for peer in range(schedule.num_devices):
            earliest = len(acts)  # suffix minimum over later-sent messages
            for k, m in reversed(list(enumerate(sends.get((peer, d), ())))):
                earliest = min(earliest, max(0, consumer_at[m] - recv_lookahead))
                post_at[earliest].append((peer, k, m))
        prog: list[Instruction] = []
        for i, a in enumerate(acts):
            prog += [PostRecv(m, peer) for peer, _, m in sorted(post_at.get(i, ()))]
            m = input_message(a, S)
            if m is not None and place[m.src_stage] != d:
                prog.append(WaitRecv(m, place[m.src_stage]))
            prog.append(Compute(a))
            out = output_message(a, S)
            if out is not None and place[out.dst_stage] != d:
                prog.append(Send(out, place[out.dst_stage]))
        if any(isinstance(x, Send) for x in prog):
            prog.append(WaitSends())
        programs.append(tuple(prog))
    lowered = LoweredSchedule(schedule, tuple(programs))
    check_comm_order(lowered)
    return lowered


# ---- checks ------------------------------------------------------------------------------------


def check_comm_order(lowered: LoweredSchedule) -> None:
    """Raise ``ScheduleError(COMM_ORDER)`` unless, for every ordered device pair, the
    sender's sends and the receiver's posted receives list the same messages in the
    same order (transports match point-to-point messages in order)."""
    P = lowered.schedule.num_devices
    sent: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    posted: dict[tuple[int, int], list[tuple[int, Message]]] = defaultdict(list)
    for d, prog in enumerate(lowered.programs):
        for i, ins in enumerate(prog):
            if isinstance(ins, Send):
                sent[d, ins.peer].append((i, ins.msg))
            elif isinstance(ins, PostRecv):
                posted[ins.peer, d].append((i, ins.msg))
    for src in range(P):
        for dst in range(P):
            s, r = sent.get((src, dst), []), posted.get((src, dst), [])
            for k in range(max(len(s), len(r))):
                sm = s[k][1] if k < len(s) else None
                rm = r[k][1] if k < len(r) else None
                if sm == rm:
                    continue
                if rm is None:
                    detail = f"device {dst} posts no receive for it"
                    dev, pos = src, s[k][0]
                else:
                    what = f"sends {sm}" if sm is not None else "sends nothing more"
                    detail = f"device {src} {what} but device {dst} posted a receive for {rm}"
                    dev, pos = dst, r[k][0]
                raise ScheduleError(
                    Reason.COMM_ORDER,
                    f"message #{k} from device {src} to device {dst} disagrees: {detail}. "
                    f"Device {dst} must post its receives from device {src} in the order "
                    f"device {src} sends them.",
                    device=dev,
                    position=pos,
                )


def validate_lowered(lowered: LoweredSchedule) -> None:
    """Run the programs in a model of the transport; raise ``ScheduleError`` if they
    cannot complete.

    Model (gloo's, and NCCL's with one communicator per direction, see
    :mod:`zerobubble.runtime.comm`): issuing a :class:`Send` or :class:`PostRecv`
    never blocks; the k-th receive a device posts from a peer matches the k-th
    message that peer sends to it; :class:`WaitRecv` blocks until its message
    was sent; :class:`WaitSends` blocks until every message the device sent has
    a posted receive.

    A compute must find its inputs (a completed receive, or the local producer
    having run). Reports ``COMM_ORDER`` for a mismatched match, ``MISSING`` for
    an input nobody delivered, ``DEADLOCK`` naming every stuck instruction when
    no device can advance.
    """
    sched = lowered.schedule
    P, S = sched.num_devices, sched.num_stages
    progs = lowered.programs
    pc = [0] * P
    sent: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src, dst) -> issued
    posted: dict[tuple[int, int], list[Message]] = defaultdict(list)  # (src, dst) -> posted
    arrived: list[set[Message]] = [set() for _ in range(P)]  # completed receives
    made: list[set[Key]] = [set() for _ in range(P)]  # what each device's computes produced
    weights: list[Counter[int]] = [Counter() for _ in range(P)]  # stage -> W/BW run
    reducing: list[set[int]] = [set() for _ in range(P)]  # stages whose reduction started

    def fail(reason: Reason, d: int, msg: str) -> ScheduleError:
        ins = progs[d][pc[d]]
        act = ins.action if isinstance(ins, Compute) else None
        return ScheduleError(reason, f"{ins}: {msg}", device=d, position=pc[d], action=act)

    def match(src: int, dst: int, k: int, d: int) -> Message | None:
        """The k-th message src sent to dst, if sent yet; it must be the k-th posted one."""
        if len(sent[src, dst]) <= k or len(posted[src, dst]) <= k:
            return None
        if sent[src, dst][k] != posted[src, dst][k]:
            raise fail(
                Reason.COMM_ORDER,
                d,
                f"receive #{k} of device {dst} from device {src} is {posted[src, dst][k]} but "
                f"device {src} sent {sent[src, dst][k]}",
            )
        return sent[src, dst][k]

    def step(d: int) -> bool:
        """Execute device d's next instruction if it can run; report whether it did."""
        ins = progs[d][pc[d]]
        if isinstance(ins, PostRecv):
            posted[ins.peer, d].append(ins.msg)
        elif isinstance(ins, WaitRecv):
            if ins.msg not in posted[ins.peer, d]:
                raise fail(Reason.MISSING, d, "waits for a receive that was never posted")
            if match(ins.peer, d, posted[ins.peer, d].index(ins.msg), d) is None:
                return False
            arrived[d].add(ins.msg)
        elif isinstance(ins, Send):
            if message_key(ins.msg) not in made[d]:
                raise fail(Reason.MISSING, d, f"sent before {producer_of(ins.msg)} produced it")
            sent[d, ins.peer].append(ins.msg)
        elif isinstance(ins, WaitSends):
            for dst in range(P):
                if len(posted[d, dst]) < len(sent[d, dst]):
                    return False
        elif isinstance(ins, ReduceGrads):
            if weights[d][ins.stage] != sched.num_microbatches or ins.stage in reducing[d]:
                raise fail(
                    Reason.MISSING,
                    d,
                    f"reduces stage {ins.stage}'s gradients after "
                    f"{weights[d][ins.stage]} of its {sched.num_microbatches} weight "
                    "gradients, or twice (it must follow the stage's last W or BW, once)",
                )
            reducing[d].add(ins.stage)
        elif isinstance(ins, WaitReduce):
            if reducing[d] != set(sched.stages_of_device[d]):
                raise fail(
                    Reason.MISSING,
                    d,
                    f"waits for the reductions of stages {sorted(sched.stages_of_device[d])} "
                    f"but only {sorted(reducing[d])} were started",
                )
        else:
            a = ins.action
            if a.op is Op.W or a.op is Op.BW:
                if a.stage in reducing[d]:
                    raise fail(
                        Reason.MISSING,
                        d,
                        f"adds to stage {a.stage}'s gradients after their reduction started",
                    )
                weights[d][a.stage] += 1
            keys = needs(a.op, a.stage, a.mb, S)
            # Messages first, then what this stage itself keeps (the F before a backward...).
            for k in sorted(keys, key=lambda k: not k.kind.travels):
                if not k.kind.travels:
                    if k not in made[d]:
                        raise fail(Reason.MISSING, d, f"{producer(k)} has not run here")
                    continue
                need = Message(MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
                local = sched.placement[k.stage] == d
                if not (k in made[d] if local else need in arrived[d]):
                    how = "its producer has not run here" if local else "no WaitRecv precedes it"
                    raise fail(Reason.MISSING, d, f"input {need} is not available ({how})")
            made[d].update(produces(a.op, a.stage, a.mb, S))
        pc[d] += 1
        return True

    progressed = True
    while progressed:
        progressed = False
        for d in range(P):
            while pc[d] < len(progs[d]) and step(d):
                progressed = True
    stuck = [d for d in range(P) if pc[d] < len(progs[d])]
    if stuck:
        parts = [f"device {d} at position {pc[d]} ({progs[d][pc[d]]})" for d in stuck]
        raise fail(
            Reason.DEADLOCK,
            stuck[0],
            "the programs cannot finish; stuck: " + "; ".join(parts),
        )
    for src, dst in sorted(set(sent) | set(posted)):
        n_sent, n_posted = len(sent[src, dst]), len(posted[src, dst])
        if n_sent != n_posted:
            raise ScheduleError(
                Reason.COMM_ORDER,
                f"device {dst} posted {n_posted} receives from device {src} "
                f"but device {src} sent {n_sent} messages to it",
                device=dst,
            )
