"""DDP-style gradient reduction over the mesh's ``dp`` dim, one async all-reduce per stage.

The executor calls :meth:`GradReducer.launch` at a
:class:`~zerobubble.program.instructions.ReduceGrads` (right after the stage's last
W or BW, see :mod:`zerobubble.program.passes.grad_sync`) and :meth:`GradReducer.wait` at the
program's :class:`~zerobubble.program.instructions.WaitReduce`. A stage's gradients
travel as one flat bucket per dtype (model order inside), summed by
``all_reduce(SUM)`` on the dp group, and are copied back into ``.grad`` once the
wait returns.

Reduction order: with two replicas the sum is ``g_0 + g_1`` per element,
commutative, so every replica gets bitwise the same value, equal to summing the
replicas' gradients in rank order. With more, gloo's ring algorithm adds the
``dp`` terms in an order that depends on the element's position; the result is
still identical on every replica, and differs from the rank-order sum by at most
``(dp - 1) * eps * sum_r |g_r|`` per element (``eps`` the dtype's unit roundoff).

With expert parallelism (a mesh with ``ep > 1``) expert parameters
(:func:`~zerobubble.parallel.ep.is_expert`) are summed over the ``edp_group`` (the
replicas holding the same experts) instead, and not at all when it has one rank.

With context parallelism (a mesh with ``cp > 1``) the cp ranks' gradients are summed first
(``inner_group``, blocking) in cp-rank order: an all-gather of the bucket (``cp`` times its
size, for the moment of the sum), not gloo's all-reduce, whose order depends on the
element, so the sum is the reference's at any cp. Then the dp replicas' (asynchronously,
as without cp; none with dp = 1): at dp = 2, ``(g_00 + g_01 + ...) + (g_10 + g_11 + ...)``
bitwise, the reference's order.

With tensor parallelism a DTensor gradient's local shard is summed (the dp group is the
ranks with the same pp and tp ranks, which hold the same shard).

Every replica must have gradients for the same parameters of a stage (same
model, same step), so the buckets agree in size; a replica that dies or stalls
turns into a :class:`~zerobubble.runtime.p2p.comm.PeerError` naming this rank, the
stage, the dim ``dp`` and the group's ranks, within the comm timeout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zerobubble.parallel.ep import is_expert
from zerobubble.runtime.p2p.comm import P2P, Arrivals, PeerError, RankName, plain_name

if TYPE_CHECKING:
    from zerobubble.parallel.mesh import PipelineMesh

__all__ = ["GradReducer", "sum_in_rank_order", "sum_over_dp", "sum_over_replicas"]


@dataclass
class _Bucket:
    stage: int
    expert: bool
    flat: Tensor
    grads: list[Tensor]
    work: dist.Work | None
    """None: summed already (over cp alone)."""


class GradReducer:
    """Sums stage gradients over a dp group, asynchronously, with bounded waits.

    Args:
        group: The dp group (this rank's data-parallel replicas); None with ``inner_group``
            only (cp without dp).
        stage_params: ``stage -> parameters`` of this rank, in model order.
        timeout_s: Longest the wait for one stage's reduction may block.
        expert_group: The group expert parameters are summed over (the mesh's
            ``edp_group``); None: they are not reduced (each rank holds its experts alone).
        name: How a message names a rank that never arrived (its mesh coordinates).
        inner_group: Summed over first, before ``group`` (the mesh's cp group); None: none.
        dim: The dim ``group`` is, for messages.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        stage_params: Mapping[int, Sequence[nn.Parameter]],
        timeout_s: float,
        expert_group: dist.ProcessGroup | None = None,
        name: RankName = plain_name,
        inner_group: dist.ProcessGroup | None = None,
        dim: str = "dp",
    ) -> None:
        self.group = group
        self.inner_group = inner_group
        self.dim = dim
        self.expert_group = expert_group
        self.stage_params = {s: list(ps) for s, ps in stage_params.items()}
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.ranks = () if group is None else tuple(dist.get_process_group_ranks(group))
        self.expert_ranks = (
            () if expert_group is None else tuple(dist.get_process_group_ranks(expert_group))
        )
        self.arrivals = Arrivals(self.rank, name)
        self._in_flight: list[_Bucket] = []

    @classmethod
    def of_mesh(
        cls, mesh: PipelineMesh, params: Mapping[int, Sequence[nn.Parameter]], timeout_s: float
    ) -> GradReducer:
        """The mesh's reduction: over cp first (in cp-rank order), then over dp; the experts'
        over edp."""
        return cls(
            mesh.dp_group,
            params,
            timeout_s,
            expert_group=mesh.edp_group,
            name=mesh.spec.name,
            inner_group=mesh.cp_group,
            dim="dp" if mesh.dp_group is not None else "cp",
        )

    def launch(self, stage: int, iteration: int) -> None:
        """Start summing ``stage``'s gradients over dp (one bucket per dtype)."""
        by_dtype: dict[tuple[bool, torch.dtype, torch.device], list[Tensor]] = {}
        for p in self.stage_params[stage]:
            g = p.grad
            expert = is_expert(p)
            if g is None or (expert and self.expert_group is None):
                continue
            g = _local(g)
            by_dtype.setdefault((expert, g.dtype, g.device), []).append(g)
        for (expert, _, _), gs in by_dtype.items():
            flat = torch.cat([g.reshape(-1) for g in gs])
            what = self._what(stage, iteration, expert)
            group = self.expert_group if expert else self.group
            ranks = self.expert_ranks if expert else self.ranks
            work = None
            try:
                if self.inner_group is not None and not expert:
                    flat = sum_in_rank_order(flat, self.inner_group)
                if group is not None:
                    work = dist.all_reduce(flat, group=group, async_op=True)
                    assert work is not None
            except Exception as e:
                raise PeerError(self.rank, None, what, str(e), group=ranks) from e
            self._in_flight.append(_Bucket(stage, expert, flat, gs, work))

    def wait(self, iteration: int) -> None:
        """Wait for every launched reduction and write the sums back into ``.grad``."""
        buckets, self._in_flight = self._in_flight, []
        for b in buckets:
            what = self._what(b.stage, iteration, b.expert)
            ranks = self.expert_ranks if b.expert else self.ranks

            def blame(
                why: str, missing: tuple[int, ...], what: str = what, ranks: tuple = ranks
            ) -> PeerError:
                return PeerError(self.rank, None, what, why, group=ranks, missing=missing)

            group = self.expert_group if b.expert else self.group
            if b.work is not None:
                self.arrivals.wait(
                    b.work, group=group, ranks=ranks, timeout_s=self.timeout_s, error=blame
                )
            offset = 0
            for g in b.grads:
                n = g.numel()
                g.copy_(b.flat[offset : offset + n].view_as(g))
                offset += n

    def _what(self, stage: int, iteration: int, expert: bool = False) -> str:
        if expert:
            return (
                f"all-reduce of stage {stage}'s expert gradients over dim 'edp' (mesh edp "
                f"group, iteration {iteration})"
            )
        return (
            f"all-reduce of stage {stage}'s gradients over dim '{self.dim}' (mesh "
            f"{self.dim} group, iteration {iteration})"
        )


def sum_over_replicas(
    mesh: PipelineMesh | None, p2p: P2P, iteration: int, n: Tensor | int
) -> Tensor | int:
    """``n`` (a batch size or count) summed over the replicas sharing the step's batch: over
    cp first (a sequence's chunks), then over dp."""
    if mesh is None:
        return n
    if mesh.cp_group is not None:
        n = sum_over_dp(mesh.cp_group, p2p, iteration, n, dim="cp")
    return sum_over_dp(mesh.dp_group, p2p, iteration, n)


def sum_in_rank_order(flat: Tensor, group: dist.ProcessGroup) -> Tensor:
    """``flat`` summed over ``group`` in rank order, ``((x_0 + x_1) + x_2) + ...`` (the
    mesh's cp reduction; the cp x tp reference sums so too). Collective over ``group``."""
    parts = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, flat, group=group)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _local(g: Tensor) -> Tensor:
    """What a replica sums of a gradient: a DTensor's local shard (the dp replicas of one tp
    rank hold the same shard, or the same partial sum), written back in place."""
    if not isinstance(g, DTensor):
        return g
    with torch.no_grad():
        return g.to_local()


def sum_over_dp(
    dp_group: dist.ProcessGroup | None,
    p2p: P2P,
    iteration: int,
    n: Tensor | int,
    of: str = "batch size or count",
    dim: str = "dp",
) -> Tensor | int:
    """``n`` summed over the dp replicas (a step's global batch size or count, which the
    losses are weighted by, or what ``of`` names); the ranks of all replicas call it
    together. The wait is bounded by ``p2p``'s timeout, and its message names the dp ranks
    and ``of``."""
    if dp_group is None:
        return n
    t = torch.as_tensor(n, device=p2p.device).clone()
    what = f"all-reduce over dim '{dim}' of iteration {iteration}'s {of}"
    work = dist.all_reduce(t, group=dp_group, async_op=True)
    assert work is not None
    p2p.wait_collective(work, what, dp_group)
    return t if isinstance(n, Tensor) else int(t.item())
