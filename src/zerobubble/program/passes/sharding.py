"""Where sharded stages gather and scatter their parameters: a pass over a rank's program.

With FSDP a stage's parameters live sharded over the data-parallel replicas. They
must be gathered before the stage's first F of a step and its gradients
reduce-scattered once its last weight gradient is in. In a zero-bubble schedule
that last W comes late (after the B of every microbatch), so the gathered
parameters are kept from the first F to the last W of the step: gathering them
again for B or W would cost one all-gather per action, and B's saved tensors
reference them anyway. :func:`insert_sharding` places one
:class:`~zerobubble.program.instructions.ShardAction`
of each kind per stage; the runtime (:mod:`zerobubble.parallel.fsdp`) carries them
out, the executor only dispatches them.

Every data-parallel replica of a pipeline rank runs the same program, so the
collectives of mirror ranks meet at the same program point and cannot deadlock
against the pipeline's messages (each replica alone is deadlock-free, and the
collective is a local step of it).

This module is pure and torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from zerobubble.program.instructions import (
    Compute,
    Instruction,
    LoweredSchedule,
    ShardAction,
    ShardOp,
)
from zerobubble.program.passes.grad_sync import last_weight_compute

__all__ = ["insert_sharding", "shard_programs"]


def insert_sharding(
    program: Sequence[Instruction], stages: Iterable[int]
) -> tuple[Instruction, ...]:
    """``program`` with an UNSHARD of each of ``stages`` before its first compute and a
    REDUCE after its last one.

    A stage's first compute in a step is an F and its last a W or BW (every valid
    schedule has that order). Raises ValueError if a stage has no compute in the
    program, or if its last compute is not a W or BW.
    """
    items = list(program)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i, ins in enumerate(items):
        if isinstance(ins, Compute):
            s = ins.action.stage
            first.setdefault(s, i)
            last[s] = i
    before: dict[int, list[ShardAction]] = {}
    after: dict[int, list[ShardAction]] = {}
    for s in sorted(set(stages)):
        if s not in first:
            raise ValueError(f"stage {s} has no compute in this program: it cannot be sharded")
        if last_weight_compute(items, s) != last[s]:
            tail = items[last[s]]
            assert isinstance(tail, Compute)
            raise ValueError(
                f"stage {s}'s last compute is {tail.action}, not a W or BW: its gradients "
                "are not complete there"
            )
        before.setdefault(first[s], []).append(ShardAction(ShardOp.UNSHARD, s))
        after.setdefault(last[s], []).append(ShardAction(ShardOp.REDUCE, s))
    out: list[Instruction] = []
    for i, ins in enumerate(items):
        out.extend(before.get(i, ()))
        out.append(ins)
        out.extend(after.get(i, ()))
    return tuple(out)


def shard_programs(lowered: LoweredSchedule) -> LoweredSchedule:
    """The FSDP pass: :func:`insert_sharding` of every device's stages in its program."""
    sched = lowered.schedule
    return lowered.with_programs(
        insert_sharding(prog, sched.stages_of_device[d]) for d, prog in enumerate(lowered.programs)
    )
