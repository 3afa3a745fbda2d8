"""How a rank's parameter relates to the model's whole tensor: the one statement that the
reductions, the gradient norm, the state dicts and the checkpoints read.

A parameter is one of three things:

* **Whole**: the model's tensor itself (replicated over dp, ep and tp where those exist).
* **A DTensor** (tensor parallelism, FSDP): torch's own placements say which part this rank
  holds; nothing is added here.
* **An expert shard** (:class:`ExpertShard`, set by :func:`mark_expert`): this ep rank's
  part of one MoE layer's experts. Its gradient is summed over the ``edp`` group, not
  ``dp`` (:func:`is_expert`); the gradient norm widens the layer's run of parameters to
  every ep rank's (:attr:`ExpertShard.run`); and where the experts are one stacked
  ``(E, ...)`` tensor (Hugging Face's), :attr:`ExpertShard.rows` says which rows the
  parameter holds under the whole tensor's name. A per-expert module's parameter (our
  ``MoE``'s ``experts.<e>``) has no rows: its name carries the global expert index.

Computation keeps expert shards as plain local tensors (the all-to-all and the B/W split
run on them bitwise as on the unsharded model). Storage sees the whole tensor:
:func:`global_view` gives a stacked shard as a DTensor ``Shard(0)`` over the ep mesh, so
a checkpoint stores one ``(E, ...)`` entry under the model's name, as it stores tensor
parallel and FSDP DTensors, and ``full_tensor()`` gathers it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

__all__ = [
    "ExpertShard",
    "expert_run",
    "expert_shard_of",
    "global_view",
    "is_expert",
    "mark_expert",
]

_ATTR = "_zb_shard"


@dataclass(frozen=True)
class ExpertShard:
    """This ep rank's part of one MoE layer's experts.

    Attributes:
        run: Tells apart the MoE layers of a stage: the parameters of one layer's local
            experts are consecutive in the stage and share a run.
        rows: ``(start, stop, num_experts)``: the parameter is rows ``[start, stop)`` of a
            whole ``(num_experts, ...)`` tensor kept under the same name (the ep peers hold
            the other rows); None for one expert's own parameter.
    """

    run: int
    rows: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        if self.rows is not None:
            start, stop, total = self.rows
            if not 0 <= start < stop <= total:
                raise ValueError(f"expert rows [{start}, {stop}) of {total}: not a row block")


def mark_expert(param: Tensor, run: int, rows: tuple[int, int, int] | None = None) -> None:
    """Mark ``param`` as an expert shard (see :class:`ExpertShard`)."""
    setattr(param, _ATTR, ExpertShard(int(run), None if rows is None else tuple(rows)))  # type: ignore[arg-type]


def expert_shard_of(param: Tensor) -> ExpertShard | None:
    """The :class:`ExpertShard` :func:`mark_expert` gave ``param``; None: not an expert."""
    return getattr(param, _ATTR, None)


def is_expert(param: Tensor) -> bool:
    """Whether ``param`` is an expert shard: summed over ``edp_group``, not ``dp_group``."""
    return expert_shard_of(param) is not None


def expert_run(param: Tensor) -> int | None:
    """The run of the MoE layer whose expert ``param`` is (None: not an expert)."""
    shard = expert_shard_of(param)
    return None if shard is None else shard.run


def global_view(
    t: Tensor, ep_mesh: DeviceMesh | None, *, like: Tensor | None = None, name: str = "an expert"
) -> Tensor:
    """``t`` as the model's whole tensor is stored, sharded as parameter ``like`` (default:
    ``t`` itself) is: rows of a stacked expert tensor as a DTensor ``Shard(0)`` over
    ``ep_mesh`` (the 1-D ``ep`` mesh), sharing ``t``'s storage so that a load into it fills
    ``t``; anything else (a whole tensor, a DTensor, a tensor of another shape than the
    parameter's, e.g. an optimizer's step count) as it is. Rows that FSDP also shards over
    edp (the parameter is a DTensor) are refused, naming the tensor (``name``): their
    two-level view is not built."""
    param = t if like is None else like
    shard = expert_shard_of(param)
    if shard is None or shard.rows is None:
        return t
    if isinstance(param, DTensor):
        start, stop, total = shard.rows
        raise ValueError(
            f"{name} tensor holding rows [{start}, {stop}) of {total} experts is also "
            f"sharded by FSDP over its edp replicas (mesh {param.device_mesh.mesh_dim_names}): "
            "the whole (E, ...) view over ep and edp is not built, so it cannot be stored or "
            "gathered whole; build the mesh with dp == ep (edp = 1: FSDP leaves the experts "
            "whole on their ep rank) or fsdp=False"
        )
    if isinstance(t, DTensor):
        return t
    start, stop, total = shard.rows
    if like is not None and t.shape != like.shape:
        return t
    if ep_mesh is None or ep_mesh.size() * (stop - start) != total:
        raise ValueError(
            f"an expert tensor holding rows [{start}, {stop}) of {total} is stored whole over "
            f"an ep mesh of size {total // (stop - start)}; pass the mesh the pipeline was "
            "built with"
        )
    return DTensor.from_local(t, ep_mesh, [Shard(0)], run_check=False)
