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
either runs :func:`ring_attention` (key/value blocks passed around the ranks, nothing of
the others' held after the layer's forward) or gathers the keys and values of the whole
sequence with :func:`gather_sequence`: an all-gather per attention layer, each rank then
holding the whole sequence's keys and values of one layer, ``cp`` times its own, from the
layer's forward to the end of its backward (the autograd graph keeps them), plus the same
once more in the backward, where each rank sends every owner the gradient of its keys and
values (an all-to-all) and the owner sums what arrives in cp-rank order. Our GPT's attention
and the Hugging Face adapter's decoder blocks (:mod:`zerobubble.interop.hf_layers`, through
a registered attention function) run the ring, and gather only when attention dropout
draws (the ring never holds the probabilities it would drop). The arithmetic
depends on the rank and the layout only, so a run is bitwise the one-process reference
that plays the group between threads (:mod:`zerobubble.reference.cp`).

Under sequence segments (Seq1F1B-style, :mod:`~zerobubble.runtime.sequence.kv`) the layout
is segments outer, cp inner: every segment is sharded alike (``ContextShards(cuts=...)``),
the rank's own tokens are cut at the cuts / ``cp``, and a segment's ring carries each rank's
earlier segments' keys and values along with its own (:func:`ring_attention`'s ``past``).

The group is anything with ``exchange(rank, blocks) -> received`` (a
:class:`~zerobubble.parallel.ep.LocalGroup` in the reference) or a process group
(:class:`ProcessExchange`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from zerobubble.runtime.sequence.kv import SegmentAware, cut_pairs, token_cuts, unaware_attention

__all__ = [
    "ContextAware",
    "ContextShards",
    "ContextSlot",
    "Exchange",
    "ProcessExchange",
    "context_parallel",
    "gather_sequence",
    "refuse_segments",
    "ring_attention",
    "segments_refusal",
    "shard_batch",
    "shard_step",
]


@dataclass(frozen=True)
class ContextShards:
    """Cp rank ``rank`` of ``size``: it holds chunks ``rank`` and ``2 * size - 1 - rank`` of
    the ``2 * size`` equal chunks of every sequence.

    With sequence segments (``cuts``, the global token boundaries ``0 = b0 < ... < bk =
    T``) the layout is segments outer, cp inner: *each segment* is cut into ``2 * size``
    chunks and the rank holds chunks ``rank`` and ``2 * size - 1 - rank`` of every
    segment, segment after segment. So every segment is balanced over the ranks, a
    segment's boundaries are the same global positions on every rank, and the rank's own
    tokens are cut at :attr:`local_cuts` (the cuts / ``size``)."""

    size: int
    rank: int
    cuts: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"cp rank {self.rank} is not in [0, {self.size})")
        if self.cuts is None:
            return
        cuts = token_cuts(self.cuts)
        object.__setattr__(self, "cuts", cuts)
        for i, (start, end) in enumerate(cut_pairs(cuts, cuts[-1] if cuts else 0)):
            if (end - start) % (2 * self.size):
                raise ValueError(
                    f"segment {i} [{start}, {end}) has {end - start} tokens, not a multiple "
                    f"of 2 * cp = {2 * self.size}: context parallelism cuts every segment into "
                    "2 * cp equal chunks; move the cuts to multiples of "
                    f"{2 * self.size} (ExecutorOptions(cuts=...)), or build the mesh with cp=1"
                )

    @property
    def chunks(self) -> tuple[int, int]:
        return self.rank, 2 * self.size - 1 - self.rank

    @property
    def local_cuts(self) -> tuple[int, ...] | None:
        """The segments' boundaries in this rank's own tokens (None without segments)."""
        return None if self.cuts is None else tuple(b // self.size for b in self.cuts)

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
        """This rank's two chunks of ``x`` along ``dim``, side by side (with :attr:`cuts`,
        its two chunks of every segment, segment after segment)."""
        if self.cuts is None:
            return self._two_chunks(x, dim, what)
        if x.shape[dim] != self.cuts[-1]:
            raise ValueError(
                f"{what} has sequences of {x.shape[dim]} tokens but the segment cuts "
                f"{list(self.cuts)} cover {self.cuts[-1]}; cut for this length "
                "(ExecutorOptions(cuts=...))"
            )
        pieces = [
            self._two_chunks(x.narrow(dim, start, end - start), dim, f"{what}'s segment {i}")
            for i, (start, end) in enumerate(itertools.pairwise(self.cuts))
        ]
        return torch.cat(pieces, dim=dim)

    def _two_chunks(self, x: Tensor, dim: int, what: str) -> Tensor:
        n = self.chunk_len(x.shape[dim], what)
        a, b = self.chunks
        return torch.cat([x.narrow(dim, a * n, n), x.narrow(dim, b * n, n)], dim=dim)

    def positions(
        self, local: int, device: torch.device | str | None = None, start: int = 0
    ) -> Tensor:
        """The global positions of this rank's ``local`` tokens (its two chunks) of the
        segment whose first own token is ``start`` (a local position: the segment starts
        at global position ``start * size`` and has ``local * size`` tokens)."""
        if local % 2:
            raise ValueError(f"a cp rank holds two equal chunks, got {local} tokens")
        n = local // 2
        a, b = self.chunks
        first = start * self.size
        return torch.cat(
            [torch.arange(first + a * n, first + (a + 1) * n, device=device),
             torch.arange(first + b * n, first + (b + 1) * n, device=device)]
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

    def shift(self, rank: int, x: Tensor) -> Tensor:
        """Send ``x`` to the next rank (``rank + 1``, cyclically); returns the previous one's."""
        size = dist.get_world_size(self.group)
        to = dist.get_global_rank(self.group, (rank + 1) % size)
        source = dist.get_global_rank(self.group, (rank - 1) % size)
        out = torch.empty_like(x)
        ops = [dist.P2POp(dist.isend, x.contiguous(), to, self.group),
               dist.P2POp(dist.irecv, out, source, self.group)]  # fmt: skip
        for work in dist.batch_isend_irecv(ops):
            work.wait()
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

    def positions(
        self, local: int, device: torch.device | str | None = None, start: int = 0
    ) -> Tensor:
        """Global positions of the rank's ``local`` tokens of the segment whose first own
        token is ``start`` (0: the whole sequence, or its first segment)."""
        return self.shards.positions(local, device, start)

    def gather(self, x: Tensor) -> Tensor:
        """``x`` (this rank's tokens on dim -2) of every rank, in the whole sequence's order;
        its gradient goes back to the owners (:func:`gather_sequence`)."""
        return gather_sequence(x, self)


class ContextAware:
    """Mixin of a module that runs on a cp rank's two chunks when given a
    :class:`ContextSlot` (``cp_slot``; None: it runs as it always does). ``holds_kv`` says
    it is an attention layer that reads the other ranks' keys and values (a ring or a
    gather)."""

    holds_kv: ClassVar[bool] = False
    takes_segments: ClassVar[bool] = False
    """Whether it runs under sequence segments too (a segment's chunks, and for an attention
    layer the earlier segments' keys and values of every rank: :func:`ring_attention`'s
    ``past``); one that does not is refused before a segment schedule runs
    (:func:`refuse_segments`)."""
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


def _shift(slot: ContextSlot, tensors: Sequence[Tensor]) -> list[Tensor]:
    """``tensors`` (one shape each on every rank) sent to the next cp rank, the previous
    rank's received: one flat message."""
    c, r = slot.shards.size, slot.shards.rank
    flat = torch.cat([t.reshape(-1) for t in tensors])
    group = slot.group
    if isinstance(group, ProcessExchange):
        got = group.shift(r, flat)
    else:  # an in-process group: an exchange with one block that is not empty
        blocks = [flat if d == (r + 1) % c else flat[:0] for d in range(c)]
        got = group.exchange(r, blocks)[(r - 1) % c]
    return [piece.view_as(t) for piece, t in zip(got.split([t.numel() for t in tensors]),
                                                  tensors, strict=True)]  # fmt: skip


def _blocks(slot: ContextSlot, source: int) -> list[tuple[int, int, int, int]]:
    """The (query half, its chunk, key half, its chunk) pairs a rank computes with cp rank
    ``source``'s keys: a key chunk after the query chunk is skipped (causal)."""
    mine = slot.shards.chunks
    theirs = ContextShards(slot.shards.size, source).chunks
    return [(hi, ci, hj, cj) for hi, ci in enumerate(mine) for hj, cj in enumerate(theirs)
            if cj <= ci]  # fmt: skip


def _visible(slot: ContextSlot, source: int, past: int) -> list[tuple[int, int, int, bool]]:
    """The (query half, key piece, key half, masked) blocks a rank computes with cp rank
    ``source``'s keys, which are ``past`` earlier segments' pieces (every key before every
    query: each piece whole, key half -1) and the current segment's two chunks (a key chunk
    after the query chunk skipped, the query chunk itself masked above the diagonal:
    :func:`_blocks`)."""
    whole = [(hi, j, -1, False) for hi in range(2) for j in range(past)]
    own = [(hi, past, hj, cj == ci) for hi, ci, hj, cj in _blocks(slot, source)]
    return whole + own


def _block_kv(pieces: Sequence[Tensor], j: int, half: int, n: int) -> Tensor:
    """Piece ``j`` of the travelling keys (or values): whole (``half`` -1, a past piece) or
    one of the current segment's two chunks of ``n`` tokens."""
    return pieces[j] if half < 0 else pieces[j].narrow(-2, half * n, n)


class _Ring(torch.autograd.Function):
    """Causal attention of a cp rank's two chunks, the key/value blocks passed around the
    ring (flash-style: an online softmax forward, the backward recomputing each block's
    probabilities from the saved log-sum-exp). Under segments each rank's earlier segments'
    keys and values travel with its own (``past`` pieces, every key visible); their
    gradients come home with the own ones and leave as the pieces' gradients."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, slot: ContextSlot, scale: float,
        past: int, *pieces: Tensor,
    ) -> Tensor:  # fmt: skip
        c, r = slot.shards.size, slot.shards.rank
        n = q.shape[-2] // 2
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        qs = q.split(n, dim=-2)
        m = [q.new_full((*q.shape[:-2], n, 1), float("-inf")) for _ in range(2)]
        total = [q.new_zeros((*q.shape[:-2], n, 1)) for _ in range(2)]
        acc = [q.new_zeros((*q.shape[:-2], n, q.shape[-1])) for _ in range(2)]
        kv = [*pieces[:past], k, *pieces[past:], v]  # keys, then values: past pieces, own
        for step in range(c):
            source = (r - step) % c
            keys, values = kv[: past + 1], kv[past + 1 :]
            for hi, j, hj, masked in _visible(slot, source, past):
                scores = (qs[hi] @ _block_kv(keys, j, hj, n).transpose(-2, -1)) * scale
                if masked:
                    scores = scores.masked_fill(future, float("-inf"))
                top = torch.maximum(m[hi], scores.amax(dim=-1, keepdim=True))
                p = torch.exp(scores - top)
                alpha = torch.exp(m[hi] - top)
                total[hi] = total[hi] * alpha + p.sum(dim=-1, keepdim=True)
                acc[hi] = acc[hi] * alpha + p @ _block_kv(values, j, hj, n)
                m[hi] = top
            if step < c - 1:
                kv = _shift(slot, kv)
        out = torch.cat([acc[h] / total[h] for h in range(2)], dim=-2)
        lse = torch.cat([m[h] + torch.log(total[h]) for h in range(2)], dim=-2)
        ctx.save_for_backward(q, k, v, out, lse, *pieces)  # the past pieces: no copies
        ctx.slot, ctx.scale, ctx.past = slot, scale, past
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *pieces = ctx.saved_tensors
        slot: ContextSlot = ctx.slot
        scale: float = ctx.scale
        past: int = ctx.past
        c, r = slot.shards.size, slot.shards.rank
        n = q.shape[-2] // 2
        future = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        qs, dos, lses = q.split(n, dim=-2), dout.split(n, dim=-2), lse.split(n, dim=-2)
        delta = (dout * out).sum(dim=-1, keepdim=True).split(n, dim=-2)
        dq = [torch.zeros_like(x) for x in qs]
        kv = [*pieces[:past], k, *pieces[past:], v]
        travelling = kv + [torch.zeros_like(t) for t in kv]  # then the keys' and values' grads
        w = past + 1
        for step in range(c):
            source = (r - step) % c
            keys, values = travelling[:w], travelling[w : 2 * w]
            # each piece's gradient, kept as its halves (or whole) until the block loop ends
            grads = [_halves(g, j, past, n) for j, g in enumerate(travelling[2 * w :])]
            for hi, j, hj, masked in _visible(slot, source, past):
                kb, vb = _block_kv(keys, j, hj, n), _block_kv(values, j, hj, n)
                scores = (qs[hi] @ kb.transpose(-2, -1)) * scale
                if masked:
                    scores = scores.masked_fill(future, float("-inf"))
                p = torch.exp(scores - lses[hi])
                gv, gk = grads[w + j], grads[j]
                gv[max(hj, 0)] = gv[max(hj, 0)] + p.transpose(-2, -1) @ dos[hi]
                ds = p * (dos[hi] @ vb.transpose(-2, -1) - delta[hi])
                dq[hi] = dq[hi] + (ds @ kb) * scale
                gk[max(hj, 0)] = gk[max(hj, 0)] + (ds.transpose(-2, -1) @ qs[hi]) * scale
            summed = [torch.cat(g, dim=-2) if len(g) > 1 else g[0] for g in grads]
            if step < c - 1:
                travelling = _shift(slot, [*keys, *values, *summed])
            else:  # the last block's gradients go home to their owner, the next rank
                travelling = _shift(slot, summed)
        dkeys, dvalues = travelling[:w], travelling[w:]
        return (
            torch.cat(dq, dim=-2), dkeys[past], dvalues[past], None, None, None,
            *dkeys[:past], *dvalues[:past],
        )  # fmt: skip


def _halves(grad: Tensor, j: int, past: int, n: int) -> list[Tensor]:
    """A travelling gradient as the blocks add into it: a past piece whole, the current
    segment's (piece ``past``, in the keys' and in the values' halves of the list) as its
    two chunks."""
    return list(grad.split(n, dim=-2)) if j % (past + 1) == past else [grad]


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    slot: ContextSlot,
    scale: float,
    *,
    past: tuple[Sequence[Tensor], Sequence[Tensor]] | None = None,
) -> Tensor:
    """Causal attention (B, H, 2n, D) of a cp rank's two chunks over the whole sequence, the
    keys and values passed around the cp ranks in ``cp - 1`` steps and their gradients
    back to their owners in ``cp`` (a ring: each rank holds one other block at a time and
    saves only its own queries, keys, values, output and log-sum-exp). A key chunk after a
    query chunk is never scored; no dropout on the probabilities (they are never held).

    Under sequence segments (:mod:`~zerobubble.runtime.sequence.kv`) the chunks are the
    current segment's, and ``past`` is this rank's keys and values of the earlier segments
    (the segment slot's :meth:`~zerobubble.runtime.sequence.kv.SegmentSlot.past` pieces,
    saved as they are: no copy): every rank's travel the ring with its own, every query
    sees them whole, and their gradients come back to their owners as the pieces'."""
    keys, values = ([], []) if past is None else (list(past[0]), list(past[1]))
    if len(keys) != len(values):
        raise ValueError(
            f"{slot.name}: ring attention's past has {len(keys)} key pieces but "
            f"{len(values)} value pieces"
        )
    return _Ring.apply(q, k, v, slot, scale, len(keys), *keys, *values)


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
    loose = unaware_attention(module, ContextAware)
    if loose is not None:
        raise ValueError(
            f"stage {stage}: {loose} is an attention layer that is not context-aware: "
            f"under context parallelism (cp={shards.size}) it would attend to its rank's "
            "two chunks only. Context-aware layers derive from "
            "zerobubble.runtime.sequence.cp.ContextAware (our GPT's attention, the Hugging "
            "Face adapter's decoder blocks); build the mesh with cp=1 for this model"
        )


def refuse_segments(module: nn.Module, stage: int | str) -> None:
    """Under sequence segments, refuse a context-aware module of a stage that does not take
    them (:attr:`ContextAware.takes_segments`): before any segment runs, rather than on the
    ranks that reach it first."""
    for name, m in module.named_modules():
        if isinstance(m, ContextAware) and not m.takes_segments:
            raise ValueError(
                f"stage {stage} {name or '(the stage)'} ({type(m).__name__}) does not take "
                "sequence segments under context parallelism yet (our GPT's layers do): run "
                "it with a schedule without segments, or build the mesh with cp=1"
            )


def shard_step(shards: ContextShards, args: Any, kwargs: Any, target: Any) -> tuple[Any, Any, Any]:
    """A step's ``(args, kwargs, target)`` cut to this rank's chunks (:func:`shard_batch`)."""
    return (
        shard_batch(args, shards, "the input batch"),
        shard_batch(kwargs, shards, "the input batch"),
        shard_batch(target, shards, "target"),
    )


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


def segments_refusal(chunks: Mapping[int, Any]) -> str | None:
    """Under cp with segments, why a context-aware module of these stages (``chunks``: stage
    -> a chunk with a ``module``) does not take them (:func:`refuse_segments`), or None."""
    try:
        for stage, chunk in sorted(chunks.items()):
            refuse_segments(chunk.module, stage)
    except ValueError as e:
        return str(e)
    return None
