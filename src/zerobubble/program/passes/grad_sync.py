"""The data-parallel lowering pass: where each stage's gradients are reduced over ``dp``.

With ``dp`` replicas of the pipeline, every replica's stage ``s`` holds its own
part of ``s``'s gradient; they must be summed before the optimizer reads them.
A stage's gradient is final after its last weight-gradient compute (W, or BW
where the backward is not split) of the step, so the reduction of ``s`` starts
right there, asynchronously, and overlaps with whatever compute the device still
has (the other stages' backwards, the pipeline's drain). One wait at the end of
the program, before the optimizer's tail (norm, clipping, NaN/Inf check), joins
them all.

Pure and torch-free, like :mod:`~zerobubble.program.lowering`; the runtime
interprets :class:`~zerobubble.program.instructions.ReduceGrads` and
:class:`~zerobubble.program.instructions.WaitReduce`.
"""

from __future__ import annotations

from collections.abc import Sequence

from zerobubble.program.instructions import (
    Compute,
    Instruction,
    LoweredSchedule,
    ReduceGrads,
    Send,
    WaitReduce,
)

__all__ = ["insert_grad_reduce", "last_weight_compute"]


def last_weight_compute(program: Sequence[object], stage: int) -> int:
    """Index in ``program`` of the last W or BW of ``stage`` (-1 when there is none): where
    the stage's gradients of the step are complete (dp's reduce and FSDP's reduce-scatter)."""
    for i in range(len(program) - 1, -1, -1):
        ins = program[i]
        if (
            isinstance(ins, Compute)
            and ins.action.stage == stage
            and ins.action.op.adds_weight_grad
        ):
            return i
    return -1


def insert_grad_reduce(lowered: LoweredSchedule) -> LoweredSchedule:
    """Insert a :class:`ReduceGrads` per (device, stage) and a :class:`WaitReduce` per device.

    ``ReduceGrads(s)`` goes right after the last W or BW of ``s`` on its device,
    after the :class:`Send` of that compute's output if it has one (the pipeline's
    message is not delayed by the reduction's launch). ``WaitReduce`` ends every
    program: the optimizer's tail follows it.
    """
    sched = lowered.schedule
    programs = []
    for d, prog in enumerate(lowered.programs):
        after: dict[int, list[int]] = {}
        for s in sched.stages_of_device[d]:
            i = last_weight_compute(prog, s)
            if i < 0:
                raise ValueError(f"device {d} runs no W or BW of its stage {s}")
            if i + 1 < len(prog) and isinstance(prog[i + 1], Send):
                i += 1
            after.setdefault(i, []).append(s)
        out: list[Instruction] = []
        for i, ins in enumerate(prog):
            out.append(ins)
            out += [ReduceGrads(s) for s in after.get(i, ())]
        out.append(WaitReduce())
        programs.append(tuple(out))
    return LoweredSchedule(sched, tuple(programs))
