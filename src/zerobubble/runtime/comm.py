"""Point-to-point messages between pipeline ranks, with timeouts and clear failures.

Every wait is bounded: a peer that died, or one that never sends, turns into a
:class:`PeerError` naming this rank, the peer and what was being done, instead
of a hang. Pipeline device ``d`` is rank ``d`` of the process group.

Transports: gloo buffers each direction independently, which is the model the
lowered programs are checked against (:func:`~zerobubble.schedule.lowering.validate_lowered`).
NCCL runs both directions of a rank pair on one communicator whose operations
execute in issue order, and a large send does not finish before its receive
runs; a send queued behind a receive can then deadlock (1F1B's steady state
does exactly that). With ``directed=True`` every direction of every pair gets
its own two-rank subgroup, which restores the buffered model; the executor
turns it on for every backend but gloo.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


class PeerError(RuntimeError):
    """Communication with another pipeline rank failed or timed out.

    Attributes:
        rank: This rank.
        peer: The rank it was talking to.
        action: What this rank was doing (an instruction, with its compute).
    """

    def __init__(self, rank: int, peer: int, action: str, cause: str) -> None:
        super().__init__(f"rank {rank}: {action} with peer rank {peer} failed: {cause}")
        self.rank = rank
        self.peer = peer
        self.action = action


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        return cls(tuple(t.shape), t.dtype)

    def __str__(self) -> str:
        return f"{list(self.shape)} {str(self.dtype).removeprefix('torch.')}"


class P2P:
    """Non-blocking sends and receives with bounded waits, for one rank of a group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        device: torch.device,
        timeout_s: float,
        *,
        directed: bool = False,
        pairs: Iterable[tuple[int, int]] = (),
    ) -> None:
        """``pairs`` are the (src, dst) ranks that exchange messages; with ``directed``
        every rank of the default group must pass the same ones (subgroup creation
        is collective)."""
        self.group = group
        self.device = device
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self._lanes: dict[tuple[int, int], tuple[dist.ProcessGroup | None, int]] = {}
        if directed:
            for src, dst in sorted(set(pairs)):
                ranks = [dist.get_global_rank(group, r) if group else r for r in (src, dst)]
                sub = dist.new_group(ranks)
                if self.rank in (src, dst):
                    peer = ranks[1] if self.rank == src else ranks[0]
                    self._lanes[src, dst] = (sub, dist.get_group_rank(sub, peer))

    def _lane(self, src: int, dst: int) -> tuple[dist.ProcessGroup | None, int]:
        """Group and group rank of the peer for messages from ``src`` to ``dst``."""
        peer = dst if src == self.rank else src
        return self._lanes.get((src, dst), (self.group, peer))

    def isend(self, tensor: torch.Tensor, peer: int, action: object) -> dist.Work:
        """Start sending ``tensor`` to ``peer``; the caller keeps it alive until waited.

        ``action`` (here and below) says what this rank was doing; it is turned
        into text only for a :class:`PeerError`, so it may be a lazy description.
        """
        g, p = self._lane(self.rank, peer)
        try:
            return dist.isend(tensor, group=g, group_dst=p)
        except Exception as e:
            raise PeerError(self.rank, peer, str(action), str(e)) from e

    def irecv(self, buffer: torch.Tensor, peer: int, action: object) -> dist.Work:
        """Post a receive from ``peer`` into ``buffer``."""
        g, p = self._lane(peer, self.rank)
        try:
            return dist.irecv(buffer, group=g, group_src=p)
        except Exception as e:
            raise PeerError(self.rank, peer, str(action), str(e)) from e

    def wait(self, work: dist.Work, peer: int, action: object) -> None:
        """Wait for ``work`` at most ``timeout_s`` seconds."""
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            took = time.monotonic() - start
            if took >= 0.99 * self.timeout_s:
                why = f"no completion within the comm timeout of {self.timeout_s:g}s (peer stuck?)"
            else:
                why = f"the transport failed after {took:.1f}s (peer died?)"
            raise PeerError(self.rank, peer, str(action), f"{why}: {e}") from e

    def send_ints(self, values: list[int], peer: int, action: str) -> None:
        """Blocking send of a short list of integers (metadata)."""
        head = torch.tensor([len(values)], dtype=torch.int64, device=self.device)
        body = torch.tensor(values, dtype=torch.int64, device=self.device)
        works = [self.isend(head, peer, action), self.isend(body, peer, action)]
        for w in works:
            self.wait(w, peer, action)

    def recv_ints(self, peer: int, action: str) -> list[int]:
        """Blocking receive of a list sent with :meth:`send_ints`."""
        head = torch.empty(1, dtype=torch.int64, device=self.device)
        self.wait(self.irecv(head, peer, action), peer, action)
        body = torch.empty(int(head.item()), dtype=torch.int64, device=self.device)
        self.wait(self.irecv(body, peer, action), peer, action)
        return body.tolist()


def encode_metas(metas: list[TensorMeta]) -> list[int]:
    """Flatten metadata to integers: per tensor, dtype code, ndim, dims."""
    out: list[int] = []
    for m in metas:
        if m.dtype not in _DTYPES:
            raise TypeError(f"dtype {m.dtype} cannot cross a pipeline boundary")
        out += [_DTYPES.index(m.dtype), len(m.shape), *m.shape]
    return out


def decode_metas(values: list[int]) -> list[TensorMeta]:
    """Inverse of :func:`encode_metas`."""
    metas, i = [], 0
    while i < len(values):
        code, ndim = values[i], values[i + 1]
        metas.append(TensorMeta(tuple(values[i + 2 : i + 2 + ndim]), _DTYPES[code]))
        i += 2 + ndim
    return metas
