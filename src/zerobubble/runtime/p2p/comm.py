"""Point-to-point messages between pipeline ranks, with timeouts and clear failures.

Every wait is bounded: a peer that died, or one that never sends, turns into a
:class:`PeerError` naming this rank, the peer and what was being done, instead
of a hang. Pipeline device ``d`` is rank ``d`` of the process group (a mesh's
``pp`` group, :mod:`zerobubble.parallel.mesh`).

Transports: gloo buffers each direction independently, which is the model the
finished programs are checked against
(:func:`~zerobubble.program.check.validate_program`).
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
Collectives (:meth:`P2P.all_reduce`, :meth:`P2P.all_gather_ints`,
:meth:`P2P.wait_collective` for any group) are bounded by the same timeout and fail with a
:class:`PeerError` naming the group and the ranks that never arrived (:class:`Arrivals`:
a wait longer than :data:`PUBLISH_AFTER_S` says so in the job's store; a rank that gives
up reads the members' entries for up to :data:`SETTLE_S`, and those without one never
reached the collective). Collectives that run inside torch (DTensor's, FSDP's, DCP's)
have no handle to wait on: their owner sets the group's transport timeout
(:func:`set_timeout`, :func:`transport_timeout`) and :meth:`Arrivals.watch` turns the
transport's error into the same message. :func:`exchange_bytes` is a bounded all-gather
over any group whose ranks say they arrived first (the checkpoint's save uses it).

Ranks in messages are global ranks (the job's); on a mesh, whose pipeline is a
subgroup, the pipeline rank follows in parentheses. Every wait marks this rank's
progress (:mod:`zerobubble.runtime.progress`) so that the launcher can name a rank
that stalls.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from zerobubble.runtime.progress import Progress

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
        rank: This rank (its global rank).
        peer: The global rank it was talking to; None for a collective over ``group``.
        action: What this rank was doing (an instruction with its compute, or the
            optimizer operation and its iteration).
        group: For a collective: the global ranks taking part.
        local: ``global rank -> rank in the subgroup`` when the group is a subgroup of the
            job (a mesh's pipeline): the message gives both; empty otherwise.
        dim: What the subgroup is, for the message ("pipeline", or "dp").
        missing: For a collective: the global ranks that never arrived (stalled or dead),
            as far as the job's store tells (:class:`Arrivals`).
    """

    def __init__(
        self,
        rank: int,
        peer: int | None,
        action: str,
        cause: str,
        *,
        group: tuple[int, ...] = (),
        local: Mapping[int, int] | None = None,
        dim: str = "pipeline",
        missing: tuple[int, ...] = (),
    ) -> None:
        local = dict(local or {})
        if peer is None:
            ranks = ", ".join(map(str, group))
            where = f"in the collective over ranks [{ranks}]"
            if local and all(r in local for r in group):
                where += f" ({dim} ranks [{', '.join(str(local[r]) for r in group)}])"
        else:
            where = f"with peer rank {_named(peer, local, dim)}"
        super().__init__(f"rank {_named(rank, local, dim)}: {action} {where} failed: {cause}")
        self.rank = rank
        self.peer = peer
        self.action = action
        self.group = group
        self.local = local
        self.missing = missing


def default_timeout() -> timedelta | None:
    """The timeout the default process group was created with (``init_distributed``'s
    ``timeout_s``); None before it exists."""
    if not dist.is_initialized():
        return None
    return group_timeout(dist.distributed_c10d._get_default_group())


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The transport timeout of ``group``'s backend (gloo or NCCL): how long one of its
    operations may block before it raises."""
    device = torch.device(group._device_types[0])
    return group._get_backend(device).options._timeout


def set_timeout(group: dist.ProcessGroup | None, timeout: timedelta | None) -> None:
    """Give ``group``'s later operations the transport timeout ``timeout`` (None: keep)."""
    if group is not None and timeout is not None:
        group.set_timeout(timeout)


@contextlib.contextmanager
def transport_timeout(group: dist.ProcessGroup | None, seconds: float) -> Iterator[None]:
    """Operations started in the block on ``group`` (None: the world) raise after
    ``seconds`` without progress; the group's timeout is restored afterwards. For the
    collectives torch runs inside a call that has no handle to wait on (DCP's)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    before = group_timeout(pg)
    set_timeout(pg, timedelta(seconds=seconds))
    try:
        yield
    finally:
        set_timeout(pg, before)


def wait_or_raise(
    work: dist.Work, timeout_s: float, who: str, blame: Callable[[str], PeerError]
) -> None:
    """Wait for ``work`` at most ``timeout_s`` seconds; on a timeout or a broken transport
    raise ``blame(why)``, ``why`` telling the two apart (``who``: whom to suspect)."""
    start = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        took = time.monotonic() - start
        if took >= 0.99 * timeout_s:
            why = f"no completion within the comm timeout of {timeout_s:g}s ({who} stuck?)"
        else:
            why = f"the transport failed after {took:.1f}s ({who} died?)"
        raise blame(f"{why}: {e}") from e


PUBLISH_AFTER_S = 0.2
"""A collective wait longer than this says so in the job's store (two store writes)."""
SETTLE_S = 0.6
"""After a failure, how long a rank reads the others' entries before naming the missing."""
_POLL_S = 0.05

RankName = Callable[[int], str]
"""How a message names a global rank: ``"rank 5 (pp 1, dp 0, tp 1)"`` on a mesh."""


def plain_name(rank: int) -> str:
    return f"rank {rank}"


def group_key(group: dist.ProcessGroup | None) -> str:
    """A name of ``group`` that is the same on every member (torch numbers groups in their
    collective creation order); the world is ``"world"``."""
    return "world" if group is None else f"pg{group.group_name}"


def transport_failure(e: BaseException) -> BaseException | None:
    """The communication error in ``e``'s chain (a torch distributed error, or gloo's
    transport timeout or closed connection raised as a RuntimeError), or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, PeerError):
            return None  # already named
        if isinstance(cur, dist.DistError) or "gloo/transport" in str(cur):
            return cur
        cur = cur.__cause__ or cur.__context__
    return None


class Arrivals:
    """This rank's entries in the job's store, and the reading of the others'.

    Args:
        rank: This process's global rank.
        name: How messages name a global rank (its mesh coordinates).
        progress: This rank's progress mark (a rank that gives up dies waiting).
    """

    def __init__(
        self, rank: int, name: RankName = plain_name, progress: Progress | None = None
    ) -> None:
        self.rank = rank
        self.name = name
        self.progress = progress or Progress.from_env(rank)
        self._store: dist.Store | None = None

    def _key(self, group: str, rank: int) -> str:
        return f"zerobubble/waiting/{group}/{rank}"

    def store(self) -> dist.Store | None:
        if self._store is None and dist.is_initialized():
            with contextlib.suppress(Exception):
                self._store = dist.distributed_c10d._get_default_store()
        return self._store

    def _set(self, group: str, value: str) -> None:
        store = self.store()
        if store is not None:
            with contextlib.suppress(Exception):  # naming is best effort, the bound is not
                store.set(self._key(group, self.rank), value)

    def missing(self, group: str, ranks: Sequence[int]) -> list[int] | None:
        """Set this rank's entry (it gave up waiting in ``group``), then read the members'
        for up to :data:`SETTLE_S`: the global ranks that never said they wait there;
        None when the store cannot be read."""
        self._set(group, "1")
        store = self.store()
        if store is None:
            return None
        others = [r for r in ranks if r != self.rank]
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                absent = [r for r in others if not _present(store, self._key(group, r))]
            except Exception:
                return None
            if not absent or time.monotonic() >= deadline:
                return absent
            time.sleep(_POLL_S)

    def wait(
        self,
        work: dist.Work,
        *,
        group: dist.ProcessGroup | None,
        ranks: Sequence[int],
        timeout_s: float,
        error: Callable[[str, tuple[int, ...]], PeerError],
    ) -> None:
        """Wait for ``work`` (a collective over ``group``, global ranks ``ranks``) at most
        ``timeout_s``; on a timeout or a broken transport raise ``error(why, missing)``,
        ``why`` naming the ranks that never arrived."""
        self.progress.waiting(None)
        key = group_key(group)
        start = time.monotonic()
        first = min(timeout_s, PUBLISH_AFTER_S)
        published = False
        try:
            try:
                work.wait(timeout=timedelta(seconds=first))
            except Exception:
                if time.monotonic() - start < 0.99 * first:
                    raise  # the transport failed: not a slow peer
                self._set(key, "1")
                published = True
                work.wait(timeout=timedelta(seconds=max(timeout_s - first, 0.001)))
        except Exception as e:
            took = time.monotonic() - start
            why = (
                f"no completion within the comm timeout of {timeout_s:g}s (a rank of the "
                "group stuck?)"
                if took >= 0.99 * timeout_s
                else f"the transport failed after {took:.1f}s (a rank of the group died?)"
            )
            absent = self.missing(key, ranks)
            raise error(f"{why}{self.naming(absent)}: {e}", tuple(absent or ())) from e
        if published:
            self._set(key, "0")
        self.progress.running()

    def naming(self, absent: Sequence[int] | None) -> str:
        """The clause of a message that names who never arrived (empty when unknown)."""
        if absent is None:
            return "; cannot tell which ranks arrived (the job's store is unreachable)"
        if not absent:
            return "; every rank of the group arrived"
        names = ", ".join(self.name(r) for r in absent)
        verb = "never arrived" if len(absent) == 1 else "never arrived (each)"
        return f"; {names} {verb} (stalled or dead)"

    @contextlib.contextmanager
    def watch(
        self,
        group: dist.ProcessGroup | None,
        action: Callable[[], str],
        *,
        timeout_s: float,
        local: dict[int, int] | None = None,
        dim: str = "pipeline",
    ) -> Iterator[None]:
        """A block whose collectives run inside torch over ``group`` (DTensor's, FSDP's,
        DCP's), bounded by the group's transport timeout (``timeout_s``, set by the
        caller): a communication error raised in it becomes a :class:`PeerError` naming
        the ranks that never arrived; any other error passes unchanged. ``action`` is
        called only then (it describes what was running)."""
        try:
            yield
        except Exception as e:
            cause = transport_failure(e)
            if cause is None:
                raise
            self.progress.waiting(None)
            ranks = tuple(dist.get_process_group_ranks(group) if group else _world())
            absent = self.missing(group_key(group), ranks)
            text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause)
            why = (
                f"no completion within the group's transport timeout of {timeout_s:g}s or a "
                f"broken connection{self.naming(absent)}: {text}"
            )
            raise PeerError(
                self.rank,
                None,
                action(),
                why,
                group=ranks,
                local=local,
                dim=dim,
                missing=tuple(absent or ()),
            ) from e


def _present(store: dist.Store, key: str) -> bool:
    """Whether ``key`` is set to "1" (``check`` first: ``get`` of a missing key blocks)."""
    return bool(store.check([key])) and store.get(key) == b"1"


def _world() -> range:
    return range(dist.get_world_size())


def _named(rank: int, local: Mapping[int, int], dim: str = "pipeline") -> str:
    return f"{rank} ({dim} rank {local[rank]})" if rank in local else str(rank)


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
        dim: str = "pipeline",
        name: RankName = plain_name,
    ) -> None:
        """``pairs`` are the (src, dst, channel) streams that carry messages; with
        ``directed`` every rank of the default group must pass the same ones
        (subgroup creation is collective). ``pipelines``: the global ranks of every
        pipeline running the same program (a mesh's dp replicas, see
        :meth:`~zerobubble.parallel.mesh.PipelineMesh.pipelines`); every rank creates
        the lanes of all of them, in that order, and keeps its own. None: ``group`` is
        the only pipeline. ``dim``: what ``group`` is, as messages name its ranks; ``name``:
        how they name a rank that never arrived at a collective (its mesh coordinates)."""
        self.group = group
        self.device = device
        self.timeout_s = timeout_s
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.global_ranks = tuple(
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.world)
        )
        """Global rank of each rank of ``group`` (messages name these)."""
        self._local = (
            {g: r for r, g in enumerate(self.global_ranks)}
            if self.world != dist.get_world_size()
            else {}
        )
        self.dim = dim
        self.progress = Progress.from_env(self.global_ranks[self.rank])
        self.arrivals = Arrivals(self.global_ranks[self.rank], name, self.progress)
        self._lanes: dict[tuple[int, int, Channel], tuple[dist.ProcessGroup | None, int]] = {}
        if directed:
            mine = [dist.get_global_rank(group, r) if group else r for r in range(self.world)]
            streams = sorted(set(pairs))
            for ranks_of in pipelines or [mine]:
                for src, dst, channel in streams:
                    ranks = [ranks_of[src], ranks_of[dst]]
                    sub = dist.new_group(ranks, timeout=default_timeout())
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
            raise self.error(peer, action, str(e)) from e
        if work is None:  # torch returns None when this rank is outside the lane's group
            raise self.error(peer, action, "not in the send lane's group")
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
            raise self.error(peer, action, str(e)) from e
        if work is None:  # torch returns None when this rank is outside the lane's group
            raise self.error(peer, action, "not in the recv lane's group")
        return work

    def wait(self, work: dist.Work, peer: int, action: object) -> None:
        """Wait for ``work``, a message with ``peer``, at most ``timeout_s`` seconds."""
        self.progress.waiting(self.global_ranks[peer])
        wait_or_raise(work, self.timeout_s, "peer", lambda why: self.error(peer, action, why))
        self.progress.running()

    def wait_collective(
        self, work: dist.Work, action: object, pg: dist.ProcessGroup | None = None
    ) -> None:
        """Wait for ``work``, a collective over ``pg`` (None: this P2P's group), at most
        ``timeout_s`` seconds; a failure names the ranks that never arrived
        (:class:`Arrivals`)."""
        group = self.group if pg is None else pg
        ranks = tuple(dist.get_process_group_ranks(group) if group is not None else _world())

        def error(why: str, missing: tuple[int, ...]) -> PeerError:
            return self.error(None, action, why, group=ranks, missing=missing)

        self.arrivals.wait(work, group=group, ranks=ranks, timeout_s=self.timeout_s, error=error)

    def name(self, rank: int) -> str:
        """Rank ``rank`` of the group as messages name it: its global rank, and on a mesh
        its pipeline rank in parentheses."""
        return _named(self.global_ranks[rank], self._local, self.dim)

    def error(
        self,
        peer: int | None,
        action: object,
        cause: str,
        *,
        group: tuple[int, ...] | None = None,
        missing: tuple[int, ...] = (),
    ) -> PeerError:
        """A :class:`PeerError` of this rank with ``peer`` (a rank of the group; None: a
        collective over the group, or over the global ranks ``group``), in global ranks."""
        return PeerError(
            self.global_ranks[self.rank],
            None if peer is None else self.global_ranks[peer],
            str(action),
            cause,
            group=self.global_ranks if group is None else group,
            local=self._local,
            dim=self.dim,
            missing=missing,
        )

    def all_reduce(self, tensor: torch.Tensor, action: str) -> None:
        """Sum ``tensor`` over the group in place, bounded by the comm timeout. A tensor on
        another device than the group's (the optimizer's CPU norm vector on an NCCL group,
        which takes device tensors only) travels through a copy on the group's device."""
        on_device = tensor if tensor.device == self.device else tensor.to(self.device)
        try:
            work = dist.all_reduce(on_device, group=self.group, async_op=True)
        except Exception as e:
            raise self.error(None, action, str(e)) from e
        assert work is not None
        self.wait_collective(work, action)
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
            raise self.error(None, action, str(e)) from e
        assert work is not None
        self.wait_collective(work, action)


def exchange_bytes(
    data: bytes,
    *,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout_s: float,
    action: str,
    key: str,
    progress: Progress | None = None,
) -> list[bytes]:
    """Every rank's ``data`` (in group rank order), each wait bounded by ``timeout_s``.

    A collective over ``group`` (None: the world) that names who is missing: each rank
    first sets its arrival entry under ``key`` in the job's store (``key`` the same on every
    rank; its n-th use is the n-th call), so that a timeout can tell the ranks that never arrived
    (stalled or dead) from a transport failure. Fails with a :class:`PeerError` whose
    ``peer`` is the one missing rank (None if several or none).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    ranks = tuple(dist.get_global_rank(group, r) if group else r for r in range(world))
    me = ranks[rank]
    progress = progress or Progress(None)
    try:
        store = dist.distributed_c10d._get_default_store()
        # The n-th call with this key on every rank: a key used again gets fresh entries.
        key = f"{key}/{store.add(f'zerobubble/{key}/calls/{me}', 1)}"
        store.set(f"zerobubble/{key}/{me}", "1")
    except Exception as e:
        raise PeerError(me, None, action, f"cannot reach the job's store ({e})", group=ranks) from e

    def gather(t: torch.Tensor, what: str) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(world)]
        start = time.monotonic()
        progress.waiting(None)
        try:
            work = dist.all_gather(out, t, group=group, async_op=True)
            assert work is not None
            work.wait(timeout=timedelta(seconds=timeout_s))
        except Exception as e:
            took = time.monotonic() - start
            missing = _not_arrived(store, key, ranks)
            if missing is None:
                who = "cannot tell which ranks arrived (the job's store is unreachable)"
            elif missing:
                who = f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} never arrived"
                who += " (stalled or dead)"
            else:
                who = "every rank arrived"
            why = (
                f"no completion within {timeout_s:.1f}s"
                if took >= 0.99 * timeout_s
                else f"the transport failed after {took:.1f}s"
            )
            peer = missing[0] if missing and len(missing) == 1 else None
            raise PeerError(me, peer, what, f"{why}; {who}: {e}", group=ranks) from e
        progress.running()
        return out

    n = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [int(t.item()) for t in gather(n, action)]
    body = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    if data:
        body[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = gather(body, action)
    return [bytes(p[:k].cpu().numpy().tobytes()) for p, k in zip(parts, sizes, strict=True)]


def _not_arrived(store: dist.Store, key: str, ranks: Sequence[int]) -> list[int] | None:
    """The global ranks whose arrival entry for ``key`` is missing; None if unknown."""
    try:
        return [r for r in ranks if not store.check([f"zerobubble/{key}/{r}"])]
    except Exception:
        return None


def dtype_code(dtype: torch.dtype) -> int:
    """A dtype as a small integer, for metadata messages."""
    if dtype not in DTYPES:
        raise TypeError(f"dtype {dtype} cannot cross a pipeline boundary")
    return DTYPES.index(dtype)


def dtype_of(code: int) -> torch.dtype:
    """Inverse of :func:`dtype_code`."""
    return DTYPES[code]
