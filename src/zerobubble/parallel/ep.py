"""Expert parallelism's communication: the ep group a MoE layer shards over, the
token all-to-all, and the mark that routes expert gradients to the right reduction.

The all-to-all is one function, :func:`start_all_to_all`, returning the output and
its :class:`torch.distributed.Work`; :class:`AllToAll` (the autograd-aware,
synchronous form) waits on it at once. Communication hides behind computation one level
up: an overlapped F&B pair (:mod:`~zerobubble.runtime.overlap`) runs one microbatch's
forward beside another's backward, each waiting for its own all-to-all on its own lane
(:attr:`ExpertGroup.group`, :attr:`ExpertGroup.backward`) while the other computes.

A forward's all-to-alls run on :attr:`ExpertGroup.group`, save in activation recompute's
replay inside B (:func:`~zerobubble.runtime.recompute.replaying`), which runs on the
backward's thread and so goes on the backwards' lane (:attr:`ExpertGroup.forward_group`).
A thread that holds the rank's generator lock (a forward, a replay that draws) gives it up
while it waits for an all-to-all (:func:`~zerobubble.runtime.rng.yield_generators`): its
ep peer's forward may be waiting, holding its own lock, for this rank's other half.

Every wait is bounded by the pipeline's comm timeout (:meth:`ExpertGroup.wait`): an ep
peer that dies or stalls becomes a :class:`~zerobubble.runtime.p2p.comm.PeerError` naming
the all-to-all, dim ``ep`` and the group's ranks.

Which group a gradient is summed over follows the parameter's shard record
(:mod:`~zerobubble.parallel.shards`, re-exported here: :func:`is_expert`): expert
parameters over the mesh's ``edp_group`` (the dp ranks holding the same experts), every
other parameter over ``dp_group``.

What the profiler may know of a stage's experts is here too, so that it imports no model:
a module that exchanges tokens for its experts holds its :class:`ExpertGroup` as attribute
``ep`` (:func:`expert_groups` finds them), and each group times its waits while asked to
(:class:`WaitLog`, :func:`timing_waits`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobubble.parallel.shards import expert_run, is_expert, mark_expert
from zerobubble.runtime.p2p.comm import Arrivals, PeerError
from zerobubble.runtime.recompute import replaying
from zerobubble.runtime.rng import yield_generators

if TYPE_CHECKING:
    from zerobubble.parallel.mesh import PipelineMesh

__all__ = [
    "AllToAll",
    "ExpertGroup",
    "LocalGroup",
    "Turns",
    "WaitLog",
    "all_to_all",
    "exchange_counts",
    "expert_groups",
    "expert_run",
    "is_expert",
    "mark_expert",
    "start_all_to_all",
    "timing_waits",
]


class Turns:
    """The threads of a threaded reference, one per replica, run one at a time: a thread
    keeps the turn until it waits at a :class:`LocalGroup` exchange (or ends), then hands it
    to the next thread that can run, in replica order from its own. The order in which
    the threads' ops run is then a function of the program alone, the same in every
    process: the collectives the threads issue on a process group they share (a tensor-
    parallel mesh, each process one tp rank) meet in the same order on every rank.
    """

    def __init__(self, size: int, timeout_s: float = 120.0) -> None:
        self.size = size
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._turn: int | None = 0
        self._blocked: set[int] = set()
        self._done: set[int] = set()
        self._failed = False

    def begin(self, thread: int) -> None:
        """Wait for ``thread``'s first turn (thread 0 has it)."""
        with self._cond:
            self._wait(thread)

    def end(self, thread: int) -> None:
        """``thread`` is done: the turn goes on."""
        with self._cond:
            self._done.add(thread)
            self._pass(thread)

    def abort(self) -> None:
        """A thread failed: every wait raises instead of hanging."""
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def block(self, thread: int) -> None:
        """``thread`` waits at an exchange: hand the turn on, and wait until the exchange is
        complete (:meth:`release`) and the turn is back."""
        with self._cond:
            self._blocked.add(thread)
            self._pass(thread)
            self._wait(thread)

    def release(self, threads: range) -> None:
        """The exchange ``threads`` wait at is complete: they may run again, each when the
        turn reaches it."""
        with self._cond:
            self._blocked.difference_update(threads)

    def _pass(self, thread: int) -> None:
        order = [(thread + i) % self.size for i in range(1, self.size + 1)]
        ready = [t for t in order if t not in self._done and t not in self._blocked]
        self._turn = ready[0] if ready else None
        if self._turn is None and len(self._done) < self.size:
            self._failed = True  # every thread left waits at an exchange that cannot complete
        self._cond.notify_all()

    def _wait(self, thread: int) -> None:
        ok = self._cond.wait_for(lambda: self._turn == thread or self._failed, self.timeout_s)
        if self._failed or not ok:
            self._failed = True
            self._cond.notify_all()
            raise RuntimeError(
                f"threaded reference: replica {thread} cannot go on (another replica failed, "
                f"or its exchange was not met within {self.timeout_s} s)"
            )


class LocalGroup:
    """An in-process stand-in for an ep process group: the threads of replicas ``first,
    ..., first + size - 1`` of a :class:`Turns` meeting at an exchange
    (:func:`~zerobubble.reference.ep.threaded_ep_reference_step`).

    :func:`exchange_counts` and :func:`all_to_all` over an :class:`ExpertGroup` whose
    ``group`` is one hand the same blocks between threads that the process group hands
    between processes: each rank receives its blocks in source-rank order.
    """

    def __init__(self, turns: Turns, first: int, size: int) -> None:
        self.size = size
        self.turns = turns
        self._threads = range(first, first + size)
        self._slots: list[list[Tensor] | None] = [None] * size
        self._got: list[list[Tensor]] = [[] for _ in range(size)]

    def exchange(self, rank: int, blocks: list[Tensor]) -> list[Tensor]:
        """Send ``blocks[d]`` to rank ``d``; returns what each source sent to ``rank``."""
        if len(blocks) != self.size:
            raise ValueError(f"LocalGroup.exchange: {len(blocks)} blocks for {self.size} ranks")
        self._slots[rank] = blocks
        if all(slot is not None for slot in self._slots):  # the last to arrive: deliver
            slots = [slot for slot in self._slots if slot is not None]
            self._got = [[slot[d] for slot in slots] for d in range(self.size)]
            self._slots = [None] * self.size
            self.turns.release(self._threads)
        else:
            self.turns.block(self._threads[rank])
        return self._got[rank]


class WaitLog:
    """While :attr:`active`, the ``(start, end)`` (``time.perf_counter_ns``) of every wait of
    an :class:`ExpertGroup` for its all-to-alls: how long the waiting thread was blocked on
    the exchange. Off by default (a wait then costs one attribute test); the profiler turns
    it on around the steps it measures (:func:`timing_waits`)."""

    def __init__(self) -> None:
        self.active: list[tuple[int, int]] | None = None
        """Where the waits go while recording; None when off."""

    def record(self, start_ns: int, end_ns: int) -> None:
        got = self.active
        if got is not None:
            got.append((start_ns, end_ns))  # list.append is atomic: pairs' two threads may wait


@contextlib.contextmanager
def timing_waits(groups: Iterable[ExpertGroup]) -> Iterator[list[tuple[int, int]]]:
    """Record every wait of ``groups`` for their all-to-alls while the block runs, into the
    list it yields (``(start, end)`` in ``time.perf_counter_ns``, in the order they ended);
    the logs are off again afterwards."""
    logs = list({id(g.log): g.log for g in groups}.values())
    got: list[tuple[int, int]] = []
    if any(log.active is not None for log in logs):
        raise RuntimeError("timing_waits: these ep groups' waits are already being recorded")
    for log in logs:
        log.active = got
    try:
        yield got
    finally:
        for log in logs:
            log.active = None


def expert_groups(module: nn.Module) -> tuple[ExpertGroup, ...]:
    """The ep groups of the expert layers in ``module``: each module's attribute ``ep`` that
    is an :class:`ExpertGroup` (our ``MoE``/``ExpertLayer`` and the HF experts replaced by
    ``ShardedExperts`` hold theirs there), each group once, in module order. Empty: the
    module holds no expert layer."""
    found: dict[int, ExpertGroup] = {}
    for m in module.modules():
        g = getattr(m, "ep", None)
        if isinstance(g, ExpertGroup):
            found.setdefault(id(g), g)
    return tuple(found.values())


@dataclass(frozen=True)
class ExpertGroup:
    """The ep ranks one MoE layer's experts are sharded over, and this rank's place.

    Deep copies return the same object: a process group is shared, not copied (the
    pipeline deep-copies its layers per stage).
    """

    group: dist.ProcessGroup | LocalGroup | None = None
    rank: int = 0
    size: int = 1
    timeout_s: float | None = None
    """Longest an all-to-all may block (None: the process group's own timeout); past it,
    or when a peer dies, a :class:`~zerobubble.runtime.p2p.comm.PeerError` names the ep ranks."""
    backward: dist.ProcessGroup | LocalGroup | None = None
    """The same ranks' second group, for the all-to-alls of backwards (None: ``group``).
    Under an overlapped schedule a forward (on a helper thread) and a backward run at once
    (:mod:`~zerobubble.runtime.overlap`): each group then sees one thread's calls, in the
    same order on every ep rank."""
    arrivals: Arrivals | None = field(default=None, compare=False, repr=False)
    """Names the ep rank that never arrived when a wait fails (None: the group only)."""
    log: WaitLog = field(default_factory=WaitLog, compare=False, repr=False)
    """Times the waits while the profiler asks (:func:`timing_waits`); shared by the copies."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or (self.size > 1 and self.group is None):
            raise ValueError(
                f"ExpertGroup(rank={self.rank}, size={self.size}) needs 0 <= rank < size and "
                "a process group when size > 1; build it with ExpertGroup.of(mesh)"
            )

    @classmethod
    def of(cls, mesh: PipelineMesh, timeout_s: float | None = None) -> ExpertGroup:
        """The ep group of a :class:`~zerobubble.parallel.mesh.PipelineMesh`."""
        arrivals = Arrivals(dist.get_rank(), mesh.spec.name)
        return cls(
            mesh.ep_group, mesh.ep_rank, mesh.ep_size, timeout_s, mesh.ep_backward_group, arrivals
        )

    @property
    def backward_group(self) -> dist.ProcessGroup | LocalGroup | None:
        """The group the backwards' all-to-alls run on."""
        return self.group if self.backward is None else self.backward

    @property
    def forward_group(self) -> dist.ProcessGroup | LocalGroup | None:
        """The group a forward's all-to-alls run on now: :attr:`group`, or in a replay of
        the forward inside B (activation recompute, which every ep peer runs at the same
        point of its backward) :attr:`backward_group`, the lane of the thread it runs on."""
        return self.backward_group if replaying() else self.group

    def wait(self, work: dist.Work, what: str, group: dist.ProcessGroup | None = None) -> None:
        """Wait for ``work`` (a collective over this group, or ``group``), bounded by
        ``timeout_s``, without the rank's generator lock (:func:`yield_generators`); the
        wait (not the lock's return) goes to :attr:`log` while it records."""
        with yield_generators():
            t0 = time.perf_counter_ns()
            try:
                self._wait(work, what, group)
            finally:
                self.log.record(t0, time.perf_counter_ns())

    def _wait(self, work: dist.Work, what: str, group: dist.ProcessGroup | None) -> None:
        if self.timeout_s is None:
            work.wait()
            return
        pg = group or self.group
        assert not isinstance(pg, LocalGroup)
        ranks = tuple(dist.get_process_group_ranks(pg))
        arrivals = self.arrivals or Arrivals(dist.get_rank())

        def blame(why: str, missing: tuple[int, ...]) -> PeerError:
            return PeerError(arrivals.rank, None, what, why, group=ranks, missing=missing)

        arrivals.wait(work, group=pg, ranks=ranks, timeout_s=self.timeout_s, error=blame)

    def __deepcopy__(self, memo: dict[int, Any]) -> ExpertGroup:
        return self


def exchange_counts(counts: Tensor, group: ExpertGroup) -> Tensor:
    """Per-expert row counts (``E``, in global expert order) sent to the experts' owners:
    returns ``(ep, E / ep)``, row ``src`` the counts rank ``src`` sends for each local expert."""
    pg = group.forward_group
    if isinstance(pg, LocalGroup):
        return torch.stack(pg.exchange(group.rank, list(counts.view(group.size, -1))))
    out = torch.empty_like(counts)
    work = dist.all_to_all_single(out, counts.contiguous(), group=pg, async_op=True)
    assert work is not None
    group.wait(work, "all-to-all of the per-expert token counts over dim 'ep'", pg)
    return out.view(group.size, -1)


def start_all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup | None
) -> tuple[Tensor, dist.Work]:
    """Start sending ``x``'s row blocks (``in_splits`` rows to each rank, in rank order);
    the output holds ``out_splits`` rows from each rank, in rank order, once the work is done."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(
        out, x.contiguous(), out_splits, in_splits, group=group, async_op=True
    )
    assert work is not None
    return out, work


class AllToAll(torch.autograd.Function):
    """The row all-to-all with autograd: the backward is the reverse all-to-all."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: ExpertGroup
    ) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        pg = group.forward_group
        if isinstance(pg, LocalGroup):
            return torch.cat(pg.exchange(group.rank, list(x.detach().split(in_splits))))
        out, work = start_all_to_all(x, out_splits, in_splits, pg)
        group.wait(work, "all-to-all of the routed tokens over dim 'ep'", pg)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        group = ctx.group.backward_group
        if isinstance(group, LocalGroup):
            back = torch.cat(group.exchange(ctx.group.rank, list(grad.split(out_splits))))
            return back, None, None, None
        back, work = start_all_to_all(grad, in_splits, out_splits, group)
        what = "reverse all-to-all of the routed tokens' gradients over dim 'ep'"
        ctx.group.wait(work, what, group)
        return back, None, None, None


def all_to_all(
    x: Tensor, out_splits: list[int], in_splits: list[int], group: ExpertGroup
) -> Tensor:
    """:class:`AllToAll` applied (synchronous, differentiable)."""
    out = AllToAll.apply(x, out_splits, in_splits, group)
    assert isinstance(out, Tensor)
    return out
