"""The global gradient norm across pipeline ranks, bitwise equal to ``clip_grad_norm_``.

``torch.nn.utils.clip_grad_norm_(params)`` computes one norm per gradient
(``torch._foreach_norm`` per (device, dtype) group where foreach is supported,
``vector_norm`` otherwise), stacks them group by group and takes the norm of
that vector. The stacking order changes the rounding, so a pipeline cannot
simply add partial sums of squares. Instead every rank computes the norms of
its own gradients with the same kernel and writes them, exactly (as float64),
into their slots of a vector laid out in model order; once the vector is
complete, any rank rebuilds the list of norms with their dtypes and reduces it
exactly as ``clip_grad_norm_`` does. The same vector, partially filled, is the
prefix state of post-validation.

Tensor parallelism: ``clip_grad_norm_`` over DTensor gradients takes each norm as
DTensor computes it: a tp-sharded gradient's norm is a partial norm over tp (each tp
rank holds the norm of its shard), a replicated one's is replicated (a gradient that is
still a partial sum is reduced first). The stack of these norms and its norm are
DTensor ops too, whose redistribution (the reduction of the partial norms over tp)
decides the rounding. So a tp rank writes the local value of each norm into its slot
and marks the partial ones (:data:`PARTIAL`); :meth:`ParamLayout.total` rebuilds the
norms as DTensors over the tp mesh with those placements and runs the same stack and
norm, so DTensor redistributes them as in ``clip_grad_norm_`` (a collective over tp:
every tp rank of a pipeline rank computes every total its peers compute). The slots
differ between tp ranks; the total does not.

Vector layout (float64): ``[norms (n) | status (n) | flags | header]`` with n
the number of parameters of the whole model; status is :data:`UNSEEN`,
:data:`PRESENT`, :data:`PARTIAL` or :data:`ABSENT` (no gradient, ignored like
``clip_grad_norm_`` ignores it). Ranks fill disjoint slots, so summing vectors (an all-reduce) is
exact. The header (message kind, iteration, vector length) is stamped on every
point-to-point state message and checked on receipt (:meth:`ParamLayout.check`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

from zerobubble.optim.config import OptimConfig
from zerobubble.runtime.p2p.comm import P2P, dtype_code, dtype_of

UNSEEN, PRESENT, ABSENT, PARTIAL = 0.0, 1.0, 2.0, 3.0
"""Slot status: not filled yet; a norm; no gradient; this tp rank's part of a partial norm."""

FLAG_DEFERRED = 0
"""Flag slot: 1 if some rank deferred its step (post-validation prefix)."""
FLAG_REPLAY = 1
"""Flag slot: 1 if the next iteration's speculative work must be replayed (set by the last rank)."""
FLAG_NONFINITE = 2
"""Flag slot: > 0 if some rank saw a non-finite norm among its own gradients (before the ep
merge drops its copy of dense norms, or where a replicated DTensor's local value is its own)."""
FLAG_AGREED = 3
"""Flag slot: 1 once the last rank wrote the total agreed over the replicas (:data:`FLAG_TOTAL`)."""
FLAG_TOTAL = 4
"""Flag slot: the global norm agreed over every replica (NaN when any saw a non-finite one)."""
NUM_FLAGS = 5
HEADER_LEN = 3
"""Header slots after the flags: message kind, iteration, vector length."""


class StateKind(enum.IntEnum):
    """Which post-validation message a state vector is."""

    PREFIX = 1
    """Rank d to d+1 at the tail of an iteration: the norms of stages 0..d."""
    FULL = 2
    """Rank d+1 to d at validation: the complete, final state."""


class Decision(enum.StrEnum):
    """What the optimizer does with one iteration's gradients."""

    STEP = "step"
    """Step with the gradients as they are (no clipping needed)."""
    CLIP = "clip"
    """Scale the gradients by the clip coefficient, then step."""
    SKIP = "skip"
    """Leave parameters and optimizer state untouched (non-finite norm)."""


@dataclass(frozen=True)
class Remote:
    """A slot of a parameter another rank of this pipeline rank holds (an expert of
    another ep rank, :mod:`~zerobubble.optim.ep_norms`): :meth:`ParamLayout.fill`
    leaves it unseen for that rank to fill."""

    dtype: torch.dtype


@dataclass(frozen=True)
class ParamLayout:
    """Slots of every parameter of the model, in model order (stage by stage).

    Attributes:
        dtypes: dtype of each slot's parameter.
        first: ``first[s]``: slot of the first parameter of stage ``s``.
        tp_mesh: The 1-D tensor-parallel mesh the parameters are DTensors on (None
            without tp): norms are taken and totalled as DTensors over it.
    """

    dtypes: tuple[torch.dtype, ...]
    first: Mapping[int, int]
    tp_mesh: DeviceMesh | None = None

    @property
    def size(self) -> int:
        return len(self.dtypes)

    @property
    def vector_len(self) -> int:
        return 2 * self.size + NUM_FLAGS + HEADER_LEN

    @property
    def flags(self) -> int:
        """Index of the first flag slot."""
        return 2 * self.size

    @classmethod
    def exchange(
        cls,
        stage_params: Mapping[int, Sequence[Tensor | Remote]],
        p2p: P2P,
        tp_mesh: DeviceMesh | None = None,
    ) -> ParamLayout:
        """Agree on the layout with every rank (a bounded collective: all ranks call it).

        Raises ValueError naming the stages when the ranks disagree on the tp size.
        """
        tp = 1 if tp_mesh is None else tp_mesh.size()
        mine: list[int] = [tp]
        for s, ps in stage_params.items():
            mine += [s, len(ps), *(dtype_code(p.dtype) for p in ps)]
        stages: dict[int, list[torch.dtype]] = {}
        sizes: dict[int, list[int]] = {}
        for part in p2p.all_gather_ints(mine, "exchange of the parameter layout"):
            sizes.setdefault(part[0], [])
            i = 1
            while i < len(part):
                s, n = part[i], part[i + 1]
                stages[s] = [dtype_of(c) for c in part[i + 2 : i + 2 + n]]
                sizes[part[0]].append(s)
                i += 2 + n
        if len(sizes) > 1:
            seen = "; ".join(f"stages {sorted(ss)}: tp={t}" for t, ss in sorted(sizes.items()))
            raise ValueError(
                f"the pipeline's ranks disagree on the tensor-parallel size ({seen}): the "
                "gradient norm is reduced over tp on every rank; parallelize every stage over "
                "a tp mesh of one size (a stage without tp-sharded parameters still needs its "
                "parameters as DTensors on that mesh, e.g. replicated)"
            )
        dtypes: list[torch.dtype] = []
        first: dict[int, int] = {}
        for s in sorted(stages):
            first[s] = len(dtypes)
            dtypes.extend(stages[s])
        return cls(tuple(dtypes), first, tp_mesh)

    def stamp(self, vec: Tensor, kind: StateKind, iteration: int) -> None:
        """Write the header of a state message."""
        h = self.flags + NUM_FLAGS
        vec[h : h + HEADER_LEN] = torch.tensor(
            [float(kind), float(iteration), float(self.vector_len)], dtype=torch.float64
        )

    def check(self, vec: Tensor, kind: StateKind, iteration: int) -> str | None:
        """Why a received state message is not the expected one (None if it is)."""
        h = self.flags + NUM_FLAGS
        got_kind, got_iter, got_len = vec[h : h + HEADER_LEN].tolist()
        want = (float(kind), float(iteration), float(self.vector_len))
        if (got_kind, got_iter, got_len) == want:
            return None
        name = {float(k): k.name.lower() for k in StateKind}.get(got_kind, f"kind {got_kind:g}")
        return (
            f"expected the {kind.name.lower()} state of iteration {iteration} "
            f"({self.vector_len} slots) but got a message whose header says {name} state of "
            f"iteration {got_iter:g} ({got_len:g} slots)"
        )

    def new_vector(self) -> Tensor:
        return torch.zeros(self.vector_len, dtype=torch.float64)

    def fill(
        self,
        vec: Tensor,
        stage_params: Mapping[int, Sequence[Tensor | Remote]],
        norm_type: float,
        combine: Callable[[Sequence[Tensor], float, Sequence[Tensor]], list[Tensor]] | None = None,
    ) -> None:
        """Write the norms of these parameters' gradients into their slots of ``vec``.

        Sharded gradients (DTensors, FSDP) contribute the norms of their local shards,
        which ``combine(norms, norm_type, grads)`` (collective over the shards' replicas,
        which it reads from the gradients) turns into the norms of the whole gradients;
        with a tp mesh too, the norm of this tp rank's part of them, marked
        :data:`PARTIAL` where the gradient is sharded over tp (FSDP has
        reduced partial sums over tp already). Without ``combine`` and with a tp mesh,
        norms are taken as DTensors (collective over tp for partial-sum gradients; a
        plain gradient as a replicated one) and their local values written, partial
        ones marked :data:`PARTIAL`.
        """
        grads: list[Tensor] = []
        slots: list[int] = []
        for s, params in stage_params.items():
            for i, p in enumerate(params):
                slot = self.first[s] + i
                if isinstance(p, Remote):
                    continue
                if p.grad is None:
                    vec[self.size + slot] = ABSENT
                else:
                    grads.append(p.grad)
                    slots.append(slot)
        if not grads:
            return
        tp = self.tp_mesh
        if combine is not None:
            local = per_tensor_norms([_local(g) for g in grads], norm_type)
            norms = combine(local, norm_type, grads)
            partial = [tp is not None and _sharded_over(g, tp) for g in grads]
        else:
            if tp is not None:
                grads = [_replicated(g, tp) for g in grads]
            norms = per_tensor_norms(grads, norm_type)
            partial = [_is_partial(n) for n in norms]
        index = torch.tensor(slots)
        values = torch.stack([_local(n).detach().to("cpu", torch.float64) for n in norms])
        vec[index] = values
        status = [PARTIAL if p else PRESENT for p in partial]
        vec[index + self.size] = torch.tensor(status, dtype=torch.float64)
        if not bool(torch.isfinite(values).all()):
            vec[self.flags + FLAG_NONFINITE] += 1.0

    def total(
        self, vec: Tensor, norm_type: float, device: torch.device, *, prefix: bool = False
    ) -> Tensor:
        """The global norm, as ``clip_grad_norm_`` would compute it over all gradients.

        With ``prefix``, slots no rank has filled yet count as zero norms (the
        prefix state of post-validation: never above the final norm). With a tp mesh
        the norms are DTensors again (see the module docstring) and the total, the same
        on every tp rank, is returned as a plain tensor (its local value).
        """
        values = vec[: self.size].tolist()
        status = vec[self.size : 2 * self.size].tolist()
        norms = []
        tp = self.tp_mesh
        partial = Replicate() if tp is None else _partial_norm(tp, norm_type)
        for slot, (v, st) in enumerate(zip(values, status, strict=True)):
            if st == ABSENT:
                continue
            if st == UNSEEN and not prefix:
                raise RuntimeError(f"gradient norm slot {slot} was never filled (protocol bug)")
            n = torch.tensor(0.0 if st == UNSEEN else v, dtype=self.dtypes[slot])
            if tp is not None:
                where = partial if st == PARTIAL else Replicate()
                n = DTensor.from_local(n, tp, [where], run_check=False)
            elif st == PARTIAL:
                raise RuntimeError(f"gradient norm slot {slot} is partial over tp without tp")
            norms.append(n)
        if not norms:
            return torch.tensor(0.0, device=device)
        # Stack in the order clip_grad_norm_ does: grouped by dtype, model order inside.
        ordered = [n for _, ts, _ in _group_by_device_and_dtype(norms) for n in ts]
        total = torch.linalg.vector_norm(torch.stack(ordered).to(device), norm_type)
        return total.full_tensor() if isinstance(total, DTensor) else total


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor; a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def _replicated(t: Tensor, mesh: DeviceMesh) -> Tensor:
    """``t`` as a DTensor over ``mesh``: a plain tensor as a replicated one (DTensor's
    foreach kernels do not mix them; the norm of its local value is the same bits)."""
    if isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, [Replicate()], run_check=False)


def _sharded_over(t: Tensor, tp: DeviceMesh) -> bool:
    """Whether ``t`` (an FSDP-sharded gradient) is sharded over ``tp``'s dim of its mesh."""
    if not isinstance(t, DTensor):
        return False
    names, (dim,) = t.device_mesh.mesh_dim_names or (), tp.mesh_dim_names or (None,)
    return dim in names and t.placements[names.index(dim)].is_shard()


def _is_partial(t: Tensor) -> bool:
    return isinstance(t, DTensor) and any(p.is_partial() for p in t.placements)


def _partial_norm(mesh: DeviceMesh, norm_type: float) -> Placement:
    """The placement DTensor gives the norm of a tensor sharded over ``mesh`` (a partial
    norm for this ``norm_type``), asked of DTensor itself (no collective)."""
    probe = DTensor.from_local(torch.zeros(1), mesh, [Shard(0)], run_check=False)
    return torch.linalg.vector_norm(probe, norm_type).placements[0]


def per_tensor_norms(grads: Sequence[Tensor], norm_type: float) -> list[Tensor]:
    """The norm of each gradient, computed by the kernel ``clip_grad_norm_`` picks for it."""
    out: dict[int, Tensor] = {}
    for device, ts, index in _group_by_device_and_dtype(grads):
        norms: Sequence[Tensor]
        if _has_foreach_support(ts, device):
            norms = torch._foreach_norm(ts, norm_type)
        else:
            norms = [torch.linalg.vector_norm(g, norm_type) for g in ts]
        for i, n in zip(index, norms, strict=True):
            out[i] = n
    return [out[i] for i in range(len(grads))]


def _group_by_device_and_dtype(
    tensors: Sequence[Tensor],
) -> list[tuple[torch.device, list[Tensor], list[int]]]:
    """``clip_grad_norm_``'s grouping: per (device, dtype) its tensors in order and their indices.

    torch types the groups as lists of optional tensors; it only returns the tensors given.
    """
    rows: list[list[Tensor | None]] = [list(tensors)]
    out = []
    for (device, _), ([ts], index) in _group_tensors_by_device_and_dtype(rows, True).items():
        present = [t for t in ts if t is not None]
        if len(present) != len(ts):
            raise RuntimeError("torch grouped a missing tensor that it was not given")
        out.append((device, present, index))
    return out


def clip_grads(params: Sequence[Tensor], max_norm: float, total: Tensor) -> None:
    """``clip_grads_with_norm_`` over ``params``, one call per mesh (plain tensors
    together): DTensor's foreach kernels take one mesh and no plain tensors (FSDP's
    ``("dp", "tp")`` parameters beside its ``("dp",)`` ones, or tp DTensors beside plain
    parameters). Every gradient is multiplied by the same coefficient, elementwise, so
    the grouping changes no bit."""
    groups: dict[DeviceMesh | None, list[Tensor]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)


def clip_coefficient(total: Tensor, max_norm: float) -> Tensor:
    """``clip_grads_with_norm_``'s coefficient: ``max_norm / (total + 1e-6)`` clamped to 1."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)


def decide(total: Tensor, config: OptimConfig) -> Decision:
    """The action the synchronous step takes for a global norm ``total``."""
    if config.skip_nonfinite and not bool(torch.isfinite(total)):
        return Decision.SKIP
    if config.max_norm is None:
        return Decision.STEP
    return Decision.STEP if bool(clip_coefficient(total, config.max_norm) == 1.0) else Decision.CLIP


def may_step_early(prefix_total: Tensor, config: OptimConfig) -> bool:
    """Post-validation: step provisionally on a prefix state that neither is non-finite nor
    triggers clipping (if the final norm does not either, the step is already right)."""
    return bool(torch.isfinite(prefix_total)) and decide(prefix_total, config) is Decision.STEP
