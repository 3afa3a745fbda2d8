"""Run a rank's program on ``torch.distributed``: a plain interpreter, one process per device.

Usage mirrors ``torch.distributed.pipelining``::

    pipe = PipelineExecutor(schedule, build_stage_modules(layers, schedule, rank), loss_fn=loss)
    losses = []
    pipe.step(x, target=y, losses=losses)   # x used on stage 0's rank, y on the last stage's

The program is built once, by :func:`~zerobubble.schedule.build.build_programs`
(every pass in one ordered list, then a check of the finished programs of every
rank in a transport model); this module only runs it. Each instruction kind of
:mod:`~zerobubble.schedule.program` has one entry in the dispatch table
:data:`_RUN`. Messages go through :class:`~zerobubble.runtime.links.Links`
(frames, layouts that may change between steps, bounded waits). A caller that
needs more (the optimizer's protocol) asks for it in the plan
(:meth:`PipelineExecutor.set_protocol`) and passes
:class:`~zerobubble.runtime.hooks.StepHooks` that act on the protocol's
instructions; at a gate that asks for a replay the interpreter drains the stale
messages the gate names, discards the step's work and restarts the program.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from zerobubble.runtime.blame import forward_failure
from zerobubble.runtime.chunk import LossFn, StageChunk, StageChunkError
from zerobubble.runtime.dp import GradReducer, sum_over_dp
from zerobubble.runtime.executor_options import ExecutorOptions
from zerobubble.runtime.fsdp import ShardedStages
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.host_memory import retain_freed_memory
from zerobubble.runtime.links import Described, Links, pipeline_p2p
from zerobubble.runtime.loss_terms import gather_terms, term_weight
from zerobubble.runtime.mesh import PipelineMesh, pipeline_group
from zerobubble.runtime.microbatch import CountFn, default_count_fn
from zerobubble.runtime.overlap import OverlapPair, run_pair
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.segment_batch import check_cuts, segment_of, segment_step
from zerobubble.runtime.shapes import map_tensors
from zerobubble.runtime.step_batch import StepBatch, split_step
from zerobubble.runtime.trace import (
    TRACED,
    Trace,
    instruction_event,
    instruction_name,
    profiled,
    profiling,
)
from zerobubble.runtime.transforms import (
    ChunkTransforms,
    StagePlan,
    TensorParallel,
    prepare_chunks,
)
from zerobubble.schedule.build import GradSync, ProgramPlan, Protocol, build_programs
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.program import (
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
from zerobubble.schedule.trace_format import EventOp, TraceEvent, event_name

__all__ = ["ExecutorOptions", "PipelineExecutor", "StepHooks"]


class PipelineExecutor:
    """Executes one rank's part of a pipeline schedule, step after step.

    Args:
        schedule: The compute schedule; validated by the builder, so an invalid one is
            refused with the validator's message before any compute. What runs is
            :attr:`schedule`, after the passes the options ask for.
        stages: This rank's virtual stages, ``stage -> nn.Module`` (wrapped in a
            :class:`StageChunk`, B/W-split where the schedule splits that stage's
            backward) or ready :class:`StageChunk` objects. Must be exactly the stages
            the schedule places on this rank.
        loss_fn: ``loss_fn(output, target)`` of the last stage (used when wrapping modules),
            or ``loss_fn(output, target, num_items)`` with ``count_fn``.
        count_fn: Opts in to a loss normalised by a count over the whole batch (e.g. the
            non-ignored tokens, HF's ``num_items_in_batch``): ``count_fn(target)`` of the
            step's whole target, computed before any compute, is passed as ``num_items``
            to every microbatch's ``loss_fn``, which returns its sum divided by it; the
            microbatches' losses are then added unscaled, so the gradients are those of
            ``sum over the batch / num_items``. Without it the loss is a per-sample mean,
            weighted by ``n_j / N`` (:func:`~zerobubble.runtime.microbatch.loss_scales`).
            Default: ``loss_fn.count_fn`` where the loss declares one (Hugging Face's
            :class:`~zerobubble.interop.hf.CausalLMLoss` does: its tokens), else none.
        group: Process group whose rank ``d`` runs device ``d`` (default: the world).
        device: Where microbatches, buffers and the stages live (default: CPU).
        options: See :class:`ExecutorOptions`.
        mesh: A :class:`~zerobubble.runtime.mesh.PipelineMesh` (instead of ``group``): the
            executor runs on its ``pp_group``. With ``dp > 1`` the builder's gradient-sync
            pass follows the mesh's :class:`~zerobubble.runtime.mesh.ParallelSpec`: a
            reduction of each stage's gradients after its last W
            (:func:`~zerobubble.schedule.dp.insert_grad_reduce`), or with ``fsdp`` the
            stages sharded by FSDP2 (:class:`~zerobubble.runtime.fsdp.ShardedStages`: an
            unshard before the stage's first F, a reduce-scatter after its last W; build
            the optimizer over the chunks' parameters afterwards, the sharded DTensors).
            The loss is normalised over the global batch (``n_j / sum of N`` per
            microbatch, or the count summed over dp), so the synchronised gradients are
            those of the global batch. With ``tp > 1`` every stage module is parallelized
            over the mesh's ``tp_mesh`` first (:mod:`~zerobubble.runtime.transforms`'s "tp"
            step): its parameters and gradients become DTensors, and a pipeline is the pp
            ranks of one ``(dp, tp)`` coordinate, each stage sending its local output to
            the same tp rank of the next.
        tp_plan: The tensor-parallel plan of the stages with a ``tp > 1`` mesh: a plan, a
            function ``(stage, stage module) -> plan`` or None (each stage module's default
            plan); see :data:`~zerobubble.runtime.transforms.StagePlan`.

    Attributes:
        schedule: The schedule this executor runs (``schedule`` after
            :attr:`ExecutorOptions.fuse_local_backward`).
        plan: The :class:`~zerobubble.schedule.build.ProgramPlan` its programs were built by.
        programs: Every rank's finished program (a
            :class:`~zerobubble.schedule.program.LoweredSchedule`); :attr:`program` is this
            rank's.
        names: The name of each instruction of :attr:`program` as its trace event has it
            (:func:`~zerobubble.runtime.trace.instruction_name`; None for kinds that record
            none): the ``torch.profiler`` range it runs in while a profiler records.
        param_version: Parameter version recorded in the trace. Setting it is the caller's
            job (:class:`~zerobubble.optim.trainer.PipelineTrainer` does it); the executor
            only labels events with it.
        iteration: Number of completed steps.
        trace: The :class:`Trace` of this rank (events of all steps until cleared).
        mesh: The :class:`~zerobubble.runtime.mesh.PipelineMesh` it runs on, or None.
        reducer: The :class:`~zerobubble.runtime.dp.GradReducer` over the mesh's dp group
            (None without a gradient reduction).
        sharding: The :class:`~zerobubble.runtime.fsdp.ShardedStages` (None without FSDP).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module | StageChunk],
        *,
        loss_fn: LossFn | None = None,
        count_fn: CountFn | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        options: ExecutorOptions | None = None,
        mesh: PipelineMesh | None = None,
        tp_plan: StagePlan = None,
    ) -> None:
        self.options = opts = options or ExecutorOptions()
        self.cuts = check_cuts(opts.cuts, schedule.segments) if schedule.segments > 1 else None
        """The segments' token boundaries (None without segments)."""
        self.count_fn = default_count_fn(loss_fn, count_fn)
        if self.cuts is not None and getattr(loss_fn, "shifts_labels", False):
            raise ValueError(
                f"schedule {schedule.name!r} cuts sequences into segments, but loss_fn "
                f"{type(loss_fn).__name__} shifts the labels inside each call, so every "
                "segment's last position would lose its target: shift the labels once for the "
                "whole sequence (label t+1 at position t, the last -100) and pass a loss that "
                "scores position t against label t"
            )
        if self.cuts is not None and self.count_fn is None:
            raise ValueError(
                f"schedule {schedule.name!r} runs sequence segments, whose losses must be "
                "their tokens' shares of the batch loss: pass count_fn (the batch's token "
                "count, e.g. non-ignored targets) and a loss_fn(output, target, num_items) "
                "that sums over tokens and divides by it"
            )
        self.plan = ProgramPlan(
            fuse_local_backward=opts.fuse_local_backward,
            recv_lookahead=opts.recv_lookahead,
            grad_sync=GradSync.NONE if mesh is None else mesh.spec.grad_sync,
        )
        self._source = schedule
        if schedule.overlaps:
            _check_overlap(schedule, opts, mesh)
        self.programs = build_programs(schedule, self.plan)
        self.schedule = self.programs.schedule
        self.group = group = pipeline_group(schedule, mesh, group)
        self.mesh = mesh
        self.device = torch.device(device or "cpu")
        self.rng = StageRng(opts.seed, self.device)
        retain = opts.retain_host_memory
        if retain or (retain is None and self.device.type == "cpu"):
            retain_freed_memory()
        self.rank = dist.get_rank(group)
        self.term_weight = term_weight(
            opts.term_weight, schedule.num_microbatches, 1 if mesh is None else mesh.spec.dp
        )
        """Each microbatch's loss terms' weight in the step's objective (None: as its loss;
        :attr:`ExecutorOptions.term_weight`)."""
        self._load_program()
        mine = self.schedule.stages_of_device[self.rank]
        if sorted(stages) != list(mine):
            raise ValueError(
                f"rank {self.rank} was given stages {sorted(stages)} but the schedule places "
                f"stages {list(mine)} on it (build them with build_stage_modules)"
            )
        self.chunks: dict[int, StageChunk] = {}
        self.sharding: ShardedStages | None = None
        self._prepare(stages, loss_fn, tp_plan)
        for chunk in self.chunks.values():  # a W's replayed draws wait for a running forward
            chunk.store.rng_lock = self.rng.lock
        self.has_first = 0 in self.chunks
        self.has_last = self.schedule.num_stages - 1 in self.chunks
        self.reducer: GradReducer | None = None
        if mesh is not None and self.plan.grad_sync.reduces:
            assert mesh.dp_group is not None  # a ParallelSpec with dp > 1
            params = {s: list(c.module.parameters()) for s, c in self.chunks.items()}
            self.reducer = GradReducer(
                mesh.dp_group, params, opts.comm_timeout_s, expert_group=mesh.edp_group
            )
        self.p2p = pipeline_p2p(
            self.programs,
            group,
            self.device,
            opts.comm_timeout_s,
            directed=opts.directed_groups,
            pipelines=None if mesh is None else mesh.pipelines(),
        )
        self.links = Links(self.p2p, self.device, self.rank)
        # The trace's epoch: every rank leaves this (bounded) barrier at nearly one instant.
        self.p2p.all_reduce(torch.zeros(1, device=self.device), "start-up barrier (trace epoch)")
        self.trace = Trace(self.rank, time.perf_counter_ns())
        self.param_version = 0
        self.iteration = 0
        self.replays = 0
        self.last_terms: dict[str, list[torch.Tensor]] = {}
        """On the last stage's rank, the loss terms of the latest step (see :meth:`step`)."""

    def _prepare(
        self,
        stages: Mapping[int, nn.Module | StageChunk],
        loss_fn: LossFn | None,
        tp_plan: StagePlan,
    ) -> None:
        """This rank's chunks through the one ordered transform step
        (:func:`~zerobubble.runtime.transforms.prepare_chunks`: tp, split, recompute,
        compile, FSDP)."""
        S, opts = self.schedule.num_stages, self.options
        last = stages.get(S - 1)
        if last is not None and not isinstance(last, StageChunk) and loss_fn is None:
            raise ValueError(f"rank {self.rank} holds the last stage {S - 1}: pass loss_fn")
        split = self.schedule.split_stages(self.rank)
        every = ChunkTransforms(
            recompute=opts.recompute, compile=opts.compile, track_memory=opts.trace
        )
        transforms = {s: replace(every, split=s in split) for s in stages}
        mesh = self.mesh
        tp = None
        if mesh is not None and mesh.tp_mesh is not None:
            tp = TensorParallel(mesh.tp_mesh, tp_plan, mesh.spec.sequence_parallel)
        elif tp_plan is not None:
            raise ValueError(
                "tp_plan is given but the mesh has no tensor parallelism (tp=1): build the "
                "mesh with build_mesh(..., tp=2 or more), or drop tp_plan"
            )
        self.chunks, self.sharding = prepare_chunks(
            stages,
            S,
            loss_fn=loss_fn,
            transforms=transforms,
            fsdp_mesh=mesh.mesh["dp"] if mesh is not None and self.plan.grad_sync.shards else None,
            device=self.device,
            timeout_s=opts.comm_timeout_s,
            tp=tp,
        )

    def set_protocol(self, protocol: Protocol | str) -> None:
        """Build the programs again with the optimizer protocol's instructions (version
        checks; with ``"speculative"`` the replay gate), for the next step on.

        Collective in effect: every rank must ask for the same protocol (the builder
        plans the gates of all ranks together). A schedule that cannot replay is refused
        here (``ScheduleError``), before any message.
        """
        plan = replace(self.plan, protocol=Protocol(protocol))
        self.programs = build_programs(self._source, plan)
        self.plan = plan
        self._load_program()

    def _load_program(self) -> None:
        """This rank's program from :attr:`programs`, and its instructions' names (once
        per build: a step only looks them up)."""
        self.program = self.programs.programs[self.rank]
        self.names = [instruction_name(ins) for ins in self.program]

    def held_bytes(self) -> int:
        """Activation bytes held by this rank's stages."""
        return sum(c.held_bytes() for c in self.chunks.values())

    # ---- one step -------------------------------------------------------------------------

    def step(
        self,
        *args: object,
        target: object = None,
        losses: list[torch.Tensor] | None = None,
        hooks: StepHooks | None = None,
        terms: dict[str, list[torch.Tensor]] | None = None,
        **kwargs: object,
    ) -> list[torch.Tensor] | None:
        """Run the schedule on one batch; gradients accumulate into the stages' ``.grad``.

        ``args`` and ``kwargs`` are needed on the rank holding stage 0, which is
        called as ``stage0(*args_j, **kwargs_j)`` per microbatch j; ``target`` (a
        tensor or pytree) is needed on the rank holding the last stage, whose
        output and ``target_j`` go to ``loss_fn``. Others may pass them too; they
        are ignored. They are split into the schedule's M microbatches by the rule of
        :func:`~zerobubble.runtime.step_batch.split_step`; ``kwargs`` cannot be named
        ``target``, ``losses``, ``hooks``, ``terms``, ``mb``, ``loss_scale``,
        ``num_items``, ``segment`` or ``term_weight``. On the last stage's rank, returns the
        M unscaled per-microbatch losses and appends them to ``losses`` if given; elsewhere
        returns None. Where the
        layers add loss terms (:func:`~zerobubble.runtime.loss_terms.add_loss_term`) a
        microbatch's loss is its objective, ``loss_fn``'s loss plus every term weighted as
        :attr:`ExecutorOptions.term_weight` says
        (:func:`~zerobubble.runtime.loss_terms.weighted_objective`), and on the
        last stage's rank ``terms`` (and :attr:`last_terms`) gets, per term name, its M
        per-microbatch values (raw: detached, unweighted, unscaled). ``hooks``
        are called after every compute, at the protocol instructions of the program
        and on every message; if a gate asks for a replay, the step's
        work so far is discarded and the step runs again from its start (its
        forwards draw the same random numbers: see :attr:`ExecutorOptions.seed`).
        With ``count_fn`` the losses are the microbatches' shares of the batch loss
        (they sum to it).
        """
        batch = split_step(
            args,
            kwargs,
            target,
            self.schedule.num_microbatches,
            rank=self.rank,
            first=self.has_first,
            last=self.has_last,
            count_fn=self.count_fn,
            device=self.device,
            over_dp=partial(
                sum_over_dp, self.mesh.dp_group if self.mesh else None, self.p2p, self.iteration
            ),
        )
        if self.cuts is not None:
            batch = segment_step(batch, self.cuts)
        run = _Run(self, batch, hooks or StepHooks())
        run.run()
        self.iteration += 1
        if not self.has_last:
            return None
        out = [loss for loss in run.losses if loss is not None]
        k = self.schedule.segments
        if k > 1:  # a microbatch's loss is the sum of its segments' shares
            out = [sum(out[j * k + 1 : (j + 1) * k], out[j * k]) for j in range(len(out) // k)]
        self.last_terms = {}
        gather_terms(run.terms, self.last_terms)
        if losses is not None:
            losses.extend(out)
        if terms is not None:
            for name, values in self.last_terms.items():
                terms.setdefault(name, []).extend(values)
        return out


class _Run:
    """One step's interpretation of the program: the values in hand, the losses."""

    def __init__(self, pipe: PipelineExecutor, batch: StepBatch, hooks: StepHooks) -> None:
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
        """Run ``ins`` by its entry of :data:`_RUN`, recording its event if traced."""
        if tracing and type(ins) in TRACED:
            self.traced(ins)
        else:
            _RUN[type(ins)](self, ins)

    def traced(self, ins: Instruction) -> None:
        """Run ``ins`` and record its event (times, held bytes before and after)."""
        pipe = self.pipe
        mem0, t0 = self.held, pipe.trace.now()
        _RUN[type(ins)](self, ins)
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

    # ---- the interpreter's entries (one per instruction kind, see _RUN) ---------------------

    def compute(self, ins: Compute) -> None:
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
                    segment=None if pipe.cuts is None else segment_of(a.mb, pipe.cuts),
                    term_weight=pipe.term_weight if last else None,
                    **kwargs,
                )
        except StageChunkError:
            raise
        except Exception as e:
            if a.stage == 0:
                raise
            raise forward_failure(e, a.stage, a.mb, chunk.layer_of(e), arg, pipe.rank) from e

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
        run_pair(pair, pipe.options.overlap_fn, pipe.options.comm_timeout_s)
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


_RUN: dict[type, Callable[[_Run, Any], None]] = {
    Compute: _Run.compute,
    Overlap: _Run.overlap,
    PostRecv: _Run.post,
    WaitRecv: _Run.wait_recv,
    Send: _Run.send,
    WaitSends: _Run.wait_sends,
    ReduceGrads: _Run.reduce_grads,
    WaitReduce: _Run.wait_reduce,
    ShardAction: _Run.shard,
    VersionCheck: _Run.version_check,
    Gate: _Run.gate,
}
"""The dispatch table: one entry per instruction kind of :mod:`~zerobubble.schedule.program`."""


def _check_overlap(schedule: Schedule, opts: ExecutorOptions, mesh: PipelineMesh | None) -> None:
    """Refuse what would share state between the two halves of an overlapped pair."""
    pairs = f"schedule {schedule.name!r} overlaps {len(schedule.overlaps)} F&B pairs"
    if opts.recompute != "none":
        raise ValueError(
            f"{pairs}, whose halves run at once, and recompute={opts.recompute!r} replays a "
            "forward (with its random state) inside the backward: drop one of the two"
        )
    if mesh is not None and mesh.spec.fsdp:
        raise ValueError(
            f"{pairs}, whose halves run at once, and FSDP keeps one state per stage for "
            "its hooks: build the mesh with fsdp=False or a schedule without overlap"
        )
    if mesh is not None and mesh.tp_size > 1:
        raise ValueError(
            f"{pairs}, whose halves run at once, and tensor parallelism (tp="
            f"{mesh.tp_size}) runs both halves' collectives on the one tp group, where the "
            "tp ranks could order them differently: build the mesh with tp=1 or a schedule "
            "without overlap"
        )
