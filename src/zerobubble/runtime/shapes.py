"""Shapes and dtypes of the tensors that cross stage boundaries, agreed on once.

A receiver must allocate its buffer before the data arrives, so before the
first step the ranks run a metadata handshake along the stages in model
order: each rank takes its stages in increasing order, receives the input
metadata of every microbatch from the previous stage, infers its outputs by
running the stage once without autograd (once per distinct input shape, so
at most twice with an uneven last microbatch) and sends them on. The chain
is deadlock-free: the lowest unfinished stage can always progress. A stage
that cannot consume what its predecessor produces fails here, before the
step's real compute starts, naming both stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from zerobubble.runtime.comm import P2P, TensorMeta, decode_metas, encode_metas
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.lowering import Message, MsgKind


class ShapeMismatchError(ValueError):
    """Two neighbouring stages disagree on the tensor between them.

    Attributes:
        src_stage, dst_stage: The producing and the consuming stage (``src_stage``
            is None when stage 0 cannot consume the input batch).
    """

    def __init__(self, src_stage: int | None, dst_stage: int, message: str) -> None:
        src = "input batch" if src_stage is None else f"stage {src_stage}"
        super().__init__(f"{src} -> stage {dst_stage}: {message}")
        self.src_stage = src_stage
        self.dst_stage = dst_stage


def infer_output(
    module: nn.Module, meta_in: TensorMeta, device: torch.device, example: torch.Tensor | None
) -> TensorMeta:
    """Shape and dtype of ``module``'s output for an input described by ``meta_in``.

    Runs the module once without autograd on ``example`` (the real first-stage
    input) or on zeros, leaving no trace: the RNG state is forked and buffers
    (e.g. running statistics) are restored afterwards.
    """
    x = example if example is not None else torch.zeros(meta_in.shape, dtype=meta_in.dtype)
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    devices = [device] if device.type != "cpu" else []
    try:
        with torch.random.fork_rng(devices=devices, device_type=device.type), torch.no_grad():
            return TensorMeta.of(module(x.to(device)))
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)


def negotiate(
    schedule: Schedule,
    rank: int,
    modules: Mapping[int, nn.Module],
    inputs: Sequence[torch.Tensor] | None,
    p2p: P2P,
) -> dict[Message, TensorMeta]:
    """Run the handshake; return the metadata of every message this rank sends or receives.

    ``inputs`` are the first stage's microbatches (needed on the rank holding it).
    A gradient message has the metadata of the activation it is the gradient of.
    """
    S, M, place = schedule.num_stages, schedule.num_microbatches, schedule.placement
    incoming: dict[int, list[TensorMeta]] = {}  # stage -> per-microbatch input metadata
    outgoing: dict[int, list[TensorMeta]] = {}
    for s in schedule.stages_of_device[rank]:
        if s == 0:
            if inputs is None:
                raise ValueError(f"rank {rank} holds stage 0, so step() needs the input batch x")
            incoming[s] = [TensorMeta.of(x) for x in inputs]
        elif place[s - 1] == rank:
            incoming[s] = outgoing[s - 1]
        else:
            what = f"shape handshake: receive stage {s - 1}'s output metadata for stage {s}"
            incoming[s] = decode_metas(p2p.recv_ints(place[s - 1], what))
            if len(incoming[s]) != M:
                raise ShapeMismatchError(
                    s - 1,
                    s,
                    f"received metadata for {len(incoming[s])} microbatches, expected {M}; "
                    "every rank must run the same schedule",
                )
        cache: dict[TensorMeta, TensorMeta] = {}
        outs = []
        for j, meta in enumerate(incoming[s]):
            if meta not in cache:
                example = inputs[j] if s == 0 and inputs is not None else None
                try:
                    cache[meta] = infer_output(modules[s], meta, p2p.device, example)
                except Exception as e:
                    src = "the input batch" if s == 0 else f"stage {s - 1}'s output"
                    raise ShapeMismatchError(
                        s - 1 if s else None,
                        s,
                        f"stage {s} (rank {rank}) cannot consume {src} of {meta} "
                        f"(microbatch {j}): {type(e).__name__}: {e}",
                    ) from e
            out = cache[meta]
            if s < S - 1 and not out.dtype.is_floating_point:
                raise ShapeMismatchError(
                    s,
                    s + 1,
                    f"stage {s} outputs {out}; a tensor between stages must be floating point "
                    "so that its gradient can flow back (move the cut to after this layer)",
                )
            outs.append(out)
        outgoing[s] = outs
        if s < S - 1 and place[s + 1] != rank:
            what = f"shape handshake: send stage {s}'s output metadata to stage {s + 1}"
            p2p.send_ints(encode_metas(outs), place[s + 1], what)

    metas: dict[Message, TensorMeta] = {}
    for s, per_mb in outgoing.items():
        if s < S - 1 and place[s + 1] != rank:
            for j in range(M):
                metas[Message(MsgKind.ACT, s, s + 1, j)] = per_mb[j]
                metas[Message(MsgKind.GRAD, s + 1, s, j)] = per_mb[j]
    for s, per_mb in incoming.items():
        if s > 0 and place[s - 1] != rank:
            for j in range(M):
                metas[Message(MsgKind.ACT, s - 1, s, j)] = per_mb[j]
                metas[Message(MsgKind.GRAD, s, s - 1, j)] = per_mb[j]
    return metas
