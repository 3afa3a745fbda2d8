"""torchtitan's table and key names for ``zerobubble bench``'s TOML files and flags.

A user coming from torchtitan writes ``[parallelism] pipeline_parallel_degree = 4`` and
``[training] steps = 8``; the job's own options (:mod:`zerobubble.train.config`) are named
after what the job does (``schedule.devices``, ``job.steps``). Each table below is one
frozen dataclass whose fields are torchtitan's keys, documented once by their docstrings;
:func:`to_job` maps the keys a source sets onto the job's option keys. A key or value that
today's job cannot honour (data or tensor parallelism, a fixed schedule, checkpoints) is
refused with the reason, never dropped: a run that silently ignored ``tensor_parallel_degree
= 2`` would not be the run the user asked for. Torch-free, like the rest of the command line.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from zerobubble.train.config import JobSection


@dataclass(frozen=True)
class TitanJob:
    """``[job]``: torchtitan's keys beside the job's own (out, seed, ...)."""

    dump_folder: str | None = None
    """Folder for the profile, traces and picture: the job's job.out."""


@dataclass(frozen=True)
class TitanTraining:
    """``[training]``: the run's length, batch and clipping (None: the job's default)."""

    steps: int | None = None
    """Measured training steps of each schedule the job trains: job.steps."""
    global_batch_size: int | None = None
    """Sequences per step over the whole job; pipeline_parallel_microbatch_size must
    divide it, and the quotient is the microbatch count schedule.microbatches (data
    parallelism is 1, so this is also the local batch)."""
    local_batch_size: int | None = None
    """Sequences per step of one data-parallel replica; with one replica, the same as
    global_batch_size (give one of the batch keys)."""
    batch_size: int | None = None
    """torchtitan's older name of local_batch_size."""
    seq_len: int | None = None
    """Tokens per sequence: job.seq_len."""
    max_norm: float | None = None
    """Clip the global gradient norm to this: optimizer.grad_clip."""
    seed: int | None = None
    """Seed of the model and of the batch order: job.seed."""


@dataclass(frozen=True)
class TitanParallelism:
    """``[parallelism]``: the mesh. Today's job is a pipeline only, so every degree but
    the pipeline's must be 1 (data_parallel_shard_degree -1, torchtitan's "the devices
    left over", also means 1)."""

    pipeline_parallel_degree: int | None = None
    """Pipeline ranks P (at least 2): schedule.devices."""
    data_parallel_replicate_degree: int = 1
    """Data-parallel replicas: 1 only (the benchmark does not; zerobubble train does)."""
    data_parallel_shard_degree: int = -1
    """FSDP shards: -1 or 1 only (the benchmark does not; zerobubble train does)."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel ranks: 1 only (the benchmark does not; zerobubble train does)."""
    expert_parallel_degree: int = 1
    """Expert-parallel ranks: 1 only (the benchmark does not; zerobubble train does)."""
    pipeline_parallel_schedule: str = "auto"
    """auto only: the job profiles 1F1B and ZB-H1, plans a schedule, tries the plan's best
    candidates and trains 1F1B, ZB-H1 and the plan in turns; a fixed kind is not a choice
    yet."""
    pipeline_parallel_microbatch_size: int | None = None
    """Sequences per microbatch: job.microbatch_size."""


@dataclass(frozen=True)
class TitanActivationCheckpoint:
    """``[activation_checkpoint]``: torchtitan's recomputation modes in the job's terms."""

    mode: str = "none"
    """none or full (each block's input kept, the block recomputed in the backward: the
    job's executor.recompute = layers); selective is not built yet."""


@dataclass(frozen=True)
class TitanCheckpoint:
    """``[checkpoint]``: the benchmark writes no checkpoints (zerobubble train does), so
    enable must be false; the other keys are accepted (as torchtitan's files carry them)
    and unused."""

    enable: bool = False
    """false only (the benchmark writes none; zerobubble train does)."""
    folder: str = "checkpoint"
    """Where checkpoints would go (unused while enable is false)."""
    interval: int = 500
    """Steps between checkpoints (unused while enable is false)."""
    keep_latest_k: int = 10
    """Checkpoints kept (unused while enable is false)."""


@dataclass(frozen=True)
class TitanMetrics:
    """``[metrics]``: the job prints one line per step (loss, step time)."""

    log_freq: int = 1
    """1 only: a line for every step (a sparser log is not built yet)."""


TABLES: dict[str, type] = {
    "job": TitanJob,
    "training": TitanTraining,
    "parallelism": TitanParallelism,
    "activation_checkpoint": TitanActivationCheckpoint,
    "checkpoint": TitanCheckpoint,
    "metrics": TitanMetrics,
}
"""torchtitan's tables; [job] also holds the job's own keys, and [model] is the job's
own table (its name key is torchtitan's too)."""

RENAMES = {
    "job.dump_folder": "job.out",
    "training.steps": "job.steps",
    "training.seq_len": "job.seq_len",
    "training.max_norm": "optimizer.grad_clip",
    "training.seed": "job.seed",
    "parallelism.pipeline_parallel_degree": "schedule.devices",
    "parallelism.pipeline_parallel_microbatch_size": "job.microbatch_size",
}
"""torchtitan's keys that are one of the job's options under another name."""

BATCHES = ("training.global_batch_size", "training.local_batch_size", "training.batch_size")
"""Three names of one batch while data parallelism is 1."""

AC_MODES = {"none": "none", "full": "layers"}
"""activation_checkpoint.mode -> executor.recompute."""

GLOBAL_BATCH = "training.global_batch_size"
"""Kept through merging: the microbatch count it means depends on the final
microbatch size (:func:`resolve_batch`)."""

_ONLY = {
    "parallelism.data_parallel_replicate_degree": ((1,), "data parallelism"),
    "parallelism.data_parallel_shard_degree": ((-1, 1), "FSDP"),
    "parallelism.tensor_parallel_degree": ((1,), "tensor parallelism"),
    "parallelism.expert_parallel_degree": ((1,), "expert parallelism"),
    "parallelism.pipeline_parallel_schedule": (("auto",), "a fixed schedule kind"),
    "checkpoint.enable": ((False,), "checkpointing"),
    "metrics.log_freq": ((1,), "a log_freq other than 1"),
}
"""Keys whose only honoured values are these: anything else is refused, naming what the
job does not do yet."""

_UNUSED = ("checkpoint.folder", "checkpoint.interval", "checkpoint.keep_latest_k")


def to_job(values: Mapping[str, object], source: str) -> dict[str, object]:
    """``values`` of one source (a file or the command line) with torchtitan's keys
    mapped onto the job's; ValueError for a value the job cannot honour or a setting given
    under both names."""
    out = {k: v for k, v in values.items() if k not in KEYS}
    for key, value in values.items():
        if key not in KEYS:
            continue
        if key in RENAMES:
            native = RENAMES[key]
            if native in values:
                raise ValueError(f"{source}: {key} and {native} set the same option; give one")
            out[native] = value
        elif key in _ONLY:
            allowed, what = _ONLY[key]
            if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
                shown = " or ".join(_toml(a) for a in allowed)
                raise ValueError(
                    f"{source}: {key} = {_toml(value)}: zerobubble bench does not do {what}; "
                    f"use {shown}, or zerobubble train, the trainer, which does (docs/train.md)"
                )
        elif key in BATCHES:
            other = next((b for b in BATCHES if b != key and b in values), None)
            if other is not None:
                raise ValueError(f"{source}: {key} and {other} are the same batch; give one")
            if "schedule.microbatches" in values:
                raise ValueError(
                    f"{source}: {key} and schedule.microbatches both size the batch; give one"
                )
            out[GLOBAL_BATCH] = value
        elif key == "activation_checkpoint.mode":
            out.update(_recompute(value, values, source))
        else:
            assert key in _UNUSED, key  # every key of TABLES is handled above
    return out


def _recompute(mode: object, values: Mapping[str, object], source: str) -> dict[str, object]:
    if "executor.recompute" in values:
        raise ValueError(
            f"{source}: activation_checkpoint.mode and executor.recompute set the same "
            "option; give one"
        )
    if mode not in AC_MODES:
        raise ValueError(
            f"{source}: activation_checkpoint.mode = {_toml(mode)}: zerobubble bench does "
            "not do selective activation checkpointing; use 'none' or 'full' "
            "(or executor.recompute = 'stage')"
        )
    return {"executor.recompute": AC_MODES[str(mode)]}


def overlay(base: Mapping[str, object], top: Mapping[str, object]) -> dict[str, object]:
    """``top`` over ``base``; a batch size given one way in ``top`` replaces the other
    way in ``base`` (a flag ``-m 8`` overrides the file's global_batch_size)."""
    out = dict(base)
    if GLOBAL_BATCH in top or "schedule.microbatches" in top:
        out.pop(GLOBAL_BATCH, None)
        out.pop("schedule.microbatches", None)
    out.update(top)
    return out


def resolve_batch(values: Mapping[str, object]) -> dict[str, object]:
    """``values`` with the global batch turned into the microbatch count it means."""
    out = dict(values)
    batch = out.pop(GLOBAL_BATCH, None)
    if batch is None:
        return out
    size = out.get("job.microbatch_size", JobSection.microbatch_size)
    assert isinstance(batch, int) and isinstance(size, int)  # type-checked on the way in
    if batch < 1 or size < 1 or batch % size:
        raise ValueError(
            f"training.global_batch_size {batch} is not a positive multiple of the microbatch "
            f"size {size} (parallelism.pipeline_parallel_microbatch_size): the step runs "
            "global_batch_size / microbatch_size microbatches; pick sizes that divide"
        )
    out["schedule.microbatches"] = batch // size
    return out


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, str) else str(value)


KEYS = frozenset(f"{t}.{f.name}" for t, cls in TABLES.items() for f in fields(cls))
"""Every torchtitan key, ``table.key``."""
