"""Context parallelism: each sequence sharded over the ``cp`` ranks of a pipeline stage.

The layout is torchtitan's load-balanced causal sharding: a sequence of ``T`` tokens is cut
into ``2 * cp`` chunks of ``L = T / (2 * cp)`` tokens, and cp rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r`` (:class:`ContextShards`), side by side: its stages see ``(B, T / cp,
...)`` tensors, the pipeline's boundary tensors included. Under a causal mask chunk ``i``
attends to ``i + 1`` chunks of keys, so every rank's two chunks attend ``2 * cp + 1``
chunks in all: the same work on every rank.

Layers that read more than their own tokens take part by deriving from
:class:`ContextAware` (as :class:`~zerobubble.runtime.sequence.kv.SegmentAware` for
segments): :func:`context_parallel` gives each one a :class:`ContextSlot` (the layout and the
group), and a stage with an attention layer that is not context-aware is refused. A layer
reads its tokens' global positions from :meth:`ContextSlot.positions`; an attention layer
gathers the keys and values of the whole sequence with :func:`gather_sequence`. That is an
all-gather per attention layer (a first version, not a ring): each rank holds the whole
sequence's keys and values of one layer, ``cp`` times its own, from the layer's forward to
the end of its backward (the autograd graph keeps them), plus the same once more in the
backward, where each rank sends every owner the gradient of its keys and values
(an all-to-all) and the owner sums what it receives in cp-rank order. Only that sum is
arithmetic; everything else moves data, so a run is bitwise the one-process reference that
plays the group between threads (:mod:`zerobubble.reference.cp`).

The group is anything with ``exchange(rank, blocks) -> received`` (a
:class:`~zerobubble.parallel.ep.LocalGroup` in the reference) or a process group
(:class:`ProcessExchange`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobubble.runtime.sequence.kv import SegmentAware

__all__ = [
    "ContextAware",
    "ContextShards",
    "ContextSlot",
    "Exchange",
    "ProcessExchange",
    "context_parallel",
    "gather_sequence",
    "shard_batch",
    "unaware_attention",
]


@dataclass(frozen=True)
class ContextShards:
    """Cp rank ``rank`` of ``size``: it holds chunks ``rank`` and ``2 * size - 1 - rank`` of
    the ``2 * size`` equal chunks of every sequence."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"cp rank {self.rank} is not in [0, {self.size})")

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    def chunk_len(self, length: int, what: str = "the sequence") -> int:
        """Tokens per chunk of a whole sequence of ``length`` tokens, checked to divide."""
        if length % (2 * self.size):
            raise ValueError(
                f"{what} has {length} tokens, not a multiple of 2 * cp = {2 * self.size}: "
                f"context parallelism cuts it into 2 * cp equal chunks; pad or cut the "
                "sequences to a multiple"
            )
        return length // (2 * self.size)

    def shard(self, x: Tensor, dim: int = 1, what: str = "the sequence") -> Tensor:
        """This rank's two chunks of ``x`` along ``dim``, side by side."""
        n = self.chunk_len(x.shape[dim], what)
        a, b = self.chunks
        return torch.cat([x.narrow(dim, a * n, n), x.narrow(dim, b * n, n)], dim=dim)

    def positions(self, local: int, device: torch.device | str | None = None) -> Tensor:
        """The global positions of this rank's ``local`` tokens (its two chunks)."""
        if local % 2:
            raise ValueError(f"a cp rank holds two equal chunks, got {local} tokens")
        n = local // 2
        a, b = self.chunks
        return torch.cat(
            [torch.arange(a * n, (a + 1) * n, device=device),
             torch.arange(b * n, (b + 1) * n, device=device)]
        )  # fmt: skip


class Exchange(Protocol):
    """An in-process group's exchange: send ``blocks[d]`` to rank ``d``, receive what each
    source sent to ``rank``, in source-rank order."""

    def exchange(self, rank: int, blocks: list[Tensor]) -> list[Tensor]: ...


class ProcessExchange:
    """:class:`Exchange` over a process group: one ``all_to_all_single`` (the blocks have one
    shape, which every rank's blocks share); :meth:`gather` is an ``all_gather``."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def gather(self, x: Tensor) -> list[Tensor]:
        """``x`` of every rank, in rank order."""
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, x.contiguous(), group=self.group)
        return out

    def exchange(self, rank: int, blocks: list[Tensor]) -> list[Tensor]:
        send = torch.stack(blocks).contiguous()
        out = torch.empty_like(send)
        dist.all_to_all_single(out, send, group=self.group)
        return list(out.unbind(0))

    def __deepcopy__(self, memo: dict[int, Any]) -> ProcessExchange:
        return self  # a process group is not copied (a stage's copy keeps its group)


@dataclass(frozen=True)
class ContextSlot:
    """What a context-aware module sees: the layout, its group and its name."""

    shards: ContextShards
    group: Exchange
    name: str

    def positions(self, local: int, device: torch.device | str | None = None) -> Tensor:
        return self.shards.positions(local, device)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` (this rank's tokens on dim -2) of every rank, in the whole sequence's order;
        its gradient goes back to the owners (:func:`gather_sequence`)."""
        return gather_sequence(x, self)


class ContextAware:
    """Mixin of a module that runs on a cp rank's two chunks when given a
    :class:`ContextSlot` (``cp_slot``; None: it runs as it always does). ``holds_kv`` says
    it is an attention layer that gathers the keys and values."""

    holds_kv: ClassVar[bool] = False
    cp_slot: ContextSlot | None = None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, slot: ContextSlot) -> Tensor:
        ctx.slot = slot
        shards = slot.shards
        c, r = shards.size, shards.rank
        group = slot.group
        if isinstance(group, ProcessExchange):
            parts = group.gather(x.detach())
        else:  # an in-process group: the same block to every rank (no copies)
            parts = group.exchange(r, [x.detach()] * c)
        n = x.shape[-2] // 2
        pieces = []
        for i in range(2 * c):
            owner, half = (i, 0) if i < c else (2 * c - 1 - i, 1)
            pieces.append(parts[owner].narrow(-2, half * n, n))
        return torch.cat(pieces, dim=-2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        slot: ContextSlot = ctx.slot
        c, r = slot.shards.size, slot.shards.rank
        n = grad.shape[-2] // (2 * c)
        blocks = [
            torch.cat([grad.narrow(-2, q * n, n), grad.narrow(-2, (2 * c - 1 - q) * n, n)], -2)
            for q in range(c)
        ]
        got = slot.group.exchange(r, blocks)
        total = got[0]
        for g in got[1:]:  # cp-rank order
            total = total + g
        return total, None


def gather_sequence(x: Tensor, slot: ContextSlot) -> Tensor:
    """The whole sequence of ``x`` (each rank's two chunks on dim -2) in token order. Its
    backward sends each rank the gradient of its chunks and sums what arrives in cp-rank
    order."""
    return _Gather.apply(x, slot)


def context_parallel(
    module: nn.Module, shards: ContextShards, group: Exchange, stage: int | str
) -> None:
    """Give every context-aware module of a stage its slot, refusing an attention layer
    that is not context-aware (it would attend to this rank's chunks only) and a
    segment-aware module that is not (it reads positions or keys beyond its own tokens,
    which on a cp rank are not where it takes them)."""
    for name, m in module.named_modules():
        where = f"stage {stage} {name or '(the stage)'}"
        if isinstance(m, ContextAware):
            m.cp_slot = ContextSlot(shards, group, where)
        elif isinstance(m, SegmentAware):
            raise ValueError(
                f"{where} ({type(m).__name__}) reads token positions or earlier keys (it is "
                f"segment-aware) but is not context-aware: on a cp rank (cp={shards.size}) "
                "it would take its two chunks for the sequence's start. Derive it from "
                "zerobubble.runtime.sequence.cp.ContextAware, or build the mesh with cp=1"
            )
    loose = unaware_attention(module)
    if loose is not None:
        raise ValueError(
            f"stage {stage}: {loose} is an attention layer that is not context-aware: "
            f"under context parallelism (cp={shards.size}) it would attend to its rank's "
            "two chunks only. Context-aware layers derive from "
            "zerobubble.runtime.sequence.cp.ContextAware (our GPT's attention, the Hugging "
            "Face adapter's decoder blocks); build the mesh with cp=1 for this model"
        )


def unaware_attention(module: nn.Module) -> str | None:
    """The name of an attention layer of ``module`` that no context-aware attention layer
    holds, or None (the heuristic of
    :func:`~zerobubble.runtime.sequence.kv.unaware_attention`)."""
    covered: list[str] = []
    for name, m in module.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in covered):
            continue
        if isinstance(m, ContextAware) and m.holds_kv:
            covered.append(name)
            continue
        if isinstance(m, nn.MultiheadAttention) or type(m).__name__.endswith("Attention"):
            return f"{name or '(the layer)'} ({type(m).__name__})"
    return None


def shard_batch(value: Any, shards: ContextShards, what: str) -> Any:
    """This rank's chunks of a batch: every tensor with a sequence dim (dim 1) sharded on
    it, in tuples, lists and mappings; a padding ``attention_mask`` is refused (the layers
    would need every rank's columns)."""
    if isinstance(value, Tensor):
        return shards.shard(value, 1, what) if value.dim() >= 2 else value
    if isinstance(value, Mapping):
        if value.get("attention_mask") is not None:
            raise ValueError(
                f"{what} has an attention_mask: context parallelism takes unpadded sequences "
                "(every token attends to all earlier ones); drop the mask, or build the mesh "
                "with cp=1"
            )
        return {k: shard_batch(v, shards, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(shard_batch(v, shards, f"{what}[{i}]") for i, v in enumerate(value))
    return value
