"""Per-step metrics a user reads while the job runs: a progress line, a JSONL stream flushed every
step, and TensorBoard scalars when the ``tensorboard`` package is installed.

Only the lead rank should hold a :class:`MetricsLog`; the caller decides which rank that is (and
gathers what the others know, e.g. the job's peak memory, before recording).

``metrics.jsonl`` gets one JSON object per recorded step, appended and flushed at once (``tail -f``
works; a resumed run appends, so steps replayed after a resume appear again, the later row
current). Fields:

- ``step``, ``loss``, ``lr``, ``grad_norm`` (null when not measured), as recorded;
- ``tokens``: tokens of the step's global batch, all data-parallel ranks together;
- ``tokens_per_s``: ``tokens / step_s`` (1 decimal); ``step_ms``: the step's wall time (3 decimals);
- ``mfu``: model FLOPs utilisation as a fraction (0.42 is 42%): ``flops_per_token * tokens_per_s
  / peak_flops``, where ``peak_flops`` is the whole job's peak (one device's times the number of
  devices); null when either is unknown (6 decimals);
- ``memory_gib``: ``memory_bytes / 2**30`` (4 decimals);
- ``time``: wall-clock seconds since the epoch at recording (3 decimals).

A float that is not finite (a diverged loss) is written as null: JSON has no NaN.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

GIB = 2**30

#: bf16 dense (no sparsity) peak FLOP/s of NVIDIA GPUs, matched as a substring of the device name,
#: first match wins (so the specific variants come first). From the vendors' data sheets, as
#: torchtitan's ``get_peak_flops`` lists them.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("H800", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
)


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step measured.

    Attributes:
        step: The step number (as the job counts it).
        loss: The step's loss.
        lr: The learning rate the step used.
        grad_norm: The total gradient norm before clipping; None if not measured.
        tokens: Tokens of the step's global batch (all data-parallel ranks).
        step_s: The step's wall time, seconds.
        memory_bytes: Peak memory (see :func:`peak_memory_bytes`).
    """

    step: int
    loss: float
    lr: float
    grad_norm: float | None
    tokens: int
    step_s: float
    memory_bytes: int


class MetricsLog:
    """Writes each recorded step to ``folder/metrics.jsonl``, a progress line and TensorBoard.

    Args:
        folder: Where ``metrics.jsonl`` goes (created); None writes no file.
        flops_per_token: The model's training FLOPs per token (:func:`flops_per_token`).
        peak_flops: The job's peak FLOP/s, all devices together (:func:`peak_flops` times the
            device count); with ``flops_per_token`` it gives MFU.
        log_freq: A progress line every this many steps (and on the first record).
        tensorboard: False for none; True for event files in ``folder/tensorboard``; a path for
            them there. Refused at construction when the ``tensorboard`` package is missing.
        write_line: Where progress lines go (a console's print).
        clock: Wall-clock seconds (tests fix it).
    """

    def __init__(
        self,
        folder: Path | None,
        *,
        flops_per_token: float | None,
        peak_flops: float | None,
        log_freq: int = 1,
        tensorboard: bool | str | Path = False,
        write_line: Callable[[str], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        if log_freq < 1:
            raise ValueError(f"log_freq={log_freq}: must be >= 1")
        for name, value in (("flops_per_token", flops_per_token), ("peak_flops", peak_flops)):
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value}: must be > 0 (or None when unknown)")
        self.folder = Path(folder) if folder is not None else None
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.log_freq = log_freq
        self._write_line = write_line
        self._clock = clock
        self._records = 0
        self._closed = False
        self._writer = _summary_writer(tensorboard, self.folder)
        self._file = None
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._file = (self.folder / "metrics.jsonl").open("a", encoding="utf-8")

    @property
    def path(self) -> Path | None:
        """The JSONL file, or None when there is no folder."""
        return self.folder / "metrics.jsonl" if self.folder is not None else None

    def record(self, stats: StepStats) -> dict[str, Any]:
        """Append the step's JSON row (flushed), maybe a progress line; returns the row."""
        if self._closed:
            raise ValueError("MetricsLog.record after close(); record before closing it")
        if not stats.step_s > 0:
            raise ValueError(f"step {stats.step}: step_s={stats.step_s}, must be > 0")
        tokens_per_s = stats.tokens / stats.step_s
        mfu = None
        if self.flops_per_token is not None and self.peak_flops is not None:
            mfu = round(self.flops_per_token * tokens_per_s / self.peak_flops, 6)
        row: dict[str, Any] = {
            "step": stats.step,
            "loss": _finite(stats.loss),
            "lr": _finite(stats.lr),
            "grad_norm": _finite(stats.grad_norm),
            "tokens": stats.tokens,
            "tokens_per_s": round(tokens_per_s, 1),
            "step_ms": round(stats.step_s * 1e3, 3),
            "mfu": mfu,
            "memory_gib": round(stats.memory_bytes / GIB, 4),
            "time": round(self._clock(), 3),
        }
        if self._file is not None:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None:
            for key in ("loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "mfu", "memory_gib"):
                if row[key] is not None:
                    self._writer.add_scalar(key, row[key], stats.step)
            self._writer.flush()
        if self._records == 0 or stats.step % self.log_freq == 0:
            self._write_line(progress_line(stats, row))
        self._records += 1
        return row

    def close(self) -> None:
        """Close the file and the event writer; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._file is not None:
            self._file.close()
        if self._writer is not None:
            self._writer.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def progress_line(stats: StepStats, row: dict[str, Any]) -> str:
    """``step 12  loss 3.1416  lr 3.0e-04  grad 0.812  tok/s 12,345  mfu 1.2%  mem 0.41 GiB
    412 ms`` (grad and mfu only when known)."""
    parts = [f"step {stats.step}", f"loss {stats.loss:.4f}", f"lr {stats.lr:.1e}"]
    if stats.grad_norm is not None:
        parts.append(f"grad {stats.grad_norm:.3f}")
    parts.append(f"tok/s {row['tokens_per_s']:,.0f}")
    if row["mfu"] is not None:
        parts.append(f"mfu {row['mfu'] * 100:.1f}%")
    parts.append(f"mem {stats.memory_bytes / GIB:.2f} GiB")
    parts.append(f"{stats.step_s * 1e3:.0f} ms")
    return "  ".join(parts)


def flops_per_token(
    num_params: int, num_layers: int, hidden: int, seq_len: int, *, embedding_params: int = 0
) -> float:
    """Training FLOPs per token: ``6 * (N - embeddings) + 12 * L * H * T``.

    The PaLM paper's appendix B formula, as torchtitan uses it: 6 FLOPs per parameter per token
    (forward 2, backward 4) for the matmuls, where the embedding lookup does no matmul (pass its
    parameters as ``embedding_params``; an untied output projection is a matmul and counts), plus
    the attention scores and weighted sum: ``12 * L * H * T`` for ``L`` layers of width ``H``
    over ``T`` tokens. Recompute is not counted (MFU counts the model's FLOPs, not the
    hardware's).
    """
    for name, value in (
        ("num_params", num_params),
        ("num_layers", num_layers),
        ("hidden", hidden),
        ("seq_len", seq_len),
        ("embedding_params", embedding_params),
    ):
        if value < 0:
            raise ValueError(f"{name}={value}: must be >= 0")
    if embedding_params > num_params:
        raise ValueError(
            f"embedding_params={embedding_params} > num_params={num_params}: the embeddings are "
            f"part of the parameters"
        )
    return float(6 * (num_params - embedding_params) + 12 * num_layers * hidden * seq_len)


def peak_flops_for_name(name: str) -> float | None:
    """The bf16 dense peak FLOP/s of a GPU by its device name; None when not in the table."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in name.lower():
            return flops
    return None


def peak_flops(device: torch.device | str) -> float | None:
    """One device's bf16 dense peak FLOP/s: known NVIDIA GPUs by name; None for others and CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(device))


def peak_memory_bytes(device: torch.device | str) -> int:
    """CUDA's peak allocated bytes on a GPU; else the process's peak resident set size."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024  # Linux reports KiB


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


def _summary_writer(tensorboard: bool | str | Path, folder: Path | None) -> Any:
    """A ``SummaryWriter``, or None when not asked for; refuses when the package is missing."""
    if not tensorboard:
        return None
    if tensorboard is True:
        if folder is None:
            raise ValueError("tensorboard=True writes under the metrics folder: give a folder")
        logdir = folder / "tensorboard"
    else:
        logdir = Path(tensorboard)
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(
            "TensorBoard event files need the `tensorboard` package: pip install tensorboard "
            "(or turn tensorboard off)"
        ) from e
    return SummaryWriter(log_dir=str(logdir))
