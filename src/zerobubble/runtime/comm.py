"""Point-to-point messages between pipeline ranks, with timeouts and clear failures.

Every wait is bounded: a peer that died, or one that never sends, turns into a
:class:`PeerError` naming this rank, the peer and what was being done, instead
of a hang. Pipeline device ``d`` is rank ``d`` of the process group (a mesh's
``pp`` group, :mod:`zerobubble.runtime.mesh`).

Transports: gloo buffers each direction independently, which is the model the
lowered programs are checked against (:func:`~zerobubble.schedule.lowering.validate_lowered`).
NCCL runs both directions of a rank pair on one communicator whose operations
execute in issue order, and a large send does not finish before its receive
runs; a send queued behind a receive can then deadlock (1F1B's steady state
does exactly that). With ``directed=True`` every direction of every pair gets
its own two-rank subgroup, which restores the buffered model; the executor
turns it on for every backend but gloo.

Channels: the pipeline's messages, the announcements of changed layouts and the
optimizer's state messages travel on separate :class:`Channel` streams (a gloo
tag; with ``directed`` their own subgroups), so a receive posted on one can never
match a message of another.
Collectives (:meth:`P2P.all_reduce`, :meth:`P2P.all_gather_ints`) are bounded by
the same timeout and fail with a :class:`PeerError` naming the group.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DTYPES = (
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
"""The dtypes a tensor crossing a stage boundary may have (their index is the wire code)."""


class Channel(enum.IntEnum):
    """Independent message streams between two ranks (the value is the gloo tag)."""

    PIPELINE = 0
    """Activations and input gradients (the lowered programs' messages)."""
    OPTIM = 1
    """The optimizer's gradient-norm state messages (post-validation)."""
    LAYOUT = 2
    """A boundary value whose layout changed: the new layout, then its frame. Apart from
    the pipeline stream, so that they cannot match a receive posted ahead there."""


class PeerError(RuntimeError):
    """Communication with another pipeline rank failed or timed out.

    Attributes:
        rank: This rank.
        peer: The rank it was talking to; None for a collective over ``group``.
        action: What this rank was doing (an instruction with its compute, or the
            optimizer operation and its iteration).
        group: For a collective: the ranks taking part.
    """

    def __init__(
        self,
        rank: int,
        peer: int | None,
        action: str,
        cause: str,
        *,
        group: tuple[int, ...] = (),
    ) -> None:
        if peer is None:
            ranks = ", ".join(map(str, group))
            where = f"in the collective over ranks [{ranks}]"
        else:
            where = f"with peer rank {peer}"
        super().__init__(f"rank {rank}: {action} {where} failed: {cause}")
        self.rank = rank
        self.peer = peer
        self.action = action
        self.group = group


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
        pairs: Iterable[tuple[int, int, Channel]] = (),
        pipelines: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """``pairs`` are the (src, dst, channel) streams that carry messages; with
        ``directed`` every rank of the default group must pass the same ones
        (subgroup creation is collective). ``pipelines``: the global ranks of every
        pipeline running the same program (a mesh's dp replicas, see
        :meth:`~zerobubble.runtime.mesh.PipelineMesh.pipelines`); every rank creates
        the lanes of all of them, in that order, and keeps its own. None: ``group`` is
        the only pipeline."""
        self.group = group
        self.device = device
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._lanes: dict[tuple[int, int, Channel], tuple[dist.ProcessGroup | None, int]] = {}
        if directed:
            mine = [dist.get_global_rank(group, r) if group else r for r in range(self.world)]
            streams = sorted(set(pairs))
            for ranks_of in pipelines or [mine]:
                for src, dst, channel in streams:
                    ranks = [ranks_of[src], ranks_of[dst]]
                    sub = dist.new_group(ranks)
                    if list(ranks_of) == mine and self.rank in (src, dst):
                        peer = ranks[1] if self.rank == src else ranks[0]
                        lane = (sub, dist.get_group_rank(sub, peer))
                        self._lanes[src, dst, Channel(channel)] = lane

    def _lane(self, src: int, dst: int, channel: Channel) -> tuple[dist.ProcessGroup | None, int]:
        """Group and group rank of the peer for messages from ``src`` to ``dst``."""
        peer = dst if src == self.rank else src
        return self._lanes.get((src, dst, channel), (self.group, peer))

    def isend(
        self,
        tensor: torch.Tensor,
        peer: int,
        action: object,
        channel: Channel = Channel.PIPELINE,
    ) -> dist.Work:
        """Start sending ``tensor`` to ``peer``; the caller keeps it alive until waited.

        ``action`` (here and below) says what this rank was doing; it is turned
        into text only for a :class:`PeerError`, so it may be a lazy description.
        """
        g, p = self._lane(self.rank, peer, channel)
        try:
            work = dist.isend(tensor, group=g, group_dst=p, tag=int(channel))
        except Exception as e:
            raise PeerError(self.rank, peer, str(action), str(e)) from e
        if work is None:  # torch returns None when this rank is outside the lane's group
            raise PeerError(self.rank, peer, str(action), "not in the send lane's group")
        return work

    def irecv(
        self,
        buffer: torch.Tensor,
        peer: int,
        action: object,
        channel: Channel = Channel.PIPELINE,
    ) -> dist.Work:
        """Post a receive from ``peer`` into ``buffer``."""
        g, p = self._lane(peer, self.rank, channel)
        try:
            work = dist.irecv(buffer, group=g, group_src=p, tag=int(channel))
        except Exception as e:
            raise PeerError(self.rank, peer, str(action), str(e)) from e
        if work is None:  # torch returns None when this rank is outside the lane's group
            raise PeerError(self.rank, peer, str(action), "not in the recv lane's group")
        return work

    def wait(self, work: dist.Work, peer: int | None, action: object) -> None:
        """Wait for ``work`` at most ``timeout_s`` seconds (``peer`` None: a collective)."""
        start = time.monotonic()
        try:
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:
            took = time.monotonic() - start
            who = "peer" if peer is not None else "a rank of the group"
            if took >= 0.99 * self.timeout_s:
                why = f"no completion within the comm timeout of {self.timeout_s:g}s ({who} stuck?)"
            else:
                why = f"the transport failed after {took:.1f}s ({who} died?)"
            raise PeerError(self.rank, peer, str(action), f"{why}: {e}", group=self._ranks()) from e

    def _ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world))

    def all_reduce(self, tensor: torch.Tensor, action: str) -> None:
        """Sum ``tensor`` over the group in place, bounded by the comm timeout. A tensor on
        another device than the group's (the optimizer's CPU norm vector on an NCCL group,
        which takes device tensors only) travels through a copy on the group's device."""
        on_device = tensor if tensor.device == self.device else tensor.to(self.device)
        try:
            work = dist.all_reduce(on_device, group=self.group, async_op=True)
        except Exception as e:
            raise PeerError(self.rank, None, action, str(e), group=self._ranks()) from e
        assert work is not None
        self.wait(work, None, action)
        if on_device is not tensor:
            tensor.copy_(on_device)

    def all_gather_ints(self, values: list[int], action: str) -> list[list[int]]:
        """Every rank's list of integers, bounded by the comm timeout (lengths may differ)."""
        n = torch.tensor([len(values)], dtype=torch.int64, device=self.device)
        sizes = [torch.empty_like(n) for _ in range(self.world)]
        self._gather(sizes, n, f"{action} (lengths)")
        longest = max(int(t.item()) for t in sizes)
        body = torch.zeros(longest, dtype=torch.int64, device=self.device)
        body[: len(values)] = torch.tensor(values, dtype=torch.int64)
        parts = [torch.empty_like(body) for _ in range(self.world)]
        self._gather(parts, body, action)
        return [p[: int(k.item())].tolist() for p, k in zip(parts, sizes, strict=True)]

    def _gather(self, out: list[torch.Tensor], t: torch.Tensor, action: str) -> None:
        try:
            work = dist.all_gather(out, t, group=self.group, async_op=True)
        except Exception as e:
            raise PeerError(self.rank, None, action, str(e), group=self._ranks()) from e
        assert work is not None
        self.wait(work, None, action)


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a small integer, for metadata messages."""
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot cross a pipeline boundary")
    return DTYPES.index(dtype)


def dtype_of(code: int) -> torch.dtype:
    """Inverse of :func:`dtype_code`."""
    return DTYPES[code]
