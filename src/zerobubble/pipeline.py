"""One object for one rank's part of a pipelined model: the front door of the runtime.

``Pipeline(layers, loss_fn, schedule)`` cuts the layers into the schedule's
stages, keeps this rank's, and runs them with a
:class:`~zerobubble.executor.PipelineExecutor`; after
:meth:`Pipeline.set_optimizer` every :meth:`Pipeline.step` is a whole training
iteration through a :class:`~zerobubble.optim.trainer.PipelineTrainer`, which
owns zero_grad, clipping, NaN/Inf skipping, the optimizer step and the
parameter version. Parameters and state dicts carry the names they have in the
user's model, so they can be compared with, loaded from and saved for the
unpipelined model.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.faults import FaultPlan
from zerobubble.optim.trainer import Commit, PipelineTrainer, stage_kwargs
from zerobubble.parallel.experts import expert_shard
from zerobubble.parallel.loss import LossParallel
from zerobubble.parallel.mesh import PipelineMesh, pipeline_group, stage_lanes
from zerobubble.parallel.parallelize import Parallelize, ParallelizeFn, StagePlan
from zerobubble.parallel.partition import (
    LayerSource,
    build_stage_modules,
    layer_keys,
    model_layers,
    model_name,
    stage_bounds,
)
from zerobubble.parallel.tied import TiedGroups, TiedParam, find_shared
from zerobubble.program.plan import ProgramPlan
from zerobubble.runtime.microbatch import CountFn
from zerobubble.runtime.stage import LossFn, StageChunk
from zerobubble.schedule.generators import generate
from zerobubble.schedule.ir import Schedule

__all__ = ["Pipeline", "rank_layers"]


class Pipeline:
    """This rank's stages of a model, ready to train with a pipeline schedule.

    Args:
        layers: The model's layers in order: a list, ``nn.Sequential`` or
            ``nn.ModuleList`` (deep-copied per stage: the caller's model is left
            untouched), or a factory ``i -> layer i`` (with ``num_layers``) that
            builds layer ``i`` identically on every rank, or a whole model with a
            ``pipeline_layers()`` method returning its layers in order. A layer with a
            ``source_name(name)`` method names its own state (see
            :mod:`~zerobubble.parallel.partition`; :mod:`zerobubble.interop.hf`).
        loss_fn: ``loss_fn(output, target) -> scalar`` of one microbatch; the
            batch loss is the microbatches' losses weighted by their sizes. With
            ``count_fn``: ``loss_fn(output, target, num_items)``, a sum over the
            microbatch divided by ``num_items``; the batch loss is their plain sum.
        schedule: A :class:`~zerobubble.schedule.ir.Schedule`, or a generator kind
            (``"zb-h1"``, ``"auto"``, ...) generated for the group's size and
            ``microbatches``, with at most one stage per layer.
        microbatches: Microbatches per step; only with a kind.
        num_layers: Layer count; only with a factory.
        boundaries: Cut points ``[0, b_1, ..., num_layers]`` (default: equal counts;
            see :func:`~zerobubble.parallel.partition.stage_bounds`).
        group: Process group whose rank ``d`` runs device ``d`` (default: the world).
        device: Where the stages and microbatches live (default: CPU), e.g.
            :attr:`~zerobubble.runtime.launcher.DistInfo.device`.
        options: :class:`~zerobubble.executor.ExecutorOptions` (its ``seed``
            seeds the stages' random ops per step, stage and microbatch).
        count_fn: ``count_fn(target)``: the count (e.g. non-ignored tokens) of the
            whole batch that normalises the loss (default: ``loss_fn.count_fn`` if the
            loss declares one, as :class:`~zerobubble.interop.hf.CausalLMLoss` does); see
            :class:`~zerobubble.executor.PipelineExecutor`.
        copy_layers: False: build the stages from the layer objects themselves
            (see :func:`~zerobubble.parallel.partition.build_stage_modules`).
        tied_check_every: Compare the replicas of parameters tied across ranks
            (a checksum each) every this many iterations; 0: never.
        mesh: A :class:`~zerobubble.parallel.mesh.PipelineMesh` from
            :func:`~zerobubble.parallel.mesh.build_mesh` (instead of ``group``): the
            pipeline runs on ``mesh.pp_group``; each replica's :meth:`step` gets its part of
            the global batch. The mesh's dimensions are applied to every stage before it
            runs, in one order (:mod:`~zerobubble.parallel.transforms`): tp (parameters,
            gradients and :meth:`state_dict` entries become DTensors, this rank's shards),
            ep (this rank keeps its experts of every module with the sharding hook
            ``shard_experts``: our MoE, transformers' experts modules in the adapter's
            layers; experts nobody sharded raise ValueError on every rank), then the B/W
            split, recompute, compile and, with ``fsdp=True``, FSDP2 over ``dp``; without
            FSDP, gradients are summed over ``mesh.dp_group`` (experts' over ``edp_group``).
            docs/scale.md and docs/moe.md say what each does.
        tp_plan: The tensor-parallel plan of a ``tp > 1`` mesh: one plan for every stage
            (names relative to the stage module, an ``nn.Sequential`` of its layers:
            ``"0.fc1"`` or ``"*.fc1"``), a function ``(stage, stage module) -> plan``, or
            None: each stage module's default plan.
        parallelize_fn: ``(stage, module, mesh) -> module``: each stage parallelized by
            hand, instead of the tp and ep steps (:mod:`~zerobubble.parallel.parallelize`).
        loss_parallel: With ``tp > 1``, the last stage's LM head leaves its logits sharded
            over the vocabulary for a loss that takes them (``loss_fn.loss_parallel``) and
            gathers them for another (None, the default), requires it (True: ValueError
            naming the stage otherwise) or gathers them (False): :mod:`~zerobubble.parallel.loss`.

    A parameter the model uses in several layers stays one parameter: layers of
    a stage share it; stages share it as a tie whose replicas take one summed
    gradient (:mod:`~zerobubble.parallel.tied`). :meth:`named_parameters` and
    :meth:`state_dict` list it once, under its first name in the model.

    The constructor is collective: every rank of the group builds its Pipeline.
    :meth:`with_schedule` gives further Pipelines on the same stages, so that several
    schedules can take turns training one model.

    Attributes:
        executor: The :class:`PipelineExecutor` (its ``schedule``, ``trace``, ``chunks``).
        trainer: The :class:`PipelineTrainer` once :meth:`set_optimizer` was called.
        rank: This process's pipeline rank.
        schedule: The schedule that runs (after the executor's passes).
        tied: The :class:`~zerobubble.parallel.tied.TiedGroups` of this rank's ties.
        shared: Every parameter the model's layers share
            (:func:`~zerobubble.parallel.tied.find_shared`), the same on every rank.
    """

    def __init__(
        self,
        layers: LayerSource,
        loss_fn: LossFn,
        schedule: Schedule | str,
        *,
        microbatches: int | None = None,
        num_layers: int | None = None,
        boundaries: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        options: ExecutorOptions | None = None,
        count_fn: CountFn | None = None,
        copy_layers: bool = True,
        tied_check_every: int = 0,
        mesh: PipelineMesh | None = None,
        tp_plan: StagePlan = None,
        parallelize_fn: ParallelizeFn | None = None,
        loss_parallel: bool | None = None,
    ) -> None:
        layers = model_layers(layers)
        group = _group_of(group, mesh)
        keys = layer_keys(layers, num_layers)
        schedule = _schedule_of(schedule, microbatches, dist.get_world_size(group), len(keys))
        group = pipeline_group(schedule, mesh, group)
        bounds = stage_bounds(len(keys), schedule.num_stages, boundaries)
        # Before the stages are built: with copy_layers=False a tie between two stages of this
        # rank gets a second Parameter on the same memory in the layers themselves.
        shared = self.shared = find_shared(layers, keys, bounds)
        stages = build_stage_modules(
            layers,
            schedule,
            dist.get_rank(group),
            num_layers=len(keys),
            boundaries=boundaries,
            device=device,
            copy_layers=copy_layers,
        )
        stage_keys = {s: keys[bounds[s].start : bounds[s].stop] for s in stages}
        self._parallelize = Parallelize.from_mesh(
            mesh,
            tp_plan=tp_plan,
            fn=parallelize_fn,
            loss=LossParallel(schedule.num_stages - 1, loss_fn, loss_parallel),
            group=group,
            timeout_s=(options or ExecutorOptions()).comm_timeout_s,
            name=lambda s, name, module: _module_name(name, stage_keys[s], module),
            ties=shared,
            lanes=stage_lanes(schedule),
        )
        self._names = _Names(shared, {s: keys[bounds[s].start : bounds[s].stop] for s in stages})
        self._stages: dict[int, nn.Module] = dict(stages)
        # Every StageChunk made for the stages, by split-ness: shared by the Pipelines of
        # with_schedule, so executors of one split-ness share one weight-gradient store.
        self._chunks: dict[bool, dict[int, StageChunk]] = {False: {}, True: {}}
        self._loss_fn, self._count_fn, self._device = loss_fn, count_fn, device
        self._group, self._mesh = group, mesh
        self.executor = self._executor(schedule, options)
        self.rank = self.executor.rank
        self.schedule = self.executor.schedule
        self.tied = TiedGroups(
            shared,
            {s: c.module for s, c in self.executor.chunks.items()},
            self.schedule.placement,
            self.rank,
            group,
            timeout_s=self.executor.options.comm_timeout_s,
            check_every=tied_check_every,
            pipelines=None if mesh is None else mesh.pipelines(),
        )
        self.trainer: PipelineTrainer | None = None
        self._names.gather({s: self._module(s) for s in stages}, group, mesh)

    def _executor(self, schedule: Schedule, options: ExecutorOptions | None) -> PipelineExecutor:
        """An executor of ``schedule`` on the stages, on the chunks made so far where their
        split-ness is what it needs; the chunks it makes itself join them.

        A stage's chunk splits its backward where the schedule, after the B/W fusion the
        options ask for, runs a B of it: the rule the executor wraps modules by.
        """
        opts = options or ExecutorOptions()
        plan = ProgramPlan(fuse_local_backward=opts.fuse_local_backward)
        split = plan.compute_schedule(schedule).split_stages()
        given = {s: self._chunks[s in split].get(s, m) for s, m in self._stages.items()}
        executor = PipelineExecutor(
            schedule,
            given,
            loss_fn=self._loss_fn,
            count_fn=self._count_fn,
            group=None if self._mesh is not None else self._group,
            device=self._device,
            options=opts,
            mesh=self._mesh,
            parallelize=self._parallelize,
        )
        for s, chunk in executor.chunks.items():
            self._chunks[chunk.split].setdefault(s, chunk)
        return executor

    def with_schedule(
        self, schedule: Schedule, *, options: ExecutorOptions | None = None
    ) -> Pipeline:
        """A Pipeline running ``schedule`` on this one's stages, to take turns with it.

        It shares the stage modules (so the parameters: one optimizer over
        :meth:`parameters` serves both), the names and the tied groups, and reuses
        the StageChunks of this Pipeline and of those made from it wherever their
        B/W split is the one ``schedule`` needs, so executors of one split share a
        weight-gradient store. Its executor has its own step count, trace and seed
        (``options``, default: this Pipeline's); give it its own optimizer config with
        :meth:`set_optimizer`. Collective, like the constructor.

        Raises ValueError if ``schedule`` places the stages otherwise (the stages are
        this rank's), if ``options`` recompute differently (checkpointing is installed
        in the shared modules) or if the stages are FSDP-sharded (sharding wraps them
        in place, once).
        """
        opts = options or self.executor.options
        _check_reuse(self.executor, schedule, opts)
        other = copy.copy(self)  # shares the stages, chunks, names and tied groups
        other.executor = self._executor(schedule, opts)
        other.schedule = other.executor.schedule
        other.trainer = None
        return other

    def _module(self, stage: int) -> nn.Module:
        return self.executor.chunks[stage].module

    # ---- training -----------------------------------------------------------------------

    def set_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        config: OptimConfig | None = None,
        *,
        faults: FaultPlan | None = None,
        on_commit: Callable[[Commit], None] | None = None,
    ) -> PipelineTrainer:
        """Let every :meth:`step` end with ``optimizer``'s step under ``config``'s semantics.

        ``optimizer`` is built over (a subset of) :meth:`parameters`. Collective (the
        ranks agree on the parameter layout); returns the trainer, for checkpoints.
        ``faults`` and ``on_commit`` go to the :class:`PipelineTrainer` (fault injection
        for tests, a callback per committed iteration).
        """
        _check_optimizer(optimizer, self.parameters(), self.rank)
        self.trainer = PipelineTrainer(
            self.executor, optimizer, config, faults=faults, on_commit=on_commit,
            tied=self.tied, names=self._name,
        )  # fmt: skip
        return self.trainer

    def step(
        self,
        *args: object,
        target: object = None,
        losses: list[Tensor] | None = None,
        terms: dict[str, list[Tensor]] | None = None,
        **kwargs: object,
    ) -> list[Tensor] | None:
        """Run one iteration on a batch split into the schedule's microbatches.

        ``args`` and ``kwargs`` (tensors or pytrees) are used on the rank holding
        stage 0, ``target`` on the rank holding the last stage (every rank may pass
        them all); tensors whose dim 0 is the batch are split, everything else goes
        unchanged to every microbatch (see :meth:`PipelineExecutor.step`). With an
        optimizer (:meth:`set_optimizer`) this is a whole training step: gradients are
        zeroed first and the optimizer steps at the end; without one, gradients
        accumulate into ``.grad``, as ``loss.backward()`` does (the replicas of a tied
        parameter then hold their own stage's part; ``pipe.tied.reduce(i)``,
        collective, sums them once the accumulation is over). On the last stage's
        rank returns the per-microbatch losses (and appends them to ``losses``);
        elsewhere returns None.

        Layers may add loss terms in their forward
        (:func:`~zerobubble.runtime.loss_terms.add_loss_term`, e.g. a router's
        load-balancing loss). A microbatch's objective is then ``loss_fn``'s loss plus every
        term (added in name order), each weighted as
        :attr:`~zerobubble.runtime.options.ExecutorOptions.term_weight` says: by
        default ``1 / (M * dp)`` in the step's objective, so the step's term is the mean
        over the global batch's microbatches. That is what is trained, and the returned
        ``losses`` are these objectives, unscaled: ``loss_fn``'s loss plus each term times
        ``w / s_j`` (``w`` the term weight, ``s_j`` the loss's weight ``n_j / N``, or 1 with
        a ``count_fn``), so that the ``s_j``-weighted sum of ``losses`` over the replicas is
        the step's objective. On the last stage's rank ``terms``, if given, gets per term
        name the microbatches' raw values (detached, unweighted: what the layers added).
        With ``term_weight="per_call"`` a term is part of its microbatch's loss, weighted as
        it is, and ``losses[j]`` is ``loss_fn``'s loss plus ``terms[name][j]`` over the names.
        """
        stage_kw = stage_kwargs(kwargs, "Pipeline.step")
        if self.trainer is None:
            return self.executor.step(*args, target=target, losses=losses, terms=terms, **stage_kw)
        out = self.trainer.step(*args, target=target, **stage_kw)
        if out is not None and losses is not None:
            losses.extend(out)
        if out is not None and terms is not None:
            for name, values in self.executor.last_terms.items():
                terms.setdefault(name, []).extend(values)
        return out

    def drain(self) -> None:
        """Make every rank's newest optimizer step final (post-validation); collective.

        Call it before reading parameters for evaluation or a checkpoint, and at the end.
        """
        if self.trainer is not None:
            self.trainer.drain()

    # ---- parameters and state -----------------------------------------------------------

    def _name(self, stage: int, stage_name: str) -> str:
        """The user's model's name of a stage entry; a shared parameter's first name."""
        return self._names.name(stage, stage_name, self._module(stage))

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters, in model order, named as in the user's model.

        A tied parameter comes once (on a rank holding several replicas: the first),
        under its first name in the model, on every rank that holds it.
        """
        seen = self.tied.secondary()
        for s in sorted(self.executor.chunks):
            for name, p in self._module(s).named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield self._name(s, name), p

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's parameters, in model order (for an optimizer)."""
        for _, p in self.named_parameters():
            yield p

    def state_dict(self) -> OrderedDict[str, Tensor]:
        """This rank's part of the model's state dict, keyed as ``model.state_dict()`` is.

        A Hugging Face experts tensor sharded over ep (``...experts.gate_up_proj``,
        ``down_proj``, their biases; :mod:`~zerobubble.interop.hf_experts`) keeps HF's name
        but holds only
        this rank's rows ``(E / ep, ...)``
        (:func:`~zerobubble.parallel.experts.expert_shard` tells which): the whole tensor
        is the ep ranks' blocks concatenated in ep-rank order. With tensor parallelism
        (a mesh with ``tp > 1``) a parallelized entry is the stage's DTensor, this rank's
        shard of it (``full_tensor()``, collective over the tp ranks, gives the whole).
        """
        out: OrderedDict[str, Tensor] = OrderedDict()
        for s in sorted(self.executor.chunks):
            for name, t in self._module(s).state_dict().items():
                out.setdefault(self._name(s, name), t)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Copy this rank's entries of ``state_dict`` into its stages.

        ``state_dict`` is keyed as the user's model's: the whole model's (each rank
        takes its own keys) or this rank's part. ``strict``: every key of this rank's
        stages must be there and every key must belong to some stage of the model;
        a mismatch raises ValueError naming the keys and the stages holding them.
        Shapes must match in any case, except that a Hugging Face experts tensor sharded
        over ep takes either the whole ``(E, ...)`` tensor (this rank keeps its rows) or
        its own rows ``(E / ep, ...)``. A shared parameter is read from its first name
        (or, failing that, any other name the model gives it) into every replica. With
        tensor parallelism an entry the stage holds as a DTensor takes a DTensor of the
        same layout (what :meth:`state_dict` gives) or the whole tensor (e.g. the
        unpipelined model's): this rank keeps its shard.
        """
        modules = {s: self._module(s) for s in sorted(self.executor.chunks)}
        local, missing = self._names.entries(state_dict, modules, self.rank)
        unexpected = [k for k in state_dict if k not in self._names.holder]
        if strict and (missing or unexpected):
            raise ValueError(_mismatch(self.rank, missing, unexpected))
        for s, entries in local.items():
            self._module(s).load_state_dict(entries, strict=strict)


def rank_layers(
    schedule: Schedule | str,
    num_layers: int,
    *,
    microbatches: int | None = None,
    boundaries: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    mesh: PipelineMesh | None = None,
) -> tuple[Schedule, tuple[int, ...]]:
    """The schedule a :class:`Pipeline` built with these arguments runs, and the indices of
    the layers its stages on this rank hold, ascending.

    So that a model too large for one device can be built as it is cut: every layer on the
    meta device, then only these materialised (as ``interop.hf_pretrained.load_pipeline``
    does). Pass the returned Schedule to the Pipeline (a kind is generated here, once).
    Arguments as :class:`Pipeline`'s; not collective.
    """
    group = _group_of(group, mesh)
    schedule = _schedule_of(schedule, microbatches, dist.get_world_size(group), num_layers)
    rank = dist.get_rank(pipeline_group(schedule, mesh, group))
    bounds = stage_bounds(num_layers, schedule.num_stages, boundaries)
    return schedule, tuple(sorted(i for s in schedule.stages_of_device[rank] for i in bounds[s]))


class _Names:
    """The user's model's names of this rank's stage entries, which :class:`Pipeline` keys
    its parameters and state dicts by, and the stage and rank holding each entry of the
    model (so a load can tell another rank's key from a stranger); shared by the
    Pipelines of :meth:`Pipeline.with_schedule`.

    Args:
        shared: Every parameter the model's layers share (a shared one goes by its first
            name in the model).
        layer_keys: Per stage of this rank, the model's keys of its layers.
    """

    def __init__(self, shared: Sequence[TiedParam], layer_keys: dict[int, Sequence[str]]) -> None:
        self.first = {n: tp.name for tp in shared for n in tp.names}
        self.layer_keys = layer_keys
        self.holder: dict[str, tuple[int, int]] = {}
        """State-dict key -> (stage, rank) of every rank (:meth:`gather`)."""

    def name(self, stage: int, stage_name: str, module: nn.Module) -> str:
        """The user's model's name of entry ``stage_name`` of ``stage`` (run as ``module``)."""
        name = model_name(stage_name, self.layer_keys[stage], _layers_of(module))
        return self.first.get(name, name)

    def gather(
        self,
        modules: Mapping[int, nn.Module],
        group: dist.ProcessGroup | None,
        mesh: PipelineMesh | None,
    ) -> None:
        """Learn every rank's keys (collective over the pipeline and the ep group)."""
        mine = {
            s: [model_name(k, self.layer_keys[s], _layers_of(m)) for k in m.state_dict()]
            for s, m in modules.items()
        }
        self.holder = _holders(mine, group, mesh)

    def entries(
        self, state_dict: Mapping[str, Tensor], modules: Mapping[int, nn.Module], rank: int
    ) -> tuple[dict[int, dict[str, Tensor]], list[tuple[int, str]]]:
        """Per stage of ``modules``, its entries of ``state_dict`` as it takes them
        (:func:`_entry`), and the ``(stage, key)`` it misses; a shared parameter is read
        from its first name or, failing that, any other name the model gives it."""
        aliases: dict[str, list[str]] = {}
        for name, first in self.first.items():
            aliases.setdefault(first, []).append(name)
        missing: list[tuple[int, str]] = []
        local: dict[int, dict[str, Tensor]] = {}
        for s, module in modules.items():
            shards = {n: expert_shard(p) for n, p in module.named_parameters()}
            local[s] = {}
            for name, current in module.state_dict().items():
                key = self.name(s, name, module)
                found = [k for k in aliases.get(key, [key]) if k in state_dict]
                if not found:
                    if (s, key) not in missing:
                        missing.append((s, key))
                    continue
                where = f"stage {s} (rank {rank})"
                local[s][name] = _entry(state_dict[found[0]], current, shards.get(name), key, where)
        return local, missing


def _layers_of(module: nn.Module) -> nn.Sequential | tuple[()]:
    """A stage module's layers for :func:`model_name` (none when B/W splitting replaced the
    stage module itself: names then come from the layer keys)."""
    return module if isinstance(module, nn.Sequential) else ()


def _group_of(
    group: dist.ProcessGroup | None, mesh: PipelineMesh | None
) -> dist.ProcessGroup | None:
    """The pipeline's process group (the mesh's ``pp_group`` with a mesh), once
    torch.distributed is up: the constructor is collective."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call zerobubble.init_distributed() first "
            "and start one process per device (python -m zerobubble.launch -n P script.py, "
            "or torchrun)"
        )
    if mesh is None:
        return group
    if group is not None and group is not mesh.pp_group:
        raise ValueError("pass either group= or mesh= (the pipeline runs on mesh.pp_group)")
    return mesh.pp_group


def _schedule_of(
    schedule: Schedule | str, microbatches: int | None, world: int, num_layers: int
) -> Schedule:
    """``schedule``, or the schedule of kind ``schedule`` generated for ``world`` devices and
    ``microbatches`` (at most one stage per layer); refuses a microbatch count that
    disagrees with a given schedule's."""
    if isinstance(schedule, str):
        if microbatches is None:
            raise ValueError(
                f"schedule {schedule!r} is a kind: pass microbatches= (per step), or pass a "
                "Schedule from zerobubble.generate"
            )
        # Without the layer count, auto could pick more stages than there are layers.
        return generate(schedule, world, microbatches, max_stages=num_layers)
    if microbatches is not None and microbatches != schedule.num_microbatches:
        raise ValueError(
            f"microbatches={microbatches} but schedule {schedule.name!r} has "
            f"{schedule.num_microbatches}; drop microbatches= or generate the schedule for it"
        )
    return schedule


def _holders(
    mine: dict[int, list[str]], group: dist.ProcessGroup | None, mesh: PipelineMesh | None
) -> dict[str, tuple[int, int]]:
    """Every state-dict key of the model -> the (stage, rank) holding it, from each rank's
    ``mine`` (its stages' keys; collective over the pipeline ``group``), so that
    :meth:`Pipeline.load_state_dict` can tell a key of another rank from a stranger."""
    gathered: list[dict[int, list[str]] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    holder: dict[str, tuple[int, int]] = {}
    for d, part in enumerate(gathered):
        assert part is not None
        for s, names in part.items():
            for name in names:
                holder.setdefault(name, (s, d))
    if mesh is not None and mesh.ep_group is not None:
        # The other ep ranks' experts belong to the model too (held there, same stages).
        peers: list[dict[str, tuple[int, int]] | None] = [None] * mesh.ep_size
        dist.all_gather_object(peers, holder, group=mesh.ep_group)
        for held in peers:
            assert held is not None
            for name, where in held.items():
                holder.setdefault(name, where)
    return holder


def _check_reuse(executor: PipelineExecutor, schedule: Schedule, opts: ExecutorOptions) -> None:
    """Refuse a :meth:`Pipeline.with_schedule` that cannot reuse ``executor``'s stages: another
    placement, FSDP-sharded stages, another recompute setting."""
    if schedule.placement != executor.schedule.placement:
        raise ValueError(
            f"schedule {schedule.name!r} places stages on devices {list(schedule.placement)} "
            f"but this pipeline's {executor.schedule.name!r} places them on "
            f"{list(executor.schedule.placement)}; with_schedule reuses this rank's stages: "
            "generate the schedule for the same placement, or build a new Pipeline"
        )
    if executor.sharding is not None:
        raise ValueError(
            "with_schedule on FSDP-sharded stages is not supported (sharding wraps the "
            "stage modules in place): build a new Pipeline for the other schedule"
        )
    if opts.recompute != executor.options.recompute:
        raise ValueError(
            f"options recompute {opts.recompute!r} but the stages were built with "
            f"{executor.options.recompute!r} (installed in the shared modules): "
            "keep the recompute setting, or build a new Pipeline"
        )


def _check_optimizer(
    optimizer: torch.optim.Optimizer, params: Iterable[nn.Parameter], rank: int
) -> None:
    """Refuse an optimizer over parameters the stages do not hold (the model's own)."""
    mine = {id(p) for p in params}
    foreign = sum(id(p) not in mine for g in optimizer.param_groups for p in g["params"])
    if foreign:
        raise ValueError(
            f"the optimizer holds {foreign} parameters that rank {rank}'s stages do not: "
            "build it from pipe.parameters() (the stages' own copies), not from the model"
        )


def _entry(
    value: Tensor,
    current: Tensor,
    shard: tuple[int, int, int] | None,
    key: str,
    where: str,
) -> Tensor:
    """``value`` as the stage entry ``current`` takes it: a whole HF experts tensor cut to this
    rank's rows (``shard``), a whole tensor distributed as ``current``'s DTensor; checked
    to have ``current``'s shape (``key``, ``where``: for the message)."""
    whole = shard is not None and value.dim() and value.shape[0] == shard[2]
    if shard is not None and whole and value.shape[0] != current.shape[0]:
        value = value[shard[0] : shard[1]]  # the whole HF tensor: this rank's rows
    if isinstance(current, DTensor) and not isinstance(value, DTensor):
        # the whole tensor: this rank keeps its shard (no message: src_data_rank)
        value = distribute_tensor(
            value.to(current.device),
            current.device_mesh,
            current.placements,
            src_data_rank=None,
        )
    if value.shape != current.shape:
        raise ValueError(
            f"state dict entry {key!r} has shape {tuple(value.shape)} but {where} "
            f"holds it with shape {tuple(current.shape)}"
        )
    return value


def _mismatch(rank: int, missing: list[tuple[int, str]], unexpected: list[str]) -> str:
    """The message of a strict :meth:`Pipeline.load_state_dict` whose keys do not match."""
    parts = []
    if missing:
        by_stage: dict[int, list[str]] = {}
        for stage, key in missing:
            by_stage.setdefault(stage, []).append(key)
        listed = "; ".join(
            f"stage {s} (rank {rank}): {', '.join(map(repr, keys))}"
            for s, keys in sorted(by_stage.items())
        )
        parts.append(f"missing keys of {listed}")
    if unexpected:
        parts.append(
            f"unexpected keys held by no stage of the model: {', '.join(map(repr, unexpected))}"
        )
    return (
        "load_state_dict: "
        + "; ".join(parts)
        + " (keys are the user's model's state_dict keys, e.g. '0.weight'; pass strict=False "
        "to load a partial state dict)"
    )


def _module_name(name: str, keys: Sequence[str], stage: nn.Module) -> str:
    """A stage submodule's name in the user's model (as :func:`model_name` names its
    parameters), else its name in the stage."""
    try:  # model_name names tensors: name a stand-in one inside the module, then drop it
        return model_name(f"{name}._", keys, stage if isinstance(stage, nn.Sequential) else ())[:-2]
    except ValueError:
        return name
