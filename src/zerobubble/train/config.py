"""Configuration of the schedule benchmark (``zerobubble bench`` / ``zerobubble profile``);
the trainer, ``zerobubble train``, is configured by :mod:`zerobubble.train.recipe`.

Five frozen sections (model, schedule, executor, optimizer, job), each field documented
once, by its docstring. :mod:`zerobubble.train.options` derives the command-line flags
and the TOML keys from these fields, so a new option is one new field (and its use).
Torch-free, so that building the command line imports no torch.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

NOT_AN_OPTION = MappingProxyType({"option": False})
"""Field metadata of what the job sets itself: neither a flag nor a TOML key."""


RECOMPUTE = ("none", "stage", "layers")
"""The activation-checkpointing settings of :class:`ExecutorSection` (see
:mod:`zerobubble.runtime.recompute`)."""

TERM_WEIGHTS = ("mean", "per_call")
"""How :class:`ExecutorSection` weighs the layers' loss terms (see
:data:`zerobubble.runtime.loss_terms.TERM_WEIGHTS`, which this torch-free module repeats)."""


TORCH_PROFILE_WARMUP, TORCH_PROFILE_ACTIVE = 1, 2
"""``job.torch_profile``: rounds of profiler warm-up (the job's own warm-up round by
default: first-step costs stay out), then rounds recorded (enough to compare steps,
small enough for a trace a browser opens)."""


def aliases(*flags: str) -> dict[str, tuple[str, ...]]:
    """Field metadata: flags that predate the sections and set the field too."""
    return {"aliases": flags}


def scaled_defaults(devices: int) -> dict[str, int]:
    """Defaults that grow with P: enough microbatches to fill the pipeline, enough
    layers for every rank."""
    return {
        "schedule.microbatches": max(ScheduleSection.microbatches, 2 * devices),
        "model.n_layers": max(ModelSection.n_layers, devices),
    }


def default_devices() -> int:
    """One pipeline rank per CPU core this process may run on (at least 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(cores, 2)


HF_MODELS = ("hf-gpt2", "hf-llama", "hf-mistral", "hf-qwen2")
"""The tiny Hugging Face configs shipped in ``zerobubble/models/configs``
(:data:`zerobubble.interop.hf.TINY_CONFIGS`)."""

SEGMENT_MODELS = ("gpt", *HF_MODELS)
"""The job's models whose attention runs in sequence segments (full attention, and the
sliding windows of hf-mistral and hf-qwen2)."""

GPT_FIELDS = ("d_model", "n_heads", "n_layers", "mlp_ratio", "tie_embeddings")
"""The model fields the job passes to :class:`~zerobubble.models.GPTConfig`."""

_ATTENTION = ("sdpa", "eager")


def hf_shipped(name: str) -> dict[str, object]:
    """The shipped config of tiny model ``name`` (JSON read without transformers)."""
    path = Path(__file__).resolve().parent.parent / "models" / "configs" / f"{name}-tiny.json"
    data: dict[str, object] = json.loads(path.read_text())
    return data


def _shipped_int(data: dict[str, object], *keys: str) -> int:
    value = next(data[k] for k in keys if k in data)
    assert isinstance(value, int)  # the shipped JSON files hold integers here
    return value


@dataclass(frozen=True)
class ModelSection:
    """Which model the job trains, and its shape. d_model, n_heads, n_layers, mlp_ratio
    and tie_embeddings shape the ``gpt`` model only: the job passes them to
    :class:`~zerobubble.models.GPTConfig` under the same names (vocabulary size,
    sequence length and seed come from the corpus and the job section); an ``hf-*``
    model takes its shape from the shipped config, with num_hidden_layers and
    attn_implementation (Hugging Face's names) overriding it."""

    d_model: int = field(default=128, metadata=aliases("--d-model"))
    """Width of the residual stream."""
    n_heads: int = field(default=4, metadata=aliases("--heads"))
    """Attention heads per block; must divide d_model."""
    n_layers: int = field(default=6, metadata=aliases("--layers"))
    """Transformer blocks; the model has n_layers + 3 layers (embedding, blocks, final
    LayerNorm, LM head) (default on the command line: max(6, P))."""
    mlp_ratio: int = 4
    """Hidden width of each block's MLP, in multiples of d_model."""
    tie_embeddings: bool = False
    """gpt: the LM head reuses the token embedding (a tied group across the first and
    last stages; hf-gpt2 and hf-qwen2 tie as their configs say)."""
    name: str = field(default="gpt", metadata=aliases("--model"))
    """gpt (zerobubble's own GPT), or a tiny Hugging Face causal LM from the config shipped
    in zerobubble/models/configs: hf-gpt2 (tied embedding and head, dropout 0.1), hf-llama
    (grouped-query attention, rotary), hf-mistral (sliding window), hf-qwen2 (tied, sliding
    window on some layers); hf-* needs transformers (the dev extra) and trains on padded
    rows of varying length with the token-normalised loss."""
    num_hidden_layers: int | None = None
    """hf-*: decoder blocks (Hugging Face's config name); the model has
    num_hidden_layers + 2 layers (embedding, blocks, norm with head); none: the shipped
    config's 6."""
    attn_implementation: str = "sdpa"
    """hf-*: the attention kernel, sdpa or eager (Hugging Face's config name)."""

    def __post_init__(self) -> None:
        if (
            self.name != "gpt"
            and self.name not in HF_MODELS
            and ("/" in self.name or os.sep in self.name)
        ):
            raise ValueError(
                f"model.name {self.name!r}: a Hugging Face directory is not a model of "
                f"zerobubble bench; use gpt or one of {', '.join(HF_MODELS)}, or train it "
                "with zerobubble train (docs/train.md)"
            )
        if self.name != "gpt" and self.name not in HF_MODELS:
            raise ValueError(
                f"model.name {self.name!r} is not a model of the job; pass --model gpt or one "
                f"of {', '.join(HF_MODELS)}"
            )
        if self.attn_implementation not in _ATTENTION:
            raise ValueError(
                f"model.attn_implementation must be sdpa or eager, got {self.attn_implementation!r}"
            )
        if self.num_hidden_layers is not None and self.num_hidden_layers < 1:
            raise ValueError(f"model.num_hidden_layers must be >= 1, got {self.num_hidden_layers}")
        for name in ("d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.name == "gpt" and self.d_model % self.n_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}: "
                "each head takes d_model / n_heads channels; pick --heads among the divisors "
                "of --d-model"
            )


@dataclass(frozen=True)
class ScheduleSection:
    """The pipeline and the memory budget of the plan."""

    devices: int = field(default=2, metadata=aliases("-p"))
    """Pipeline ranks P, one process each; at least 2 (default on the command line: one
    per CPU core, or WORLD_SIZE under torchrun)."""
    microbatches: int = field(default=8, metadata=aliases("-m"))
    """Microbatches per step M (default on the command line: max(8, 2P))."""
    mem_limit: int | None = field(default=None, metadata=aliases("--mem-limit"))
    """Activation bytes per device the plan may hold; none: mem_ratio x 1F1B's peak
    predicted from the profile."""
    mem_ratio: float = field(default=1.5, metadata=aliases("--mem-ratio"))
    """Without mem_limit: the limit as this multiple of 1F1B's predicted activation peak
    (with recompute, of the larger of that peak and one microbatch's M_W, which every B
    rebuilds)."""

    segments: int = field(default=1, metadata=aliases("--segments"))
    """Sequence segments per microbatch k (sequence-level pipelining, see
    docs/long-context.md); above 1 the plan's candidates also cut every sequence into k
    segments of equal measured work (and into 2, 4, ... fewer) under seq-zb and seq1f1b,
    and the trials measure the best of them. Every schedule then trains a loss summed over
    tokens and divided by the batch's count (labels shifted once for the whole sequence),
    and hf-* batches all have job.seq_len tokens (their rows still padded); without
    recompute."""

    def __post_init__(self) -> None:
        if self.segments < 1:
            raise ValueError(f"schedule.segments must be >= 1, got {self.segments}")
        if self.devices < 2:
            raise ValueError(
                f"schedule.devices must be >= 2, got {self.devices}: the job profiles and "
                "compares pipeline schedules, which need two ranks or more; pass -p 2 or more"
            )
        if self.microbatches < 1:
            raise ValueError(f"schedule.microbatches must be >= 1, got {self.microbatches}")
        if self.mem_limit is not None and self.mem_limit <= 0:
            raise ValueError(f"schedule.mem_limit must be > 0 bytes, got {self.mem_limit}")
        if not (math.isfinite(self.mem_ratio) and self.mem_ratio > 0):
            raise ValueError(
                f"schedule.mem_ratio must be a finite number > 0, got {self.mem_ratio}"
            )


@dataclass(frozen=True)
class ExecutorSection:
    """How every phase's executor runs (see
    :class:`~zerobubble.executor.ExecutorOptions`; the job sets fusion per phase)."""

    comm_timeout_s: float = 120.0
    """Longest wait on a peer, in seconds, before failing with an error naming it."""
    recv_lookahead: int = 2
    """How many compute actions before its consumer a receive is posted."""
    recompute: str = field(default="none", metadata=aliases("--recompute"))
    """Activation checkpointing of every phase's stages: none; stage (F keeps each
    stage's input, B recomputes the stage); layers (F keeps each layer's input, B
    recomputes the layers). W is unchanged; the plan costs B one forward more and M_B
    the kept inputs (measured)."""
    term_weight: str = "mean"
    """How each microbatch's loss terms (a mixture of experts' router losses) weigh in the
    step's objective: mean (1 / (M * dp) each: the step's term is the mean over the global
    batch's microbatches, whatever M and dp) or per_call (Hugging Face's: each term is part
    of its microbatch's loss and weighted as it is). See docs/moe.md."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.comm_timeout_s) and self.comm_timeout_s > 0):
            raise ValueError(
                f"executor.comm_timeout_s must be a finite number > 0, got {self.comm_timeout_s}"
            )
        if self.recv_lookahead < 0:
            raise ValueError(f"executor.recv_lookahead must be >= 0, got {self.recv_lookahead}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"executor.recompute must be one of {', '.join(RECOMPUTE)}, got "
                f"{self.recompute!r}; pass --recompute none, stage or layers"
            )
        if self.term_weight not in TERM_WEIGHTS:
            raise ValueError(
                f"executor.term_weight must be one of {', '.join(TERM_WEIGHTS)}, got "
                f"{self.term_weight!r}; pass --executor.term-weight mean or per_call"
            )


@dataclass(frozen=True)
class OptimizerSection:
    """AdamW behind :mod:`zerobubble.optim`'s synchronous step."""

    lr: float = field(default=3e-3, metadata=aliases("--lr"))
    """AdamW learning rate."""
    grad_clip: float | None = field(default=1.0, metadata=aliases("--grad-clip"))
    """Clip the global gradient norm (over every stage) to this; none: no clipping."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optimizer.lr must be a finite number > 0, got {self.lr}")
        if self.grad_clip is not None and not (
            math.isfinite(self.grad_clip) and self.grad_clip > 0
        ):
            raise ValueError(
                f"optimizer.grad_clip must be a finite number > 0 (or none), got {self.grad_clip}"
            )


@dataclass(frozen=True)
class JobSection:
    """What the job measures and where it writes. Sizes default to a run of well under a
    minute on two CPU cores."""

    microbatch_size: int = field(default=4, metadata=aliases("--microbatch-size"))
    """Sequences per microbatch."""
    seq_len: int = field(default=64, metadata=aliases("--seq-len"))
    """Characters per sequence (hf-*: at most; each step's length T is drawn from
    [ceil(L/2), L], each row's from [ceil(T/2), T], rows right-padded to T)."""
    steps: int = field(default=8, metadata=aliases("--steps"))
    """Measured training steps of each of 1F1B, ZB-H1 and the plan (after the warm-up),
    taking turns."""
    baseline_steps: int = field(default=4, metadata=aliases("--baseline-steps"))
    """Profiling steps of each of 1F1B and ZB-H1 (after the warm-up), taking turns."""
    trials: int = field(default=3, metadata=aliases("--trials"))
    """How many of the plan's candidates (the plan and the fixed kinds that fit the limit,
    best prediction first) train job.trial_steps steps each, taking turns, before the
    fastest by measurement becomes the plan; 1: the best prediction, untried."""
    trial_steps: int = 2
    """Measured steps of each tried candidate (after the warm-up)."""
    warmup: int = field(default=1, metadata=aliases("--warmup"))
    """Steps run before measuring, in every phase; excluded from every figure."""
    layer_iters: int = 4
    """Measured iterations of the per-layer profile (after one warm-up)."""
    corpus_chars: int = 300_000
    """Characters of the stdlib corpus to read."""
    seed: int = field(default=0, metadata=aliases("--seed"))
    """Seed of the model and of the batch order (the same on every rank)."""
    out: str = field(default="out", metadata=aliases("--out"))
    """Folder for the profile, traces and picture."""
    timeout_s: float = field(default=900.0, metadata=aliases("--timeout"))
    """Seconds the whole job may take when this process launches the ranks."""
    torch_profile: str | None = field(default=None, metadata=aliases("--torch-profile"))
    """Folder for a torch.profiler (Kineto) trace of each rank, rank<r>.json, of the
    training rounds (a round: one step of each schedule; under zerobubble profile, the
    profiling rounds): one round of profiler warm-up, then two recorded (fewer when fewer
    run); CPU activities, and CUDA on a GPU. Every action runs in a range named like its
    event in our trace (zb.F s1 mb3, zb.send act s0->s1 mb3, zb.opt_step); none: no
    profile (default)."""
    profile_only: bool = field(default=False, metadata=NOT_AN_OPTION)
    """Stop after profiling and planning (``zerobubble profile``)."""

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "seq_len", "layer_iters", "corpus_chars"):
            if getattr(self, name) < 1:
                raise ValueError(f"job.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"job.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("trials", "trial_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"job.{name} must be >= 1, got {getattr(self, name)}")
        if self.baseline_steps < 1:
            raise ValueError(
                f"job.baseline_steps must be >= 1, got {self.baseline_steps}: "
                "the stages are profiled from them"
            )
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ValueError(f"job.timeout_s must be a finite number > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class TrainConfig:
    """What the job builds, measures, plans and trains; checks that span sections."""

    model: ModelSection = field(default_factory=ModelSection)
    schedule: ScheduleSection = field(default_factory=ScheduleSection)
    executor: ExecutorSection = field(default_factory=ExecutorSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    job: JobSection = field(default_factory=JobSection)

    def __post_init__(self) -> None:
        self._check_segments()
        P = self.schedule.devices
        if self.model.name == "gpt":
            n_layers = self.model.n_layers + 3
            if n_layers < P:
                raise ValueError(
                    f"{P} devices need at least {P} layers but the model has {n_layers} "
                    f"(embedding, {self.model.n_layers} blocks, norm, head); use --layers "
                    f"{P - 3} or more, or fewer devices"
                )
            return
        shipped = hf_shipped(self.model.name)
        blocks = self.model.num_hidden_layers
        if blocks is None:
            blocks = _shipped_int(shipped, "num_hidden_layers", "n_layer")
        if blocks + 2 < P:
            raise ValueError(
                f"{P} devices need at least {P} layers but {self.model.name} has {blocks + 2} "
                f"(embedding, {blocks} blocks, norm with head); use --model.num-hidden-layers "
                f"{P - 2} or more, or fewer devices"
            )
        positions = _shipped_int(shipped, "max_position_embeddings", "n_positions")
        if not 2 <= self.job.seq_len <= positions:
            raise ValueError(
                f"job.seq_len {self.job.seq_len}: {self.model.name} takes rows of 2 to "
                f"{positions} tokens (its max_position_embeddings); pass --seq-len in that range"
            )

    def _check_segments(self) -> None:
        k = self.schedule.segments
        if k == 1:
            return
        if self.model.name not in SEGMENT_MODELS:
            raise ValueError(
                f"--segments {k}: {self.model.name} does not run in sequence segments; use "
                f"--model {', '.join(SEGMENT_MODELS)}, or --segments 1"
            )
        if self.job.seq_len < max(4, k):
            raise ValueError(
                f"--segments {k} needs sequences of at least {max(4, k)} tokens (one per "
                f"segment, 4 to profile the segment cost), got --seq-len {self.job.seq_len}"
            )

    @property
    def batch_size(self) -> int:
        return self.schedule.microbatches * self.job.microbatch_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.job.seq_len
