"""The pipeline's messages on the wire: one :class:`Link` per peer, frames and layouts.

A boundary value is a tensor or a pytree of them (:mod:`zerobubble.runtime.shapes`),
sent as one frame per message (:mod:`zerobubble.runtime.p2p.wire`). Its layout
(structure, shapes, dtypes) may change between steps and microbatches: a receiver
expects the layout the same message had last time, and the sender announces a new
one in two extra messages (the layout codes, then the frame if it does not fit
the expected buffer) on the layout channel only when it differs. Both ends update
their record on every change, so they agree without a handshake; each link numbers
the layouts it announced, so a layout that comes back is named, not resent.

:class:`Links` is the one object that owns this state (what each message's layout
was, the receives posted and not yet waited for, the sends in flight); the
executor calls it at its message instructions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from zerobubble.program.instructions import (
    LoweredSchedule,
    Message,
    MsgKind,
    PostRecv,
    Send,
    WaitRecv,
)
from zerobubble.runtime.hooks import StepHooks
from zerobubble.runtime.p2p.comm import P2P, Channel, RankName, TensorMeta, plain_name
from zerobubble.runtime.p2p.wire import (
    FRAME_HEADER,
    NEW_LAYOUT,
    SAME_LAYOUT,
    FrameHeader,
    frame_header,
    pack_frame,
    stub_frame,
    unpack_frame,
)
from zerobubble.runtime.shapes import Layout, flatten, unflatten

__all__ = ["Described", "Link", "Links", "pipeline_p2p"]


@dataclass
class _Posted:
    buf: torch.Tensor
    work: dist.Work
    what: object


@dataclass
class Link:
    """The state of the messages between this rank and one peer (both directions)."""

    peer: int
    sent: dict[Message, Layout] = field(default_factory=dict)
    """The layout the peer expects for each message this rank sends (its last one)."""
    expected: dict[Message, Layout] = field(default_factory=dict)
    """The layout this rank expects for each message it receives."""
    ids_out: dict[Layout, int] = field(default_factory=dict)
    """Layouts announced to the peer, by id (in the order of the layout stream)."""
    ids_in: list[Layout] = field(default_factory=list)
    """Layouts the peer announced, by id."""
    posted: dict[Message, _Posted] = field(default_factory=dict)
    """Receives posted and not waited for yet, in posting order."""
    early: dict[Message, Any] = field(default_factory=dict)
    """Values completed ahead of their wait (a later message's layout needed them first)."""


class Links:
    """All of this rank's links, on one :class:`~zerobubble.runtime.p2p.comm.P2P`."""

    def __init__(self, p2p: P2P, device: torch.device, rank: int) -> None:
        self.p2p, self.device, self.rank = p2p, device, rank
        self.hooks = StepHooks()
        """The current step's hooks (they encode and decode the frames)."""
        self._links: dict[int, Link] = {}
        self._layouts: dict[tuple[int, ...], Layout] = {}
        self._in_flight: list[tuple[dist.Work, torch.Tensor, int, object]] = []

    def link(self, peer: int) -> Link:
        got = self._links.get(peer)
        if got is None:
            got = self._links[peer] = Link(peer)
        return got

    def layout(self, codes: tuple[int, ...]) -> Layout:
        """The decoded layout of ``codes`` (cached: a fixed-shape run decodes each once)."""
        got = self._layouts.get(codes)
        if got is None:
            got = self._layouts[codes] = Layout.of(codes, FRAME_HEADER)
        return got

    # ---- sending ----------------------------------------------------------------------------

    def send(self, msg: Message, peer: int, value: Any, what: object) -> None:
        """Send ``value`` as ``msg``'s frame; first a stub and the new layout if the
        receiver expects another one."""
        link, hooks, device = self.link(peer), self.hooks, self.device
        codes, tensors = flatten(value, boundary_name(msg))
        layout = self.layout(codes)
        self._in_flight = [f for f in self._in_flight if not f[0].is_completed()]
        expected = link.sent.get(msg)
        if layout is expected:
            self._isend(hooks.encode(msg, pack_frame(layout, tensors, device)), peer, what)
            return
        new = layout not in link.ids_out
        if new:
            link.ids_out[layout] = len(link.ids_out)
        size = FRAME_HEADER if expected is None else expected.nbytes
        inline = layout.nbytes <= size
        head = FrameHeader(NEW_LAYOUT, len(codes) if new else 0, link.ids_out[layout], inline)
        if inline:
            first = pack_frame(layout, tensors, device, size=size, header=head)
        else:
            first = stub_frame(size, head, device)
        self._isend(hooks.encode(msg, first), peer, what)
        if new:
            codes_t = torch.tensor(codes, dtype=torch.int64, device=device)
            self._isend(codes_t, peer, what, Channel.LAYOUT)
        if not inline:
            frame = pack_frame(layout, tensors, device)
            self._isend(hooks.encode(msg, frame), peer, what, Channel.LAYOUT)
        link.sent[msg] = layout

    def _isend(
        self, t: torch.Tensor, peer: int, what: object, channel: Channel = Channel.PIPELINE
    ) -> None:
        t = t.contiguous()
        self._in_flight.append((self.p2p.isend(t, peer, what, channel), t, peer, what))

    def wait_sends(self) -> None:
        """Wait (bounded) for every send started so far."""
        for work, _, peer, what in self._in_flight:
            self.p2p.wait(work, peer, what)
        self._in_flight.clear()

    # ---- receiving --------------------------------------------------------------------------

    def post(self, msg: Message, peer: int, what: object) -> None:
        """Post the receive of ``msg``'s frame, in the buffer of the layout expected."""
        link = self.link(peer)
        buf = self._buffer(msg, link.expected.get(msg))
        link.posted[msg] = _Posted(buf, self.p2p.irecv(buf, peer, what), what)

    def _buffer(self, msg: Message, layout: Layout | None) -> torch.Tensor:
        meta = self.hooks.wire_meta(msg, frame_meta(layout))
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def receive(self, msg: Message, peer: int, what: object, *, stale: bool = False) -> Any:
        """The value of ``msg``, whose frame was posted.

        A new layout and its frame come on the layout stream in the order the peer
        sent them, which is the order of the posts; so the frames posted before
        ``msg`` from the same peer are completed first (they arrived before it).
        """
        link = self.link(peer)
        if msg in link.early:
            return link.early.pop(msg)
        for other in list(link.posted):
            if other == msg:
                break
            link.early[other] = self._complete(link, other, None, stale=stale)
        return self._complete(link, msg, what, stale=stale)

    def _complete(self, link: Link, msg: Message, what: object, *, stale: bool) -> Any:
        """Wait for ``msg``'s posted frame (and the new layout and frame it may announce)
        and return the value it carries; ``what`` names the wait (default: the post)."""
        p2p, peer, hooks = self.p2p, link.peer, self.hooks
        posted = link.posted.pop(msg)
        what = posted.what if what is None else what
        p2p.wait(posted.work, peer, what)
        layout = link.expected.get(msg)
        frame = hooks.decode(msg, posted.buf, frame_meta(layout), stale=stale)
        head = frame_header(frame)
        if head.flag == NEW_LAYOUT:
            if head.layout_len:
                codes = torch.empty(head.layout_len, dtype=torch.int64, device=self.device)
                p2p.wait(p2p.irecv(codes, peer, what, Channel.LAYOUT), peer, what)
                link.ids_in.append(self.layout(tuple(codes.tolist())))
            if not 0 <= head.layout_id < len(link.ids_in):
                raise RuntimeError(
                    f"rank {self.rank}: {what} names layout {head.layout_id} but peer rank "
                    f"{peer} announced {len(link.ids_in)}: messages crossed (protocol bug)"
                )
            layout = link.expected[msg] = link.ids_in[head.layout_id]
            if not head.inline:
                buf = self._buffer(msg, layout)
                p2p.wait(p2p.irecv(buf, peer, what, Channel.LAYOUT), peer, what)
                frame = hooks.decode(msg, buf, frame_meta(layout), stale=stale)
        elif layout is None or head.flag != SAME_LAYOUT:
            raise RuntimeError(
                f"rank {self.rank}: {what} got a frame with flag {head.flag} before any "
                "layout was announced: messages crossed (protocol bug)"
            )
        return unflatten(layout.codes, unpack_frame(frame, layout))

    def drain(self, stale: tuple[tuple[int, Message], ...]) -> None:
        """Before a replay: post the ``(peer, message)`` pairs still owed, then complete
        every posted receive as stale and forget the values received ahead."""
        for peer, msg in stale:
            self.post(msg, peer, f"drain of stale {msg} from device {peer}")
        for link in self._links.values():
            for msg in list(link.posted):
                self._complete(link, msg, None, stale=True)
            link.early.clear()


class Described:
    """A message instruction named for a PeerError: formatted only if one is raised (not on
    every instruction)."""

    __slots__ = ("ins", "iteration")

    def __init__(self, ins: PostRecv | WaitRecv | Send, iteration: int) -> None:
        self.ins, self.iteration = ins, iteration

    def __str__(self) -> str:
        ins, m, k = self.ins, self.ins.msg, self.iteration
        if isinstance(ins, Send):
            op = "F" if m.kind is MsgKind.ACT else "backward"
            return f"{ins} (output of {op}(s{m.src_stage},mb{m.mb}), iteration {k})"
        consumer = "F" if m.kind is MsgKind.ACT else "backward"
        return f"{ins} (input of {consumer}(s{m.dst_stage},mb{m.mb}), iteration {k})"


def frame_meta(layout: Layout | None) -> TensorMeta:
    """The uint8 buffer of a frame in ``layout`` (None: not seen yet, a bare header)."""
    return TensorMeta((FRAME_HEADER if layout is None else layout.nbytes,), torch.uint8)


def boundary_name(m: Message) -> str:
    """How errors name a message's value: ``stage 1 output``, ``stage 2 input gradient``."""
    if m.kind is MsgKind.ACT:
        return f"stage {m.src_stage} output"
    return f"stage {m.src_stage} input gradient"


def pipeline_p2p(
    programs: LoweredSchedule,
    group: dist.ProcessGroup | None,
    device: torch.device,
    timeout_s: float,
    *,
    directed: bool | None,
    pipelines: list[list[int]] | None,
    name: RankName = plain_name,
) -> P2P:
    """The point-to-point lanes every rank's program uses, and the optimizer's.

    ``directed`` None gives each direction of each pair its own subgroup for every
    backend but gloo (see :mod:`~zerobubble.runtime.p2p.comm`); creating them is collective.
    """
    if directed is None:
        directed = dist.get_backend(group) != "gloo"
    pairs = [
        (d, ins.peer, channel)
        for d, prog in enumerate(programs.programs)
        for ins in prog
        if isinstance(ins, Send)
        for channel in (Channel.PIPELINE, Channel.LAYOUT)
    ]
    # The optimizer's state messages travel between neighbours, both ways.
    world = programs.schedule.num_devices
    pairs += [(a, b, Channel.OPTIM) for d in range(world - 1) for a, b in ((d, d + 1), (d + 1, d))]
    return P2P(
        group, device, timeout_s, directed=directed, pairs=pairs, pipelines=pipelines, name=name
    )
