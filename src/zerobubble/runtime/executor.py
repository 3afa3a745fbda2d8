"""Run a compute schedule on ``torch.distributed``, one process per pipeline device.

Usage mirrors ``torch.distributed.pipelining``::

    pipe = PipelineExecutor(schedule, build_stage_modules(layers, schedule, rank), loss_fn=loss)
    losses = []
    pipe.step(x, target=y, losses=losses)   # x used on stage 0's rank, y on the last stage's

The schedule is validated and lowered once (:mod:`zerobubble.schedule.lowering`);
``step`` interprets this rank's program: receives are posted early, sends are
asynchronous, and every wait is bounded by the comm timeout. What crosses a
boundary is a tensor or a pytree of them (:mod:`zerobubble.runtime.shapes`), sent
as one frame per message (:mod:`zerobubble.runtime.wire`); its layout (structure,
shapes, dtypes) may change between steps and microbatches: a receiver expects the
layout the same message had last time, and the sender announces a new one in
two extra messages only when it differs.

The executor is a plain interpreter. A caller that needs more (the optimizer's
speculative protocol) loads a program with extra instructions
(:class:`~zerobubble.schedule.replay.Gate`,
:class:`~zerobubble.schedule.replay.VersionCheck`; :meth:`PipelineExecutor.load_program`)
and passes :class:`StepHooks` that act on them and encode/decode messages; the
executor only runs them: at a gate that asks for a replay it drains the stale
messages the gate names, discards the step's work and restarts the program.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.runtime.chunk import LossFn, StageChunk, StageChunkError
from zerobubble.runtime.comm import P2P, Channel, TensorMeta
from zerobubble.runtime.dp import GradReducer
from zerobubble.runtime.fsdp import ShardedStages
from zerobubble.runtime.host_memory import retain_freed_memory
from zerobubble.runtime.mesh import PipelineMesh
from zerobubble.runtime.microbatch import (
    CountFn,
    batch_count,
    batch_size,
    default_count_fn,
    split_tree,
)
from zerobubble.runtime.recompute import Recompute, recompute_plan
from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.shapes import (
    Layout,
    ShapeMismatchError,
    describe,
    flatten,
    is_layout_error,
    map_tensors,
    to_device,
    unflatten,
)
from zerobubble.runtime.trace import Trace
from zerobubble.runtime.wire import (
    FRAME_HEADER,
    NEW_LAYOUT,
    SAME_LAYOUT,
    FrameHeader,
    frame_header,
    pack_frame,
    stub_frame,
    unpack_frame,
)
from zerobubble.schedule.dp import insert_grad_reduce
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.lowering import (
    Compute,
    Instruction,
    Message,
    MsgKind,
    PostRecv,
    ReduceGrads,
    Send,
    WaitRecv,
    WaitReduce,
    WaitSends,
    input_message,
    lower,
    output_message,
    validate_lowered,
)
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.replay import Gate, VersionCheck
from zerobubble.schedule.sharding import ShardAction
from zerobubble.schedule.trace_format import TraceEvent
from zerobubble.schedule.validate import validate

ProgramItem = Instruction | Gate | VersionCheck | ShardAction
"""One instruction of a rank's program: the lowered ones plus the protocol's and FSDP's."""


class StepHooks:
    """What a caller plugs into :meth:`PipelineExecutor.step`; the defaults do nothing.

    The executor calls them at the protocol instructions a caller's pass inserted
    and on every message; it never interprets what they decide.
    """

    def after_compute(self, action: Action) -> None:
        """Called after every compute action (fault injection uses it)."""

    def check_version(self, action: Action) -> None:
        """At a :class:`~zerobubble.schedule.replay.VersionCheck`, before ``action`` runs."""

    def at_gate(self) -> bool:
        """At a :class:`~zerobubble.schedule.replay.Gate` (once per step). True: discard
        the step's work so far and replay it."""
        return False

    def on_replay(self) -> None:
        """After the stale messages were drained, before the step runs again."""

    def wire_meta(self, msg: Message, meta: TensorMeta) -> TensorMeta:
        """The buffer a message of ``meta`` travels in (a header may enlarge it)."""
        return meta

    def encode(self, msg: Message, t: torch.Tensor) -> torch.Tensor:
        """What is sent for ``msg``'s payload ``t``."""
        return t

    def decode(
        self, msg: Message, buf: torch.Tensor, meta: TensorMeta, *, stale: bool
    ) -> torch.Tensor:
        """The payload of a received buffer (``stale``: drained before a replay)."""
        return buf


@dataclass(frozen=True)
class ExecutorOptions:
    """How a :class:`PipelineExecutor` runs."""

    comm_timeout_s: float = 60.0
    """Longest a single wait on a peer (a receive, the final send flush, a layout
    message) may block; past it the step raises :class:`~zerobubble.runtime.comm.PeerError`
    naming the peer and the instruction. A dead peer is usually reported sooner."""

    recv_lookahead: int = 2
    """How many compute actions before its consumer a receive is posted (more overlap,
    more receive buffers held); see :func:`~zerobubble.schedule.lowering.lower`."""

    directed_groups: bool | None = None
    """Give each direction of each communicating rank pair its own subgroup. None picks
    it for every backend but gloo (NCCL would otherwise serialise both directions and
    can deadlock, see :mod:`~zerobubble.runtime.comm`). With a mesh, every pipeline of
    the job runs the same schedule and every rank creates every pipeline's subgroups
    (``new_group`` is collective over the default group); without one the pipeline's
    group must be the whole default group."""

    trace: bool = True
    """Record a :class:`~zerobubble.runtime.trace.TraceEvent` per executed instruction
    in :attr:`PipelineExecutor.trace` (one ``held_bytes`` query per compute: only
    computes change what the stages hold). The stages then track their saved tensors
    (``StageChunk(track_memory=True)``), a Python call per saved tensor in F and in B;
    turn it off for the fastest steps."""

    fuse_local_backward: bool = True
    """Run a B immediately followed by its own W as one BW where no other device waits
    for that B (stage 0, or a stage whose upstream neighbour shares the device; see
    :func:`~zerobubble.schedule.passes.fuse_local_backward`). Every order and
    cross-device dependency stays the same; one ordinary backward is cheaper than B
    plus W. :attr:`PipelineExecutor.schedule` and the trace then show BW: turn it off
    to measure B and W of every stage (profiling)."""

    retain_host_memory: bool | None = None
    """Keep freed host memory in the process for reuse instead of returning it to the
    OS (glibc ``mallopt``, see :mod:`~zerobubble.runtime.host_memory`): a step then
    does not page-fault its activations back in. Process-wide and permanent; resident
    memory stays near its peak. None turns it on when the stages run on the CPU."""

    seed: int = 0
    """Seed of the stages' randomness: every forward of stage ``s`` on microbatch ``j`` in
    step ``k`` (:attr:`PipelineExecutor.iteration`) runs with the CPU's and the device's
    default generators set to a state derived from ``(seed, k, s, j)``
    (:class:`~zerobubble.runtime.rng.StageRng`), and the caller's states are restored after
    it. Dropout then draws the same under every schedule and on a replay, bitwise as
    :func:`~zerobubble.runtime.reference.reference_step` given the same seed. Every rank
    must use the same seed."""

    recompute: Recompute = "none"
    """Activation checkpointing of the stages the executor wraps (``StageChunk(recompute=)``,
    see :mod:`~zerobubble.runtime.recompute`): "none", "stage", "layers" or a predicate
    ``(layer name, module) -> bool``. F keeps only the checkpointed inputs; B recomputes
    (with F's generator state: dropout draws the same) and keeps what W needs."""

    def __post_init__(self) -> None:
        if not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0 seconds, got {self.comm_timeout_s}")
        if self.recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be >= 0, got {self.recv_lookahead}")
        StageRng(self.seed, "cpu")  # a seed out of range is refused here
        recompute_plan(self.recompute)  # and a recompute setting that is not one


class PipelineExecutor:
    """Executes one rank's part of a pipeline schedule, step after step.

    Args:
        schedule: The compute schedule; validated here, so an invalid one is refused
            with the validator's message before any compute. What runs is
            :attr:`schedule`, after the passes the options ask for.
        stages: This rank's virtual stages, ``stage -> nn.Module`` (wrapped in a
            :class:`StageChunk`, B/W-split where the schedule splits that stage's
            backward) or ready :class:`StageChunk` objects. Must be exactly the stages the schedule
            places on this rank.
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
            executor runs on its ``pp_group``; with ``dp > 1`` a lowering pass inserts a
            gradient reduction per stage (:func:`~zerobubble.schedule.dp.insert_grad_reduce`),
            the loss is normalised over the global batch (the replicas' batches together:
            ``n_j / sum of N`` per microbatch, or the count summed over dp), so the
            reduced gradients are those of the global batch.
        fsdp: With ``mesh`` (``dp > 1``): shard the stages' parameters, gradients and
            optimizer state over ``dp`` with FSDP2 instead of reducing whole gradients
            (:class:`~zerobubble.runtime.fsdp.ShardedStages`: a pass inserts each stage's
            unshard before its first F and its reduce-scatter after its last W; build
            the optimizer over the chunks' parameters afterwards, the sharded DTensors).

    Attributes:
        schedule: The schedule this executor runs (``schedule`` after
            :attr:`ExecutorOptions.fuse_local_backward`).
        param_version: Parameter version recorded in the trace. Setting it is the caller's
            job (:class:`~zerobubble.optim.trainer.PipelineTrainer` does it); the executor
            only labels events with it.
        iteration: Number of completed steps.
        trace: The :class:`Trace` of this rank (events of all steps until cleared).
        mesh: The :class:`~zerobubble.runtime.mesh.PipelineMesh` it runs on, or None.
        reducer: The :class:`~zerobubble.runtime.dp.GradReducer` over the mesh's dp group
            (None without data parallelism).
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
        fsdp: bool = False,
    ) -> None:
        validate(schedule)
        if fsdp and (mesh is None or mesh.dp_group is None):
            raise ValueError(
                "fsdp=True shards over the mesh's dp dimension: pass mesh=build_mesh(pp, dp) "
                f"with dp >= 2 (got {'no mesh' if mesh is None else f'dp={mesh.dp_size}'})"
            )
        if mesh is not None:
            if group is not None and group is not mesh.pp_group:
                raise ValueError("pass either group= or mesh= (the pipeline runs on mesh.pp_group)")
            group = mesh.pp_group
            if mesh.pp_size != schedule.num_devices:
                raise ValueError(
                    f"schedule {schedule.name!r} has {schedule.num_devices} devices but the mesh's "
                    f"'pp' dim has {mesh.pp_size} ranks (mesh pp={mesh.pp_size} x "
                    f"dp={mesh.dp_size}); build the mesh with pp={schedule.num_devices} or "
                    f"generate the schedule for {mesh.pp_size} devices"
                )
        self.mesh = mesh
        self.options = options or ExecutorOptions()
        self.count_fn = default_count_fn(loss_fn, count_fn)
        if self.options.fuse_local_backward:
            schedule = fuse_local_backward(schedule)
        self.schedule = schedule
        self.group = group
        self.device = torch.device(device or "cpu")
        self.rng = StageRng(self.options.seed, self.device)
        retain = self.options.retain_host_memory
        if retain or (retain is None and self.device.type == "cpu"):
            retain_freed_memory()
        self.rank = dist.get_rank(group)
        world = dist.get_world_size(group)
        if world != schedule.num_devices:
            raise ValueError(
                f"schedule {schedule.name!r} needs {schedule.num_devices} ranks but the process "
                f"group has {world}; launch with -n {schedule.num_devices}"
            )
        mine = schedule.stages_of_device[self.rank]
        if sorted(stages) != list(mine):
            raise ValueError(
                f"rank {self.rank} was given stages {sorted(stages)} but the schedule places "
                f"stages {list(mine)} on it (build them with build_stage_modules)"
            )
        S = schedule.num_stages
        self.chunks = {s: self._chunk(s, m, loss_fn) for s, m in sorted(stages.items())}
        self.lowered = lower(schedule, recv_lookahead=self.options.recv_lookahead)
        dp_group = mesh.dp_group if mesh is not None and not fsdp else None
        if dp_group is not None:
            self.lowered = insert_grad_reduce(self.lowered)
        validate_lowered(self.lowered)
        self.reducer = (
            None
            if dp_group is None
            else GradReducer(
                dp_group,
                {s: list(c.module.parameters()) for s, c in self.chunks.items()},
                self.options.comm_timeout_s,
            )
        )
        self.program: tuple[ProgramItem, ...] = self.lowered.programs[self.rank]
        self.sharding: ShardedStages | None = None
        if fsdp:
            assert mesh is not None
            self.sharding = ShardedStages(
                self.chunks,
                mesh.mesh["dp"],
                device=self.device,
                timeout_s=self.options.comm_timeout_s,
            )
            self.program = self.sharding.insert(self.program)
        self.has_first, self.has_last = 0 in self.chunks, S - 1 in self.chunks
        directed = self.options.directed_groups
        if directed is None:
            directed = dist.get_backend(group) != "gloo"
        pairs = [
            (d, ins.peer, channel)
            for d, prog in enumerate(self.lowered.programs)
            for ins in prog
            if isinstance(ins, Send)
            for channel in (Channel.PIPELINE, Channel.LAYOUT)
        ]
        # The optimizer's state messages travel between neighbours, both ways.
        pairs += [
            (a, b, Channel.OPTIM) for d in range(world - 1) for a, b in ((d, d + 1), (d + 1, d))
        ]
        self.p2p = P2P(
            group,
            self.device,
            self.options.comm_timeout_s,
            directed=directed,
            pairs=pairs,
            pipelines=None if mesh is None else mesh.pipelines(),
        )
        # The trace's epoch: every rank leaves this (bounded) barrier at nearly one instant.
        self.p2p.all_reduce(torch.zeros(1, device=self.device), "start-up barrier (trace epoch)")
        self.trace = Trace(self.rank, time.perf_counter_ns())
        self.param_version = 0
        self.iteration = 0
        self.replays = 0
        # The layout each message had last time, as sent and as received (both ends
        # update theirs on every change, so they agree without a handshake).
        self._sent: dict[Message, Layout] = {}
        self._expected: dict[Message, Layout] = {}
        self._layouts: dict[tuple[int, ...], Layout] = {}
        # Per peer, the layouts announced to it / by it, by id (both ends number them
        # in the order of the layout stream), so a layout that comes back is not resent.
        self._ids_out: dict[int, dict[Layout, int]] = {}
        self._ids_in: dict[int, list[Layout]] = {}

    def layout(self, codes: tuple[int, ...]) -> Layout:
        """The decoded layout of ``codes`` (cached: a fixed-shape run decodes each once)."""
        got = self._layouts.get(codes)
        if got is None:
            got = self._layouts[codes] = Layout.of(codes, FRAME_HEADER)
        return got

    def _chunk(self, s: int, m: nn.Module | StageChunk, loss_fn: LossFn | None) -> StageChunk:
        if isinstance(m, StageChunk):
            if m.stage != s or m.num_stages != self.schedule.num_stages:
                raise ValueError(
                    f"the StageChunk given for stage {s} is stage {m.stage} of {m.num_stages}; "
                    f"the schedule has {self.schedule.num_stages} stages"
                )
            if self.options.trace and not m.track_memory:
                raise ValueError(
                    f"the StageChunk given for stage {s} has track_memory=False, but the trace "
                    "records held bytes: build it with track_memory=True or pass "
                    "ExecutorOptions(trace=False)"
                )
            return m
        S = self.schedule.num_stages
        if s == S - 1 and loss_fn is None:
            raise ValueError(f"rank {self.rank} holds the last stage {s}: pass loss_fn")
        split = any(a.op is Op.B and a.stage == s for a in self.schedule.actions[self.rank])
        return StageChunk(
            m,
            s,
            S,
            loss_fn=loss_fn if s == S - 1 else None,
            split=split,
            track_memory=self.options.trace,
            recompute=self.options.recompute,
        )

    def load_program(self, program: Sequence[ProgramItem]) -> None:
        """Run ``program`` from the next step on: this rank's lowered program with receive
        posts possibly moved and protocol instructions inserted (an optimizer pass).

        Every rank must load programs derived from the same plan (the pass checks
        them together); here only the lowered instructions are checked to be the same.
        """
        mine = Counter(i for i in program if not isinstance(i, Gate | VersionCheck | ShardAction))
        if mine != Counter(self.lowered.programs[self.rank]):
            raise ValueError(
                f"rank {self.rank}: the loaded program does not hold exactly the lowered "
                "program's instructions; derive it from PipelineExecutor.lowered"
            )
        if sum(isinstance(i, Gate) for i in program) > 1:
            raise ValueError(f"rank {self.rank}: a program holds at most one replay gate")
        if self.sharding is not None:
            program = self.sharding.insert([i for i in program if not isinstance(i, ShardAction)])
        self.program = tuple(program)

    def _over_dp(self, n: torch.Tensor | int) -> Any:
        """``n`` summed over the dp replicas (the global batch's size or count); the
        last stage's ranks of all replicas call it together."""
        if self.mesh is None or self.mesh.dp_group is None:
            return n
        t = torch.as_tensor(n, device=self.device).clone()
        what = f"all-reduce over dim 'dp' of iteration {self.iteration}'s batch size or count"
        work = dist.all_reduce(t, group=self.mesh.dp_group, async_op=True)
        assert work is not None
        dp = tuple(dist.get_process_group_ranks(self.mesh.dp_group))
        self.p2p.wait(work, None, what, group=dp)  # the message names the dp group's ranks
        return t if isinstance(n, torch.Tensor) else int(t.item())

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
        **kwargs: object,
    ) -> list[torch.Tensor] | None:
        """Run the schedule on one batch; gradients accumulate into the stages' ``.grad``.

        ``args`` and ``kwargs`` are needed on the rank holding stage 0, which is
        called as ``stage0(*args_j, **kwargs_j)`` per microbatch j; ``target`` (a
        tensor or pytree) is needed on the rank holding the last stage, whose
        output and ``target_j`` go to ``loss_fn``. Others may pass them too; they
        are ignored. Splitting rule: the batch size N is dim 0 of the first tensor
        with a dim (depth-first through ``args`` then ``kwargs``; for ``target``,
        through it); every tensor whose dim 0 is N is split into the schedule's M
        microbatches as ``torch.tensor_split`` does, every other value (0-dim
        tensors, tensors of another length, None, numbers...) goes unchanged to
        every microbatch. ``kwargs`` cannot be named ``target``, ``losses``,
        ``hooks``, ``mb``, ``loss_scale`` or ``num_items``. On
        the last stage's rank, returns the M unscaled per-microbatch losses and
        appends them to ``losses`` if given; elsewhere returns None. ``hooks``
        are called after every compute, at the protocol instructions of a loaded
        program and on every message; if a gate asks for a replay, the step's
        work so far is discarded and the step runs again from its start (its
        forwards draw the same random numbers: see :attr:`ExecutorOptions.seed`).
        With ``count_fn`` the losses are the microbatches' shares of the batch loss
        (they sum to it).
        """
        M = self.schedule.num_microbatches
        taken = sorted(set(kwargs) & _RESERVED)
        if taken:
            raise ValueError(
                f"step() keyword argument(s) {', '.join(taken)} are reserved for the runtime "
                "(StageChunk.forward's own); rename the stage-0 argument or pass it positionally"
            )
        inputs = targets = scales = num_items = None
        if self.has_first:
            if not args and not kwargs:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the batch x")
            n = batch_size((args, kwargs), "the input batch (step's arguments)")
            inputs = [to_device(mb, self.device) for mb in split_tree((args, kwargs), M, n)]
        if self.has_last:
            if target is None:
                raise ValueError(
                    f"rank {self.rank} holds the last stage: step() needs target for the loss"
                )
            n = batch_size(target, "target")
            targets = [to_device(t, self.device) for t in split_tree(target, M, n)]
            if self.count_fn is None:
                sizes = [len(t) for t in torch.tensor_split(torch.empty(n), M)]
                total = self._over_dp(n)  # loss_scales' n_j / N, N the global batch
                scales = [k / total for k in sizes]
            else:
                num_items = self._over_dp(batch_count(self.count_fn, target, self.device))
                scales = [1.0] * M
        hooks = hooks or StepHooks()
        run = _Step(self, inputs, targets, scales, hooks, num_items)
        i, past_gate = 0, False
        while i < len(self.program):
            ins = self.program[i]
            i += 1
            match ins:
                case Gate() if not past_gate:
                    past_gate = True  # one stop per step: a replayed run passes the gate
                    if hooks.at_gate():
                        run = run.replay(ins)
                        i = 0
                case Gate():
                    pass
                case VersionCheck(action):
                    hooks.check_version(action)
                case ShardAction():
                    assert self.sharding is not None  # only the sharding's pass inserts them
                    self.sharding.run(ins)
                case _:
                    run.execute(ins)
                    if isinstance(ins, Compute):
                        hooks.after_compute(ins.action)
        self.iteration += 1
        if not self.has_last:
            return None
        out = [loss for loss in run.losses if loss is not None]
        if losses is not None:
            losses.extend(out)
        return out


_RESERVED = frozenset({"mb", "loss_scale", "num_items"})
"""Keyword names of :meth:`StageChunk.forward` that stage-0 keyword arguments cannot take."""


class _Step:
    """State of one ``step``: buffers in flight, local handoffs, sends to flush."""

    def __init__(
        self,
        pipe: PipelineExecutor,
        inputs: list[tuple[tuple[Any, ...], dict[str, Any]]] | None,
        targets: list[Any] | None,
        scales: list[float] | None,
        hooks: StepHooks,
        num_items: torch.Tensor | int | None = None,
    ) -> None:
        self.pipe = pipe
        self.hooks = hooks
        self.inputs, self.targets, self.scales = inputs, targets, scales
        self.num_items = num_items
        self.S = pipe.schedule.num_stages
        self.losses: list[torch.Tensor | None] = [None] * pipe.schedule.num_microbatches
        # Pytrees received or produced, not yet consumed.
        self.ready: dict[Message, Any] = {}
        self.posted: dict[Message, tuple[torch.Tensor, dist.Work, int, object]] = {}
        self.early: dict[Message, object] = {}  # received ahead of their WaitRecv
        self.in_flight: list[tuple[dist.Work, torch.Tensor, Send]] = []
        self.held = pipe.held_bytes() if pipe.options.trace else 0  # as of the last compute

    def execute(self, ins: Instruction) -> None:
        pipe = self.pipe
        tracing = pipe.options.trace
        if tracing:
            mem0, t0 = self.held, pipe.trace.now()
        match ins:
            case Compute(action):
                self.compute(action)
            case PostRecv(msg, peer):
                self.post(msg, peer, self.describe(ins))
            case WaitRecv(msg, peer):
                self.ready[msg] = self.receive(msg, self.describe(ins), stale=False)
            case Send(msg, peer):
                self.send(msg, peer, ins)
            case WaitSends():
                for work, _, send in self.in_flight:
                    pipe.p2p.wait(work, send.peer, self.describe(send))
                self.in_flight.clear()
            case ReduceGrads(stage):
                assert pipe.reducer is not None  # the pass inserts it only with a dp group
                pipe.reducer.launch(stage, pipe.iteration)
            case WaitReduce():
                assert pipe.reducer is not None
                pipe.reducer.wait(pipe.iteration)
        if tracing:
            t1 = pipe.trace.now()
            if isinstance(ins, Compute):
                self.held = pipe.held_bytes()
            pipe.trace.record(self.event(ins, t0, t1, mem0, self.held))

    def send(self, msg: Message, peer: int, ins: Send) -> None:
        """Send ``msg``'s value as a frame; first a stub and the new layout if the
        receiver expects another one."""
        pipe = self.pipe
        codes, tensors = flatten(self.ready.pop(msg), _boundary_name(msg))
        layout = pipe.layout(codes)
        self.in_flight = [f for f in self.in_flight if not f[0].is_completed()]
        expected = pipe._sent.get(msg)
        if layout is expected:
            frame = pack_frame(layout, tensors, pipe.device)
            self.isend(self.hooks.encode(msg, frame), peer, ins)
            return
        ids = pipe._ids_out.setdefault(peer, {})
        new = layout not in ids
        if new:
            ids[layout] = len(ids)
        size = FRAME_HEADER if expected is None else expected.nbytes
        inline = layout.nbytes <= size
        head = FrameHeader(NEW_LAYOUT, len(codes) if new else 0, ids[layout], inline)
        if inline:
            first = pack_frame(layout, tensors, pipe.device, size=size, header=head)
        else:
            first = stub_frame(size, head, pipe.device)
        self.isend(self.hooks.encode(msg, first), peer, ins)
        if new:
            codes_t = torch.tensor(codes, dtype=torch.int64, device=pipe.device)
            self.isend(codes_t, peer, ins, Channel.LAYOUT)
        if not inline:
            frame = pack_frame(layout, tensors, pipe.device)
            self.isend(self.hooks.encode(msg, frame), peer, ins, Channel.LAYOUT)
        pipe._sent[msg] = layout

    def isend(
        self, t: torch.Tensor, peer: int, ins: Send, channel: Channel = Channel.PIPELINE
    ) -> None:
        t = t.contiguous()
        work = self.pipe.p2p.isend(t, peer, self.describe(ins), channel)
        self.in_flight.append((work, t, ins))

    def post(self, msg: Message, peer: int, what: object) -> None:
        buf = self.buffer(msg, self.pipe._expected.get(msg))
        self.posted[msg] = (buf, self.pipe.p2p.irecv(buf, peer, what), peer, what)

    def buffer(self, msg: Message, layout: Layout | None) -> torch.Tensor:
        meta = self.hooks.wire_meta(msg, _frame_meta(layout))
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.pipe.device)

    def receive(self, msg: Message, what: object, *, stale: bool) -> object:
        """The value of ``msg``, whose frame was posted.

        A new layout and its frame come on the layout stream in the order the peer
        sent them, which is the order of the posts; so the frames posted before
        ``msg`` from the same peer are completed first (they arrived before it).
        """
        if msg in self.early:
            return self.early.pop(msg)
        peer = self.posted[msg][2]
        for other, (_, _, src, _) in list(self.posted.items()):
            if other == msg:
                break
            if src == peer:
                self.early[other] = self.complete(other, stale=stale)
        return self.complete(msg, what, stale=stale)

    def complete(self, msg: Message, what: object = None, *, stale: bool) -> object:
        """Wait for ``msg``'s posted frame (and the new layout and frame it may announce)
        and return the value it carries; ``what`` names the wait in errors (default:
        the post)."""
        pipe = self.pipe
        buf, work, peer, posted = self.posted.pop(msg)
        what = posted if what is None else what
        pipe.p2p.wait(work, peer, what)
        layout = pipe._expected.get(msg)
        frame = self.hooks.decode(msg, buf, _frame_meta(layout), stale=stale)
        head = frame_header(frame)
        if head.flag == NEW_LAYOUT:
            known = pipe._ids_in.setdefault(peer, [])
            if head.layout_len:
                codes = torch.empty(head.layout_len, dtype=torch.int64, device=pipe.device)
                pipe.p2p.wait(pipe.p2p.irecv(codes, peer, what, Channel.LAYOUT), peer, what)
                known.append(pipe.layout(tuple(codes.tolist())))
            if not 0 <= head.layout_id < len(known):
                raise RuntimeError(
                    f"rank {pipe.rank}: {what} names layout {head.layout_id} but peer rank "
                    f"{peer} announced {len(known)}: messages crossed (protocol bug)"
                )
            layout = pipe._expected[msg] = known[head.layout_id]
            if not head.inline:
                buf = self.buffer(msg, layout)
                pipe.p2p.wait(pipe.p2p.irecv(buf, peer, what, Channel.LAYOUT), peer, what)
                frame = self.hooks.decode(msg, buf, _frame_meta(layout), stale=stale)
        elif layout is None or head.flag != SAME_LAYOUT:
            raise RuntimeError(
                f"rank {pipe.rank}: {what} got a frame with flag {head.flag} before any "
                "layout was announced: messages crossed (protocol bug)"
            )
        return unflatten(layout.codes, unpack_frame(frame, layout))

    def replay(self, gate: Gate) -> _Step:
        """Discard this attempt (stage state, stale messages) and return a fresh one."""
        pipe = self.pipe
        tracing = pipe.options.trace
        t0, mem0 = (pipe.trace.now(), pipe.held_bytes()) if tracing else (0, 0)
        for peer, msg in gate.drain:
            self.post(msg, peer, f"drain of stale {msg} from device {peer}")
        for msg in list(self.posted):
            self.complete(msg, stale=True)
        self.early.clear()
        for chunk in pipe.chunks.values():
            chunk.discard()
        self.hooks.on_replay()
        fresh = _Step(pipe, self.inputs, self.targets, self.scales, self.hooks, self.num_items)
        fresh.in_flight = self.in_flight
        pipe.replays += 1
        if tracing:
            common = self.common(t0, pipe.trace.now(), mem0, pipe.held_bytes())
            pipe.trace.record(TraceEvent(op="replay", stage=None, mb=None, **common))
        return fresh

    def compute(self, a: Action) -> None:
        chunk = self.pipe.chunks[a.stage]
        last = a.stage == self.S - 1
        if a.op is Op.W:
            chunk.backward_weight(a.mb)
            return
        need = input_message(a, self.S)
        arg = self.ready.pop(need) if need is not None else None
        if a.op is Op.F:
            if a.stage == 0:
                assert self.inputs is not None  # step() splits the batch on stage 0's rank
                args, kwargs = self.inputs[a.mb]
            else:
                args, kwargs = (arg,), {}
            target, scale = None, 1.0
            if last:
                assert self.targets is not None and self.scales is not None
                target, scale = self.targets[a.mb], self.scales[a.mb]
            try:
                with self.pipe.rng.scope(self.pipe.iteration, a.stage, a.mb):
                    y = chunk.forward(
                        a.mb,
                        *args,
                        target=target,
                        loss_scale=scale,
                        num_items=self.num_items if last else None,
                        **kwargs,
                    )
            except StageChunkError:
                raise
            except Exception as e:
                if a.stage == 0:
                    raise
                if not is_layout_error(e):  # the stage's own failure, not its input's
                    layer = chunk.layer_of(e)
                    where = "" if layer is None else f" in {layer}"
                    raise StageChunkError(
                        a.stage,
                        a.mb,
                        f"forward (rank {self.pipe.rank}) failed{where}: {type(e).__name__}: {e}",
                    ) from e
                codes, _ = flatten(arg, f"stage {a.stage} input")
                raise ShapeMismatchError(
                    a.stage - 1,
                    a.stage,
                    f"stage {a.stage} (rank {self.pipe.rank}) cannot consume stage "
                    f"{a.stage - 1}'s output of {describe(codes)} (microbatch {a.mb}): "
                    f"{type(e).__name__}: {e}",
                ) from e
            if last:
                self.losses[a.mb] = y
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

    def describe(self, ins: PostRecv | WaitRecv | Send) -> _Description:
        """The instruction and the compute it serves, for error messages (formatted lazily)."""
        return _Description(ins, self.pipe.iteration)

    def common(self, t0: int, t1: int, mem0: int, mem1: int) -> dict:
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

    def event(self, ins: Instruction, t0: int, t1: int, mem0: int, mem1: int) -> TraceEvent:
        common = self.common(t0, t1, mem0, mem1)
        if isinstance(ins, Compute):
            a = ins.action
            return TraceEvent(op=a.op.value, stage=a.stage, mb=a.mb, **common)
        if isinstance(ins, WaitSends):
            return TraceEvent(op="wait_sends", stage=None, mb=None, **common)
        if isinstance(ins, ReduceGrads):
            return TraceEvent(op="reduce_grads", stage=ins.stage, mb=None, **common)
        if isinstance(ins, WaitReduce):
            return TraceEvent(op="wait_reduce", stage=None, mb=None, **common)
        m = ins.msg
        op = {PostRecv: "post_recv", WaitRecv: "wait_recv", Send: "send"}[type(ins)]
        here = m.src_stage if isinstance(ins, Send) else m.dst_stage
        msg_id = (m.kind.value, m.src_stage, m.dst_stage, m.mb)
        return TraceEvent(op=op, stage=here, mb=m.mb, peer=ins.peer, msg=msg_id, **common)


class _Description:
    """Text for a PeerError, built only if one is raised (not on every instruction)."""

    __slots__ = ("ins", "iteration")

    def __init__(self, ins: PostRecv | WaitRecv | Send, iteration: int) -> None:
        self.ins, self.iteration = ins, iteration

    def __str__(self) -> str:
        ins, m, k = self.ins, self.ins.msg, self.iteration
        if isinstance(ins, Send):
            return f"{ins} (output of {_producer_name(m)}, iteration {k})"
        consumer = "F" if m.kind is MsgKind.ACT else "backward"
        return f"{ins} (input of {consumer}(s{m.dst_stage},mb{m.mb}), iteration {k})"


def _frame_meta(layout: Layout | None) -> TensorMeta:
    """The uint8 buffer of a frame in ``layout`` (None: not seen yet, a bare header)."""
    return TensorMeta((FRAME_HEADER if layout is None else layout.nbytes,), torch.uint8)


def _boundary_name(m: Message) -> str:
    """How errors name a message's value: ``stage 1 output``, ``stage 2 input gradient``."""
    if m.kind is MsgKind.ACT:
        return f"stage {m.src_stage} output"
    return f"stage {m.src_stage} input gradient"


def _producer_name(m: Message) -> str:
    op = "F" if m.kind is MsgKind.ACT else "backward"
    return f"{op}(s{m.src_stage},mb{m.mb})"
