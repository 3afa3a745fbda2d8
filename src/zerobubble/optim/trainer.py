"""A pipeline training step with synchronous optimizer semantics, with or without a barrier.

``PipelineTrainer(executor, optimizer, OptimConfig(...))`` owns zero_grad, the
global gradient norm, clipping, NaN/Inf skipping and the optimizer step::

    params = [p for c in pipe.chunks.values() for p in c.module.parameters()]
    trainer = PipelineTrainer(pipe, torch.optim.AdamW(params, ...), config)
    for x, y in batches:
        trainer.step(x, target=y)      # iteration k (+ validation of k-1 in post-validation)
    trainer.drain()                    # validated drain point: checkpoint, evaluate, stop

Modes (:class:`~zerobubble.optim.config.OptimConfig`):

* ``sync``: at the tail of iteration k every rank fills its per-parameter
  gradient norms into a model-ordered vector, one all-reduce completes it,
  and every rank derives the same global norm (bitwise ``clip_grad_norm_``),
  then skips, clips and steps, or steps.
* ``conservative`` / ``speculative`` post-validation: the vector travels along
  the pipeline instead. Rank d
  receives the prefix from d-1, adds its norms, steps *provisionally* if the
  prefix is finite and below the clip threshold (else defers), and passes it
  on. The last rank sees the full state and applies the final action at once;
  the full vector then travels back P-1 -> 0, and each rank validates: keep,
  roll back and apply the right action (skip, or the clipped step), or apply
  what it deferred. Conservative: a rank validates before its first forward
  of k+1. Speculative: before its first backward of k+1 (the executor's replay
  gate); if any rank's parameters change there, every rank replays k+1.

Every rank must call ``step`` and ``drain`` the same number of times. The trainer
owns the parameter version (``executor.param_version`` follows its
:class:`~zerobubble.optim.versions.RankVersions`) and has the executor's programs
built with the protocol's instructions (:mod:`zerobubble.optim.speculation`). Every
wait is bounded by the executor's ``comm_timeout_s`` and fails with a
:class:`~zerobubble.runtime.p2p.comm.PeerError`; the state messages travel on their
own channel (:class:`~zerobubble.runtime.p2p.comm.Channel`) and are checked on receipt.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from zerobubble.executor import PipelineExecutor
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.ep_norms import ExpertNorms, expert_slots
from zerobubble.optim.faults import CrashPoint, FaultPlan
from zerobubble.optim.norms import (
    FLAG_AGREED,
    FLAG_DEFERRED,
    FLAG_NONFINITE,
    FLAG_REPLAY,
    FLAG_TOTAL,
    Decision,
    ParamLayout,
    Remote,
    StateKind,
    clip_grads,
    decide,
    may_step_early,
)
from zerobubble.optim.replicas import ReplicaCheck
from zerobubble.optim.rollback import make_undo
from zerobubble.optim.speculation import VersionGuard
from zerobubble.optim.step_state import StepState
from zerobubble.optim.versions import OptState, ProtocolError, RankVersions
from zerobubble.parallel.dp import sum_over_dp
from zerobubble.parallel.mesh import PipelineMesh
from zerobubble.parallel.tied import TiedGroups
from zerobubble.program.plan import Protocol
from zerobubble.runtime.p2p.comm import Channel
from zerobubble.runtime.recorder import profiled
from zerobubble.schedule.ir import Action as ComputeAction
from zerobubble.schedule.step_sim import StepMode
from zerobubble.trace.format import TraceEvent, event_name

__all__ = ["Commit", "PipelineTrainer", "group_settings", "stage_key", "tp_mesh_of"]


@dataclass(frozen=True)
class Commit:
    """The final optimizer decision of one iteration on one rank.

    Attributes:
        iteration: The iteration (0-based).
        version: Committed parameter version afterwards (``iteration + 1``).
        action: ``step``, ``clip`` or ``skip``.
        total_norm: The global gradient norm (as ``clip_grad_norm_`` returns it).
        provisional: Post-validation, ranks but the last: ``"stepped"`` or ``"deferred"``.
        rolled_back: The provisional step was undone.
        replay: Speculative mode: the next iteration's pre-gate work is replayed.
    """

    iteration: int
    version: int
    action: Decision
    total_norm: float
    provisional: str | None = None
    rolled_back: bool = False
    replay: bool = False


@dataclass
class _Pending:
    """An iteration whose validation is still ahead on this rank."""

    iteration: int
    stepped: bool | None  # None: the last rank, already final
    hyper: list[dict[str, Any]] | None = None  # param-group settings the step ran with
    back: tuple[Tensor, dist.Work] | None = None  # receive of the full state from rank d+1
    replay: bool = False  # the last rank's verdict


class _Hooks(VersionGuard):
    def __init__(self, trainer: PipelineTrainer, iteration: int) -> None:
        super().__init__(trainer.pipe, headers=trainer.config.speculative)
        self.trainer, self.iteration = trainer, iteration

    def after_compute(self, action: ComputeAction) -> None:
        self.trainer.faults.after_compute(self.iteration, action, self.trainer.stage_params)

    def at_gate(self) -> bool:
        self.gated = True
        replay = self.trainer._gate()
        if not replay:
            self.check_kept()
        return replay


class PipelineTrainer:
    """Runs iterations of a :class:`PipelineExecutor` with one optimizer per rank.

    Args:
        executor: This rank's executor. The trainer has its programs rebuilt with the
            protocol's instructions (:meth:`PipelineExecutor.set_protocol`); a schedule
            that cannot replay speculative work is refused here.
        optimizer: Any ``torch.optim.Optimizer`` over (a subset of) this rank's
            stage parameters, e.g. built from :attr:`params`.
        config: See :class:`OptimConfig`.
        faults: Faults to inject (tests); see :mod:`zerobubble.optim.faults`.
        on_commit: Called with each :class:`Commit`, right after the final action
            of an iteration is applied on this rank.
        tied: The parameters tied across stages
            (:class:`~zerobubble.parallel.tied.TiedGroups`): their gradients are summed
            over the holder stages at the tail, before the norm, clipping, the
            NaN/Inf check and the step; the norm counts each once.
        names: ``(stage, stage entry name) -> name`` in the model: the key of every
            parameter, buffer and optimizer-state entry in a checkpoint
            (:class:`~zerobubble.Pipeline` passes the user's model's names, FQNs);
            ``s<stage>.<name>`` by default (stages built by hand have no model above them).

    The stages' modules that implement :class:`~zerobubble.optim.step_state.StepState`
    (state moved once per applied step, e.g. DeepSeek-V3's expert biases) are told when a
    step begins, ends (to reduce over dp) and is committed (applied or skipped).

    The constructor is collective (ranks agree on the parameter layout).

    Attributes:
        stage_params: ``stage -> parameters`` of this rank, in model order.
        params: All of them, in model order (clipping covers every one with a gradient).
        versions: The rank's :class:`~zerobubble.optim.versions.RankVersions`.
        last_commit: The newest :class:`Commit`.
    """

    def __init__(
        self,
        executor: PipelineExecutor,
        optimizer: torch.optim.Optimizer,
        config: OptimConfig | None = None,
        *,
        faults: FaultPlan | None = None,
        on_commit: Callable[[Commit], None] | None = None,
        tied: TiedGroups | None = None,
        names: Callable[[int, str], str] | None = None,
    ) -> None:
        self.pipe = executor
        self.tied = tied
        self.names = names or stage_key
        self.optimizer = optimizer
        self.config = config or OptimConfig()
        self.faults = faults or FaultPlan()
        self.on_commit = on_commit
        self.stage_params = {s: list(c.module.parameters()) for s, c in executor.chunks.items()}
        self.params = [p for s in sorted(self.stage_params) for p in self.stage_params[s]]
        self.step_states: list[StepState] = [
            m
            for s in sorted(executor.chunks)
            for m in executor.chunks[s].module.modules()
            if isinstance(m, StepState)
        ]
        """The stages' modules with per-step state, in stage and module order."""
        _refuse_unsupported(executor, optimizer, self.config, self.params, self.step_states)
        pv = self.config.post_validation
        executor.set_protocol(Protocol.SPECULATIVE if self.config.speculative else Protocol.CHECKED)
        self.undo = make_undo(optimizer, self.config.rollback) if pv else None
        self.norm = _GlobalNorm(executor, self.stage_params, self.params, self.config, tied)
        self.norm_params = self.norm.params
        self.layout = self.norm.layout
        self.replicas = ReplicaCheck.of(executor, self.stage_params)
        self.versions = RankVersions(speculative=self.config.speculative)
        self.rank, self.world = executor.rank, executor.schedule.num_devices
        self.last_commit: Commit | None = None
        self._pending: _Pending | None = None
        self._sends: list[tuple[dist.Work, Tensor, int, str]] = []

    # ---- public API ---------------------------------------------------------------------

    def step(self, *args: object, target: object = None, **kwargs: object) -> list[Tensor] | None:
        """Run one iteration; returns the per-microbatch losses on the last stage's rank.

        ``args``, ``target`` and ``kwargs`` are split into microbatches as
        :meth:`PipelineExecutor.step` says.

        In post-validation mode the optimizer step of this iteration is
        provisional when ``step`` returns; it is validated inside the next
        ``step`` (or :meth:`drain`).
        """
        stage_kw = stage_kwargs(kwargs, "PipelineTrainer.step")  # refused before any state moves
        k = self.versions.iteration
        cfg = self.config
        if cfg.mode is StepMode.CONSERVATIVE and self._pending:
            self._validate()  # conservative: before the first forward of k
        self.versions.begin_compute(k)
        if not cfg.speculative:
            self._zero_grad()
        for state in self.step_states:
            state.begin_step()
        losses = self.pipe.step(*args, target=target, hooks=_Hooks(self, k), **stage_kw)
        self._end_states(k)
        in_flight = sum(len(c.pending()) for c in self.pipe.chunks.values())
        self.versions.end_compute(k, in_flight)
        self.faults.at_tail(k, self.stage_params)
        self.faults.crash(self.rank, k, CrashPoint.AT_TAIL)
        self.faults.stall(self.rank, k)
        if self.tied is not None:  # first: rank d's prefix receive may wait on a holder
            self.tied.reduce(k)
        if not cfg.post_validation:
            self._sync_tail(k)
        else:
            self._post_validation_tail(k)
        return losses

    def drain(self) -> None:
        """Reach a validated drain point: every rank's newest step is final.

        Every rank must call it (it completes the validation messages). Call it
        before a checkpoint, an evaluation, or the end of training.
        """
        if self._pending is not None:
            self._validate()
        self._flush_sends()
        self.versions.require_drained()

    def restore(self, iteration: int) -> None:
        """Set the counters after loading the state of a drain point at ``iteration``."""
        if self._pending is not None:
            raise RuntimeError("restore() with an iteration in flight; drain() first")
        self.versions = RankVersions(
            speculative=self.config.speculative,
            iteration=iteration,
            param_version=iteration,
            committed=iteration,
            opt=OptState.VALIDATED if iteration else OptState.NOT_STARTED,
        )
        self.pipe.iteration = self.pipe.param_version = iteration

    # ---- the synchronous step -----------------------------------------------------------

    def _sync_tail(self, k: int) -> None:
        with self._span("opt_reduce", k):
            vec = self.layout.new_vector()
            self.norm.fill(vec, k)
            self.pipe.p2p.all_reduce(vec, f"all-reduce of iteration {k}'s gradient-norm state")
            total = self.norm.agree(vec, self.norm.total(vec, k), k)
            action = decide(total, self.config)
        self._apply(action, total, k)
        self._commit(k, action, total)

    # ---- post-validation ----------------------------------------------------------------

    def _post_validation_tail(self, k: int) -> None:
        d, last = self.rank, self.rank == self.world - 1
        with self._span("opt_prefix", k):
            vec = self.layout.new_vector()
            if d > 0:
                what = f"receive of iteration {k}'s gradient-norm prefix state"
                work = self.pipe.p2p.irecv(vec, d - 1, what, Channel.OPTIM)
                self.pipe.p2p.wait(work, d - 1, what)
                self._check(vec, StateKind.PREFIX, k, d - 1)
            self.norm.fill(vec, k)
            flags = self.layout.flags
            if last:
                total = self.norm.agree(vec, self.norm.total(vec, k), k)
                action = decide(total, self.config)
                replay = not (action is Decision.STEP and vec[flags + FLAG_DEFERRED] == 0)
                vec[flags + FLAG_REPLAY] = float(replay)
                if self.norm.replica_groups:  # the others decide on the agreed norm too
                    vec[flags + FLAG_AGREED] = 1.0
                    vec[flags + FLAG_TOTAL] = float(total)
                self.layout.stamp(vec, StateKind.FULL, k)
                if d > 0:  # send the full state back first: the others' validation waits on it
                    self._send(vec, d - 1, f"send of iteration {k}'s validated optimizer state")
            else:
                prefix = self.norm.total(vec, k, prefix=True)
                stepped = may_step_early(prefix, self.config)
                if not stepped:
                    vec[flags + FLAG_DEFERRED] = 1.0
                self.layout.stamp(vec, StateKind.PREFIX, k)
                # Pass the prefix on before stepping, so the ranks' steps overlap.
                self._send(vec, d + 1, f"send of iteration {k}'s gradient-norm prefix state")
                back = self.layout.new_vector()
                what = f"receive of iteration {k}'s validated optimizer state"
                work = self.pipe.p2p.irecv(back, d + 1, what, Channel.OPTIM)
        if last:
            self._apply(action, total, k)
            self._pending = _Pending(k, None, replay=replay)
            self._commit(k, action, total, replay=replay)
            return
        with self._span("opt_provisional" if stepped else "opt_defer", k):
            hyper = group_settings(self.optimizer)
            if stepped:
                assert self.undo is not None
                self.undo.prepare()
                self.optimizer.step()
            self.versions.provisional(k, stepped)
            self.pipe.param_version = self.versions.param_version
        self._pending = _Pending(k, stepped, hyper, (back, work))
        self.faults.crash(d, k, CrashPoint.AFTER_PROVISIONAL)

    def _gate(self) -> bool:
        """Speculative mode, at the executor's gate: validate, then clear gradients."""
        replay = self._validate() if self._pending is not None else False
        self._zero_grad()
        return replay

    def _validate(self) -> bool:
        """Validate the pending iteration on this rank; returns the global replay verdict."""
        pend, self._pending = self._pending, None
        assert pend is not None
        k, d = pend.iteration, self.rank
        if pend.back is None:  # the last rank applied its final action at the tail
            self._flush_sends()
            return pend.replay
        with self._span("opt_validate", k):
            vec, work = pend.back
            what = f"receive of iteration {k}'s validated optimizer state"
            self.pipe.p2p.wait(work, d + 1, what)
            self._check(vec, StateKind.FULL, k, d + 1)
            if d > 0:
                self._send(vec, d - 1, f"send of iteration {k}'s validated optimizer state")
            self._flush_sends(keep_last=d > 0)
            total = self.norm.total(vec, k)
            if vec[self.layout.flags + FLAG_AGREED] > 0:
                agreed = float(vec[self.layout.flags + FLAG_TOTAL])
                total = torch.tensor(agreed, dtype=total.dtype, device=total.device)
            action = decide(total, self.config)
            replay = bool(vec[self.layout.flags + FLAG_REPLAY])
        rolled_back = False
        assert pend.hyper is not None
        with _settings_applied(self.optimizer, pend.hyper):
            if pend.stepped and action is not Decision.STEP:
                with self._span("opt_rollback", k):
                    assert self.undo is not None
                    self.undo.undo()
                    self.versions.rollback(k)
                    self.pipe.param_version = self.versions.param_version
                rolled_back = True
            if not pend.stepped or rolled_back:
                self._apply(action, total, k)
        provisional = "stepped" if pend.stepped else "deferred"
        self._commit(k, action, total, provisional, rolled_back, replay)
        return replay

    # ---- shared pieces ------------------------------------------------------------------

    def _end_states(self, k: int) -> None:
        """The step's :class:`StepState` s combine what they saw over dp (collective)."""
        if not self.step_states:
            return
        mesh = self.pipe.mesh
        reduce = partial(
            sum_over_dp,
            None if mesh is None else mesh.dp_group,
            self.pipe.p2p,
            k,
            of="per-step module state (StepState)",
        )
        for state in self.step_states:
            state.end_step(reduce)  # type: ignore[arg-type]  # a tensor in, a tensor out

    def _apply(self, action: Decision, total: Tensor, k: int) -> None:
        """The final action: skip, or (clip and) step."""
        with self._span("opt_skip" if action is Decision.SKIP else "opt_step", k):
            if action is not Decision.SKIP:
                if action is Decision.CLIP:
                    assert self.config.max_norm is not None
                    clip_grads(self.params, self.config.max_norm, total)
                self.optimizer.step()

    def _commit(
        self,
        k: int,
        action: Decision,
        total: Tensor,
        provisional: str | None = None,
        rolled_back: bool = False,
        replay: bool = False,
    ) -> None:
        with self._span("opt_commit", k):
            self.versions.commit(k)
            self.pipe.param_version = self.versions.param_version
            for state in self.step_states:
                state.commit_step(action is not Decision.SKIP)
        every = self.config.replica_check_every
        if self.replicas is not None and every is not None and (k + 1) % every == 0:
            self.replicas.check(k)
        info = Commit(
            k, self.versions.committed, action, float(total), provisional, rolled_back, replay
        )
        self.last_commit = info
        if self.on_commit is not None:
            self.on_commit(info)

    def _zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _send(self, vec: Tensor, peer: int, what: str) -> None:
        t = vec.clone()
        self._sends.append((self.pipe.p2p.isend(t, peer, what, Channel.OPTIM), t, peer, what))

    def _check(self, vec: Tensor, kind: StateKind, k: int, peer: int) -> None:
        """A state message must be the one this receive was posted for."""
        why = self.layout.check(vec, kind, k)
        if why is not None:
            name = self.pipe.p2p.name
            raise ProtocolError(f"rank {name(self.rank)}: receive from rank {name(peer)}: {why}")

    def _flush_sends(self, keep_last: bool = False) -> None:
        """Wait for state messages sent earlier (bounded); keep the newest if asked."""
        done = self._sends[:-1] if keep_last else self._sends
        for work, _, peer, what in done:
            self.pipe.p2p.wait(work, peer, what)
        self._sends = self._sends[-1:] if keep_last else []

    def _now(self) -> int:
        return self.pipe.trace.now()

    @contextlib.contextmanager
    def _span(self, op: str, k: int) -> Iterator[None]:
        """The block is optimizer event ``op`` of iteration ``k``: its trace event (when
        the block completes) and, while a profiler records, a range of the event's name."""
        t0 = self._now()
        with profiled(event_name(op)):
            yield
        self._event(op, k, t0)

    def _event(self, op: str, k: int, t0: int) -> None:
        if not self.pipe.options.trace:
            return
        held = self.pipe.held_bytes()
        self.pipe.trace.record(
            TraceEvent(
                iteration=k,
                rank=self.rank,
                op=op,
                stage=None,
                mb=None,
                param_version=self.versions.param_version,
                start_ns=t0,
                end_ns=self._now(),
                mem_before=held,
                mem_after=held,
            )
        )


def _refuse_unsupported(
    executor: PipelineExecutor,
    optimizer: torch.optim.Optimizer,
    config: OptimConfig,
    params: Sequence[Tensor],
    step_states: Sequence[StepState],
) -> None:
    """Refuse an optimizer over parameters this rank does not hold, and the modes this
    rank's stages cannot run in."""
    mine = {id(p) for p in params}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(
            f"the optimizer holds {foreign} parameters that are not in rank "
            f"{executor.rank}'s stages; build it from trainer.params (the executor's "
            "stage parameters), not from the original model"
        )
    if config.speculative and step_states:
        raise ValueError(
            f"rank {executor.rank}: {type(step_states[0]).__name__} updates its state "
            "once per applied optimizer step, but speculative post-validation runs the next "
            "step's first forwards before this step is validated (with the state of before "
            "the update); use OptimConfig(mode='sync') or mode='conservative'"
        )
    if config.post_validation and executor.sharding is not None:
        raise ValueError(
            f"rank {executor.rank}: post-validation ({config.mode.value}) with FSDP-"
            "sharded stages is not supported (a rollback would leave the gathered "
            "parameters stale); use the synchronous step (OptimConfig(mode='sync'))"
        )


class _GlobalNorm:
    """This rank's part in the global gradient norm: the layout of the norm-state vector
    (agreed by every rank at construction, a collective), this rank's norms in it (with ep:
    merged with its ep peers'), its total, and the agreement over the job's replicas."""

    def __init__(
        self,
        executor: PipelineExecutor,
        stage_params: Mapping[int, Sequence[Tensor]],
        params: Sequence[Tensor],
        config: OptimConfig,
        tied: TiedGroups | None,
    ) -> None:
        self.pipe, self.config = executor, config
        sharding = executor.sharding
        self._combine = None if sharding is None else sharding.combine_norms
        norm_params = stage_params if tied is None else tied.norm_params(stage_params)
        self.params: Mapping[int, Sequence[Tensor | Remote]] = norm_params
        self._experts: ExpertNorms | None = None
        mesh = executor.mesh
        if mesh is not None and mesh.ep_group is not None:  # experts sharded: slots for all
            self.params = expert_slots(norm_params, mesh.ep_rank, mesh.ep_size)
        sharded_over = () if sharding is None else sharding.meshes
        tp_mesh = tp_mesh_of(executor.rank, params, mesh, sharded_over=sharded_over)
        self.layout = ParamLayout.exchange(self.params, executor.p2p, tp_mesh)
        if mesh is not None and mesh.ep_group is not None:
            self._experts = ExpertNorms(
                self.layout, self.params, mesh.ep_rank, mesh.ep_group, executor.p2p
            )
        self.replica_groups: list[tuple[dist.ProcessGroup, str]] = []
        """The groups over which the replicas of a pipeline rank agree on the step (dp, then
        tp): with the pipeline's own reduction, the whole job decides as one."""
        if mesh is not None and mesh.dp_group is not None:
            self.replica_groups.append((mesh.dp_group, "dp"))
        if self.layout.tp_mesh is not None:
            self.replica_groups.append((self.layout.tp_mesh.get_group(), "tp"))

    def fill(self, vec: Tensor, k: int) -> None:
        """Add the norms of this rank's gradients (with ep: and of its ep peers' experts, a
        collective over ep) into their slots of ``vec``, which holds none of them yet."""
        with self.tp_collectives(f"iteration {k}'s gradient norms"):
            if self._experts is None:
                self.layout.fill(vec, self.params, self.config.norm_type, self._combine)
                return
            own = self.layout.new_vector()
            self.layout.fill(own, self.params, self.config.norm_type, self._combine)
        self._experts.merge(own, k)
        vec.add_(own)  # exact: the slots are disjoint (zeros on one side)

    def agree(self, vec: Tensor, total: Tensor, k: int) -> Tensor:
        """The global norm every replica of the job decides on: the largest over the dp and
        the tp replicas (each pipeline's is the same unless gradients differ after the
        reduction), NaN when any rank saw a non-finite norm. A NaN that reaches one
        replica's gradients after the dp reduction then makes every replica skip, instead
        of one skipping and the others stepping (their parameters would differ from then
        on). One small all-reduce per replica dim; ``total`` unchanged without replicas."""
        if not self.replica_groups:
            return total
        nonfinite = vec[self.layout.flags + FLAG_NONFINITE] > 0 or not torch.isfinite(total)
        t = torch.tensor(
            [float(nonfinite), 0.0 if nonfinite else float(total)],
            dtype=torch.float64,
            device=self.pipe.device,
        )
        for group, dim in self.replica_groups:
            what = f"all-reduce over dim '{dim}' of iteration {k}'s skip decision and norm"
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
            assert work is not None
            self.pipe.p2p.wait_collective(work, what, group)
        if t[0] > 0:
            return total if not torch.isfinite(total) else torch.full_like(total, float("nan"))
        return torch.tensor(float(t[1]), dtype=total.dtype, device=total.device)

    def total(self, vec: Tensor, k: int, *, prefix: bool = False) -> Tensor:
        """The norm of ``vec`` (with tp: DTensor's reduction over the tp group, bounded by
        its transport timeout and named like every other collective)."""
        with self.tp_collectives(f"iteration {k}'s gradient norm"):
            return self.layout.total(vec, self.config.norm_type, self.pipe.device, prefix=prefix)

    def tp_collectives(self, what: str) -> contextlib.AbstractContextManager[None]:
        tp = self.layout.tp_mesh
        if tp is None:
            return contextlib.nullcontext()
        return self.pipe.p2p.arrivals.watch(
            tp.get_group(),
            lambda: f"{what} (DTensor's reduction over dim 'tp')",
            timeout_s=self.pipe.p2p.timeout_s,
        )


def stage_key(stage: int, name: str) -> str:
    """``s<stage>.<name>``: a stage entry's checkpoint key where no model names it."""
    return f"s{stage}.{name}"


def tp_mesh_of(
    rank: int,
    params: Sequence[Tensor],
    mesh: PipelineMesh | None = None,
    *,
    sharded_over: Sequence[DeviceMesh] = (),
) -> DeviceMesh | None:
    """The tensor-parallel mesh of this rank's DTensor parameters (None if it has none).

    The gradient norm is taken over it as ``clip_grad_norm_`` takes it over DTensors
    (:mod:`~zerobubble.optim.norms`); plain parameters beside them count as replicated.
    ``sharded_over``: the meshes FSDP shards the parameters over (dp, and with ep the
    experts' edp), whose dim leads their meshes (``("dp",)``, or ``("dp", "tp")`` over tp
    DTensors) and is not tp's. With the
    job's ``mesh`` at ``tp > 1`` the result is its :attr:`~PipelineMesh.tp_mesh`, which
    the parameters' must be (the checkpoint's per-rank keys and the norm's tp reduction
    then follow the mesh even where a plan leaves a stage's parameters plain).

    The tp lanes of a schedule with overlapped pairs (the same tp ranks, a group per stage
    of a rank) count as the job mesh's tp dim. Raises ValueError when the parameters live
    on several meshes, a multi-dimensional one, or not on the job mesh's tp dim.
    """
    leads = [m.mesh_dim_names or () for m in sharded_over]
    meshes = set()
    for p in params:
        if isinstance(p, DTensor):
            m = p.device_mesh
            names = m.mesh_dim_names or ()
            lead = next((d for d in leads if names[: len(d)] == d), None)
            if lead is not None:  # FSDP's dp (or edp) dim first
                if len(names) == len(lead):
                    continue  # sharded over dp only: a plain parameter's shards
                m = m[names[len(lead) :]]
            meshes.add(m)
    want = None if mesh is None else mesh.tp_mesh
    if not meshes:
        return want
    if want is not None:  # a stage's tp lane (overlapped pairs): the tp ranks, another group
        meshes = {want if _same_ranks(m, want) else m for m in meshes}
    found = meshes.pop()
    if meshes or found.ndim != 1:
        seen = sorted(str(m.mesh_dim_names or m.shape) for m in (found, *meshes))
        raise ValueError(
            f"rank {rank}: the stages' DTensor parameters live on the meshes {seen}; "
            "tensor parallelism inside a pipeline needs all of them on one 1-D tp mesh "
            "(parallelize every stage over the same mesh['tp'])"
        )
    if want is not None and found != want:
        raise ValueError(
            f"rank {rank}: the stages' DTensor parameters live on the mesh "
            f"{found.mesh_dim_names} {found.mesh.tolist()}, not on the job mesh's tp dim "
            f"{want.mesh.tolist()}: parallelize the stages over mesh.tp_mesh (or let "
            "Pipeline(..., mesh=) do it)"
        )
    return found


def _same_ranks(a: DeviceMesh, b: DeviceMesh) -> bool:
    return a.ndim == b.ndim == 1 and a.mesh.tolist() == b.mesh.tolist()


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's settings (lr, betas, ...), copied: a scheduler may change them."""
    return [
        {k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in optimizer.param_groups
    ]


@contextlib.contextmanager
def _settings_applied(
    optimizer: torch.optim.Optimizer, hyper: list[dict[str, Any]]
) -> Iterator[None]:
    """Run with the settings a provisional step used (redo and undo must match it)."""
    current = group_settings(optimizer)
    for g, h in zip(optimizer.param_groups, hyper, strict=True):
        g.update(h)
    try:
        yield
    finally:
        for g, h in zip(optimizer.param_groups, current, strict=True):
            g.update(h)


_EXECUTOR_OWN = frozenset({"hooks", "losses", "terms"})
"""Keyword names of :meth:`PipelineExecutor.step` that stage-0 keyword arguments cannot take."""


def stage_kwargs(kwargs: Mapping[str, object], caller: str) -> dict[str, Any]:
    """The stage-0 keyword arguments, refused where a name would bind to the executor's own.

    The values are the caller's opaque pytrees, hence ``Any``; the names are what is
    checked, so none of them can silently become ``PipelineExecutor.step``'s ``hooks``
    or ``losses``.
    """
    taken = sorted(set(kwargs) & _EXECUTOR_OWN)
    if taken:
        raise ValueError(
            f"{caller}() keyword argument(s) {', '.join(taken)} are reserved for the runtime "
            "(PipelineExecutor.step's own); rename the stage-0 argument or pass it positionally"
        )
    return dict(kwargs)
