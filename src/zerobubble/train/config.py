"""Configuration of the end-to-end job (``zerobubble train`` / ``zerobubble profile``)."""

from __future__ import annotations

import os
from dataclasses import dataclass


def default_devices() -> int:
    """One pipeline rank per CPU core this process may run on (at least 2)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 2
    return max(cores, 2)


@dataclass(frozen=True)
class TrainConfig:
    """What the job builds, measures, plans and trains. Sizes default to a run of
    well under a minute on two CPU cores."""

    devices: int = 2
    """Pipeline ranks P (one process each). The CLI defaults it to the core count."""
    microbatches: int = 8
    """Microbatches per step M."""
    microbatch_size: int = 4
    """Sequences per microbatch."""
    seq_len: int = 64
    """Characters per sequence."""
    d_model: int = 128
    """Width of the GPT's residual stream."""
    n_heads: int = 4
    """Attention heads per block."""
    n_layers: int = 6
    """Transformer blocks (the model has n_layers + 3 layers: embedding, blocks,
    final LayerNorm, LM head)."""
    lr: float = 3e-3
    """AdamW learning rate."""
    grad_clip: float | None = 1.0
    """Clip the global gradient norm (over every stage) to this; None: no clipping."""
    steps: int = 8
    """Measured training steps of each of 1F1B, ZB-H1 and the plan (after the warm-up),
    taking turns."""
    baseline_steps: int = 4
    """Profiling steps of each of 1F1B and ZB-H1 (after the warm-up), taking turns."""
    warmup: int = 1
    """Steps run before measuring, in every phase; excluded from every figure."""
    layer_iters: int = 4
    """Measured iterations of the per-layer profile (after one warm-up)."""
    mem_limit: int | None = None
    """Activation-memory limit per device for the planner, in bytes; None: mem_ratio x
    1F1B's peak predicted from the profile."""
    mem_ratio: float = 1.5
    """The default limit as a multiple of 1F1B's activation peak."""
    corpus_chars: int = 300_000
    """Characters of the stdlib corpus to read."""
    seed: int = 0
    """Seed of the model and of the batch order (the same on every rank)."""
    out: str = "out"
    """Folder for the profile, traces and picture."""
    comm_timeout_s: float = 120.0
    """Longest wait on a peer before failing with a clear error."""
    profile_only: bool = False
    """Stop after profiling and planning (``zerobubble profile``)."""

    def __post_init__(self) -> None:
        for name in (
            "devices",
            "microbatches",
            "microbatch_size",
            "seq_len",
            "d_model",
            "n_heads",
            "n_layers",
            "layer_iters",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("steps", "baseline_steps", "warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.baseline_steps < 1:
            raise ValueError("baseline_steps must be >= 1: the stages are profiled from them")
        if self.n_layers + 3 < self.devices:
            raise ValueError(
                f"{self.devices} devices need at least {self.devices} layers but the model has "
                f"{self.n_layers + 3}; use --layers {self.devices - 3} or more, or fewer devices"
            )
        if self.mem_limit is not None and self.mem_limit <= 0:
            raise ValueError(f"mem_limit must be > 0 bytes, got {self.mem_limit}")
        if self.mem_ratio <= 0:
            raise ValueError(f"mem_ratio must be > 0, got {self.mem_ratio}")

    @property
    def batch_size(self) -> int:
        return self.microbatches * self.microbatch_size

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len
