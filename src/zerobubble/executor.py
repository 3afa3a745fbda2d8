"""One rank of a pipeline, set up and run: its stages transformed, its links, its program.

Usage mirrors ``torch.distributed.pipelining``::

    pipe = PipelineExecutor(schedule, build_stage_modules(layers, schedule, rank), loss_fn=loss)
    losses = []
    pipe.step(x, target=y, losses=losses)   # x used on stage 0's rank, y on the last stage's

Two objects: :class:`PipelineExecutor` is the rank's setup. It applies the parallel
transforms to each stage (:func:`~zerobubble.parallel.transforms.prepare_chunks`), opens the
links and the data-parallel reducer, and builds the program once with
:func:`~zerobubble.program.builder.build_programs` (every pass in one ordered list, then a
check of every rank's finished program in a transport model). Each step, it splits the batch
and hands itself to an :class:`~zerobubble.runtime.interpreter.Interpreter`, which runs the
program through one dispatch entry per instruction kind. A caller that needs more (the
optimizer's protocol) asks for it in the plan (:meth:`PipelineExecutor.set_protocol`) and
passes :class:`~zerobubble.runtime.hooks.StepHooks` that act on the protocol's instructions.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.parallel.checks import check_job, check_pairs, pair_runner
from zerobubble.parallel.dp import GradReducer, sum_over_replicas
from zerobubble.parallel.fsdp import ShardedStages
from zerobubble.parallel.loss import LossParallel
from zerobubble.parallel.mesh import PipelineMesh, pipeline_group, stage_lanes
from zerobubble.parallel.parallelize import Parallelize, ParallelizeFn, StagePlan
from zerobubble.parallel.transforms import ChunkTransforms, prepare_chunks
from zerobubble.program.builder import build_programs
from zerobubble.program.plan import GradSync, ProgramPlan, Protocol
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.host_memory import retain_freed_memory
from zerobubble.runtime.interpreter import Interpreter
from zerobubble.runtime.loss_terms import gather_terms, term_weight
from zerobubble.runtime.microbatch import CountFn, default_count_fn
from zerobubble.runtime.options import ExecutorOptions
from zerobubble.runtime.overlap import OverlapFn
from zerobubble.runtime.p2p.comm import exchange_bytes, plain_name, set_timeout
from zerobubble.runtime.p2p.links import Links, pipeline_p2p
from zerobubble.runtime.recorder import (
    Trace,
    instruction_name,
)
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.sequence.batch import check_agreed_cuts, check_cuts, segment_step
from zerobubble.runtime.sequence.cp import ContextShards, segments_refusal, shard_step
from zerobubble.runtime.sequence.guard import SegmentGuard
from zerobubble.runtime.stage import LossFn, StageChunk
from zerobubble.runtime.step_batch import split_step
from zerobubble.schedule.ir import Schedule

__all__ = ["ExecutorOptions", "PipelineExecutor", "StepHooks"]


def _refuse_both(parallelize: Parallelize | None, *given: object) -> None:
    """``parallelize`` (the steps built already) ignores the options that build them."""
    if parallelize is not None and any(g is not None for g in given):
        raise ValueError(
            "pass parallelize (the steps built already) or tp_plan/parallelize_fn/"
            "loss_parallel (to build them from the mesh), not both: the built steps would "
            "ignore the others"
        )


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
        mesh: A :class:`~zerobubble.parallel.mesh.PipelineMesh` (instead of ``group``): the
            executor runs on its ``pp_group``. With ``dp > 1`` the builder's gradient-sync
            pass follows the mesh's :class:`~zerobubble.parallel.mesh.ParallelSpec`: a
            reduction of each stage's gradients after its last W
            (:func:`~zerobubble.program.passes.grad_sync.insert_grad_reduce`), or with ``fsdp`` the
            stages sharded by FSDP2 (:class:`~zerobubble.parallel.fsdp.ShardedStages`: an
            unshard before the stage's first F, a reduce-scatter after its last W; build
            the optimizer over the chunks' parameters afterwards, the sharded DTensors).
            The loss is normalised over the global batch (``n_j / sum of N`` per
            microbatch, or the count summed over dp), so the synchronised gradients are
            those of the global batch. Every stage module meets the mesh's model-facing
            dimensions first (:class:`~zerobubble.parallel.parallelize.Parallelize`): with
            ``tp > 1`` its parameters and gradients become DTensors over the ``tp_mesh``,
            and a pipeline is the pp ranks of one ``(dp, tp)`` coordinate, each stage
            sending its local output to the same tp rank of the next; with ``ep > 1`` each
            rank keeps its experts of its ep group.
        tp_plan: The tensor-parallel plan of the stages with a ``tp > 1`` mesh: a plan, a
            function ``(stage, stage module) -> plan`` or None (each stage module's default
            plan); see :data:`~zerobubble.parallel.parallelize.StagePlan`.
        parallelize_fn: ``(stage, module, mesh) -> module``, which parallelizes each stage
            by hand instead of the tp and ep steps (needs ``mesh``; not with ``tp_plan``).
        loss_parallel: With ``tp > 1`` and the default plans, whether the last stage's LM
            head leaves its logits sharded over the vocabulary for the loss
            (:mod:`~zerobubble.parallel.loss`): None (default) where ``loss_fn`` takes them
            (``loss_fn.loss_parallel``), gathered for any other loss; True requires it
            (ValueError naming the stage otherwise); False gathers them.
        parallelize: Those steps built already (a caller making several executors over the
            same stages builds them once; not with ``tp_plan``, ``parallelize_fn`` or
            ``loss_parallel``).

    Attributes:
        schedule: The schedule this executor runs (``schedule`` after
            :attr:`ExecutorOptions.fuse_local_backward`).
        plan: The :class:`~zerobubble.program.plan.ProgramPlan` its programs were built by.
        programs: Every rank's finished program (a
            :class:`~zerobubble.program.instructions.LoweredSchedule`); :attr:`program` is this
            rank's.
        names: The name of each instruction of :attr:`program` as its trace event has it
            (:func:`~zerobubble.runtime.recorder.instruction_name`; None for kinds that record
            none): the ``torch.profiler`` range it runs in while a profiler records.
        param_version: Parameter version recorded in the trace. Setting it is the caller's
            job (:class:`~zerobubble.optim.trainer.PipelineTrainer` does it); the executor
            only labels events with it.
        iteration: Number of completed steps.
        trace: The :class:`Trace` of this rank (events of all steps until cleared).
        mesh: The :class:`~zerobubble.parallel.mesh.PipelineMesh` it runs on, or None.
        reducer: The :class:`~zerobubble.parallel.dp.GradReducer` over the mesh's dp group
            (None without a gradient reduction).
        sharding: The :class:`~zerobubble.parallel.fsdp.ShardedStages` (None without FSDP).
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
        parallelize_fn: ParallelizeFn | None = None,
        loss_parallel: bool | None = None,
        parallelize: Parallelize | None = None,
    ) -> None:
        _refuse_both(parallelize, tp_plan, parallelize_fn, loss_parallel)
        self.options = opts = options or ExecutorOptions()
        self.cuts = check_cuts(opts.cuts, schedule.segments, f"schedule {schedule.name!r}")
        """The segments' token boundaries (None without segments)."""
        self.count_fn = default_count_fn(loss_fn, count_fn)
        if self.cuts is not None:
            _check_segment_loss(schedule, loss_fn, self.count_fn)
        self.context = _context(schedule, self.count_fn, loss_fn, mesh, self.cuts)
        self.plan = ProgramPlan(
            fuse_local_backward=opts.fuse_local_backward,
            recv_lookahead=opts.recv_lookahead,
            grad_sync=GradSync.NONE if mesh is None else mesh.spec.grad_sync,
        )
        self._source = schedule
        check_job(schedule, opts, mesh, self.cuts)
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
        replicas = 1 if mesh is None else mesh.spec.dp * mesh.spec.cp
        self.term_weight = term_weight(opts.term_weight, schedule.num_microbatches, replicas)
        """Each microbatch's loss terms' weight in the step's objective (None: as its loss;
        :attr:`ExecutorOptions.term_weight`)."""
        self._load_program()
        _check_stages(stages, self.schedule.stages_of_device[self.rank], self.rank)
        self.chunks: dict[int, StageChunk] = {}
        self.sharding: ShardedStages | None = None
        if parallelize is None:
            parallelize = Parallelize.from_mesh(
                mesh,
                tp_plan=tp_plan,
                fn=parallelize_fn,
                loss=LossParallel(schedule.num_stages - 1, loss_fn, loss_parallel),
                group=group,
                timeout_s=opts.comm_timeout_s,
                lanes=stage_lanes(schedule),
            )
        self._prepare(stages, loss_fn, parallelize)
        check_pairs(self.schedule, self.chunks, mesh, group)
        self.segment_guard = SegmentGuard.install(self.cuts, self.chunks, self.device, mesh)
        for chunk in self.chunks.values():  # a W's replayed draws wait for a running forward
            chunk.store.rng_lock = self.rng.lock
        self.has_first = 0 in self.chunks
        self.has_last = self.schedule.num_stages - 1 in self.chunks
        self.tp_group = None if mesh is None else mesh.tp_group
        """The group of the stages' tensor-parallel collectives, which DTensor runs inside
        torch: its transport timeout is the comm timeout, and a compute that fails in one
        names the tp rank that never arrived
        (:meth:`~zerobubble.runtime.p2p.comm.Arrivals.watch`)."""
        set_timeout(self.tp_group, timedelta(seconds=opts.comm_timeout_s))
        self.reducer = self._reducer()
        self._connect()
        self.trace = Trace(self.rank, time.perf_counter_ns())
        self.param_version = 0
        self.iteration = 0
        self.replays = 0
        self.last_terms: dict[str, list[torch.Tensor]] = {}
        """On the last stage's rank, the loss terms of the latest step (see :meth:`step`)."""

    @property
    def overlap_fn(self) -> OverlapFn | None:
        """How an overlapped pair runs (:func:`~zerobubble.parallel.checks.pair_runner`)."""
        return pair_runner(self.options, self.mesh)

    def _reducer(self) -> GradReducer | None:
        """The reduction of the stages' gradients over the mesh's dp group (the experts'
        over its edp group), where the plan's gradient sync reduces whole gradients."""
        mesh = self.mesh
        if mesh is None or not self.plan.grad_sync.reduces:
            return None
        params = {s: list(c.module.parameters()) for s, c in self.chunks.items()}
        return GradReducer.of_mesh(mesh, params, self.options.comm_timeout_s)

    def _connect(self) -> None:
        """The pipeline's point-to-point links, then one start-up barrier (every rank leaves
        it at nearly one instant: the trace's epoch), then the agreement on the cuts."""
        opts, mesh = self.options, self.mesh
        self.p2p = pipeline_p2p(
            self.programs,
            self.group,
            self.device,
            opts.comm_timeout_s,
            directed=opts.directed_groups,
            pipelines=None if mesh is None else mesh.pipelines(),
            name=plain_name if mesh is None else mesh.spec.name,
        )
        self.links = Links(self.p2p, self.device, self.rank)
        self.p2p.all_reduce(torch.zeros(1, device=self.device), "start-up barrier (trace epoch)")
        if self.cuts is not None:
            self._agree_on_cuts()

    def _prepare(
        self,
        stages: Mapping[int, nn.Module | StageChunk],
        loss_fn: LossFn | None,
        parallelize: Parallelize,
    ) -> None:
        """This rank's chunks through the one ordered transform list
        (:func:`~zerobubble.parallel.transforms.prepare_chunks`: tp and ep, or a user's
        function; split, recompute, compile, FSDP)."""
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
        shards = mesh is not None and self.plan.grad_sync.shards
        self.chunks, self.sharding = prepare_chunks(
            stages,
            S,
            loss_fn=loss_fn,
            transforms=transforms,
            fsdp_mesh=mesh.mesh["dp"] if shards and mesh is not None else None,
            expert_mesh=(
                mesh.ep_mesh["edp"] if shards and mesh is not None and mesh.ep_mesh else None
            ),
            device=self.device,
            timeout_s=opts.comm_timeout_s,
            parallelize=parallelize,
            name=plain_name if mesh is None else mesh.spec.name,
        )

    def _agree_on_cuts(self) -> None:
        """Every rank of the job must cut the sequences at the same tokens (a pipeline whose
        ranks slice differently would exchange boundary values of other lengths, or hang):
        one bounded all-gather of the cuts at start-up, over the job with a mesh (the dp and
        tp replicas too), else over the pipeline. Each rank's refusal of its stages under cp
        rides along, so every rank raises it (not only those holding the layer)."""
        assert self.cuts is not None
        group = None if self.mesh is not None else self.group
        refused = None if self.context is None else segments_refusal(self.chunks)
        mine = json.dumps({"cuts": self.cuts, "refused": refused}).encode()
        theirs = exchange_bytes(
            mine,
            group=group,
            device=self.device,
            timeout_s=self.options.comm_timeout_s,
            action="exchange of the sequence segments' cuts at start-up",
            key="executor/cuts",
            progress=self.p2p.progress,
        )
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(theirs))
        got = {r: json.loads(t) for r, t in zip(ranks, theirs, strict=True)}
        check_agreed_cuts(got, self.cuts, plain_name if self.mesh is None else self.mesh.spec.name)

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

    @property
    def local_cuts(self) -> tuple[int, ...] | None:
        """The segments' boundaries in this rank's tokens: :attr:`cuts`, or under context
        parallelism the cuts / cp (each segment sharded over the cp ranks alike)."""
        return self.cuts if self.context is None else self.context.local_cuts

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
        if self.context is not None:  # this rank's chunks of every sequence
            args, kwargs, target = shard_step(self.context, args, kwargs, target)
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
            over_dp=partial(sum_over_replicas, self.mesh, self.p2p, self.iteration),
        )
        if self.local_cuts is not None:
            batch = segment_step(batch, self.local_cuts)
        run = Interpreter(self, batch, hooks or StepHooks())
        run.run()
        self.iteration += 1
        if self.segment_guard is not None:  # raises on every rank if a stage failed
            self.segment_guard.agree(self.group, self.options.comm_timeout_s, self.p2p.progress)
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


def _context(
    schedule: Schedule,
    count_fn: Any,
    loss_fn: LossFn | None,
    mesh: PipelineMesh | None,
    cuts: tuple[int, ...] | None,
) -> ContextShards | None:
    """This rank's sequence chunks under context parallelism (None: whole sequences; with
    segments, its chunks of every segment, whose lengths must divide by 2 * cp), refusing a
    loss not normalised by a count over the whole batch (what cp composes with is the
    composition table's, :func:`~zerobubble.parallel.checks.check_job`)."""
    if mesh is None or mesh.cp_size == 1:
        return None
    cp = f"context parallelism (cp={mesh.cp_size})"
    if count_fn is None:
        raise ValueError(
            f"{cp} needs count_fn: each rank's loss is its chunks' share of the batch loss, "
            "loss_fn(output, target, count_fn(target)) with the count summed over cp (a "
            "token-summed loss); pass count_fn"
        )
    if getattr(loss_fn, "shifts_labels", False):
        raise ValueError(
            f"{cp}: the loss shifts labels inside each call, which would drop each chunk's "
            "last target; shift the labels once for the whole sequence"
        )
    return ContextShards(mesh.cp_size, mesh.cp_rank, cuts)


def _check_segment_loss(schedule: Schedule, loss_fn: LossFn | None, count_fn: Any) -> None:
    """Refuse a loss that segments would compute wrongly: one that shifts the labels inside
    each call, or one not normalised by a count over the whole batch (``count_fn``)."""
    if getattr(loss_fn, "shifts_labels", False):
        raise ValueError(
            f"schedule {schedule.name!r} cuts sequences into segments, but loss_fn "
            f"{type(loss_fn).__name__} shifts the labels inside each call, so every "
            "segment's last position would lose its target: shift the labels once for the "
            "whole sequence (label t+1 at position t, the last -100) and pass a loss that "
            "scores position t against label t"
        )
    if count_fn is None:
        raise ValueError(
            f"schedule {schedule.name!r} runs sequence segments, whose losses must be "
            "their tokens' shares of the batch loss: pass count_fn (the batch's token "
            "count, e.g. non-ignored targets) and a loss_fn(output, target, num_items) "
            "that sums over tokens and divides by it"
        )


def _check_stages(stages: Mapping[int, Any], mine: Sequence[int], rank: int) -> None:
    """Refuse stages other than those the schedule places on this rank."""
    if sorted(stages) != list(mine):
        raise ValueError(
            f"rank {rank} was given stages {sorted(stages)} but the schedule places "
            f"stages {list(mine)} on it (build them with build_stage_modules)"
        )
