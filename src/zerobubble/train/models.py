"""The models the job trains, with their loss and their batches.

``--model gpt`` is :mod:`zerobubble.models.gpt` on fixed-length character windows
with the per-sample mean loss. ``--model hf-*`` is a tiny Hugging Face causal LM
built from a config shipped in ``zerobubble/models/configs``
(:func:`zerobubble.interop.hf.tiny_model`), fed as a tokenizer would feed it:
right-padded rows of varying length with an attention mask, trained with the
model's own shifted cross-entropy normalised by the whole batch's token count
(:func:`padded_batch` states the rule). Both read the same stdlib corpus.

With sequence segments (``schedule.segments`` > 1) a loss call sees one segment, so
both train :class:`TokenSumLoss` instead: labels shifted once for the whole sequence
(:func:`shift_labels`), the cross-entropy summed over the call's tokens and divided by
the batch's count, so that segments and microbatches add up to the batch's token mean
(for ``gpt``, whose rows are all tokens, the same mean as its per-sample loss); and
hf-* batches all take the longest length (the cuts are fixed token positions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.models.corpus import CharCorpus
from zerobubble.runtime.microbatch import CountFn
from zerobubble.runtime.stage import LossFn
from zerobubble.train.config import GPT_FIELDS, TrainConfig

__all__ = [
    "IGNORE_INDEX",
    "JobModel",
    "TokenSumLoss",
    "build_job_model",
    "padded_batch",
    "shift_labels",
]

IGNORE_INDEX = -100
"""Label of a padding position: left out of the loss and of its token count."""


BatchFn = Callable[[int, torch.Generator, bool], tuple[tuple[Any, ...], Tensor]]
"""``batch(rows, generator, longest) -> (step arguments, target)``."""


@dataclass(frozen=True)
class JobModel:
    """What the job needs of a model: its layers, losses and batches."""

    layers: list[nn.Module]
    loss_fn: LossFn
    """The last stage's loss (``loss_fn(out, target, num_items)`` with :attr:`count_fn`)."""
    count_fn: CountFn | None
    """The whole batch's normaliser (non-ignored tokens), or None: per-sample mean."""
    profile_loss: Callable[[Tensor, Tensor], Tensor]
    """``loss(out, target)`` of one microbatch alone, for the per-layer profile."""
    batch: BatchFn
    """``batch(rows, generator, longest) -> (step arguments, target)``; ``longest``: rows of
    the longest length the job can draw (``seq_len``), what the profile is measured on."""
    hidden: int
    """Width of the hidden state between blocks (sizes the latency probe)."""
    summary: str


@dataclass(frozen=True)
class TokenSumLoss:
    """``loss(logits, labels, num_items)``: cross-entropy summed over the call's tokens (label
    ``t`` scores position ``t``; :data:`IGNORE_INDEX` left out), divided by ``num_items``,
    the batch's :meth:`count_fn`. Calls on segments and microbatches add up to the
    batch's token mean, whatever the cut (what a segment schedule needs)."""

    ignore_index: int = IGNORE_INDEX

    def __call__(self, logits: Tensor, labels: Tensor, num_items: int | Tensor) -> Tensor:
        ce = F.cross_entropy(
            logits.float().flatten(0, -2),
            labels.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return ce / num_items

    def count_fn(self, labels: Tensor) -> int:
        """The batch's scored tokens: labels that are not ignored."""
        return int((labels != self.ignore_index).sum())


def shift_labels(labels: Tensor) -> Tensor:
    """Labels shifted once for the whole sequence: position ``t`` gets label ``t + 1`` (what
    a causal LM's own loss shifts inside each call), the last position
    :data:`IGNORE_INDEX`."""
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:, :-1] = labels[:, 1:]
    return out


def build_job_model(cfg: TrainConfig, corpus: CharCorpus) -> JobModel:
    """The model ``cfg.model.name`` names, seeded by ``cfg.job.seed``."""
    if cfg.model.name == "gpt":
        return _gpt(cfg, corpus)
    return _hf(cfg, corpus)


def _gpt(cfg: TrainConfig, corpus: CharCorpus) -> JobModel:
    shape = {k: v for k, v in asdict(cfg.model).items() if k in GPT_FIELDS}
    gpt = GPTConfig(
        vocab_size=corpus.vocab_size, max_seq_len=cfg.job.seq_len, seed=cfg.job.seed, **shape
    )
    layers = list(build_gpt(gpt))

    def batch(rows: int, gen: torch.Generator, longest: bool) -> tuple[tuple[Any, ...], Tensor]:
        x, y = corpus.batch(rows, cfg.job.seq_len, gen)  # always seq_len long
        return (x,), y

    tied = ", tied embedding and head" if cfg.model.tie_embeddings else ""
    blocks = f"{cfg.model.n_layers} blocks, d={cfg.model.d_model}{tied}"
    summary = f"GPT: {len(layers)} layers ({blocks})"
    if cfg.schedule.segments > 1:
        return _token_summed(layers, batch, cfg.model.d_model, f"{summary}, token-summed loss")
    return JobModel(layers, gpt_loss, None, gpt_loss, batch, cfg.model.d_model, summary)


def _hf(cfg: TrainConfig, corpus: CharCorpus) -> JobModel:
    from zerobubble.interop import hf

    m = cfg.model
    overrides: dict[str, Any] = {"attn_implementation": m.attn_implementation}
    if m.num_hidden_layers is not None:
        overrides["num_hidden_layers"] = m.num_hidden_layers
    model = hf.tiny_model(m.name, seed=cfg.job.seed, **overrides)
    config: Any = model.config  # a transformers config (nn.Module types it Tensor | Module)
    if corpus.vocab_size > config.vocab_size:
        raise ValueError(
            f"{m.name}'s vocabulary has {config.vocab_size} ids but the corpus needs "
            f"{corpus.vocab_size}; the shipped config must have vocab_size >= {corpus.vocab_size}"
        )
    layers = hf.causal_lm_layers(model)
    loss = hf.CausalLMLoss(model, ignore_index=IGNORE_INDEX)
    pad = config.pad_token_id if config.pad_token_id is not None else 0

    def count(labels: Tensor) -> int:
        return hf.count_tokens(labels, IGNORE_INDEX)

    def batch(rows: int, gen: torch.Generator, longest: bool) -> tuple[tuple[Any, ...], Tensor]:
        ids, mask, labels = padded_batch(corpus, rows, cfg.job.seq_len, gen, pad, longest=longest)
        return ({"input_ids": ids, "attention_mask": mask},), labels

    tied = ", tied embedding and head" if config.tie_word_embeddings else ""
    summary = (
        f"{m.name} ({type(model).__name__}, {m.attn_implementation} attention): {len(layers)} "
        f"layers ({config.num_hidden_layers} blocks, d={config.hidden_size}{tied})"
    )
    if cfg.schedule.segments > 1:

        def whole(rows: int, gen: torch.Generator, longest: bool) -> tuple[tuple[Any, ...], Tensor]:
            (inputs,), labels = batch(rows, gen, True)  # fixed cuts: every batch the longest
            return (inputs,), shift_labels(labels)

        shifted = f"{summary}, labels shifted once and the loss summed over tokens"
        return _token_summed(layers, whole, config.hidden_size, shifted)
    return JobModel(
        layers,
        loss,
        count,
        lambda logits, labels: loss(logits, labels),
        batch,
        config.hidden_size,
        summary,
    )


def _token_summed(layers: list[nn.Module], batch: BatchFn, hidden: int, summary: str) -> JobModel:
    """The job's model under segments: :class:`TokenSumLoss` for every schedule."""
    summed = TokenSumLoss()
    return JobModel(
        layers,
        summed,
        summed.count_fn,
        lambda out, y: summed(out, y, summed.count_fn(y)),
        batch,
        hidden,
        summary,
    )


def padded_batch(
    corpus: CharCorpus,
    rows: int,
    seq_len: int,
    gen: torch.Generator,
    pad_id: int,
    *,
    longest: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``rows`` right-padded token rows: ``(input_ids, attention_mask, labels)``, ``(rows, T)``.

    The rule, drawn from ``gen`` in this order: the step's length ``T`` uniformly from
    ``[ceil(L/2), L]`` (L = ``seq_len``), so the sequence length changes from step to
    step; each row's length uniformly from ``[ceil(T/2), T]`` (at least 2 tokens, so
    every row has a target after the shift); each row's start in the corpus. Rows are
    padded on the right to ``T`` with ``pad_id``; ``attention_mask`` is 1 on tokens and
    0 on padding, ``labels`` are the ids with :data:`IGNORE_INDEX` on padding (the loss
    shifts them).

    ``longest``: ``T = L``, the longest batch the rule can give (activations grow with
    ``T``; the job profiles memory on it, so its plan holds on every step). ``T`` is still
    drawn, so the draws after it are the same, and the batch equals the one drawn where
    the draw gave ``L``.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 for padded batches, got {seq_len}")
    width = int(torch.randint(_half(seq_len), seq_len + 1, (), generator=gen))
    if longest:
        width = seq_len
    lengths = torch.randint(_half(width), width + 1, (rows,), generator=gen)
    starts = torch.randint(0, len(corpus.tokens) - width, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    ids = corpus.tokens[starts[:, None] + torch.arange(width)]
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, pad_id))
    labels = torch.where(mask.bool(), ids, torch.full_like(ids, IGNORE_INDEX))
    return ids, mask, labels


def _half(n: int) -> int:
    """ceil(n / 2), at least 2."""
    return max(2, -(-n // 2))
