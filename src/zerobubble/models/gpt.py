"""A small GPT, built as an ordered list of layers so a partitioner can cut it anywhere.

``build_gpt(cfg)`` returns ``nn.Sequential(embedding, block_0 .. block_{L-1},
final LayerNorm, LM head)``; :func:`gpt_loss` is the token-mean cross-entropy (under
tensor parallelism on the LM head's vocabulary shards: :mod:`~zerobubble.parallel.loss`).
Attention is written with plain matmul and softmax (no fused SDPA kernel) so
CPU results are deterministic and its saved tensors are ordinary autograd
tensors. Dropout (``GPTConfig.dropout``, off by default) draws from the default
generators, which the runtime seeds per (step, stage, microbatch)
(:mod:`~zerobubble.runtime.rng`), so runs with it stay reproducible bitwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from zerobubble.parallel.loss import cross_entropy, takes_sharded_logits
from zerobubble.parallel.tp import LayerLayout, dropout_kinds
from zerobubble.runtime.sequence.cp import ContextAware, ContextSlot, ring_attention
from zerobubble.runtime.sequence.kv import SegmentAware, joined_kv

__all__ = ["Block", "CausalSelfAttention", "GPTConfig", "GPTEmbedding", "build_gpt", "gpt_loss"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape and initialisation of :func:`build_gpt`'s model."""

    vocab_size: int = 256
    """Number of distinct token ids; also the LM head's output width."""
    max_seq_len: int = 64
    """Longest sequence the position embedding (and the causal mask) covers."""
    d_model: int = 64
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads per block; must divide ``d_model``."""
    n_layers: int = 2
    """Number of transformer blocks."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP, in multiples of ``d_model``."""
    layer_norm_eps: float = 1e-5
    """Epsilon of every LayerNorm."""
    init_std: float = 0.02
    """Std of the normal init of Linear and Embedding weights (biases start at 0).
    The two residual projections of each block use ``init_std / sqrt(2 * n_layers)``,
    as in GPT-2, so the residual stream's variance does not grow with depth."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the LM head (one Parameter). In a
    pipeline the first and last stages each hold a replica whose gradients are
    summed in stage order (see docs/runtime.md, "Shared and tied parameters")."""
    seed: int = 0
    """Seed of the initialisation; the global RNG is left untouched."""
    dropout: float = 0.0
    """Dropout probability, as GPT-2 places it: on the embedding's output, on the
    attention probabilities, and on each residual branch (attention and MLP) before it
    is added."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class GPTEmbedding(SegmentAware, ContextAware, nn.Module):
    """Token plus learned position embedding: (B, T) ids -> (B, T, d_model).

    In a segment scope (:mod:`zerobubble.runtime.sequence.kv`) the ids are tokens
    ``[start, start + T)`` of the sequence and take those positions; on a cp rank
    (:mod:`zerobubble.runtime.sequence.cp`) its two chunks' global positions (of the
    segment, under both).
    """

    takes_segments = True

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.max_seq_len = cfg.max_seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    tp_token_ids = True
    """Takes the token ids, whose length sequence parallelism shards (checked)."""

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`): the token table
        vocabulary-sharded, its output left a DTensor to meet the position table's, which
        is replicated (as a DTensor, so its gradient is exact on sequence shards); the sum
        handed on as local ``seq`` tensors, where the dropout draws sharded with sequence
        parallelism and replicated without."""
        kinds = {"tok": "embedding_dtensor", "pos": "replicated", "": "shard_output"}
        return kinds | dropout_kinds(self, {"drop": layout.sequence_parallel})

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[-1]
        cp = self.cp_slot
        start = 0 if self.segment_slot is None else self.segment_slot.start
        if cp is not None:  # a segment's own start, in the rank's tokens
            positions = cp.positions(t, idx.device, start)
            if int(positions.max()) >= self.max_seq_len:
                raise ValueError(
                    f"{cp.name}: tokens up to position {int(positions.max())} exceed "
                    f"max_seq_len={self.max_seq_len}"
                )
            return self.drop(self.tok(idx) + self.pos(positions))
        if start + t > self.max_seq_len:
            what = f"sequence length {t}" if start == 0 else f"segment [{start}, {start + t})"
            raise ValueError(f"{what} exceeds max_seq_len={self.max_seq_len}")
        return self.drop(
            self.tok(idx) + self.pos(torch.arange(start, start + t, device=idx.device))
        )


class CausalSelfAttention(SegmentAware, ContextAware, nn.Module):
    """Multi-head causal self-attention with separate q/k/v/out nn.Linear projections.

    In a segment scope the queries of tokens ``[start, start + T)`` attend over the earlier
    segments' keys and values followed by their own (each query row meets the same keys,
    in the same order, as in one pass), and the own keys and values go to the scope.

    On a cp rank (:mod:`zerobubble.runtime.sequence.cp`) its two chunks attend the whole
    sequence's keys by a ring (or, with attention dropout, over the gathered keys: each
    chunk ``[s, e)`` attends keys ``[0, e)`` as the segment ``[s, e)`` would); under both,
    the segment's chunks attend every rank's earlier segments' keys and values too.
    """

    holds_kv = True
    takes_segments = True
    future: Tensor  # a buffer: nn.Module's attribute lookup alone types it as Tensor | Module

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        future = torch.ones(cfg.max_seq_len, cfg.max_seq_len, dtype=torch.bool).triu(1)
        self.register_buffer("future", future, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        # The projections' width, not x's: under tensor parallelism q/k/v hold this rank's
        # heads only (d / tp columns), and with sequence parallelism x is a sequence shard
        # that q/k/v gather, so batch, length and width are read off their output.
        q, k, v = self.q(x), self.k(x), self.v(x)
        b, t, width = q.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, width // self.head_dim, self.head_dim).transpose(1, 2)  # (B,H,T,D)

        q, k, v = heads(q), heads(k), heads(v)
        if self.cp_slot is not None:
            y = self._context(q, k, v, self.cp_slot)
            return self.resid_drop(self.out(y.transpose(1, 2).reshape(b, t, width)))
        start, end = 0, t
        slot = self.segment_slot
        if slot is not None:
            start, end = slot.start, slot.start + t
            if end > self.future.shape[0]:
                raise ValueError(
                    f"{slot.name}: segment [{start}, {end}) exceeds max_seq_len="
                    f"{self.future.shape[0]}"
                )
            past_k, past_v = slot.past()
            if past_k:  # the joined keys and values are saved as their pieces (joined_kv)
                slot.record(k, v)
                with joined_kv([[*past_k, k], [*past_v, v]], dim=2) as (k, v):
                    return self._attend(q, k, v, start, end)
            # The first segment: the copies one pass's matmuls make of the keys and values
            # (the same layouts, so the same products), made here and handed to the later
            # segments too: its graph saves them, and nothing else holds them again.
            k, v = k.transpose(-2, -1).contiguous().transpose(-2, -1), v.contiguous()
            slot.record(k, v)
        return self._attend(q, k, v, start, end)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, start: int, end: int) -> Tensor:
        """Queries of tokens ``[start, end)`` over the keys and values of ``[0, end)``."""
        b, _, t, _ = q.shape
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(self.future[start:end, :end], float("-inf"))
        y = self.attn_drop(torch.softmax(scores, dim=-1)) @ v
        return self.resid_drop(self.out(y.transpose(1, 2).reshape(b, t, -1)))

    def _context(self, q: Tensor, k: Tensor, v: Tensor, cp: ContextSlot) -> Tensor:
        """A cp rank's attention (B, H, 2n, D). Without attention dropout a ring
        (:func:`~zerobubble.runtime.sequence.cp.ring_attention`; in a segment scope over
        the earlier segments' pieces too, the own keys and values recorded); with it, each
        chunk's queries over the gathered keys up to its end (masked columns never scored),
        whose probabilities the dropout draws on. Under segments that gathers every earlier
        segment's keys and values again in each segment, and its graph holds them until its
        backward (``cp`` times the rank's keys and values up to the segment's end, per
        layer): the ring holds none of them."""
        slot, past = self.segment_slot, None
        if slot is not None:  # the earlier segments' keys and values: this rank's pieces
            past = slot.past()
            slot.record(k, v)
        if not (self.training and self.attn_drop.p > 0):  # no probabilities to drop: a ring
            return ring_attention(q, k, v, cp, self.scale, past=past)
        keys, values, offset = cp.gather(k), cp.gather(v), 0
        if slot is not None and past is not None:  # tokens [0, the segment's end) in order:
            # every earlier segment's pieces gathered again (their gradients sent home)
            keys = torch.cat([*(cp.gather(t) for t in past[0]), keys], dim=2)
            values = torch.cat([*(cp.gather(t) for t in past[1]), values], dim=2)
            offset = slot.start * cp.shards.size  # the segment's first global position
        n = q.shape[2] // 2
        if keys.shape[2] > self.future.shape[0]:
            raise ValueError(
                f"{cp.name}: a sequence of {keys.shape[2]} tokens exceeds max_seq_len="
                f"{self.future.shape[0]}"
            )
        out = []
        for half, chunk in enumerate(cp.shards.chunks):
            start, end = offset + chunk * n, offset + (chunk + 1) * n
            scores = q[:, :, half * n : (half + 1) * n] @ keys[:, :, :end].transpose(-2, -1)
            scores = (scores * self.scale).masked_fill(self.future[start:end, :end], float("-inf"))
            out.append(self.attn_drop(torch.softmax(scores, dim=-1)) @ values[:, :, :end])
        return torch.cat(out, dim=2)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(cfg.mlp_ratio * d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def tp_kinds(self, layout: LayerLayout) -> dict[str, str]:
        """Tensor parallelism (:mod:`~zerobubble.parallel.tp`), Megatron's layout: q/k/v
        column-wise on one prepared input (our MLP has one column-wise ``fc``), the
        attention's output and ``proj`` row-wise, the norms on sequence shards with sequence
        parallelism. Attention probabilities are this rank's heads (their dropout draws
        sharded); the residual branches are sequence shards with sequence parallelism, the
        row-wise layers' all-reduced whole output without."""
        layout.divisible("attn", "n_heads", self.attn.n_heads)
        kinds = {
            "attn": "prepare_input",
            **dict.fromkeys(("attn.q", "attn.k", "attn.v"), "colwise_prepared"),
            "attn.out": "rowwise",
            "fc": "colwise",
            "proj": "rowwise",
        }
        sp = layout.sequence_parallel
        kinds |= dropout_kinds(self, {"attn.attn_drop": True, "attn.resid_drop": sp, "drop": sp})
        return kinds | layout.norms(self)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(self.act(self.fc(self.ln2(x)))))


def _init(model: nn.Sequential, cfg: GPTConfig) -> None:
    gen = torch.Generator().manual_seed(cfg.seed)
    residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                is_residual = name.endswith(("attn.out", ".proj"))
                std = residual_std if is_residual else cfg.init_std
                nn.init.normal_(m.weight, 0.0, std, generator=gen)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)


def build_gpt(cfg: GPTConfig) -> nn.Sequential:
    """``[GPTEmbedding, Block x n_layers, LayerNorm, Linear head]``, seeded by ``cfg.seed``."""
    with torch.random.fork_rng(devices=[]):  # module constructors draw from the global RNG
        embedding = GPTEmbedding(cfg)
        blocks = [Block(cfg) for _ in range(cfg.n_layers)]
        norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)
        head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        model = nn.Sequential(embedding, *blocks, norm, head)
        _init(model, cfg)
    if cfg.tie_embeddings:
        head.weight = embedding.tok.weight
    return model


@takes_sharded_logits
def gpt_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy: logits (B, T, V), targets (B, T) ids (-100: left out).

    Takes the logits sharded over the vocabulary (loss parallel under tp: the LM head's
    ``Shard(-1)`` DTensor, never gathered) as well as whole.
    """
    return cross_entropy(logits, targets)
