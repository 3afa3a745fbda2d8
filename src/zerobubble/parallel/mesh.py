"""The job's parallel layout: one :class:`ParallelSpec`, checked once, and its device mesh.

Named dims ``pp`` (outermost), ``dp`` and ``tp`` (innermost); how the dp replicas share a
stage's parameters (replicated with a gradient all-reduce, or sharded with FSDP2) is part
of the spec, not a separate flag. Expert parallelism (``ep``) shards a MoE layer's
experts over ``ep`` consecutive dp ranks (inside ``dp``, as torchtitan and Megatron
do). Tensor parallelism (``tp``) shards each stage's layers over ``tp`` consecutive
ranks with PyTorch's DTensor (:mod:`~zerobubble.parallel.tp`).

A job of ``pp * dp * tp`` ranks runs ``dp * tp`` copies of one pipeline program. Global
rank ``(pp_rank * dp + dp_rank) * tp + tp_rank`` (``pp`` outermost, ``tp`` innermost, as
torchtitan lays it out): a rank's tensor-parallel peers, which talk inside every layer,
are its neighbours, then its data-parallel peers, which ``torchrun`` puts on the same
node, so the collectives of every layer and the gradient all-reduce stay inside a node
and only pipeline hops cross nodes. A pipeline is the ``pp`` ranks with the same
``(dp, tp)`` coordinates: a stage sends its (tp rank's) output to the same tp rank of the
next stage. The executor, the optimizer's norm messages and the tie groups run on
:attr:`PipelineMesh.pp_group`; the gradient reduction runs on :attr:`PipelineMesh.dp_group`
(the ranks with the same ``(pp, tp)`` coordinates); the layers' tensor-parallel
collectives run on :attr:`PipelineMesh.tp_mesh`. pp=2 x dp=2 x tp=2::

    global rank   0 1 2 3 | 4 5 6 7
    pp rank       0 0 0 0 | 1 1 1 1
    dp rank       0 0 1 1 | 0 0 1 1     dp groups  [0,2] [1,3] [4,6] [5,7]
    tp rank       0 1 0 1 | 0 1 0 1     tp groups  [0,1] [2,3] [4,5] [6,7]
                                        pipelines  [0,4] [1,5] [2,6] [3,7]

Context parallelism (``cp``) shards every sequence over ``cp`` ranks
(:mod:`~zerobubble.runtime.sequence.cp`: cp rank ``r`` holds chunks ``r`` and ``2 cp - 1 -
r`` of ``2 cp``). Its dim sits between ``dp`` and ``tp`` (torchtitan's order pp, dp, cp,
tp): global rank ``((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank``, so the cp
peers, which gather keys and values in every attention layer, are neighbours. Each of
the ``dp * cp * tp`` pipelines runs one program; :attr:`PipelineMesh.cp_group` is the ranks
with the same ``(pp, dp, tp)``. Gradients are summed over cp first (in cp-rank order),
then over dp; the loss's token count likewise. pp=2 x dp=2 x cp=2::

    global rank   0 1 2 3 | 4 5 6 7
    pp rank       0 0 0 0 | 1 1 1 1
    dp rank       0 0 1 1 | 0 0 1 1     dp groups  [0,2] [1,3] [4,6] [5,7]
    cp rank       0 1 0 1 | 0 1 0 1     cp groups  [0,1] [2,3] [4,5] [6,7]
                                        pipelines  [0,4] [1,5] [2,6] [3,7]

With tp too, each tp rank's heads run over the cp group of its tp rank; pp=2 x cp=2 x
tp=2::

    global rank   0 1 2 3 | 4 5 6 7
    cp rank       0 0 1 1 | 0 0 1 1     cp groups  [0,2] [1,3] [4,6] [5,7]
    tp rank       0 1 0 1 | 0 1 0 1     tp groups  [0,1] [2,3] [4,5] [6,7]

With ``ep > 1`` the dp rank splits as ``dp_rank = edp_rank * ep + ep_rank``: the ``ep``
dp ranks of one pipeline rank and one tp rank that differ in their ep rank form its
:attr:`PipelineMesh.ep_group` (they hold different experts and exchange tokens with
all-to-all), and the dp ranks with the same ep (and tp) rank form its
:attr:`PipelineMesh.edp_group` (size ``dp / ep``: they hold the same experts, whose
gradients are summed over it; dense gradients still sum over the whole ``dp_group``).
pp=2 x dp=4 x ep=2::

    global rank   0 1 2 3 | 4 5 6 7
    pp rank       0 0 0 0 | 1 1 1 1
    dp rank       0 1 2 3 | 0 1 2 3
    ep rank       0 1 0 1 | 0 1 0 1     ep groups  [0,1] [2,3] [4,5] [6,7]
    edp rank      0 0 1 1 | 0 0 1 1     edp groups [0,2] [1,3] [4,6] [5,7]

Under a schedule with overlapped F&B pairs (:mod:`~zerobubble.runtime.overlap`) a rank runs
the forward of one of its stages beside the backward of another, on two threads; with
``tp > 1`` both run DTensor collectives among the same tp ranks, which could issue them in
different orders. So each stage a rank holds gets its own tp *lane*
(:meth:`PipelineMesh.with_tp_lanes`): the same tp ranks, but a process group of its own, as
a 1-D DeviceMesh named ``"tp"`` (lane 0, :attr:`PipelineMesh.tp_mesh` itself) or
``"tp_lane<k>_<its group's name>"``. The name matters: DTensor treats meshes with equal
ranks and names as one (its sharding caches hand back the mesh, and so the group, of the
first one they saw), so a lane must differ by name from every other mesh, those of another
mesh's lanes included. A mesh makes its lanes once, for all the pipelines built on it.

With ``tp > 1`` too, the experts are replicated over tp (no expert-tensor parallelism):
each tp rank holds its ep rank's experts whole and runs the all-to-all with the ranks of
its own tp rank, so there is one ep group per ``(pp, edp, tp)`` coordinate. Every tp rank
routes the same tokens (a MoE block's input is replicated over tp, or under sequence
parallelism gathered by the block), so the expert gradients are equal on the tp ranks and
need no tp reduction.
pp=1 x dp=2 x ep=2 x tp=2::

    global rank   0 1 2 3
    dp (ep) rank  0 0 1 1     ep groups  [0,2] [1,3]
    tp rank       0 1 0 1     tp groups  [0,1] [2,3]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from zerobubble import composition
from zerobubble.program.plan import GradSync
from zerobubble.runtime.p2p.comm import default_timeout, set_timeout
from zerobubble.schedule.ir import Schedule

__all__ = [
    "ParallelSpec",
    "PipelineMesh",
    "build_mesh",
    "is_tp_dim",
    "pipeline_group",
    "pipeline_ranks",
    "stage_lanes",
]

TP_LANE = "tp_lane"
"""The dim name of tp lane ``k >= 1`` is ``f"{TP_LANE}{k}"`` (lane 0's is ``"tp"``)."""


def is_tp_dim(name: str | None) -> bool:
    """Whether a mesh dim named ``name`` is the tp dim (of any lane)."""
    return name == "tp" or (name is not None and name.startswith(TP_LANE))


@dataclass(frozen=True)
class ParallelSpec:
    """The job's parallel dimensions; invalid combinations are refused here, once."""

    pp: int
    """Pipeline ranks (devices of one schedule)."""
    dp: int = 1
    """Data-parallel replicas of the pipeline."""
    fsdp: bool = False
    """Shard every stage's parameters, gradients and optimizer state over ``dp`` with FSDP2
    (:mod:`~zerobubble.parallel.fsdp`) instead of replicating them and all-reducing whole
    gradients. Needs ``dp >= 2``. With ``ep > 1`` the experts are sharded over the
    ``dp / ep`` replicas holding them instead (``edp``; left whole when that is 1)."""
    ep: int = 1
    """Expert-parallel ranks: each MoE layer's experts are sharded over ``ep`` consecutive
    dp ranks (``dp % ep == 0``); the ``dp / ep`` ranks holding the same experts sum their
    gradients. With ``tp > 1`` the experts are replicated over tp (each tp rank runs its
    own ep group)."""
    tp: int = 1
    """Tensor-parallel ranks: each stage's layers are sharded over ``tp`` consecutive ranks
    (DTensor, :mod:`~zerobubble.parallel.tp`)."""
    sequence_parallel: bool = False
    """Shard the activations between the tensor-parallel regions (norms, dropout, the stage
    boundaries) over the sequence dim of the ``tp`` ranks. Needs ``tp >= 2``."""
    cp: int = 1
    """Context-parallel ranks: every sequence is sharded over ``cp`` ranks
    (:mod:`~zerobubble.runtime.sequence.cp`); with tp each tp rank's heads (not with ep or
    FSDP yet)."""

    def __post_init__(self) -> None:
        # Types first: a string size would otherwise fail deep inside the comparisons below
        # (or, worse, multiply into a repeated string), naming no field.
        for name in ("pp", "dp", "ep", "tp", "cp"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(
                    f"ParallelSpec.{name} must be an integer >= 1, got {value!r} "
                    f"({type(value).__name__}); pass e.g. {name}=2"
                )
        for name in ("fsdp", "sequence_parallel"):
            value = getattr(self, name)
            if type(value) is not bool:
                raise ValueError(
                    f"ParallelSpec.{name} must be True or False, got {value!r} "
                    f"({type(value).__name__})"
                )
        if self.cp < 1:
            raise ValueError(f"mesh sizes must be >= 1, got cp={self.cp}")
        if self.pp < 1 or self.dp < 1 or self.ep < 1 or self.tp < 1:
            sizes = f"pp={self.pp}, dp={self.dp}, ep={self.ep}"
            raise ValueError(
                f"mesh sizes must be >= 1, got {sizes}"
                + (f", tp={self.tp}" if self.tp != 1 else "")
            )
        if self.dp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp={self.dp} (experts are sharded over ep ranks "
                f"inside the data-parallel ranks); choose dp as a multiple of ep"
            )
        if self.fsdp and self.dp < 2:
            raise ValueError(
                f"fsdp=True shards over the mesh's dp dimension: it needs dp >= 2 (got "
                f"dp={self.dp}); build the mesh with dp >= 2 or leave fsdp off"
            )
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                f"sequence_parallel=True shards activations over the mesh's tp dimension: it "
                f"needs tp >= 2 (got tp={self.tp}); build the mesh with tp >= 2 or leave "
                "sequence_parallel off"
            )
        sizes = f"pp={self.pp}, dp={self.dp}, ep={self.ep}, tp={self.tp}, cp={self.cp}"
        composition.check(self.features, f"the mesh ({sizes}, fsdp={self.fsdp})")

    @property
    def features(self) -> set[str]:
        """The mesh's :mod:`~zerobubble.composition` features."""
        on = {"dp": self.dp > 1, "fsdp": self.fsdp, "tp": self.tp > 1}
        on.update(sp=self.sequence_parallel, ep=self.ep > 1, cp=self.cp > 1)
        return {f for f, yes in on.items() if yes}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def coordinates(self, rank: int) -> dict[str, int]:
        """Global rank ``rank``'s coordinates: ``pp``, ``dp``, ``tp`` and ``ep`` (the dims
        of size > 1 and always ``pp``; the layout of the module docstring)."""
        tp_rank, cp_rank, dp_rank, pp_rank = (
            rank % self.tp,
            rank // self.tp % self.cp,
            rank // (self.tp * self.cp) % self.dp,
            rank // (self.dp * self.cp * self.tp),
        )
        out = {"pp": pp_rank, "dp": dp_rank, "cp": cp_rank, "tp": tp_rank}
        out["ep"] = dp_rank % self.ep
        return {k: v for k, v in out.items() if k == "pp" or getattr(self, k) > 1}

    def name(self, rank: int) -> str:
        """Global rank ``rank`` as failure messages name it: ``rank 5 (pp 1, dp 0, tp 1)``."""
        coords = ", ".join(f"{k} {v}" for k, v in self.coordinates(rank).items())
        return f"rank {rank} ({coords})"

    @property
    def edp(self) -> int:
        """Data-parallel replicas of each expert (``dp / ep``)."""
        return self.dp // self.ep

    @property
    def grad_sync(self) -> GradSync:
        """How the program meets the other replicas' gradients (a pass of the builder)."""
        if self.dp == 1 and self.cp == 1:
            return GradSync.NONE
        return GradSync.FSDP if self.fsdp else GradSync.REDUCE


@dataclass(frozen=True)
class PipelineMesh:
    """The job's DeviceMesh with named dims ("pp", "dp"[, "tp"]) and this rank's place in it.

    Attributes:
        mesh: The :class:`DeviceMesh`: shape ``(pp, dp)``, dim names ``("pp", "dp")``; with
            ``tp > 1`` shape ``(pp, dp, tp)``, dim names ``("pp", "dp", "tp")``.
        pp_group: This rank's pipeline (size ``pp``); its rank ``d`` runs device ``d``.
        dp_group: This rank's data-parallel replicas (size ``dp``, the ranks with the same
            pp and tp ranks); None when ``dp == 1``.
        pp_rank, pp_size, dp_rank, dp_size: This rank's coordinates and the dim sizes.
        spec: The :class:`ParallelSpec` it was built from.
        ep_group: The ``ep`` consecutive dp ranks of this rank's pipeline rank and tp rank,
            which shard the experts and exchange tokens (None when ``ep == 1``).
        edp_group: The dp ranks holding this rank's experts (same pp, ep and tp rank, size
            ``dp / ep``), over which expert gradients are summed (None when it is 1).
        ep_mesh: The ``(pp, edp, ep)`` DeviceMesh of those groups, ``(pp, tp, edp, ep)``
            with ``tp > 1`` (None when ``ep == 1``).
        ep_backward_group: A second group of ``ep_group``'s ranks, for the all-to-alls of
            backwards, so that an overlapped F&B pair's two threads never share a group
            (:class:`~zerobubble.parallel.ep.ExpertGroup`).
        tp_mesh: The 1-D ``"tp"`` DeviceMesh of this rank's tensor-parallel peers (the ranks
            with the same pp and dp ranks), which the stages are parallelized over; None when
            ``tp == 1``.
        tp_rank: This rank's coordinate in it (0 when ``tp == 1``).
        tp_lanes: The further tp lanes made so far (:meth:`with_tp_lanes`): lane ``k`` is
            ``tp_lanes[k - 1]``, the tp ranks of :attr:`tp_mesh` over a group of its own.
    """

    mesh: DeviceMesh
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup | None
    pp_rank: int
    pp_size: int
    dp_rank: int
    dp_size: int
    spec: ParallelSpec
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    ep_mesh: DeviceMesh | None = None
    ep_backward_group: dist.ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = None
    tp_rank: int = 0
    tp_lanes: list[DeviceMesh] = field(default_factory=list, compare=False, repr=False)
    cp_group: dist.ProcessGroup | None = None
    """The ranks with this rank's pp, dp and tp ranks, which share its sequences (None when
    ``cp == 1``)."""
    cp_rank: int = 0

    @property
    def cp_size(self) -> int:
        return self.spec.cp

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.spec.ep

    @property
    def ep_size(self) -> int:
        return self.spec.ep

    @property
    def tp_size(self) -> int:
        return self.spec.tp

    @property
    def tp_group(self) -> dist.ProcessGroup | None:
        """The process group of :attr:`tp_mesh` (None when ``tp == 1``)."""
        return None if self.tp_mesh is None else self.tp_mesh.get_group()

    def tp_lane(self, lane: int) -> DeviceMesh | None:
        """Tp lane ``lane``'s mesh (lane 0: :attr:`tp_mesh`; None when ``tp == 1``)."""
        if self.tp_mesh is None or lane == 0:
            return self.tp_mesh
        return self.tp_lanes[lane - 1]

    def with_tp_lanes(self, lanes: int) -> PipelineMesh:
        """This mesh, with at least ``lanes`` tp lanes made (none where ``tp == 1``): the
        missing ones are added to :attr:`tp_lanes`, kept for every later caller. Collective
        over the job where it makes groups: every rank makes every tp group of each new
        lane, in one order, and keeps its own.

        A lane's mesh is the tp dim of a ``("pp", "dp", <lane>)`` mesh over the job's ranks
        (its pp and dp groups the job's own), so FSDP2 can lay a parameter over the dp dim
        and a lane's tp dim as it does over the job mesh's ``("dp", "tp")``.
        """
        if self.tp_mesh is None:
            return self
        mesh, rank = self.mesh, dist.get_rank()
        tp_ranks = mesh.mesh.reshape(-1, self.spec.tp).tolist()  # every tp group, in order
        timeout = default_timeout()
        for k in range(1 + len(self.tp_lanes), lanes):
            mine = None
            for ranks in tp_ranks:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    mine = group
            assert mine is not None  # every rank is in one tp group
            name = f"{TP_LANE}{k}_{mine.group_name}"
            root = DeviceMesh.from_group(
                [mesh.get_group("pp"), mesh.get_group("dp"), mine],
                mesh.device_type,
                mesh.mesh,
                mesh_dim_names=("pp", "dp", name),
            )
            self.tp_lanes.append(root[name])
        return self

    def with_fsdp(self, fsdp: bool = True) -> PipelineMesh:
        """The same mesh (same groups) with the dp replicas sharding, or not, their stages."""
        return replace(self, spec=replace(self.spec, fsdp=fsdp))

    def pipelines(self) -> list[list[int]]:
        """The global ranks of every pipeline (one list per (dp, tp) coordinate, in pp order)."""
        return pipeline_ranks(self.pp_size, self.dp_size * self.cp_size, self.tp_size)


def pipeline_ranks(pp: int, dp: int, tp: int = 1) -> list[list[int]]:
    """Global ranks of each of the ``dp * tp`` pipelines of a ``(pp, dp, tp)`` mesh, ordered
    by their first rank (with cp, pass ``dp * cp`` as ``dp``: cp sits inside dp).

    Subgroups inside a pipeline (directed P2P lanes, tie groups) are made with
    ``dist.new_group``, which is collective over the default group: every rank
    creates the subgroups of every pipeline, in this order, and keeps its own.
    """
    return [[(d * dp + j) * tp + t for d in range(pp)] for j in range(dp) for t in range(tp)]


def build_mesh(
    pp: int,
    dp: int = 1,
    *,
    fsdp: bool = False,
    ep: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    device_type: str | None = None,
    cp: int = 1,
) -> PipelineMesh:
    """Build the mesh of :class:`ParallelSpec` ``(pp, dp, fsdp, ep, tp, sequence_parallel)``
    over the default process group; collective. ``(pp, dp)``, or ``(pp, dp, tp)`` with
    ``tp > 1``; with ``ep > 1`` also the ``(pp, dp / ep, ep)`` mesh of the expert groups,
    ``(pp, tp, dp / ep, ep)`` with ``tp > 1`` (see the module docstring for the layout).

    ``device_type`` defaults to that of the default group's backend (``"cpu"`` for
    gloo, the accelerator's type otherwise). Raises ValueError when the world size
    is not ``pp * dp * tp``.
    """
    spec = ParallelSpec(pp, dp, fsdp, ep, tp, sequence_parallel, cp)  # its fields checked first
    if device_type is not None and not isinstance(device_type, str):
        raise ValueError(
            f"build_mesh: device_type must be a device type name such as 'cpu' or 'cuda' (or "
            f"None), got {device_type!r} ({type(device_type).__name__})"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call zerobubble.init_distributed() before "
            "build_mesh"
        )
    _check_world(spec, dist.get_world_size())
    if device_type is None:
        device_type = "cpu" if dist.get_backend() == "gloo" else _accelerator_type()
    # torchtitan's order pp, dp, cp, tp; a dim of size 1 left out (but dp)
    sized = [(pp, "pp"), (dp, "dp"), (cp, "cp"), (tp, "tp")]
    kept = [(n, name) for n, name in sized if n > 1 or name in ("pp", "dp")]
    dims, names = tuple(n for n, _ in kept), tuple(name for _, name in kept)
    mesh = init_device_mesh(device_type, dims, mesh_dim_names=names)
    rank = dist.get_rank()
    timeout = default_timeout()
    ep_mesh, backward = _expert_meshes(spec, device_type, rank, timeout) if ep > 1 else (None, None)
    # DeviceMesh makes its subgroups with torch's default timeout (30 minutes), not the one
    # given to init_distributed: each of this rank's groups gets the user's.
    for sub in (mesh, ep_mesh):
        if sub is not None:
            for name in sub.mesh_dim_names or ():
                set_timeout(sub.get_group(name), timeout)
    return PipelineMesh(
        mesh=mesh,
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp") if dp > 1 else None,
        pp_rank=rank // (dp * cp * tp),
        pp_size=pp,
        dp_rank=rank // (cp * tp) % dp,
        dp_size=dp,
        spec=spec,
        ep_group=None if ep_mesh is None else ep_mesh.get_group("ep"),
        edp_group=None if ep_mesh is None or dp == ep else ep_mesh.get_group("edp"),
        ep_mesh=ep_mesh,
        ep_backward_group=backward,
        tp_mesh=mesh["tp"] if tp > 1 else None,
        tp_rank=rank % tp,
        cp_group=mesh.get_group("cp") if cp > 1 else None,
        cp_rank=rank // tp % cp,
    )


def _check_world(spec: ParallelSpec, world: int) -> None:
    """Refuse a world of another size than the mesh's, naming both and the fix."""
    if world == spec.world_size:
        return
    pp, dp, cp, tp = spec.pp, spec.dp, spec.cp, spec.tp
    if cp > 1:
        tps = "" if tp == 1 else f" x tp={tp}"
        raise ValueError(
            f"the world has {world} ranks but the mesh pp={pp} x dp={dp} x cp={cp}{tps} needs "
            f"{spec.world_size}; launch pp*dp*cp{'*tp' if tps else ''} = {spec.world_size} "
            f"processes or change --pp/--dp/--cp{'/--tp' if tps else ''}"
        )
    if tp == 1:
        raise ValueError(
            f"the world has {world} ranks but the mesh pp={pp} x dp={dp} needs {pp * dp}; "
            f"launch pp*dp = {pp * dp} processes or change --pp/--dp"
        )
    raise ValueError(
        f"the world has {world} ranks but the mesh pp={pp} x dp={dp} x tp={tp} needs "
        f"{spec.world_size}; launch pp*dp*tp = {spec.world_size} processes or change "
        "--pp/--dp/--tp"
    )


def _expert_meshes(
    spec: ParallelSpec, device_type: str, rank: int, timeout: timedelta | None
) -> tuple[DeviceMesh, dist.ProcessGroup | None]:
    """The ``(pp, edp, ep)`` mesh of the expert groups (``(pp, tp, edp, ep)`` with tp: one
    grid per tp rank, the experts replicated over tp), and this rank's second ep group, for
    the backwards' all-to-alls; collective."""
    pp, dp, ep, tp = spec.pp, spec.dp, spec.ep, spec.tp
    ranks_of = torch.arange(pp * dp * tp).view(pp, dp // ep, ep, tp)
    ep_names: tuple[str, ...] = ("pp", "edp", "ep")
    layout = ranks_of[..., 0]
    if tp > 1:
        ep_names, layout = ("pp", "tp", "edp", "ep"), ranks_of.permute(0, 3, 1, 2)
    ep_mesh = DeviceMesh(device_type, layout, mesh_dim_names=ep_names)
    backward = None
    for ranks in layout.reshape(-1, ep).tolist():  # new_group is collective: every rank
        group = dist.new_group(ranks, timeout=timeout)  # makes every group, in one order,
        if rank in ranks:  # and keeps its own
            backward = group
    return ep_mesh, backward


def stage_lanes(schedule: Schedule) -> dict[int, int]:
    """Each stage's tp lane under ``schedule``: its index among its device's stages, so the
    two stages of an overlapped pair (always two stages of one device) never share one;
    every stage lane 0 where the schedule overlaps nothing."""
    if not schedule.overlaps:
        return dict.fromkeys(range(schedule.num_stages), 0)
    return {s: i for stages in schedule.stages_of_device for i, s in enumerate(stages)}


def pipeline_group(
    schedule: Schedule, mesh: PipelineMesh | None, group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    """The process group ``schedule`` runs on, checked against ``mesh`` or ``group``.

    The one check of a pipeline's ranks: with a mesh, its ``pp`` dim (``group`` must be
    None or the mesh's); without, ``group`` (None: the world). Raises ValueError naming
    both sizes and the fix when they differ from the schedule's devices.
    """
    if mesh is not None:
        if group is not None and group is not mesh.pp_group:
            raise ValueError("pass either group= or mesh= (the pipeline runs on mesh.pp_group)")
        if mesh.pp_size != schedule.num_devices:
            tp = f" x tp={mesh.tp_size}" if mesh.tp_size > 1 else ""
            raise ValueError(
                f"schedule {schedule.name!r} has {schedule.num_devices} devices but the mesh's "
                f"'pp' dim has {mesh.pp_size} ranks (mesh pp={mesh.pp_size} x "
                f"dp={mesh.dp_size}{tp}); build the mesh with pp={schedule.num_devices} or "
                f"generate the schedule for {mesh.pp_size} devices"
            )
        return mesh.pp_group
    world = dist.get_world_size(group)
    if world != schedule.num_devices:
        raise ValueError(
            f"schedule {schedule.name!r} needs {schedule.num_devices} ranks but the process "
            f"group has {world}; launch with -n {schedule.num_devices}"
        )
    return group


def _accelerator_type() -> str:
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"
