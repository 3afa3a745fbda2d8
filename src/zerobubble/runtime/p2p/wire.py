"""Version headers on pipeline messages, and the frames that carry boundary values.

When work of iteration k+1 may run on provisional parameters (speculative
post-validation, see :mod:`zerobubble.optim`), every message must say which
iteration, parameter version and attempt produced it: a receiver then tells
stale messages (from work a rollback discarded) from fresh ones, and checks
that a microbatch sees one parameter version along the whole pipeline. The
header also names the message (kind, stages, microbatch, payload bytes), so a
receive that got another message than the one it was posted for is caught
instead of silently reinterpreting the bytes.

The header is eight int64 values (64 bytes) in front of the payload's bytes, in
the same message: transports match point-to-point messages in order, and a
separate header message would double their number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zerobubble.program.instructions import Message, MsgKind
from zerobubble.runtime.p2p.comm import TensorMeta
from zerobubble.runtime.shapes import Layout

HEADER_BYTES = 64
"""Header size: eight int64 values; a multiple of 64 so that the payload keeps the
alignment of a fresh allocation (CPU matmul kernels may round differently on unaligned
data)."""

_KINDS = (MsgKind.ACT, MsgKind.GRAD)


@dataclass(frozen=True, slots=True)
class Header:
    """Who produced a message, and which message it is.

    Attributes:
        iteration: The executor step the message belongs to.
        version: The sender's parameter version when it computed the payload.
        attempt: 0 for the first run of the step, 1 after a replay.
        message: (kind code, src stage, dst stage, microbatch, payload bytes).
    """

    iteration: int
    version: int
    attempt: int
    message: tuple[int, int, int, int, int]

    @staticmethod
    def identity(msg: Message, meta: TensorMeta) -> tuple[int, int, int, int, int]:
        nbytes = math.prod(meta.shape) * meta.dtype.itemsize
        return (_KINDS.index(msg.kind), msg.src_stage, msg.dst_stage, msg.mb, nbytes)

    @classmethod
    def of(cls, msg: Message, iteration: int, version: int, attempt: int, t: Tensor) -> Header:
        return cls(iteration, version, attempt, cls.identity(msg, TensorMeta.of(t)))

    def describe(self) -> str:
        kind, src, dst, mb, nbytes = self.message
        name = _KINDS[kind].value if 0 <= kind < len(_KINDS) else f"kind {kind}"
        return (
            f"{name} s{src}->s{dst} mb{mb} ({nbytes} bytes) of iteration {self.iteration} "
            f"attempt {self.attempt}"
        )


def packed_meta(meta: TensorMeta) -> TensorMeta:
    """The uint8 buffer a message of ``meta`` travels in, header included."""
    nbytes = math.prod(meta.shape) * meta.dtype.itemsize
    return TensorMeta((HEADER_BYTES + nbytes,), torch.uint8)


def pack(t: Tensor, header: Header) -> Tensor:
    """``header`` then the bytes of ``t`` (made contiguous), as one uint8 tensor."""
    values = [header.iteration, header.version, header.attempt, *header.message]
    head = torch.tensor(values, dtype=torch.int64, device=t.device)
    body = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([head.view(torch.uint8), body])


def unpack(buf: Tensor, meta: TensorMeta) -> tuple[Tensor, Header]:
    """Inverse of :func:`pack`: the payload (a view of ``buf``) and its header."""
    it, version, attempt, *message = buf[:HEADER_BYTES].view(torch.int64).tolist()
    body = buf[HEADER_BYTES:].view(meta.dtype).view(meta.shape)
    return body, Header(it, version, attempt, tuple(message))


# ---- frames: the tensors of one boundary value in one message --------------------------

FRAME_HEADER = 64
"""A frame starts with eight int64 values: the flag and, for :data:`NEW_LAYOUT`, the
length of a layout that follows, the layout's id and whether the tensors are inline;
then zeros."""

SAME_LAYOUT, NEW_LAYOUT = 0, 1
"""Frame flags. SAME: the tensors follow in the layout the receiver expects. NEW:
this frame has the expected size but another layout, the one with the given id in
the sender's table for this receiver; a new one (length > 0) comes next on the
layout stream and gets the next id. The tensors are in this frame (inline, when
they fit) or come next on the layout stream in a frame of their own."""


@dataclass(frozen=True, slots=True)
class FrameHeader:
    flag: int
    layout_len: int = 0
    layout_id: int = 0
    inline: bool = True


def pack_frame(
    layout: Layout,
    tensors: Sequence[Tensor],
    device: torch.device,
    *,
    size: int | None = None,
    header: FrameHeader | None = None,
) -> Tensor:
    """``tensors`` laid out as ``layout`` says, in a frame of ``size`` bytes (at least
    the layout's; default: exactly), as one uint8 tensor. Without ``header``: SAME."""
    buf = torch.empty(layout.nbytes if size is None else size, dtype=torch.uint8, device=device)
    _write_header(buf, header)
    for i, t in enumerate(tensors):
        _slot(buf, layout, i).copy_(t.detach())
    return buf


def _slot(frame: Tensor, layout: Layout, i: int) -> Tensor:
    """Tensor ``i`` of ``layout`` as a view of ``frame``: row-major, or with the strides the
    sender's tensor had (:func:`~zerobubble.runtime.shapes.kept_strides`)."""
    meta, off = layout.metas[i], layout.offsets[i]
    n = math.prod(meta.shape) * meta.dtype.itemsize
    flat = frame[off : off + n].view(meta.dtype)
    strides = layout.strides[i] if layout.strides else None
    return flat.view(meta.shape) if strides is None else flat.as_strided(meta.shape, strides)


def stub_frame(size: int, header: FrameHeader, device: torch.device) -> Tensor:
    """A frame of ``size`` bytes with ``header`` and no tensors."""
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    _write_header(buf, header)
    return buf


def _write_header(buf: Tensor, header: FrameHeader | None) -> None:
    head = buf[:FRAME_HEADER].view(torch.int64)
    if header is None:
        head.zero_()
        return
    values = [header.flag, header.layout_len, header.layout_id, int(header.inline)]
    head.copy_(torch.tensor(values + [0] * 4))


def frame_header(frame: Tensor) -> FrameHeader:
    """The header of a received frame."""
    flag, n, lid, inline = frame[:32].view(torch.int64).tolist()
    return FrameHeader(flag, n, lid, bool(inline))


def unpack_frame(frame: Tensor, layout: Layout) -> list[Tensor]:
    """The tensors of a received frame: views of it with the sender's memory format, those
    with a gradient flagged ``requires_grad``."""
    out = []
    for i, grad in enumerate(layout.grads):
        t = _slot(frame, layout, i)
        out.append(t.requires_grad_(True) if grad else t)
    return out
