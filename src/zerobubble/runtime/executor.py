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
from zerobubble.runtime.shapes import ShapeMismatchError, negotiate
from zerobubble.runtime.trace import Trace, TraceEvent, sync_epoch
from zerobubble.schedule.ir import Action, Op, Schedule
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
    computes change what the stages hold)."""

    def __post_init__(self) -> None:
        if not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be > 0 seconds, got {self.comm_timeout_s}")
        if self.recv_lookahead < 0:
            raise ValueError(f"recv_lookahead must be >= 0, got {self.recv_lookahead}")


class PipelineExecutor:
    """Executes one rank's part of a pipeline schedule, step after step.

    Args:
        schedule: The compute schedule; validated here, so an invalid one is refused
            with the validator's message before any compute.
        stages: This rank's virtual stages, ``stage -> nn.Module`` (wrapped in a
            :class:`StageChunk`, B/W-split where the schedule splits that stage's
            backward) or ready :class:`StageChunk` objects. Must be exactly the stages the schedule
            places on this rank.
        loss_fn: ``loss_fn(output, target)`` of the last stage (used when wrapping modules).
        group: Process group whose rank ``d`` runs device ``d`` (default: the world).
        device: Where microbatches, buffers and the stages live (default: CPU).
        options: See :class:`ExecutorOptions`.

    Attributes:
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
        self.schedule = schedule
        self.group = group
        self.device = torch.device(device or "cpu")
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
        self.program: tuple[Instruction, ...] = self.lowered.programs[self.rank]
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
        self._metas: dict[Message, TensorMeta] | None = None
        self._input_metas: list[TensorMeta] | None = None

    def _chunk(self, s: int, m: nn.Module | StageChunk, loss_fn: nn.Module | None) -> StageChunk:
        if isinstance(m, StageChunk):
            if m.stage != s or m.num_stages != self.schedule.num_stages:
                raise ValueError(
                    f"the StageChunk given for stage {s} is stage {m.stage} of {m.num_stages}; "
                    f"the schedule has {self.schedule.num_stages} stages"
                )
            return m
        S = self.schedule.num_stages
        if s == S - 1 and loss_fn is None:
            raise ValueError(f"rank {self.rank} holds the last stage {s}: pass loss_fn")
        split = any(a.op is Op.B and a.stage == s for a in self.schedule.actions[self.rank])
        return StageChunk(m, s, S, loss_fn=loss_fn if s == S - 1 else None, split=split)

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
    ) -> list[torch.Tensor] | None:
        """Run the schedule on one batch; gradients accumulate into the stages' ``.grad``.

        ``x`` is needed on the rank holding stage 0 and ``target`` on the rank
        holding the last stage (others may pass them too; they are ignored). On
        the last stage's rank, returns the M unscaled per-microbatch losses and
        appends them to ``losses`` if given; elsewhere returns None.
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
        run = _Step(self, inputs, targets, scales)
        for ins in self.program:
            run.execute(ins)
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

    def execute(self, ins: Instruction) -> None:
        pipe = self.pipe
        tracing = pipe.options.trace
        if tracing:
            mem0, t0 = self.held, pipe.trace.now()
        match ins:
            case Compute(action):
                self.compute(action)
            case PostRecv(msg, peer):
                meta = pipe._metas[msg]
                buf = torch.empty(meta.shape, dtype=meta.dtype, device=pipe.device)
                self.posted[msg] = (buf, pipe.p2p.irecv(buf, peer, self.describe(ins)))
            case WaitRecv(msg, peer):
                buf, work = self.posted.pop(msg)
                pipe.p2p.wait(work, peer, self.describe(ins))
                self.ready[msg] = buf
            case Send(msg, peer):
                t = self.ready.pop(msg)
                self.check_meta(msg, t)
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

    def describe(self, ins: PostRecv | WaitRecv | Send) -> str:
        """The instruction and the compute it serves, for error messages."""
        m = ins.msg
        if isinstance(ins, Send):
            return f"{ins} (output of {_producer_name(m)})"
        consumer = "F" if m.kind is MsgKind.ACT else "backward"
        return f"{ins} (input of {consumer}(s{m.dst_stage},mb{m.mb}))"

    def event(self, ins: Instruction, t0: int, t1: int, mem0: int, mem1: int) -> TraceEvent:
        pipe = self.pipe
        common = {
            "iteration": pipe.iteration,
            "rank": pipe.rank,
            "param_version": pipe.param_version,
            "start_ns": t0,
            "end_ns": t1,
            "mem_before": mem0,
            "mem_after": mem1,
        }
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


def _producer_name(m: Message) -> str:
    op = "F" if m.kind is MsgKind.ACT else "backward"
    return f"{op}(s{m.src_stage},mb{m.mb})"
