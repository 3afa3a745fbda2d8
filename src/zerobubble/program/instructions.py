"""The instruction set: everything a rank's program may hold, and what each instruction needs.

A compute :class:`~zerobubble.schedule.ir.Schedule` only orders F, B, W and BW.
What a rank runs is a *program*: those computes plus the instructions that the
passes of :func:`~zerobubble.program.builder.build_programs` insert (messages,
gradient reduction, FSDP's unshard and reduce-scatter, the optimizer's protocol).
Every kind is defined here, once, and states its own meaning in the transport
model that checks the finished programs before anything runs
(:func:`~zerobubble.program.check.validate_program`): each class's
``step(model, device)`` says what the instruction needs to have happened on the
device (through the dependency rule of :mod:`~zerobubble.schedule.deps` for the
computes and their messages) and what it makes happen, and returns False when it
must wait.

Adding a kind (an overlapped F+B, an all-to-all, an offload) is: a class here with
its ``step``, the pass that inserts it (:mod:`~zerobubble.program.builder`), and its
entry in the interpreter's dispatch table (:mod:`~zerobubble.executor`).

This module is pure and torch-free.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from zerobubble.schedule.deps import RULES, Key, Kind, needs, producer, produces
from zerobubble.schedule.errors import Reason
from zerobubble.schedule.ir import Action, Op, Schedule

if TYPE_CHECKING:
    from zerobubble.program.check import Model

__all__ = [
    "Compute",
    "Gate",
    "Instruction",
    "LoweredSchedule",
    "Message",
    "MsgKind",
    "Overlap",
    "PostRecv",
    "Program",
    "ReduceGrads",
    "Send",
    "ShardAction",
    "ShardOp",
    "VersionCheck",
    "WaitRecv",
    "WaitReduce",
    "WaitSends",
    "input_message",
    "message_key",
    "output_message",
    "producer_of",
]


_FORWARD_KINDS = frozenset(RULES[Op.F].produces)
"""What forwards make (activations, saved state, keys and values): a replay gate may come
after these, before anything a backward makes."""


# ---- messages ----------------------------------------------------------------------------------


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


# ---- compute -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compute:
    """Run one compute action (F, B, W or BW) of a stage held by this device."""

    action: Action

    def __str__(self) -> str:
        return str(self.action)

    def step(self, m: Model, d: int) -> bool:
        """Needs what the dependency rule says (a message received, or the local producer
        having run), the stage's parameters gathered if it is sharded, its version checked
        where the plan asks for checks; a weight gradient only before its reduction."""
        a = self.action
        if m.checks and m.checked[d] != a:
            raise m.fail(Reason.MISSING, d, "runs without its version check right before it")
        m.checked[d] = None
        if a.stage in m.sharded[d] and a.stage not in m.gathered[d]:
            raise m.fail(
                Reason.MISSING, d, f"stage {a.stage}'s parameters are not gathered (no unshard)"
            )
        if a.op.adds_weight_grad:
            if a.stage in m.reducing[d]:
                raise m.fail(
                    Reason.MISSING,
                    d,
                    f"adds to stage {a.stage}'s gradients after their reduction started",
                )
            m.weights[d][a.stage] += 1
        S, k_seg = m.schedule.num_stages, m.schedule.segments
        # Messages first, then what this stage itself keeps (the F before a backward...).
        for k in sorted(needs(a.op, a.stage, a.mb, S, k_seg), key=lambda k: not k.kind.travels):
            if not k.kind.travels:
                if k not in m.made[d]:
                    raise m.fail(Reason.MISSING, d, f"{producer(k)} has not run here")
                continue
            need = Message(MsgKind(k.kind.value), k.stage, k.consumer_stage, k.mb)
            local = m.schedule.placement[k.stage] == d
            if not (k in m.made[d] if local else need in m.arrived[d]):
                how = "its producer has not run here" if local else "no WaitRecv precedes it"
                raise m.fail(Reason.MISSING, d, f"input {need} is not available ({how})")
        m.made[d].update(produces(a.op, a.stage, a.mb, S, k_seg))
        return True


@dataclass(frozen=True, slots=True)
class Overlap:
    """An F and a backward of other microbatches, on this device, run together: one's
    communication inside the stage (an all-to-all) is in flight while the other computes.

    ``parts`` holds each half's version check (when the program has them) and compute,
    the F's first. The transport model runs them in that order: the schedule already
    refused a pair whose backward needs its F (the ``overlap`` reason), so a program is
    valid overlapped exactly when it is valid in order, and the interpreter may run the
    two halves at once.
    """

    parts: tuple[VersionCheck | Compute, ...]

    def __post_init__(self) -> None:
        computes = [p for p in self.parts if isinstance(p, Compute)]
        if len(computes) != 2 or computes[0].action.op is not Op.F:
            raise ValueError(f"an overlap holds an F then a backward, got {self.parts}")

    @property
    def computes(self) -> tuple[Compute, Compute]:
        f, b = (p for p in self.parts if isinstance(p, Compute))
        return f, b

    def __str__(self) -> str:
        f, b = self.computes
        return f"overlap {f} & {b}"

    def step(self, m: Model, d: int) -> bool:
        """Its parts in order (each raises when its needs are not met; none waits)."""
        for part in self.parts:
            part.step(m, d)
        return True


# ---- point-to-point messages -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PostRecv:
    """Post a non-blocking receive of ``msg`` from device ``peer`` (it lands in the background)."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"post_recv {self.msg} from device {self.peer}"

    def step(self, m: Model, d: int) -> bool:
        """Never blocks; the k-th post from a peer matches the k-th message it sends here."""
        m.posted[self.peer, d].append(self.msg)
        return True


@dataclass(frozen=True, slots=True)
class WaitRecv:
    """Block until the posted receive of ``msg`` from ``peer`` has completed."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"wait_recv {self.msg} from device {self.peer}"

    def step(self, m: Model, d: int) -> bool:
        """Needs its receive posted; waits until the peer sent the matching message."""
        posted = m.posted[self.peer, d]
        if self.msg not in posted:
            raise m.fail(Reason.MISSING, d, "waits for a receive that was never posted")
        if m.match(self.peer, d, posted.index(self.msg), d) is None:
            return False
        m.arrived[d].add(self.msg)
        return True


@dataclass(frozen=True, slots=True)
class Send:
    """Start an asynchronous send of ``msg`` to device ``peer`` (never waited on here)."""

    msg: Message
    peer: int

    def __str__(self) -> str:
        return f"send {self.msg} to device {self.peer}"

    def step(self, m: Model, d: int) -> bool:
        """Needs its producer to have run on this device; never blocks."""
        if message_key(self.msg) not in m.made[d]:
            raise m.fail(Reason.MISSING, d, f"sent before {producer_of(self.msg)} produced it")
        m.sent[d, self.peer].append(self.msg)
        return True


@dataclass(frozen=True, slots=True)
class WaitSends:
    """Block until every send this device started has completed (end of a step)."""

    def __str__(self) -> str:
        return "wait_sends"

    def step(self, m: Model, d: int) -> bool:
        """Waits until every message this device sent has a posted receive."""
        return all(len(m.posted[d, dst]) >= len(m.sent[d, dst]) for dst in range(m.P))


# ---- data parallelism --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReduceGrads:
    """Start an asynchronous sum of ``stage``'s parameter gradients over the data-parallel
    replicas (right after the stage's last W or BW of the step)."""

    stage: int

    def __str__(self) -> str:
        return f"reduce_grads s{self.stage}"

    def step(self, m: Model, d: int) -> bool:
        """Needs every weight gradient of the stage (all M), once."""
        M = m.schedule.num_units
        if m.weights[d][self.stage] != M or self.stage in m.reducing[d]:
            raise m.fail(
                Reason.MISSING,
                d,
                f"reduces stage {self.stage}'s gradients after {m.weights[d][self.stage]} of "
                f"its {M} weight gradients, or twice (it must follow the stage's last W or BW, "
                "once)",
            )
        m.reducing[d].add(self.stage)
        return True


@dataclass(frozen=True, slots=True)
class WaitReduce:
    """Block until every gradient reduction this device started has completed."""

    def __str__(self) -> str:
        return "wait_reduce"

    def step(self, m: Model, d: int) -> bool:
        """Needs the reduction of every stage of the device started."""
        stages = set(m.schedule.stages_of_device[d])
        if m.reducing[d] != stages:
            raise m.fail(
                Reason.MISSING,
                d,
                f"waits for the reductions of stages {sorted(stages)} but only "
                f"{sorted(m.reducing[d])} were started",
            )
        m.waited_reduce[d] = True
        return True


class ShardOp(enum.StrEnum):
    """What a sharded stage does with its parameters."""

    UNSHARD = "unshard"
    """All-gather the stage's parameters (before its first F of the step)."""
    REDUCE = "reduce_scatter"
    """Reduce-scatter its gradients over the replicas, then free the gathered
    parameters (after its last W or BW of the step)."""

    __hash__ = str.__hash__


@dataclass(frozen=True, slots=True)
class ShardAction:
    """FSDP: ``op`` on the parameters of ``stage`` (every replica runs the same program, so
    the collectives of mirror ranks meet at the same program point)."""

    op: ShardOp
    stage: int

    def __str__(self) -> str:
        return f"{self.op.value}(s{self.stage})"

    def step(self, m: Model, d: int) -> bool:
        """Unshard: once, before any compute of the stage. Reduce-scatter: after all M
        weight gradients, once; no compute of the stage after it."""
        s = self.stage
        if self.op is ShardOp.UNSHARD:
            if s in m.gathered[d] or s in m.scattered[d]:
                raise m.fail(Reason.DUPLICATE, d, f"gathers stage {s}'s parameters twice")
            if any(k.stage == s for k in m.made[d]):
                raise m.fail(Reason.LOCAL_ORDER, d, f"gathers stage {s} after it computed")
            m.gathered[d].add(s)
            return True
        M = m.schedule.num_units
        if s not in m.gathered[d] or m.weights[d][s] != M:
            raise m.fail(
                Reason.MISSING,
                d,
                f"reduce-scatters stage {s} after {m.weights[d][s]} of its {M} weight "
                "gradients or without its unshard (it must follow the stage's last W or BW)",
            )
        m.gathered[d].discard(s)
        m.scattered[d].add(s)
        m.reducing[d].add(s)
        return True


# ---- the optimizer's protocol ------------------------------------------------------------------


@dataclass(frozen=True)
class Gate:
    """The replay gate of speculative post-validation: the caller validates here and may ask
    for a replay.

    On a replay the interpreter posts ``drain`` (the stale messages peers sent before
    their gates that this rank had not posted yet), waits for every posted receive,
    discards the step's work and runs the program again from its start (passing the
    gate without stopping).
    """

    drain: tuple[tuple[int, Message], ...]
    """``(peer, message)`` in the order to post them."""

    def __str__(self) -> str:
        return f"replay gate ({len(self.drain)} stale messages to drain on a replay)"

    def step(self, m: Model, d: int) -> bool:
        """Once per program, before any backward (what a replay drains is checked across
        the ranks, see :func:`~zerobubble.program.check.check_gates`)."""
        if m.gated[d]:
            raise m.fail(Reason.DUPLICATE, d, "a program holds at most one replay gate")
        if any(k.kind not in _FORWARD_KINDS for k in m.made[d]):
            raise m.fail(Reason.LOCAL_ORDER, d, "the replay gate comes after a backward")
        m.gated[d] = True
        return True


@dataclass(frozen=True)
class VersionCheck:
    """Right before a compute: the caller records (F) or checks (B, W, BW) the parameter
    version its microbatch runs on."""

    action: Action

    def __str__(self) -> str:
        return f"version check of {self.action}"

    def step(self, m: Model, d: int) -> bool:
        """Checks the compute that follows it."""
        m.checked[d] = self.action
        return True


Instruction = (
    Compute
    | Overlap
    | PostRecv
    | WaitRecv
    | Send
    | WaitSends
    | ReduceGrads
    | WaitReduce
    | ShardAction
    | Gate
    | VersionCheck
)
"""One instruction of a rank's program."""

Program = tuple[Instruction, ...]
"""One rank's instructions, in the order it runs them."""


@dataclass(frozen=True)
class LoweredSchedule:
    """A schedule with one program of instructions per device (what every pass maps).

    Attributes:
        schedule: The compute schedule it was lowered from.
        programs: ``programs[d]`` is device ``d``'s instruction list.
    """

    schedule: Schedule
    programs: tuple[Program, ...]

    def messages(self, device: int) -> tuple[Message, ...]:
        """Messages device ``device`` receives, in the order it posts them."""
        return tuple(i.msg for i in self.programs[device] if isinstance(i, PostRecv))

    def with_programs(self, programs: Iterable[Sequence[Instruction]]) -> LoweredSchedule:
        """The same schedule with other programs (a pass's result)."""
        return LoweredSchedule(self.schedule, tuple(tuple(p) for p in programs))
