"""What ``zerobubble train`` (the trainer) trains, and how: one TOML in torchtitan's tables.

Each table is one frozen dataclass whose fields are the TOML keys (torchtitan's names where
torchtitan has the setting, ours beside them), each documented once by its docstring, so
``zerobubble train --help``, the TOML reader and the flags (``--parallelism.
tensor_parallel_degree 2``) all come from here (:func:`recipe_options`). Values are checked
where they are defined (``__post_init__``); checks that span tables are in
:class:`Recipe`. Torch-free, so that the command line imports no torch to refuse a typo.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from zerobubble import composition
from zerobubble.train.options import Option, closest, read_toml, table_options

__all__ = [
    "SCHEDULE_NAMES",
    "Recipe",
    "build_recipe",
    "load_recipe",
    "recipe_options",
    "schedule_kind",
]

SCHEDULE_NAMES = {
    "gpipe": "gpipe",
    "1f1b": "1f1b",
    "interleaved1f1b": "interleaved-1f1b",
    "zbh1": "zb-h1",
    "zbh2": "zb-h2",
    "zerobubble": "zb-h1",
    "interleavedzerobubble": "zb-h1",
    "zbv": "zbv",
    "zbvzerobubble": "zbv",
    "dualpipev": "dualpipev",
    "seq1f1b": "seq1f1b",
    "seqzb": "seq-zb",
    "seqzbv": "seq-zbv",
    "vhalf": "v-half",
    "vmin": "v-min",
    "auto": "auto",
}
"""``pipeline_parallel_schedule`` (case, ``-`` and ``_`` ignored: torchtitan's ``1F1B``,
``ZBVZeroBubble``, ``DualPipeV`` and our ``zb-h1``) -> the generator kind it runs."""

_DECAY = ("cosine", "linear")
_PRECISION = ("float32", "bfloat16", "bf16")
_AC = ("none", "full")


def schedule_kind(name: str) -> str:
    """The generator kind of ``pipeline_parallel_schedule`` ``name``; ValueError naming the
    closest valid name."""
    key = name.lower().replace("-", "").replace("_", "")
    if key not in SCHEDULE_NAMES:
        shown = sorted({*SCHEDULE_NAMES.values(), "1F1B", "ZBH1", "ZBVZeroBubble", "DualPipeV"})
        raise ValueError(
            f"parallelism.pipeline_parallel_schedule {name!r} is not a schedule"
            f"{closest(name, shown)}; use one of {', '.join(shown)}, or "
            "pipeline_parallel_schedule_csv = a schedule file"
        )
    return SCHEDULE_NAMES[key]


@dataclass(frozen=True)
class JobTable:
    """``[job]``: where the run writes."""

    dump_folder: str = "out/train"
    """Folder of the run's outputs: metrics, TensorBoard events, checkpoints (relative
    ``checkpoint.folder`` and ``metrics.save_tb_folder`` are inside it)."""


@dataclass(frozen=True)
class ModelTable:
    """``[model]``: the model to train."""

    name: str = "hf-llama"
    """A local Hugging Face directory (config.json and *.safetensors, as save_pretrained
    writes: each rank reads only its stages' tensors); a shipped tiny config (gpt, hf-gpt2,
    hf-llama, hf-mistral, hf-qwen2, hf-mixtral, hf-qwen3-moe); or module:function, a
    factory of your own returning the model's layers (a list, nn.Sequential or
    nn.ModuleList, the last layer giving logits) (docs/train.md)."""
    num_hidden_layers: int | None = None
    """Shipped hf-* configs only: decoder blocks (Hugging Face's name); none: the shipped
    config's."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("model.name is empty: name a model directory, config or factory")
        if self.num_hidden_layers is not None and self.num_hidden_layers < 1:
            raise ValueError(f"model.num_hidden_layers must be >= 1, got {self.num_hidden_layers}")


@dataclass(frozen=True)
class OptimizerTable:
    """``[optimizer]``: AdamW (the one optimizer the trainer builds)."""

    name: str = "AdamW"
    """AdamW only."""
    lr: float = 8e-4
    """Peak learning rate (after the warm-up)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay."""

    def __post_init__(self) -> None:
        if self.name.lower() != "adamw":
            raise ValueError(f"optimizer.name {self.name!r}: the trainer builds AdamW only")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"optimizer.lr must be a finite number > 0, got {self.lr}")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"optimizer.eps must be a finite number > 0, got {self.eps}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(frozen=True)
class LRSchedulerTable:
    """``[lr_scheduler]``: linear warm-up, then decay to ``min_lr_factor`` x lr."""

    warmup_steps: int = 0
    """Steps of linear warm-up from lr / (warmup_steps + 1) to lr."""
    decay_type: str = "cosine"
    """cosine or linear decay over the steps after the warm-up."""
    min_lr_factor: float = 0.0
    """The last step's learning rate as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_type not in _DECAY:
            raise ValueError(
                f"lr_scheduler.decay_type {self.decay_type!r}{closest(self.decay_type, _DECAY)}; "
                "use cosine or linear"
            )
        if not 0 <= self.min_lr_factor <= 1:
            raise ValueError(
                f"lr_scheduler.min_lr_factor must be in [0, 1], got {self.min_lr_factor}"
            )


@dataclass(frozen=True)
class TrainingTable:
    """``[training]``: length, batch and numerics of the run."""

    steps: int = 10
    """Optimizer steps of the whole run (a resumed run continues to this step)."""
    global_batch_size: int | None = None
    """Sequences per step over all data-parallel replicas (give this or
    local_batch_size)."""
    local_batch_size: int | None = None
    """Sequences per step of one data-parallel replica; default 8 when neither is given."""
    seq_len: int = 64
    """Tokens per sequence."""
    max_norm: float | None = 1.0
    """Clip the global gradient norm (every stage, every shard) to this; none: no clipping."""
    seed: int = 0
    """Seed of the model's initialisation (shipped configs, factories), of the stages'
    random ops and of the data order."""
    mixed_precision_param: str = "float32"
    """float32 (default), or bfloat16 (bf16): the forward runs under bf16 autocast; the
    parameters and AdamW's state stay float32."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"training.steps must be >= 1, got {self.steps}")
        if self.seq_len < 2:
            raise ValueError(f"training.seq_len must be >= 2, got {self.seq_len}")
        for name in ("global_batch_size", "local_batch_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"training.{name} must be >= 1, got {value}")
        if self.global_batch_size is not None and self.local_batch_size is not None:
            raise ValueError(
                "training.global_batch_size and training.local_batch_size both size the batch; "
                "give one"
            )
        if self.max_norm is not None and not (math.isfinite(self.max_norm) and self.max_norm > 0):
            raise ValueError(f"training.max_norm must be > 0 (or none), got {self.max_norm}")
        if self.mixed_precision_param not in _PRECISION:
            raise ValueError(
                f"training.mixed_precision_param {self.mixed_precision_param!r}: use float32 or "
                "bfloat16"
            )

    @property
    def bf16(self) -> bool:
        return self.mixed_precision_param in ("bfloat16", "bf16")


@dataclass(frozen=True)
class ParallelismTable:
    """``[parallelism]``: the mesh (world size = pp x dp_replicate x dp_shard x tp; expert
    parallelism shards experts inside the data-parallel ranks) and the schedule."""

    pipeline_parallel_degree: int = 2
    """Pipeline ranks."""
    data_parallel_replicate_degree: int = 1
    """Data-parallel replicas holding whole stages (gradients all-reduced)."""
    data_parallel_shard_degree: int = 1
    """Data-parallel replicas sharding their stages with FSDP2 (-1, torchtitan's "the rest":
    1); not together with data_parallel_replicate_degree > 1."""
    tensor_parallel_degree: int = 1
    """Tensor-parallel ranks per stage (the stage modules' default plans)."""
    expert_parallel_degree: int = 1
    """Ranks each MoE layer's experts are sharded over; must divide the data-parallel
    degree."""
    pipeline_parallel_schedule: str = "1F1B"
    """A schedule kind (1F1B, ZBH1, ZBVZeroBubble, DualPipeV, interleaved1F1B, GPipe, or our
    spelling: zb-h1, zbv, ...), or auto: profile a few steps, plan, measure the plan against
    1F1B and the fixed kinds, train with the fastest (docs/train.md)."""
    pipeline_parallel_schedule_csv: str | None = None
    """A schedule file (JSON, or PyTorch's CSV as torchtitan reads it) run instead of
    pipeline_parallel_schedule; it must have pipeline_parallel_degree devices."""
    pipeline_parallel_microbatch_size: int = 1
    """Sequences per microbatch; it must divide the local batch."""
    segments: int = 1
    """Ours: sequence segments per microbatch of the seq* kinds (docs/long-context.md)."""
    overlap: bool = False
    """Ours: overlapped F&B pairs (one microbatch's forward beside another's backward, e.g.
    MoE all-to-alls hidden behind compute) in the kinds that form them (zbv-auto, zb-auto,
    dualpipev; docs/moe.md)."""

    def __post_init__(self) -> None:
        for name in (
            "pipeline_parallel_degree",
            "data_parallel_replicate_degree",
            "tensor_parallel_degree",
            "expert_parallel_degree",
            "pipeline_parallel_microbatch_size",
            "segments",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"parallelism.{name} must be >= 1, got {getattr(self, name)}")
        if self.data_parallel_shard_degree < 1 and self.data_parallel_shard_degree != -1:
            raise ValueError(
                "parallelism.data_parallel_shard_degree must be >= 1 or -1, got "
                f"{self.data_parallel_shard_degree}"
            )
        if self.shard > 1 and self.data_parallel_replicate_degree > 1:
            raise ValueError(
                "parallelism: data_parallel_replicate_degree > 1 with data_parallel_shard_degree "
                "> 1 (HSDP) is not built; give one of them"
            )
        if self.dp % self.expert_parallel_degree:
            raise ValueError(
                f"parallelism.expert_parallel_degree {self.expert_parallel_degree} must divide "
                f"the data-parallel degree {self.dp} (experts are sharded inside the "
                "data-parallel ranks); raise data_parallel_replicate_degree"
            )
        if self.pipeline_parallel_schedule_csv is None:
            schedule_kind(self.pipeline_parallel_schedule)

    @property
    def shard(self) -> int:
        return max(self.data_parallel_shard_degree, 1)

    @property
    def dp(self) -> int:
        """Data-parallel replicas, replicated or sharded."""
        return self.data_parallel_replicate_degree * self.shard

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_degree * self.dp * self.tensor_parallel_degree


@dataclass(frozen=True)
class ActivationCheckpointTable:
    """``[activation_checkpoint]``."""

    mode: str = "none"
    """none, or full: each layer's input kept, the layer recomputed in the backward."""

    def __post_init__(self) -> None:
        if self.mode not in _AC:
            raise ValueError(
                f"activation_checkpoint.mode {self.mode!r}: use none or full (selective is "
                "not built)"
            )


@dataclass(frozen=True)
class CheckpointTable:
    """``[checkpoint]``: DCP checkpoints keyed by the model's names (HF names for HF
    models), committed by a manifest; a run resumes from the newest one by itself."""

    enable: bool = False
    """Save checkpoints, and resume from the folder's newest (or load_step's) one."""
    folder: str = "checkpoint"
    """Where, relative to job.dump_folder (or absolute)."""
    interval: int = 500
    """Save every this many steps (and after the last step)."""
    keep_latest_k: int = 10
    """Keep this many newest checkpoints, delete older ones once a newer one is committed;
    0: keep all."""
    load_step: int = -1
    """Resume from this committed step; -1: the newest, if any."""
    export_folder: str | None = None
    """Ours: after the last step, write the model as a Hugging Face directory here
    (from_pretrained loads it); also --export DIR."""

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(f"checkpoint.interval must be >= 1, got {self.interval}")
        if self.keep_latest_k < 0:
            raise ValueError(f"checkpoint.keep_latest_k must be >= 0, got {self.keep_latest_k}")
        if self.load_step < -1:
            raise ValueError(f"checkpoint.load_step must be >= 0 or -1, got {self.load_step}")


@dataclass(frozen=True)
class MetricsTable:
    """``[metrics]``."""

    log_freq: int = 1
    """Print a progress line every this many steps (the JSONL stream has every step)."""
    enable_tensorboard: bool = False
    """Write TensorBoard event files (needs tensorboard installed)."""
    save_tb_folder: str = "tb"
    """TensorBoard folder, relative to job.dump_folder."""

    def __post_init__(self) -> None:
        if self.log_freq < 1:
            raise ValueError(f"metrics.log_freq must be >= 1, got {self.log_freq}")


@dataclass(frozen=True)
class DataTable:
    """``[data]`` (ours): the text to train on."""

    path: str | None = None
    """A text file, a JSONL file (one record per line) or a folder of them, tokenised with the
    model directory's tokenizer; none: the stdlib corpus, character ids (the default)."""
    text_key: str = "text"
    """JSONL: the field holding each record's text."""
    packing: bool = True
    """Pack documents back to back into rows of seq_len tokens; false: one document per row,
    right-padded (padding left out of the loss)."""


@dataclass(frozen=True)
class Recipe:
    """The whole run; every table checked, and the checks that span tables."""

    job: JobTable = field(default_factory=JobTable)
    model: ModelTable = field(default_factory=ModelTable)
    optimizer: OptimizerTable = field(default_factory=OptimizerTable)
    lr_scheduler: LRSchedulerTable = field(default_factory=LRSchedulerTable)
    training: TrainingTable = field(default_factory=TrainingTable)
    parallelism: ParallelismTable = field(default_factory=ParallelismTable)
    activation_checkpoint: ActivationCheckpointTable = field(
        default_factory=ActivationCheckpointTable
    )
    checkpoint: CheckpointTable = field(default_factory=CheckpointTable)
    metrics: MetricsTable = field(default_factory=MetricsTable)
    data: DataTable = field(default_factory=DataTable)

    def __post_init__(self) -> None:
        par, mb = self.parallelism, self.parallelism.pipeline_parallel_microbatch_size
        local = self.local_batch_size
        if local * par.dp != self.global_batch_size or local % mb:
            raise ValueError(
                f"the batch: global {self.global_batch_size} sequences over {par.dp} "
                f"data-parallel replicas in microbatches of {mb}: the global batch must be "
                "dp x a multiple of pipeline_parallel_microbatch_size; pick sizes that divide"
            )
        if self.lr_scheduler.warmup_steps > self.training.steps:
            raise ValueError(
                f"lr_scheduler.warmup_steps {self.lr_scheduler.warmup_steps} is more than "
                f"training.steps {self.training.steps}"
            )
        composition.check(self.features, "the recipe")

    @property
    def features(self) -> set[str]:
        """The run's :mod:`~zerobubble.composition` features, checked before any rank starts
        (the executor checks them again)."""
        par = self.parallelism
        on = {
            "dp": par.dp > 1,
            "fsdp": par.shard > 1,
            "tp": par.tensor_parallel_degree > 1,
            "ep": par.expert_parallel_degree > 1,
            "segments": par.segments > 1,
            "overlap": par.overlap,
            "recompute": self.activation_checkpoint.mode != "none",
        }
        return {f for f, yes in on.items() if yes}

    @property
    def global_batch_size(self) -> int:
        t = self.training
        if t.global_batch_size is not None:
            return t.global_batch_size
        return (t.local_batch_size or 8) * self.parallelism.dp

    @property
    def local_batch_size(self) -> int:
        return self.global_batch_size // self.parallelism.dp

    @property
    def microbatches(self) -> int:
        return self.local_batch_size // self.parallelism.pipeline_parallel_microbatch_size

    def path(self, name: str) -> Path:
        """``name`` under the dump folder (an absolute ``name`` as it is)."""
        return Path(self.job.dump_folder) / name

    def lr_factor(self, step: int) -> float:
        """The learning rate of 0-based ``step`` as a fraction of ``optimizer.lr``: linear
        warm-up over ``warmup_steps``, then cosine or linear decay to ``min_lr_factor``."""
        s = self.lr_scheduler
        if step < s.warmup_steps:
            return (step + 1) / (s.warmup_steps + 1)
        span = self.training.steps - s.warmup_steps
        progress = min(max((step - s.warmup_steps) / max(span - 1, 1), 0.0), 1.0)
        if s.decay_type == "linear":
            shape = 1.0 - progress
        else:
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        return s.min_lr_factor + (1.0 - s.min_lr_factor) * shape


def _tables() -> dict[str, type]:
    return typing.get_type_hints(Recipe)


def recipe_options() -> tuple[Option, ...]:
    """Every key of the recipe, ``table.key``, in table and field order."""
    defaults = Recipe()
    return table_options((t, cls, getattr(defaults, t)) for t, cls in _tables().items())


def load_recipe(path: str | Path) -> dict[str, object]:
    """The keys a TOML file sets, ``{table.key: value}``, type-checked; errors name the
    file, the key and the closest valid one."""
    return read_toml(path, recipe_options())


def build_recipe(values: Mapping[str, object]) -> Recipe:
    """A :class:`Recipe` from ``{table.key: value}`` (later sources merged over earlier ones
    by the caller); ValueError names an unknown key's closest valid one."""
    known = {o.key for o in recipe_options()}
    by_table: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown key {key!r}{closest(key, known)}")
        table, name = key.split(".")
        by_table.setdefault(table, {})[name] = value
    return Recipe(**{t: cls(**by_table.get(t, {})) for t, cls in _tables().items()})
