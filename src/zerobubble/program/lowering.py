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
it on any program, and
:func:`~zerobubble.program.check.validate_program` runs the finished
programs in a model of the transport (sends buffered, receives posted ahead) to
refuse anything that could deadlock. The instructions are those of
:mod:`~zerobubble.program.instructions`.

This module is pure and torch-free.
"""

from __future__ import annotations

from collections import defaultdict

from zerobubble.program.instructions import (
    Compute,
    Instruction,
    LoweredSchedule,
    Message,
    PostRecv,
    Send,
    WaitRecv,
    WaitSends,
    input_message,
    output_message,
)
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Schedule

__all__ = ["check_comm_order", "lower"]


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
