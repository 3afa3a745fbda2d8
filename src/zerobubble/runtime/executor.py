"""Run a compute schedule on ``torch.distributed``, one process per pipeline device.

Usage mirrors ``torch.distributed.pipelining``::

    pipe = PipelineExecutor(schedule, build_stage_modules(layers, schedule, rank), loss_fn=loss)
    losses = []
    pipe.step(x, target=y, losses=losses)   # x used on stage 0's rank, y on the last stage's

The schedule is validated and lowered once (:mod:`zerobubble.runtime.lowering`);
``step`` interprets this rank's program: receives are posted early, sends are
asynchronous, and every wait is bounded by the comm timeout. Tensor shapes
between stages are agreed on at the first step (:mod:`zerobubble.runtime.shapes`)
and must stay the same afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from zerobubble.runtime.chunk import StageChunk
from zerobubble.runtime.comm import P2P, TensorMeta
from zerobubble.runtime.host_memory import retain_freed_memory
from zerobubble.runtime.lowering import (
    Compute,
    Instruction,
    Message,
    MsgKind,
    PostRecv,
    Send,
    WaitRecv,
    WaitSends,
    input_message,
    lower,
    output_message,
    validate_lowered,
)
from zerobubble.runtime.microbatch import loss_scales, split_batch
from zerobubble.runtime.replay import GatePlan, StepHooks, plan_gates
from zerobubble.runtime.shapes import ShapeMismatchError, negotiate
from zerobubble.runtime.trace import Trace, TraceEvent, sync_epoch
from zerobubble.runtime.wire import Header, pack, packed_meta, unpack
from zerobubble.schedule.ir import Action, Op, Schedule
from zerobubble.schedule.passes import fuse_local_backward
from zerobubble.schedule.validate import validate


@dataclass(frozen=True)
class ExecutorOptions:
    """How a :class:`PipelineExecutor` runs."""

    comm_timeout_s: float = 60.0
    """Longest a single wait on a peer (a receive, the final send flush, a handshake
    message) may block; past it the step raises :class:`~zerobubble.runtime.comm.PeerError`
    naming the peer and the instruction. A dead peer is usually reported sooner."""

    recv_lookahead: int = 2
    """How many compute actions before its consumer a receive is posted (more overlap,
    more receive buffers held); see :func:`~zerobubble.runtime.lowering.lower`."""

    directed_groups: bool | None = None
    """Give each direction of each communicating rank pair its own subgroup. None picks
    it for every backend but gloo (NCCL would otherwise serialise both directions and
    can deadlock, see :mod:`~zerobubble.runtime.comm`). Needs the default process
    group to be exactly the pipeline's ranks, all running the same schedule."""

    trace: bool = True
    """Record a :class:`~zerobubble.runtime.trace.TraceEvent` per executed instruction
    in :attr:`PipelineExecutor.trace` (one ``held_bytes`` query per compute: only
    computes change what the stages hold). The stages then track their saved tensors
    (``StageChunk(track_memory=True)``), a Python call per saved tensor in F and in B;
    turn it off for the fastest steps."""

    replay_gate: bool = False
    """Reserve a gate in every rank's program, right before its first backward, where
    the caller (speculative post-validation, :mod:`zerobubble.optim`) may discard the
    step's work so far and replay it (:mod:`~zerobubble.runtime.replay`). Messages
    then carry a version header (:mod:`~zerobubble.runtime.wire`). A schedule whose
    ranks cannot reach their gates on pre-gate work alone is refused."""

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

    def __post_init__(self) -> None:
        if not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0 seconds, got {self.comm_timeout_s}")
        if self.recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be >= 0, got {self.recv_lookahead}")


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
        loss_fn: ``loss_fn(output, target)`` of the last stage (used when wrapping modules).
        group: Process group whose rank ``d`` runs device ``d`` (default: the world).
        device: Where microbatches, buffers and the stages live (default: CPU).
        options: See :class:`ExecutorOptions`.

    Attributes:
        schedule: The schedule this executor runs (``schedule`` after
            :attr:`ExecutorOptions.fuse_local_backward`).
        param_version: Parameter version recorded in the trace; the optimizer layer bumps it.
        iteration: Number of completed steps.
        trace: The :class:`Trace` of this rank (events of all steps until cleared).
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, nn.Module | StageChunk],
        *,
        loss_fn: nn.Module | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        options: ExecutorOptions | None = None,
    ) -> None:
        validate(schedule)
        self.options = options or ExecutorOptions()
        if self.options.fuse_local_backward:
            schedule = fuse_local_backward(schedule)
        self.schedule = schedule
        self.group = group
        self.device = torch.device(device or "cpu")
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
        validate_lowered(self.lowered)
        self.gate_plan: GatePlan | None = None
        self.program: tuple[Instruction, ...] = self.lowered.programs[self.rank]
        if self.options.replay_gate:
            self.gate_plan = plan_gates(self.lowered)
            self.program = self.gate_plan.programs[self.rank]
        self.has_first, self.has_last = 0 in self.chunks, S - 1 in self.chunks
        directed = self.options.directed_groups
        if directed is None:
            directed = dist.get_backend(group) != "gloo"
        pairs = [
            (d, ins.peer)
            for d, prog in enumerate(self.lowered.programs)
            for ins in prog
            if isinstance(ins, Send)
        ]
        self.p2p = P2P(
            group, self.device, self.options.comm_timeout_s, directed=directed, pairs=pairs
        )
        self.trace = Trace(self.rank, sync_epoch(group))
        self.param_version = 0
        self.iteration = 0
        self.replays = 0
        self._metas: dict[Message, TensorMeta] | None = None
        self._input_metas: list[TensorMeta] | None = None

    def _chunk(self, s: int, m: nn.Module | StageChunk, loss_fn: nn.Module | None) -> StageChunk:
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
        )

    def held_bytes(self) -> int:
        """Activation bytes held by this rank's stages."""
        return sum(c.held_bytes() for c in self.chunks.values())

    # ---- one step -------------------------------------------------------------------------

    def step(
        self,
        x: torch.Tensor | None = None,
        *,
        target: torch.Tensor | None = None,
        losses: list[torch.Tensor] | None = None,
        hooks: StepHooks | None = None,
    ) -> list[torch.Tensor] | None:
        """Run the schedule on one batch; gradients accumulate into the stages' ``.grad``.

        ``x`` is needed on the rank holding stage 0 and ``target`` on the rank
        holding the last stage (others may pass them too; they are ignored). On
        the last stage's rank, returns the M unscaled per-microbatch losses and
        appends them to ``losses`` if given; elsewhere returns None. ``hooks``
        are called after every compute and, with ``replay_gate``, at the gate;
        if the gate asks for a replay, the step's work so far is discarded (RNG
        state restored) and the step runs again from its start.
        """
        M = self.schedule.num_microbatches
        inputs = targets = scales = None
        if self.has_first:
            if x is None:
                raise ValueError(f"rank {self.rank} holds stage 0: step() needs the batch x")
            inputs = [t.to(self.device) for t in split_batch(x, M)]
        if self.has_last:
            if target is None:
                raise ValueError(
                    f"rank {self.rank} holds the last stage: step() needs target for the loss"
                )
            targets = [t.to(self.device) for t in split_batch(target, M)]
            scales = loss_scales([t.shape[0] for t in targets])
        self._check_inputs(inputs)
        if self._metas is None:
            modules = {s: c.module for s, c in self.chunks.items()}
            self._metas = negotiate(self.schedule, self.rank, modules, inputs, self.p2p)
        hooks = hooks or StepHooks()
        gate = self.gate_plan.gates[self.rank] if self.gate_plan is not None else -1
        rng = _rng_state(self.device) if gate >= 0 else None
        run = _Step(self, inputs, targets, scales)
        i = 0
        while i < len(self.program):
            if i == gate and not run.gated:
                run.gated = True
                if hooks.at_gate():
                    run = run.replay()
                    _set_rng_state(self.device, rng)
                    i = 0
                    continue
                run.check_speculation()
            ins = self.program[i]
            run.execute(ins)
            if isinstance(ins, Compute):
                hooks.after_compute(ins.action)
            i += 1
        self.iteration += 1
        if not self.has_last:
            return None
        out = [loss for loss in run.losses if loss is not None]
        if losses is not None:
            losses.extend(out)
        return out

    def _check_inputs(self, inputs: list[torch.Tensor] | None) -> None:
        """Stage 0's microbatch shapes must stay those of the first step (the handshake)."""
        if inputs is None:
            return
        metas = [TensorMeta.of(t) for t in inputs]
        if self._input_metas is None:
            self._input_metas = metas
        elif metas != self._input_metas:
            j = next(
                j for j, (a, b) in enumerate(zip(metas, self._input_metas, strict=True)) if a != b
            )
            raise ShapeMismatchError(
                None,
                0,
                f"microbatch {j} of this batch is {metas[j]} but the first step's was "
                f"{self._input_metas[j]}; shapes between stages are fixed at the first step, "
                "so keep the batch shape (or build a new executor)",
            )


class _Step:
    """State of one ``step``: buffers in flight, local handoffs, sends to flush."""

    def __init__(
        self,
        pipe: PipelineExecutor,
        inputs: list[torch.Tensor] | None,
        targets: list[torch.Tensor] | None,
        scales: list[float] | None,
    ) -> None:
        self.pipe = pipe
        self.inputs, self.targets, self.scales = inputs, targets, scales
        self.S = pipe.schedule.num_stages
        self.losses: list[torch.Tensor | None] = [None] * pipe.schedule.num_microbatches
        self.ready: dict[Message, torch.Tensor] = {}  # received or produced, not yet consumed
        self.posted: dict[Message, tuple[torch.Tensor, dist.Work]] = {}
        self.in_flight: list[tuple[dist.Work, torch.Tensor, Send]] = []
        self.held = pipe.held_bytes() if pipe.options.trace else 0  # as of the last compute
        self.headers = pipe.gate_plan is not None
        self.attempt = 0
        self.gated = False  # past the replay gate (or replaying)
        self.mixed: str | None = None  # a pre-gate message on another parameter version
        self.f_version: dict[tuple[int, int], int] = {}  # (stage, mb) -> version its F ran on

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
                buf, work = self.posted.pop(msg)
                pipe.p2p.wait(work, peer, self.describe(ins))
                self.ready[msg] = self.open(msg, buf)
            case Send(msg, peer):
                t = self.ready.pop(msg)
                self.check_meta(msg, t)
                if self.headers:
                    t = pack(t, Header(pipe.iteration, pipe.param_version, self.attempt))
                t = t.contiguous()
                self.in_flight = [f for f in self.in_flight if not f[0].is_completed()]
                self.in_flight.append((pipe.p2p.isend(t, peer, self.describe(ins)), t, ins))
            case WaitSends():
                for work, _, send in self.in_flight:
                    pipe.p2p.wait(work, send.peer, self.describe(send))
                self.in_flight.clear()
        if tracing:
            t1 = pipe.trace.now()
            if isinstance(ins, Compute):
                self.held = pipe.held_bytes()
            pipe.trace.record(self.event(ins, t0, t1, mem0, self.held))

    def post(self, msg: Message, peer: int, what: object) -> None:
        meta = self.pipe._metas[msg]
        if self.headers:
            meta = packed_meta(meta)
        buf = torch.empty(meta.shape, dtype=meta.dtype, device=self.pipe.device)
        self.posted[msg] = (buf, self.pipe.p2p.irecv(buf, peer, what))

    def open(self, msg: Message, buf: torch.Tensor, *, stale: bool = False) -> torch.Tensor:
        """The payload of a received buffer; checks its version header if there is one.

        A ``stale`` message (drained before a replay) must come from this
        attempt; its parameter version is not checked.
        """
        if not self.headers:
            return buf
        pipe = self.pipe
        t, head = unpack(buf, pipe._metas[msg])
        if head.iteration != pipe.iteration or head.attempt != self.attempt:
            raise RuntimeError(
                f"rank {pipe.rank}: {msg} carries iteration {head.iteration} attempt "
                f"{head.attempt} but this rank runs iteration {pipe.iteration} attempt "
                f"{self.attempt}: a stale message was not drained (protocol bug)"
            )
        if head.version != pipe.param_version and not stale:
            what = (
                f"{msg} was computed on parameter version {head.version} but rank "
                f"{pipe.rank} is on version {pipe.param_version}"
            )
            if self.gated:
                raise RuntimeError(f"one parameter version per microbatch violated: {what}")
            self.mixed = self.mixed or what
        return t

    def replay(self) -> _Step:
        """Discard this attempt (stage state, stale messages) and return a fresh one."""
        pipe = self.pipe
        plan = pipe.gate_plan
        assert plan is not None
        tracing = pipe.options.trace
        t0, mem0 = (pipe.trace.now(), pipe.held_bytes()) if tracing else (0, 0)
        for peer, msgs in plan.stale[pipe.rank].items():
            for msg in msgs[plan.posted[pipe.rank].get(peer, 0) :]:
                self.post(msg, peer, f"drain of stale {msg} from device {peer}")
        for msg, (buf, work) in self.posted.items():
            peer = pipe.schedule.placement[msg.src_stage]
            pipe.p2p.wait(work, peer, f"drain of stale {msg} from device {peer}")
            self.open(msg, buf, stale=True)
        for chunk in pipe.chunks.values():
            chunk.discard()
        fresh = _Step(pipe, self.inputs, self.targets, self.scales)
        fresh.attempt, fresh.gated, fresh.in_flight = self.attempt + 1, True, self.in_flight
        pipe.replays += 1
        if tracing:
            common = self.common(t0, pipe.trace.now(), mem0, pipe.held_bytes())
            pipe.trace.record(TraceEvent(op="replay", stage=None, mb=None, **common))
        return fresh

    def check_speculation(self) -> None:
        """At the gate without a replay: the pre-gate work must be on today's version."""
        pipe = self.pipe
        stale = sorted((k, v) for k, v in self.f_version.items() if v != pipe.param_version)
        if self.mixed or stale:
            (s, mb), v = stale[0] if stale else ((0, 0), 0)
            why = self.mixed or f"F(s{s},mb{mb}) ran on parameter version {v}"
            raise RuntimeError(
                f"rank {pipe.rank}: speculative work was kept at the gate but {why} and the "
                f"validated version is {pipe.param_version} (a replay was needed)"
            )

    def compute(self, a: Action) -> None:
        chunk = self.pipe.chunks[a.stage]
        last = a.stage == self.S - 1
        key = (a.stage, a.mb)
        if a.op is Op.F:
            self.f_version[key] = self.pipe.param_version
        elif self.f_version.get(key) != self.pipe.param_version:
            raise RuntimeError(
                f"rank {self.pipe.rank}: {a} runs on parameter version "
                f"{self.pipe.param_version} but its F ran on {self.f_version.get(key)}; "
                "parameters must not change between a microbatch's F and its backward"
            )
        if a.op in (Op.W, Op.BW):
            del self.f_version[key]
        if a.op is Op.W:
            chunk.backward_weight(a.mb)
            return
        need = input_message(a, self.S)
        arg = self.ready.pop(need) if need is not None else None
        if a.op is Op.F:
            if a.stage == 0:
                arg = self.inputs[a.mb]
            y = chunk.forward(
                a.mb,
                arg,
                target=self.targets[a.mb] if last else None,
                loss_scale=self.scales[a.mb] if last else 1.0,
            )
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
        if y is None:
            raise RuntimeError(
                f"{a} produced no gradient for stage {a.stage}'s input; the tensor from stage "
                f"{a.stage - 1} must require grad"
            )
        local = self.pipe.schedule.placement[out.dst_stage] == self.pipe.rank
        self.ready[out] = y.detach() if local else y

    def check_meta(self, msg: Message, t: torch.Tensor) -> None:
        want, got = self.pipe._metas[msg], TensorMeta.of(t)
        if want != got:
            what = "output" if msg.kind is MsgKind.ACT else "input gradient"
            raise ShapeMismatchError(
                msg.src_stage if msg.kind is MsgKind.ACT else msg.dst_stage,
                msg.dst_stage if msg.kind is MsgKind.ACT else msg.src_stage,
                f"stage {msg.src_stage} produced an {what} of {got} for microbatch {msg.mb}, "
                f"but stage {msg.dst_stage} expects {want} (agreed at the first step); keep "
                "the batch shape fixed across steps",
            )

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


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """CPU and accelerator RNG state, so a replay draws the same random numbers."""
    acc = None
    if device.type != "cpu":
        acc = torch.get_device_module(device.type).get_rng_state(device)
    return torch.get_rng_state(), acc


def _set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.get_device_module(device.type).set_rng_state(state[1], device)


def _producer_name(m: Message) -> str:
    op = "F" if m.kind is MsgKind.ACT else "backward"
    return f"{op}(s{m.src_stage},mb{m.mb})"
