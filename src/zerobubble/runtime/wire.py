"""Version headers on pipeline messages.

When work of iteration k+1 may run on provisional parameters (speculative
post-validation, see :mod:`zerobubble.optim`), every message must say which
iteration, parameter version and attempt produced it: a receiver then tells
stale messages (from work a rollback discarded) from fresh ones, and checks
that a microbatch sees one parameter version along the whole pipeline.

The header is three int64 values (padded to 64 bytes) in front of the payload's bytes, in the same
message: transports match point-to-point messages in order, and a separate
header message would double their number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from zerobubble.runtime.comm import TensorMeta

HEADER_BYTES = 64
"""Header size: three int64 values, padded so that the payload keeps the 64-byte alignment
of a fresh allocation (CPU matmul kernels may round differently on unaligned data)."""


@dataclass(frozen=True, slots=True)
class Header:
    """Who produced a message.

    Attributes:
        iteration: The executor step the message belongs to.
        version: The sender's parameter version when it computed the payload.
        attempt: 0 for the first run of the step, 1 after a replay.
    """

    iteration: int
    version: int
    attempt: int


def packed_meta(meta: TensorMeta) -> TensorMeta:
    """The uint8 buffer a message of ``meta`` travels in, header included."""
    nbytes = math.prod(meta.shape) * meta.dtype.itemsize
    return TensorMeta((HEADER_BYTES + nbytes,), torch.uint8)


def pack(t: Tensor, header: Header) -> Tensor:
    """``header`` then the bytes of ``t`` (made contiguous), as one uint8 tensor."""
    head = torch.zeros(HEADER_BYTES // 8, dtype=torch.int64, device=t.device)
    head[:3] = torch.tensor([header.iteration, header.version, header.attempt])
    body = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([head.view(torch.uint8), body])


def unpack(buf: Tensor, meta: TensorMeta) -> tuple[Tensor, Header]:
    """Inverse of :func:`pack`: the payload (a view of ``buf``) and its header."""
    head = buf[:24].view(torch.int64).tolist()
    body = buf[HEADER_BYTES:].view(meta.dtype).view(meta.shape)
    return body, Header(*head)
