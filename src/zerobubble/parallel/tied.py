"""Parameters shared between layers, and tied across stages.

A model may use one Parameter in several layers: GPT's LM head reuses the token
embedding (``lm_head.weight = wte.weight``). Where the layers land on different
stages, every stage holding the parameter keeps its own replica (its own
Parameter object; stages on one rank share the replica's memory), and the
replicas' gradients are summed before the optimizer sees them, so every replica
takes the same step and they stay bitwise identical.

Order of accumulation (what :func:`tied_reference_step` reproduces): each
holder stage accumulates its own gradient over the microbatches in microbatch
order, as for any parameter; the tied gradient is then the sum of the stages'
gradients in stage order, ``((g_s1 + g_s2) + g_s3) ...``. Plain autograd on the
unpipelined model adds the two uses within each microbatch instead, so its
rounding differs (``bench/tied_order.py`` measures by how much). The per-stage
split makes the result independent of the schedule: a rank holding two stages
of a tie (V placements) would otherwise accumulate in the schedule's W order.

The reduction is one bounded all-gather per tie on the process group of the
ranks holding it (:class:`TiedGroups`), at the tail of an iteration, before the
gradient norm, clipping, the NaN/Inf check and the optimizer step. The global
norm counts a tied parameter once, at its first stage (as ``clip_grad_norm_``
over ``model.parameters()`` does); the other replicas are left out of the norm
state (:meth:`TiedGroups.norm_params`) and, on a rank holding two of them, all
but the first have ``.grad = None`` so an optimizer steps the shared memory once.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from zerobubble.parallel.mesh import is_tp_dim
from zerobubble.runtime.microbatch import loss_scales, split_batch
from zerobubble.runtime.p2p.comm import PeerError, dtype_code
from zerobubble.runtime.progress import Progress

__all__ = [
    "TiedGroups",
    "TiedParam",
    "find_shared",
    "laid_out_as",
    "tie_local_replicas",
    "tied_reference_step",
]

_MAX_DIMS = 8


@dataclass(frozen=True)
class TiedParam:
    """One Parameter that several layers of the model use.

    Attributes:
        names: Every name the model gives it (``named_parameters(remove_duplicate=False)``
            order); ``names[0]`` is the one it is listed and saved under.
        stages: Stages whose layers use it, ascending.
        local: ``local[s]``: its names inside stage ``s``'s module (``"<i>.<name>"``).
        source_names: ``names`` as the user's model spells them, for reports: a layer
            cut out of a bigger model names its state itself (``source_name``, as
            :func:`~zerobubble.parallel.partition.model_name` does), else ``names``.
    """

    names: tuple[str, ...]
    stages: tuple[int, ...]
    local: Mapping[int, tuple[str, ...]]
    source_names: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def tied(self) -> bool:
        """Used by more than one stage (a reduction is needed)."""
        return len(self.stages) > 1


def find_shared(
    layers: Sequence[nn.Module] | nn.Sequential | nn.ModuleList | Callable[[int], nn.Module],
    keys: Sequence[str],
    bounds: Sequence[range],
) -> tuple[TiedParam, ...]:
    """Every parameter that appears under more than one name, in model order.

    The one finder of shared parameters: stage building and :class:`~zerobubble.Pipeline`
    (and so the train job) take their ties from it. ``layers`` are the model's layers in
    order (``keys`` their :func:`~zerobubble.parallel.partition.layer_keys`), ``bounds``
    each stage's layer range. A layer factory gives none: no rank builds every layer, so
    a tie across its stages cannot be found (stage building refuses one it sees on its
    own rank).

    Raises ValueError, naming it, for what the runtime cannot honour: a buffer
    shared by layers of different stages (buffers are not synchronised), and two
    different Parameters of different stages sharing memory (a tie by ``.data``
    rather than by object, which deep copies would break). Meta tensors hold no memory, so
    a model built on the meta device (to be materialised per rank) is checked by object only.
    """
    if not isinstance(layers, nn.Sequential | nn.ModuleList | Sequence):
        return ()
    ordered = list(layers)
    stage_of = {i: s for s, r in enumerate(bounds) for i in r}
    params: dict[int, list[tuple[int, str, str, str]]] = {}
    buffers: dict[int, list[tuple[int, str]]] = {}
    for i, layer in enumerate(ordered):
        s, local_index = stage_of[i], i - bounds[stage_of[i]].start
        for name, p in layer.named_parameters(remove_duplicate=False):
            params.setdefault(id(p), []).append(
                (s, f"{local_index}.{name}", f"{keys[i]}.{name}", _user_name(layer, keys[i], name))
            )
        for name, b in layer.named_buffers(remove_duplicate=False):
            buffers.setdefault(id(b), []).append((s, _user_name(layer, keys[i], name)))
    for buf_uses in buffers.values():
        if len({s for s, _ in buf_uses}) > 1:
            where = ", ".join(f"{n!r} (stage {s})" for s, n in buf_uses)
            raise ValueError(
                f"buffer {buf_uses[0][1]!r} is shared by layers of different stages: {where}; "
                "the pipeline does not keep buffers in sync across stages: give each layer its "
                "own buffer, or choose boundaries that keep these layers on one stage"
            )
    _refuse_memory_ties(ordered, stage_of, keys)
    out = []
    for uses in params.values():
        if len(uses) < 2:
            continue
        stages = tuple(sorted({u[0] for u in uses}))
        local = {s: tuple(u[1] for u in uses if u[0] == s) for s in stages}
        names = tuple(u[2] for u in uses)
        out.append(TiedParam(names, stages, local, tuple(u[3] for u in uses)))
    return tuple(out)


def _user_name(layer: nn.Module, key: str, name: str) -> str:
    """``name`` of ``layer`` as the user's model spells it, for messages (as
    :func:`~zerobubble.parallel.partition.model_name`: a layer's ``source_name`` if it has one)."""
    namer = getattr(layer, "source_name", None)
    return str(namer(name)) if namer is not None else f"{key}.{name}"


def _refuse_memory_ties(
    layers: Sequence[nn.Module], stage_of: Mapping[int, int], keys: Sequence[str]
) -> None:
    seen: dict[tuple[int, int], tuple[int, str, int]] = {}  # (device-ptr, nbytes) -> use
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            # a DTensor wraps no storage of its own: its local shard's is what it holds
            local = p.to_local() if isinstance(p, DTensor) else p
            if p.numel() == 0 or local.is_meta:
                continue  # no memory to share: every meta tensor's storage reads (0, nbytes)
            storage = local.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            first = seen.setdefault(key, (id(p), _user_name(layer, keys[i], name), stage_of[i]))
            if first[0] != id(p) and first[2] != stage_of[i]:
                raise ValueError(
                    f"parameters {first[1]!r} (stage {first[2]}) and "
                    f"{_user_name(layer, keys[i], name)!r} "
                    f"(stage {stage_of[i]}) share memory but are different Parameter objects; "
                    "tie them by assigning the same Parameter (e.g. head.weight = "
                    "embedding.weight), so the pipeline knows to keep them equal"
                )


def tie_local_replicas(stages: Mapping[int, nn.Module], shared: Sequence[TiedParam]) -> None:
    """Give every stage of ``stages`` its own replica of a tie, sharing the first one's memory.

    Each stage keeps its own Parameter object (its gradient is its own sum); the
    data is one tensor, so the rank holds the values once. A Parameter object
    used by two of the stages (uncopied layers) is replaced in the later stage by
    a new Parameter on the same data. Call after moving the modules to their
    device (a move gives every Parameter new memory), and again after tensor parallelism
    made each replica a DTensor of its own (the replicas must then have one layout).
    """
    for tp in shared:
        here = [s for s in tp.stages if s in stages]
        if len(here) < 2:
            continue
        first = stages[here[0]].get_parameter(tp.local[here[0]][0])
        for k, s in enumerate(here[1:], start=1):
            p = stages[s].get_parameter(tp.local[s][0])
            if p is first:
                _replace(stages, here[:k], s, tp, first)
                continue
            if (p.shape, p.dtype, p.device) != (first.shape, first.dtype, first.device):
                raise ValueError(_mismatch(tp, here[0], first, s, p))
            if isinstance(first, DTensor) or isinstance(p, DTensor):
                _share_dtensor(stages, tp, (here[0], first), (s, p))
                continue
            with torch.no_grad():
                p.data = first.data


def _share_dtensor(
    stages: Mapping[int, nn.Module],
    tp: TiedParam,
    first: tuple[int, Tensor],
    later: tuple[int, Tensor],
) -> None:
    """Stage ``later``'s replica of a tie as a new DTensor Parameter on the first replica's
    local shard (one layout on both: a vocabulary-sharded embedding and a column-wise
    LM head are both ``Shard(0)``)."""
    (s0, p0), (s1, p1) = first, later
    lay0, lay1 = _layout(p0), _layout(p1)
    if lay0 != lay1:
        raise ValueError(
            f"tied parameter {tp.name!r}: stage {s0} holds it as {lay0} but stage {s1} as "
            f"{lay1}; a tie under tensor parallelism needs one layout on every holder stage "
            "(e.g. the embedding vocabulary-sharded and the LM head column-wise, both "
            "Shard(0)): give both layers plans that shard the tied weight alike, or untie them"
        )
    # On the later stage's own mesh: under overlapped pairs each stage has its own tp lane.
    replica = nn.Parameter(_like(local(p0.detach()), p1), requires_grad=p1.requires_grad)
    for name in tp.local[s1]:
        owner_name, _, leaf = name.rpartition(".")
        setattr(stages[s1].get_submodule(owner_name), leaf, replica)


def _layout(p: Tensor) -> str:
    """A replica's layout, for comparing (across ranks too) and naming: its placements over
    its mesh's dims (a tp lane's as "tp": the stages' lanes are one dim), or "a whole
    tensor"."""
    if not isinstance(p, DTensor):
        return "a whole tensor"
    mesh = p.device_mesh
    names = None if mesh.mesh_dim_names is None else tuple(
        "tp" if is_tp_dim(n) else n for n in mesh.mesh_dim_names
    )  # fmt: skip
    return f"{tuple(p.placements)} over mesh dims {names} {tuple(mesh.shape)}"


def local(t: Tensor) -> Tensor:
    """This rank's shard of ``t`` (``t`` itself unless a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def _replace(
    stages: Mapping[int, nn.Module], earlier: Sequence[int], s: int, tp: TiedParam, p: Tensor
) -> None:
    """Stage ``s``'s uses of ``p`` get one new Parameter on ``p``'s data."""
    before = {id(m) for e in earlier for m in stages[e].modules()}
    replica = nn.Parameter(p.data, requires_grad=p.requires_grad)
    for name in tp.local[s]:
        owner_name, _, leaf = name.rpartition(".")
        owner = stages[s].get_submodule(owner_name)
        if id(owner) in before:
            raise ValueError(
                f"parameter {tp.name!r} is used by stages {earlier[0]} and {s} through one "
                f"shared module ({stages[s].get_submodule(owner_name).__class__.__name__} "
                f"holding {', '.join(map(repr, tp.names))}); each stage needs its own module: "
                "let the layers share the Parameter, not the module, or keep copy_layers=True"
            )
        setattr(owner, leaf, replica)


def laid_out_as(grad: Tensor, param: Tensor, name: str) -> Tensor:
    """``grad`` in ``param``'s layout, so that a tie's gradients add shard by shard: a
    replicated gradient of a vocabulary-sharded table is cut to this rank's rows (exact),
    a partial one reduced (collective over the tp ranks, which all get here in order)."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        if grad.placements != param.placements:
            grad = grad.redistribute(param.device_mesh, param.placements)
        return grad
    if isinstance(grad, DTensor) or isinstance(param, DTensor):
        raise ValueError(
            f"tied parameter {name!r}: a gradient {_layout(grad)} for a parameter "
            f"{_layout(param)}; its stages must lay it out alike"
        )
    return grad


_MESH_DIMS = 3


def _layout_codes(p: Tensor) -> list[int]:
    """A replica's placements as integers, one per mesh dim (for an all-gather): -2 a whole
    tensor, 0 ``Replicate``, 1 ``Partial``, ``10 + d`` ``Shard(d)``, -1 no such mesh dim."""
    if not isinstance(p, DTensor):
        return [-2] * _MESH_DIMS
    codes = [10 + q.dim if isinstance(q, Shard) else int(q.is_partial()) for q in p.placements]
    return (codes + [-1] * _MESH_DIMS)[:_MESH_DIMS]


def _decode(codes: Sequence[int]) -> str:
    if codes and codes[0] == -2:
        return "whole"
    names = {0: "Replicate()", 1: "Partial()"}
    return "(" + ", ".join(names.get(c, f"Shard({c - 10})") for c in codes if c != -1) + ")"


def _like(shard: Tensor, param: Tensor) -> Tensor:
    """``shard`` (this rank's part) laid out as ``param`` is."""
    if not isinstance(param, DTensor):
        return shard
    return DTensor.from_local(
        shard, param.device_mesh, param.placements, run_check=False, shape=param.shape,
        stride=param.stride(),
    )  # fmt: skip


def _mismatch(tp: TiedParam, s0: int, p0: Tensor, s1: int, p1: Tensor) -> str:
    return (
        f"tied parameter {tp.name!r}: stage {s0} holds it as {tuple(p0.shape)} {p0.dtype} on "
        f"{p0.device} but stage {s1} as {tuple(p1.shape)} {p1.dtype} on {p1.device}; every "
        "replica of a tie must have one shape, dtype and device: convert the model before "
        "building the pipeline, not one stage"
    )


def checksum(t: Tensor) -> int:
    """A position-weighted sum of ``t``'s bits: equal tensors give equal sums, cheaply."""
    flat = local(t.detach()).reshape(-1)
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    bits = flat.view(ints).to(torch.int64)
    weights = torch.arange(bits.numel(), dtype=torch.int64, device=bits.device) % 65521 + 1
    return int((bits * weights).sum().item())


@dataclass
class _Group:
    tp: TiedParam
    replicas: dict[int, nn.Parameter]  # this rank's stages -> replica
    ranks: tuple[int, ...]  # pipeline ranks holding it, ascending
    pg: dist.ProcessGroup | None  # their process group (None: one rank holds every stage)


class TiedGroups:
    """This rank's part of every tie: reduction, norm bookkeeping, replica checks.

    Args:
        shared: From :func:`find_shared` (the same on every rank).
        stages: This rank's stage modules (after any layer swap: the executor's).
        placement: ``placement[s]`` is the pipeline rank of stage ``s``.
        rank: This pipeline rank.
        group: The pipeline's process group (None: the world).
        timeout_s: Bound of every collective (fails with :class:`PeerError`).
        check_every: Compare the replicas' checksums across holders at the tail of
            every ``check_every``-th iteration (0: never; :meth:`check` on demand).
        pipelines: The global ranks of every pipeline of a mesh (its dp replicas, see
            :meth:`~zerobubble.parallel.mesh.PipelineMesh.pipelines`); None: ``group`` is
            the only one.

    The constructor is collective over the default group (``dist.new_group`` per tie
    held by several ranks) and checks that the replicas agree in shape and dtype.
    """

    def __init__(
        self,
        shared: Sequence[TiedParam],
        stages: Mapping[int, nn.Module],
        placement: Sequence[int],
        rank: int,
        group: dist.ProcessGroup | None = None,
        *,
        timeout_s: float = 60.0,
        check_every: int = 0,
        pipelines: Sequence[Sequence[int]] | None = None,
    ) -> None:
        if check_every < 0:
            raise ValueError(f"check_every must be >= 0 iterations, got {check_every}")
        self.rank, self.timeout_s, self.check_every = rank, timeout_s, check_every
        self._placement = tuple(placement)
        self.groups: list[_Group] = []
        size = dist.get_world_size(group) if dist.is_initialized() else 1
        # Messages name global ranks; on a mesh (a pipeline subgroup) the pipeline rank too.
        self._global = {r: dist.get_global_rank(group, r) if group else r for r in range(size)}
        subgroup = dist.is_initialized() and size != dist.get_world_size()
        self._local = {g: r for r, g in self._global.items()} if subgroup else {}
        self.progress = Progress.from_env(self._global.get(rank, rank))
        for tp in shared:
            if not tp.tied:
                continue
            ranks = tuple(sorted({placement[s] for s in tp.stages}))
            pg = None
            if len(ranks) > 1:
                # new_group is collective over the default group: every pipeline's, in order.
                mine_by_rank = {r: dist.get_global_rank(group, r) if group else r for r in ranks}
                mine = list(mine_by_rank.values())
                every: list[Sequence[int] | Mapping[int, int]] = [mine_by_rank]
                if pipelines:
                    every = list(pipelines)
                for ranks_of in every:
                    these = [ranks_of[r] for r in ranks]
                    made = dist.new_group(these)
                    if these == mine:
                        pg = made
            replicas = {
                s: stages[s].get_parameter(tp.local[s][0]) for s in tp.stages if s in stages
            }
            if replicas:
                self.groups.append(_Group(tp, replicas, ranks, pg))
        for g in self.groups:
            self._check_meta(g)

    # ---- views ----------------------------------------------------------------------------

    def secondary(self) -> set[int]:
        """ids of this rank's replicas that are not the rank's first of their tie."""
        return {id(p) for g in self.groups for s, p in g.replicas.items() if s != min(g.replicas)}

    def listed_name(self, param: Tensor) -> str | None:
        """The model's first name of ``param`` if it is a replica of a tie, else None."""
        for g in self.groups:
            if any(p is param for p in g.replicas.values()):
                return g.tp.name
        return None

    def norm_params(self, stage_params: Mapping[int, Sequence[Tensor]]) -> dict[int, list[Tensor]]:
        """``stage_params`` without the replicas the global norm must not count twice."""
        later = {id(p) for g in self.groups for s, p in g.replicas.items() if s != g.tp.stages[0]}
        return {s: [p for p in ps if id(p) not in later] for s, ps in stage_params.items()}

    # ---- reduction and checks -------------------------------------------------------------

    def reduce(self, iteration: int) -> None:
        """Sum each tie's gradient over its holder stages in stage order (see the module).

        Every replica of the tie ends with that sum (a copy each); on a rank holding
        several, the ones after the first get ``.grad = None``.
        """
        if self.check_every and iteration % self.check_every == 0:
            self.check(iteration)
        for g in self.groups:
            grads = self._stage_grads(g, iteration)
            present = [local(t) for s in g.tp.stages if (t := grads[s]) is not None]
            total: Tensor | None = None
            if present:  # shard by shard: the replicas of one rank may sit on two tp lanes
                total = present[0]
                for more in present[1:]:
                    total = total + more
            first = min(g.replicas)
            for s, p in g.replicas.items():
                p.grad = None if total is None or s != first else _like(total.clone(), p)

    def check(self, iteration: int) -> None:
        """Raise if a tie's replicas differ across its holder ranks (a checksum each)."""
        for g in self.groups:
            mine = checksum(next(iter(g.replicas.values())))
            if g.pg is None:
                continue
            what = f"comparison of tied parameter {g.tp.name!r}'s replicas at iteration {iteration}"
            dev = next(iter(g.replicas.values())).device  # the tie group's device (NCCL: not CPU)
            sums = self._gather(g, torch.tensor([mine], dtype=torch.int64, device=dev), what)
            if len({int(t.item()) for t in sums}) > 1:
                got = ", ".join(
                    f"rank {self._name(r)}: {int(t.item())}"
                    for r, t in zip(g.ranks, sums, strict=True)
                )
                raise RuntimeError(
                    f"rank {self._name(self.rank)}: the replicas of tied parameter "
                    f"{g.tp.name!r} (stages {list(g.tp.stages)}) differ at iteration "
                    f"{iteration} (checksums {got}): "
                    "something changed one replica outside the optimizer step (an in-place "
                    "write on one rank, or an optimizer missing the replica); load the same "
                    "state on every rank"
                )

    def _stage_grads(self, g: _Group, iteration: int) -> dict[int, Tensor | None]:
        """Every holder stage's gradient of the tie (the other ranks' gathered); under
        tensor parallelism each rank's shard, with this rank's replica's layout."""
        out: dict[int, Tensor | None] = {
            s: None if p.grad is None else laid_out_as(p.grad, p, g.tp.name)
            for s, p in g.replicas.items()
        }
        if g.pg is None:
            return out
        ref = next(iter(g.replicas.values()))
        shard = local(ref)
        rows = torch.zeros(len(g.tp.stages), shard.numel() + 1, dtype=ref.dtype, device=ref.device)
        for i, s in enumerate(g.tp.stages):
            grad = out.get(s)
            if grad is not None:
                rows[i, :-1] = local(grad).reshape(-1)
                rows[i, -1] = 1
        what = f"reduction of tied parameter {g.tp.name!r}'s gradient at iteration {iteration}"
        parts = self._gather(g, rows, what)
        for i, s in enumerate(g.tp.stages):
            if s not in g.replicas:
                row = parts[g.ranks.index(self._placement[s])][i]
                out[s] = _like(row[:-1].view_as(shard), ref) if row[-1] == 1 else None
        return out

    def _check_meta(self, g: _Group) -> None:
        items = sorted(g.replicas.items())
        s0, p0 = items[0]
        for s, p in items[1:]:
            if (p.shape, p.dtype, p.device) != (p0.shape, p0.dtype, p0.device):
                raise ValueError(_mismatch(g.tp, s0, p0, s, p))
            if _layout(p) != _layout(p0):
                raise ValueError(
                    f"tied parameter {g.tp.name!r}: stage {s0} holds it as {_layout(p0)} but "
                    f"stage {s} as {_layout(p)}; give both layers plans that shard it alike"
                )
        if g.pg is None:
            return
        if p0.dim() > _MAX_DIMS:
            raise ValueError(f"tied parameter {g.tp.name!r} has more than {_MAX_DIMS} dims")
        meta = [dtype_code(p0.dtype), p0.dim(), *p0.shape] + [0] * (_MAX_DIMS - p0.dim())
        meta += _layout_codes(p0)  # the tp layout: one on every holder
        what = f"exchange of tied parameter {g.tp.name!r}'s shape, dtype and layout"
        metas = [t.tolist() for t in self._gather(g, torch.tensor(meta, device=p0.device), what)]
        if any(m != metas[0] for m in metas):
            got = "; ".join(
                f"rank {r}: {m[: 2 + m[1]]} {_decode(m[2 + _MAX_DIMS :])}"
                for r, m in zip(g.ranks, metas, strict=True)
            )
            raise ValueError(
                f"tied parameter {g.tp.name!r} has different shapes, dtypes or tensor-parallel "
                f"layouts on its holder ranks ([dtype code, ndim, dims] layout: {got}); build "
                "the same model on every rank, and under tensor parallelism shard the tied "
                "weight alike on every holder stage (e.g. a vocabulary-sharded embedding and a "
                "column-wise LM head)"
            )

    def _gather(self, g: _Group, t: Tensor, what: str) -> list[Tensor]:
        """All-gather ``t`` over the tie's ranks, bounded by the timeout."""
        out = [torch.empty_like(t) for _ in g.ranks]
        start = time.monotonic()
        self.progress.waiting(None)
        try:
            work = dist.all_gather(out, t, group=g.pg, async_op=True)
            assert work is not None
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            took = time.monotonic() - start
            why = (
                f"no completion within the comm timeout of {self.timeout_s:g}s"
                if took >= 0.99 * self.timeout_s
                else f"the transport failed after {took:.1f}s"
            )
            raise PeerError(
                self._global.get(self.rank, self.rank),
                None,
                what,
                f"{why}: {e}",
                group=tuple(self._global.get(r, r) for r in g.ranks),
                local=self._local,
            ) from e
        self.progress.running()
        return out

    def _name(self, rank: int) -> str:
        """A pipeline rank as messages name it: global, with the pipeline rank on a mesh."""
        g = self._global.get(rank, rank)
        return f"{g} (pipeline rank {rank})" if g in self._local else str(g)


def tied_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    target: Tensor,
    m: int,
    bounds: Sequence[range],
) -> list[Tensor]:
    """:func:`~zerobubble.reference.step.reference_step` in the documented tied order.

    The layers are cut at ``bounds`` (e.g. :func:`~zerobubble.parallel.partition.stage_bounds`)
    into stage copies whose tied parameters are separate leaves; plain autograd runs
    microbatch by microbatch, then each tie's stage gradients are summed in stage order.
    Every gradient lands in the ``.grad`` of ``layers``' own parameters (cleared first),
    so their optimizer can step. Returns the unscaled per-microbatch losses.
    """
    model = layers if isinstance(layers, nn.Sequential) else nn.Sequential(*layers)
    keys = tuple(model._modules)
    shared = find_shared(list(model), keys, bounds)
    stages = {s: copy.deepcopy(nn.Sequential(*[model[i] for i in r])) for s, r in enumerate(bounds)}
    xs, targets = split_batch(x, m), split_batch(target, m)
    losses = []
    for xj, tj, scale in zip(xs, targets, loss_scales([len(t) for t in xs]), strict=True):
        h = xj
        for s in sorted(stages):
            h = stages[s](h)
        loss = loss_fn(h, tj)
        (loss * scale).backward()
        losses.append(loss.detach())
    own = dict(model.named_parameters())
    for p in own.values():
        p.grad = None
    tied = {tp.name: tp for tp in shared if tp.tied}
    tied_names = {n for tp in tied.values() for n in tp.names}
    for s, stage in stages.items():
        for name, p in stage.named_parameters():
            i, rest = name.split(".", 1)
            key = f"{keys[bounds[s].start + int(i)]}.{rest}"
            if key not in tied_names and p.grad is not None:
                own[key].grad = p.grad
    for name, tp in tied.items():
        total = None
        for s in tp.stages:
            grad = stages[s].get_parameter(tp.local[s][0]).grad
            if grad is not None:
                total = grad if total is None else total + grad
        own[name].grad = total
    return losses
