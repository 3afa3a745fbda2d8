"""The replica check: data-parallel replicas hold the same parameters, or the run stops.

Replicas stay identical because they sum the same gradients and take the same decision on
every step (:meth:`~zerobubble.optim.trainer._GlobalNorm.agree`). What bypasses both (a
parameter written on one rank, memory that flips a bit) would go unnoticed for the rest of
the run, so :class:`ReplicaCheck` compares a checksum of each stage's parameters over the
dp replicas every ``OptimConfig.replica_check_every`` steps: two sums of the parameters'
bytes read as 64-bit words (:func:`checksum`, over the tensors' own storage, no copy), then
one bounded all-gather of those integers. Dense parameters are compared over
the whole dp group, expert shards among the replicas of the same ep rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from zerobubble.executor import PipelineExecutor
from zerobubble.parallel.ep import is_expert
from zerobubble.parallel.mesh import PipelineMesh

__all__ = ["ReplicaCheck", "ReplicaDivergence", "checksum"]


class ReplicaDivergence(RuntimeError):
    """Data-parallel replicas hold different parameters.

    Attributes:
        iteration: The committed iteration after which they were compared.
        stage: The first stage whose parameters differ.
        ranks: The global ranks of the replicas that differ from the reference replica.
    """

    def __init__(self, message: str, *, iteration: int, stage: int, ranks: tuple[int, ...]):
        super().__init__(message)
        self.iteration = iteration
        self.stage = stage
        self.ranks = ranks


def checksum(params: Sequence[Tensor]) -> tuple[int, int]:
    """Two sums, modulo 2**64 (as int64), of the parameters' bytes read as 64-bit words (this rank's
    shard of a DTensor; a last partial word byte by byte): of all words, and of every other
    word. A change of any byte changes the first; two words trading places the second."""
    total = even = 0
    with torch.no_grad():
        for p in params:
            t = p.to_local() if isinstance(p, DTensor) else p
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            if b.data_ptr() % 8:  # a view at an offset that 64-bit words cannot start at
                b = b.clone()
            whole = b.numel() // 8 * 8
            words = b[:whole].view(torch.int64)
            total += int(words.sum()) + int(torch.sum(b[whole:], dtype=torch.int64))
            even += int(words[::2].sum())
    return _int64(total), _int64(even)


def _int64(x: int) -> int:
    """``x`` modulo 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    return (x + 2**63) % 2**64 - 2**63


class ReplicaCheck:
    """Compares this rank's stages with their dp replicas (see the module docstring)."""

    def __init__(
        self,
        executor: PipelineExecutor,
        mesh: PipelineMesh,
        stage_params: Mapping[int, Sequence[Tensor]],
    ) -> None:
        assert mesh.dp_group is not None
        self.pipe = executor
        self.mesh = mesh
        self.group = mesh.dp_group
        self.stage_params = {s: list(ps) for s, ps in sorted(stage_params.items())}
        self.ranks = tuple(dist.get_process_group_ranks(self.group))

    @classmethod
    def of(
        cls, executor: PipelineExecutor, stage_params: Mapping[int, Sequence[Tensor]]
    ) -> ReplicaCheck | None:
        """The check of ``executor``'s rank; None without dp replicas, or under FSDP (each
        replica holds another shard)."""
        mesh = executor.mesh
        if mesh is None or mesh.dp_group is None or executor.sharding is not None:
            return None
        return cls(executor, mesh, stage_params)

    def check(self, iteration: int) -> None:
        """Gather every replica's checksums (collective over dp, bounded) and raise
        :class:`ReplicaDivergence` naming the replica that differs."""
        mine: list[int] = []
        for params in self.stage_params.values():
            dense = [p for p in params if not is_expert(p)]
            experts = [p for p in params if is_expert(p)]
            mine += [*checksum(dense), *checksum(experts)]
        t = torch.tensor(mine, dtype=torch.int64, device=self.pipe.device)
        parts = [torch.empty_like(t) for _ in self.ranks]
        what = f"all-gather over dim 'dp' of the parameter checksums after iteration {iteration}"
        work = dist.all_gather(parts, t, group=self.group, async_op=True)
        assert work is not None
        self.pipe.p2p.wait_collective(work, what, self.group)
        sums = dict(zip(self.ranks, (p.tolist() for p in parts), strict=True))
        spec = self.mesh.spec
        for i, stage in enumerate(self.stage_params):
            for kind, at in (("dense parameters", 4 * i), ("expert shards", 4 * i + 2)):
                # Who must agree: every dp replica on dense parameters; on expert shards, the
                # replicas of one ep rank (the others hold other experts).
                holders: dict[int, list[int]] = {}
                for r in self.ranks:
                    key = spec.coordinates(r).get("ep", 0) if at % 4 else 0
                    holders.setdefault(key, []).append(r)
                for peers in holders.values():
                    ref = peers[0]
                    differ = [r for r in peers if sums[r][at : at + 2] != sums[ref][at : at + 2]]
                    if differ:
                        self._raise(iteration, stage, kind, ref, differ, sums, at)

    def _raise(
        self,
        iteration: int,
        stage: int,
        kind: str,
        ref: int,
        differ: list[int],
        sums: Mapping[int, list[int]],
        at: int,
    ) -> None:
        name = self.mesh.spec.name
        me = dist.get_rank()
        them = "; ".join(f"{name(r)} holds {sums[r][at : at + 2]}" for r in differ)
        raise ReplicaDivergence(
            f"{name(me)}: replica check after iteration {iteration}: stage {stage}'s {kind} "
            f"differ between the data-parallel replicas: {name(ref)} holds checksums "
            f"{sums[ref][at : at + 2]}, but {them}; the replicas diverged (a parameter or "
            "optimizer state changed on one of them outside the synchronised step): restore "
            "the newest checkpoint",
            iteration=iteration,
            stage=stage,
            ranks=tuple(differ),
        )
