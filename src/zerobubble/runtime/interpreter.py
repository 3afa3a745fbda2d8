"""The interpreter of a rank's program: one entry per instruction kind, nothing else.

A rank's setup (:class:`~zerobubble.executor.PipelineExecutor`: its stages transformed, its
links, reducer and shards) hands this module a :class:`Rank`; :class:`Interpreter` runs the
program's instructions in order through :data:`DISPATCH` for one step and keeps that step's
values in hand, losses and loss terms. At a gate that asks for a replay it drains the stale
messages the gate names, discards the step's work and restarts the program. It imports no
parallelism: the reducer and the shards are whatever objects the program's instructions need
(``launch``/``wait``, ``run``), set up by the layer above.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.profiler import record_function

from zerobubble.program.instructions import (
    Compute,
    Gate,
    Instruction,
    Overlap,
    PostRecv,
    ReduceGrads,
    Send,
    ShardAction,
    VersionCheck,
    WaitRecv,
    WaitReduce,
    WaitSends,
    input_message,
    output_message,
)
from zerobubble.runtime.blame import forward_failure, where_failed
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.options import ExecutorOptions
from zerobubble.runtime.overlap import OverlapPair, run_pair
from zerobubble.runtime.p2p.comm import PeerError
from zerobubble.runtime.p2p.links import Described, Links
from zerobubble.runtime.recorder import (
    TRACED,
    Trace,
    instruction_event,
    instruction_name,
    profiled,
    profiling,
)
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.sequence.batch import segment_of
from zerobubble.runtime.shapes import map_tensors
from zerobubble.runtime.stage import StageChunk, StageChunkError
from zerobubble.runtime.step_batch import StepBatch
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.trace.format import EventOp, TraceEvent, event_name

__all__ = ["DISPATCH", "Interpreter", "Rank"]


class Rank(Protocol):
    """What the interpreter reads of a rank, as its setup left it (``replays`` it counts)."""

    replays: int

    @property
    def schedule(self) -> Schedule: ...
    @property
    def program(self) -> Sequence[Instruction]: ...
    @property
    def names(self) -> Sequence[str | None]: ...
    @property
    def options(self) -> ExecutorOptions: ...
    @property
    def chunks(self) -> Mapping[int, StageChunk]: ...
    @property
    def links(self) -> Links: ...
    @property
    def p2p(self) -> Any: ...  # the pipeline group's wrapper: its ``arrivals`` and ``progress``
    @property
    def tp_group(self) -> Any: ...  # the stages' tensor-parallel group, or None
    @property
    def reducer(self) -> Any: ...  # launch(stage, iteration), wait(iteration) if it reduces
    @property
    def sharding(self) -> Any: ...  # run(ShardAction) if the program shards
    @property
    def rng(self) -> StageRng: ...
    @property
    def trace(self) -> Trace: ...
    @property
    def local_cuts(self) -> tuple[int, ...] | None: ...  # the segments' cuts in this rank's tokens
    @property
    def overlap_fn(self) -> Any: ...  # how a pair runs (None: both halves at once)
    @property
    def term_weight(self) -> Any: ...
    @property
    def rank(self) -> int: ...
    @property
    def iteration(self) -> int: ...
    @property
    def param_version(self) -> int: ...

    def held_bytes(self) -> int: ...


class Interpreter:
    """One step's interpretation of a rank's program: the values in hand, the losses.

    ``pipe`` is the rank (:class:`Rank`) as its setup left it; this object only reads it,
    runs each instruction by its entry of :data:`DISPATCH`, and counts replays on it.
    """

    def __init__(self, pipe: Rank, batch: StepBatch, hooks: StepHooks) -> None:
        self.pipe, self.batch, self.hooks = pipe, batch, hooks
        pipe.links.hooks = hooks
        self.S = pipe.schedule.num_stages
        self.i = 0  # the next instruction
        self.past_gate = False  # one stop per step: a replayed run passes the gate
        self.ready: dict[Any, Any] = {}  # values received or produced, not yet consumed
        self.losses: list[torch.Tensor | None] = [None] * pipe.schedule.num_units
        self.terms: list[dict[str, torch.Tensor]] = [{} for _ in self.losses]
        self.held = pipe.held_bytes() if pipe.options.trace else 0  # as of the last compute

    def run(self) -> None:
        program, names, hooks = self.pipe.program, self.pipe.names, self.hooks
        tracing = self.pipe.options.trace
        while self.i < len(program):
            ins, name = program[self.i], names[self.i]
            self.i += 1
            kind = type(ins)
            # The one place an instruction's work is wrapped: its profiler range (only
            # while a profiler records) around its trace event's timing.
            if name is not None and profiling():
                with record_function(name):
                    self.dispatch(ins, tracing)
            else:
                self.dispatch(ins, tracing)
            if kind is Compute:
                hooks.after_compute(ins.action)  # type: ignore[union-attr]  # a Compute

    def dispatch(self, ins: Instruction, tracing: bool) -> None:
        """Run ``ins`` by its entry of :data:`DISPATCH`, recording its event if traced."""
        if tracing and type(ins) in TRACED:
            self.traced(ins)
        else:
            DISPATCH[type(ins)](self, ins)

    def traced(self, ins: Instruction) -> None:
        """Run ``ins`` and record its event (times, held bytes before and after)."""
        pipe = self.pipe
        mem0, t0 = self.held, pipe.trace.now()
        DISPATCH[type(ins)](self, ins)
        t1 = pipe.trace.now()
        if isinstance(ins, Compute):
            self.held = pipe.held_bytes()
        pipe.trace.record(instruction_event(ins, self.common(t0, t1, mem0, self.held)))

    def common(self, t0: int, t1: int, mem0: int, mem1: int) -> dict[str, Any]:
        pipe = self.pipe
        return {
            "iteration": pipe.iteration,
            "rank": pipe.rank,
            "param_version": pipe.param_version,
            "start_ns": t0,
            "end_ns": t1,
            "mem_before": mem0,
            "mem_after": mem1,
        }

    # ---- the interpreter's entries (one per instruction kind, see DISPATCH) ---------------------

    def compute(self, ins: Compute) -> None:
        pipe = self.pipe
        if pipe.tp_group is None:
            self.run_compute(ins)
            return
        with pipe.p2p.arrivals.watch(
            pipe.tp_group,
            lambda: f"{ins.action} of iteration {pipe.iteration} (its collectives over dim 'tp')",
            timeout_s=pipe.options.comm_timeout_s,
        ):
            self.run_compute(ins)

    def run_compute(self, ins: Compute) -> None:
        a = ins.action
        chunk = self.pipe.chunks[a.stage]
        if a.op is Op.W:
            chunk.backward_weight(a.mb)
            return
        need = input_message(a, self.S)
        arg = self.ready.pop(need) if need is not None else None
        if a.op is Op.F:
            y = self.forward(a, chunk, arg)
            if a.stage == self.S - 1:
                self.losses[a.mb] = y
                self.terms[a.mb] = chunk.take_terms(a.mb)
                return
        elif a.op is Op.B:
            y = chunk.backward_input(a.mb, arg)
        else:
            y = chunk.backward_full(a.mb, arg)
        out = output_message(a, self.S)
        if out is None:
            return
        local = self.pipe.schedule.placement[out.dst_stage] == self.pipe.rank
        if local and a.op is not Op.F:
            y = map_tensors(y, torch.Tensor.detach)
        self.ready[out] = y

    def forward(self, a: Action, chunk: StageChunk, arg: Any) -> Any:
        """F of ``a``; an exception blames what failed: the stage's own code (naming the
        layer), or its input's layout (naming both stages) when the error says so."""
        pipe, batch, last = self.pipe, self.batch, a.stage == self.S - 1
        cuts = pipe.local_cuts
        if a.stage == 0:
            assert batch.inputs is not None  # _batch splits it on stage 0's rank
            args, kwargs = batch.inputs[a.mb]
        else:
            args, kwargs = (arg,), {}
        target, scale = None, 1.0
        if last:
            assert batch.targets is not None and batch.scales is not None
            target, scale = batch.targets[a.mb], batch.scales[a.mb]
        try:
            with pipe.rng.scope(pipe.iteration, a.stage, a.mb):
                return chunk.forward(
                    a.mb,
                    *args,
                    target=target,
                    loss_scale=scale,
                    num_items=batch.num_items if last else None,
                    segment=None if cuts is None else segment_of(a.mb, cuts),
                    term_weight=pipe.term_weight if last else None,
                    **kwargs,
                )
        except (StageChunkError, PeerError):  # a peer's failure is not this stage's input's
            raise
        except Exception as e:
            layer = chunk.layer_path(e)
            if a.stage == 0:  # the user's own exception, with a note saying where
                e.add_note(f"stage 0, microbatch {a.mb}: {where_failed(layer, pipe.rank)}")
                raise
            raise forward_failure(e, a.stage, a.mb, layer, arg, pipe.rank) from e

    def overlap(self, ins: Overlap) -> None:
        """Both halves of a pair at once (:mod:`~zerobubble.runtime.overlap`): their version
        checks first, here; each compute's event and profiler range on its own thread."""
        pipe, tracing = self.pipe, self.pipe.options.trace
        for part in ins.parts:
            if isinstance(part, VersionCheck):
                self.version_check(part)
        f, b = ins.computes
        mem0 = self.held
        times: dict[Compute, tuple[int, int]] = {}

        def half(c: Compute) -> Callable[[], None]:
            def run() -> None:
                t0 = pipe.trace.now() if tracing else 0
                name = instruction_name(c)
                if name is not None and profiling():
                    with record_function(name):
                        self.compute(c)
                else:
                    self.compute(c)
                if tracing:
                    times[c] = (t0, pipe.trace.now())

            return run

        pair = OverlapPair(f.action, b.action, half(f), half(b))
        try:
            run_pair(pair, pipe.overlap_fn, pipe.options.comm_timeout_s)
        except PeerError:  # the other half may have marked this rank running since: it
            pipe.p2p.progress.waiting(None)  # dies waiting (the launcher's blame reads it)
            raise
        if tracing:
            self.held = pipe.held_bytes()
            for c in sorted(times, key=lambda c: times[c]):
                t0, t1 = times[c]
                pipe.trace.record(instruction_event(c, self.common(t0, t1, mem0, self.held)))
        self.hooks.after_compute(f.action)
        self.hooks.after_compute(b.action)

    def post(self, ins: PostRecv) -> None:
        self.pipe.links.post(ins.msg, ins.peer, Described(ins, self.pipe.iteration))

    def wait_recv(self, ins: WaitRecv) -> None:
        what = Described(ins, self.pipe.iteration)
        self.ready[ins.msg] = self.pipe.links.receive(ins.msg, ins.peer, what)

    def send(self, ins: Send) -> None:
        value = self.ready.pop(ins.msg)
        self.pipe.links.send(ins.msg, ins.peer, value, Described(ins, self.pipe.iteration))

    def wait_sends(self, ins: WaitSends) -> None:
        self.pipe.links.wait_sends()

    def reduce_grads(self, ins: ReduceGrads) -> None:
        assert self.pipe.reducer is not None  # the builder inserts it only with a dp group
        self.pipe.reducer.launch(ins.stage, self.pipe.iteration)

    def wait_reduce(self, ins: WaitReduce) -> None:
        assert self.pipe.reducer is not None
        self.pipe.reducer.wait(self.pipe.iteration)

    def shard(self, ins: ShardAction) -> None:
        assert self.pipe.sharding is not None  # the builder inserts it only with FSDP
        self.pipe.sharding.run(ins)

    def version_check(self, ins: VersionCheck) -> None:
        self.hooks.check_version(ins.action)

    def gate(self, ins: Gate) -> None:
        if self.past_gate:
            return
        self.past_gate = True
        if self.hooks.at_gate():
            self.replay(ins)

    def replay(self, gate: Gate) -> None:
        """Discard this attempt (stage state, stale messages) and restart the program.

        Its own profiler range: the gate that runs it records no event of its own."""
        pipe = self.pipe
        tracing = pipe.options.trace
        t0, mem0 = (pipe.trace.now(), pipe.held_bytes()) if tracing else (0, 0)
        with profiled(event_name(EventOp.REPLAY)):
            pipe.links.drain(gate.drain)
            for chunk in pipe.chunks.values():
                chunk.discard()
            self.hooks.on_replay()
        self.ready.clear()
        self.losses = [None] * len(self.losses)
        self.terms = [{} for _ in self.losses]
        self.i = 0
        pipe.replays += 1
        if tracing:
            self.held = pipe.held_bytes()
            common = self.common(t0, pipe.trace.now(), mem0, self.held)
            pipe.trace.record(TraceEvent(op=EventOp.REPLAY, stage=None, mb=None, **common))


DISPATCH: dict[type, Callable[[Interpreter, Any], None]] = {
    Compute: Interpreter.compute,
    Overlap: Interpreter.overlap,
    PostRecv: Interpreter.post,
    WaitRecv: Interpreter.wait_recv,
    Send: Interpreter.send,
    WaitSends: Interpreter.wait_sends,
    ReduceGrads: Interpreter.reduce_grads,
    WaitReduce: Interpreter.wait_reduce,
    ShardAction: Interpreter.shard,
    VersionCheck: Interpreter.version_check,
    Gate: Interpreter.gate,
}
"""The dispatch table: one entry per instruction kind of :mod:`~zerobubble.program.instructions`."""
