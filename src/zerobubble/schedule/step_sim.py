"""Iterations back to back: the optimizer step as a barrier versus post-validation.

:func:`~zerobubble.schedule.simulate.simulate` times one iteration with every
device starting at 0. In training, what joins iteration k to k+1 is the
optimizer step, and how it is coordinated decides whether the next
iteration's forwards can start along the pipeline as soon as each device is
free (a parallelogram) or only after a common barrier (a vertical edge):

* ``sync``: a global reduction of the gradient state (latency ``allreduce``)
  starts when the last device finishes its last action; then every device
  steps (``opt_step``) and starts k+1.
* ``conservative`` post-validation: once its own work is done and the prefix
  state from d-1 has arrived (``hop``), device d passes the prefix on and
  steps (``opt_step``); the full state travels back from P-1 (which has it
  with the prefix) to 0, one ``hop`` per device; d starts k+1 once it has it.
* ``speculative`` post-validation: d starts k+1 right after its provisional
  step and needs the full state only before its first backward of k+1.

Rollbacks are not modelled (the protocol assumes they are rare; each costs a
replay of the pre-gate work). Torch-free; durations are any numbers.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from zerobubble.schedule.costs import CostModel, Number
from zerobubble.schedule.deps import backward_ops, dependencies
from zerobubble.schedule.errors import Reason, ScheduleError
from zerobubble.schedule.ir import Action, Schedule


class StepMode(enum.StrEnum):
    """How the optimizer step joins iteration k to k+1 (the one definition: the trainer's
    :class:`~zerobubble.optim.config.OptimConfig` and this simulator both use it)."""

    SYNC = "sync"
    """Reduce the global gradient state across all ranks, then every rank clips, skips or
    steps together. A barrier at the end of every iteration; simplest to audit."""
    CONSERVATIVE = "conservative"
    """Post-validation: step provisionally on the prefix of the global state that reaches a
    rank along the pipeline, validate once the full state has travelled back (before the
    rank's first forward of k+1), and roll back if needed."""
    SPECULATIVE = "speculative"
    """Post-validation whose forwards of k+1 may run on provisional parameters until the
    rank's replay gate (before its first backward); on a rollback every rank discards that
    work and replays it."""

    @property
    def post_validation(self) -> bool:
        return self is not StepMode.SYNC


@dataclass(frozen=True)
class StepCosts:
    """Durations of the optimizer protocol.

    Attributes:
        opt_step: One optimizer step on a device.
        allreduce: Latency of the global reduction (sync mode).
        hop: Latency of one neighbour-to-neighbour state message (post-validation).
    """

    opt_step: Number = 0
    allreduce: Number = 0
    hop: Number = 0


@dataclass(frozen=True)
class StepSim:
    """Timing of ``iterations`` back-to-back iterations.

    Attributes:
        mode: The simulated :class:`StepMode`.
        first_start: ``first_start[i][d]``: when device d starts iteration i.
        done: ``done[i][d]``: when device d finishes iteration i's optimizer step
            (the provisional one in post-validation).
    """

    mode: StepMode
    first_start: tuple[tuple[Number, ...], ...]
    done: tuple[tuple[Number, ...], ...]

    @property
    def step_time(self) -> float:
        """Steady-state time per iteration: start-to-start of device 0, first to last."""
        n = len(self.first_start)
        if n < 2:
            raise ValueError("the step time needs at least two iterations")
        return float(self.first_start[-1][0] - self.first_start[0][0]) / (n - 1)


Key = tuple[str, int] | tuple[str, int, int] | tuple[str, int, Action]
"""A task: ("A", it, action); sync: ("reduce", it), ("opt", it, d); post-validation:
("prefix", it, d) (receive and forward the prefix), ("tail", it, d) (the step), ("val", it, d)."""


def simulate_steps(
    schedule: Schedule,
    costs: CostModel,
    step_costs: StepCosts,
    *,
    mode: StepMode | str,
    iterations: int = 4,
) -> StepSim:
    """Simulate ``iterations`` iterations of ``schedule`` joined by the optimizer ``mode``."""
    mode = StepMode(mode)
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    P, S = schedule.num_devices, schedule.num_stages
    sc = step_costs
    bops = backward_ops(schedule)
    # Per device (and one pseudo-device for the all-reduce): task order, durations, deps.
    order: list[list[Key]] = [[] for _ in range(P + 1)]
    duration: dict[Key, Number] = {}
    deps: dict[Key, Sequence[tuple[Key, Number]]] = {}

    def add(device: int, key: Key, dur: Number, after: Sequence[tuple[Key, Number]]) -> None:
        order[device].append(key)
        duration[key], deps[key] = dur, after

    def validation(it: int, d: int) -> None:
        src = ("prefix", it, P - 1) if d == P - 2 else ("val", it, d + 1)
        add(d, ("val", it, d), 0, [(src, sc.hop)])

    for it in range(iterations):
        for d in range(P):
            gate = mode is StepMode.SPECULATIVE and it > 0 and d < P - 1
            for a in schedule.actions[d]:
                if gate and a.op.is_backward:
                    validation(it - 1, d)
                    gate = False
                after = [
                    (
                        ("A", it, dep),
                        costs.hop(dep.op, dep.stage) if schedule.placement[dep.stage] != d else 0,
                    )
                    for dep in dependencies(a, S, bops, schedule.segments)
                ]
                add(d, ("A", it, a), costs.duration(a.op, a.stage), after)
        if mode is StepMode.SYNC:
            lasts = [(("A", it, schedule.actions[d][-1]), 0) for d in range(P)]
            add(P, ("reduce", it), sc.allreduce, lasts)
            for d in range(P):
                add(d, ("opt", it, d), sc.opt_step, [(("reduce", it), 0)])
            continue
        for d in range(P):  # forward the prefix first, then step
            add(d, ("prefix", it, d), 0, [(("prefix", it, d - 1), sc.hop)] if d else [])
            add(d, ("tail", it, d), sc.opt_step, [])
        if mode is StepMode.CONSERVATIVE or it == iterations - 1:
            for d in reversed(range(P - 1)):
                validation(it, d)
    start = _run(order, duration, deps)
    step = "opt" if mode is StepMode.SYNC else "tail"
    return StepSim(
        mode,
        tuple(
            tuple(start["A", it, schedule.actions[d][0]] for d in range(P))
            for it in range(iterations)
        ),
        tuple(
            tuple(start[step, it, d] + sc.opt_step for d in range(P)) for it in range(iterations)
        ),
    )


def _run(
    order: list[list[Key]],
    duration: dict[Key, Number],
    deps: dict[Key, Sequence[tuple[Key, Number]]],
) -> dict[Key, Number]:
    """Start times: each task after its device's previous one and its dependencies."""
    prev: dict[Key, Key] = {}
    for keys in order:
        for a, b in itertools.pairwise(keys):
            prev[b] = a
    waiting = {k: len(deps[k]) + (k in prev) for k in duration}
    succs: dict[Key, list[Key]] = {k: [] for k in duration}
    for k in duration:
        for dep, _ in deps[k]:
            succs[dep].append(k)
        if k in prev:
            succs[prev[k]].append(k)
    start: dict[Key, Number] = {}
    end: dict[Key, Number] = {}
    ready = [k for k, n in waiting.items() if n == 0]
    while ready:
        k = ready.pop()
        t = end[prev[k]] if k in prev else 0
        for dep, lat in deps[k]:
            t = max(t, end[dep] + lat)
        start[k], end[k] = t, t + duration[k]
        for s in succs[k]:
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if len(start) != len(duration):
        raise ScheduleError(Reason.DEADLOCK, "the iterations and their optimizer steps deadlock")
    return start
