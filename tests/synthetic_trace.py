"""A trace of a schedule without running it: each device's lowered program, timed.

Every instruction takes ``dt`` ns; a wait for a message returns ``latency`` ns after
its send ended. Torch-free, so check-trace tests need no processes.
"""

from __future__ import annotations

from zerobubble.program.instructions import Compute, PostRecv, Send, WaitRecv
from zerobubble.program.lowering import lower
from zerobubble.schedule.ir import Schedule
from zerobubble.trace.format import EventOp, TraceEvent

_OP = {PostRecv: EventOp.POST_RECV, WaitRecv: EventOp.WAIT_RECV, Send: EventOp.SEND}


def synthetic_trace(
    schedule: Schedule, *, iteration: int = 0, dt: int = 10, latency: int = 0
) -> list[TraceEvent]:
    progs = lower(schedule).programs
    pc = [0] * len(progs)
    clock = [0] * len(progs)
    sent: dict[object, int] = {}  # message -> end of its send
    events: list[TraceEvent] = []
    progressed = True
    while progressed:
        progressed = False
        for d, prog in enumerate(progs):
            while pc[d] < len(prog):
                ins = prog[pc[d]]
                start = clock[d]
                if isinstance(ins, WaitRecv):
                    if ins.msg not in sent:
                        break
                    start = max(start, sent[ins.msg] + latency)
                common = dict(
                    iteration=iteration,
                    rank=d,
                    param_version=iteration,
                    start_ns=start,
                    end_ns=start + dt,
                    mem_before=0,
                    mem_after=0,
                )
                if isinstance(ins, Compute):
                    a = ins.action
                    events.append(TraceEvent(op=a.op, stage=a.stage, mb=a.mb, **common))
                elif isinstance(ins, PostRecv | WaitRecv | Send):
                    m = ins.msg
                    here = m.src_stage if isinstance(ins, Send) else m.dst_stage
                    msg = (m.kind, m.src_stage, m.dst_stage, m.mb)
                    events.append(
                        TraceEvent(
                            op=_OP[type(ins)], stage=here, mb=m.mb, peer=ins.peer, msg=msg, **common
                        )
                    )
                    if isinstance(ins, Send):
                        sent[m] = start + dt
                else:
                    events.append(TraceEvent(op=EventOp.WAIT_SENDS, stage=None, mb=None, **common))
                clock[d] = start + dt + 1
                pc[d] += 1
                progressed = True
    if any(pc[d] < len(p) for d, p in enumerate(progs)):
        raise AssertionError("the lowered programs deadlock")
    return events
