"""Where the trainer's model comes from: a Hugging Face directory, a shipped tiny config, or a
user's factory; each built as this rank's :class:`~zerobubble.pipeline.Pipeline`.

A Hugging Face directory goes through :func:`~zerobubble.interop.hf_pretrained.load_pipeline`:
the model is built on the meta device and each rank reads only its stages' tensors, so
per-rank parameter memory is about 1/P of the model; checkpoint names ``transformers``
converts on loading are followed (Mixtral's and Qwen-MoE's per-expert tensors stacked, see
:func:`~zerobubble.interop.hf_pretrained.per_rank_refusal`). A family whose conversion it
does not apply is loaded whole (``from_pretrained``) on every rank instead, with a warning,
and an export writes it back under the modules' names, which load per rank.
A shipped tiny config and a factory build their layers on every rank (the Pipeline keeps
only this rank's stages).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zerobubble.executor import ExecutorOptions
from zerobubble.parallel.mesh import PipelineMesh
from zerobubble.parallel.partition import model_layers
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.stage import LossFn
from zerobubble.schedule.ir import Schedule
from zerobubble.train.recipe import Recipe

__all__ = ["IGNORE_INDEX", "ModelSource", "ShiftedTokenLoss", "check_name", "model_source"]

IGNORE_INDEX = -100
"""Label of a position left out of the loss (padding)."""

SHIPPED_HF = ("hf-gpt2", "hf-llama", "hf-mistral", "hf-qwen2", "hf-mixtral", "hf-qwen3-moe")
"""The shipped tiny Hugging Face configs the trainer takes by name."""


@dataclass(frozen=True)
class ShiftedTokenLoss:
    """``loss(logits, labels, num_items)``: next-token cross-entropy (position ``t`` scored
    against label ``t + 1``, :data:`IGNORE_INDEX` left out) summed over the call and divided
    by the batch's :meth:`count_fn`, so microbatches and replicas add up to the batch's token
    mean (the loss of ``gpt`` and of factories, fed the same batches as HF models)."""

    ignore_index: int = IGNORE_INDEX

    def __call__(self, logits: Tensor, labels: Tensor, num_items: int | Tensor) -> Tensor:
        ce = F.cross_entropy(
            logits[:, :-1].float().flatten(0, -2),
            labels[:, 1:].flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        return ce / num_items

    def count_fn(self, labels: Tensor) -> int:
        """The batch's scored tokens: shifted labels that are not ignored."""
        return int((labels[:, 1:] != self.ignore_index).sum())


BuildFn = Callable[[Schedule | str, int, PipelineMesh, ExecutorOptions], Pipeline]
"""``build(schedule, microbatches, mesh, options) -> this rank's Pipeline``."""


@dataclass(frozen=True)
class ModelSource:
    """A model the trainer can build per rank."""

    build: BuildFn
    num_layers: int
    """Layers the pipeline cuts (checked against the stages before building)."""
    vocab_size: int
    hf_config: Any
    """The ``transformers`` config (export writes it), or None: not a Hugging Face model."""
    tokenizer_dir: str | None
    """The model directory, whose tokenizer ``[data] path`` text is encoded with."""
    summary: str
    pad_id: int = 0
    shape: tuple[int, int, int, int] | None = None
    """``(parameters, embedding parameters, blocks, hidden width)`` of a Hugging Face model,
    for its FLOPs per token (MFU); None: unknown."""
    plan_layers: Callable[[], tuple[list[nn.Module], LossFn]] | None = None
    """``() -> (layers, loss_fn)`` whose tensors may be on the meta device: what the memory
    estimate (``--dry-run``) measures without building the model; None: the built layers."""


def model_source(recipe: Recipe) -> ModelSource:
    """The source ``model.name`` names; ValueError says what a name may be."""
    name = recipe.model.name
    seed = recipe.training.seed
    if name == "gpt":
        return _gpt(recipe)
    if name in SHIPPED_HF:
        from zerobubble.interop import hf

        overrides = {}
        if recipe.model.num_hidden_layers is not None:
            overrides["num_hidden_layers"] = recipe.model.num_hidden_layers
        model = hf.tiny_model(name, seed=seed, **overrides)
        return _whole_hf(model, None, f"{name} (shipped tiny config)")
    if recipe.model.num_hidden_layers is not None:
        raise ValueError(
            "model.num_hidden_layers resizes the shipped hf-* configs only; a directory's "
            "config.json or a factory sets its own size"
        )
    if Path(name).is_dir() or "/" in name:
        return _directory(Path(name))
    if ":" in name:
        return factory_source(name)
    raise ValueError(
        f"model.name {name!r} is no model: give a Hugging Face directory (config.json and "
        f"*.safetensors), one of gpt, {', '.join(SHIPPED_HF)}, or module:function"
    )


def _gpt(recipe: Recipe) -> ModelSource:
    from zerobubble.models import GPTConfig, build_gpt

    cfg = GPTConfig(vocab_size=256, max_seq_len=recipe.training.seq_len, seed=recipe.training.seed)
    layers = list(build_gpt(cfg))
    return _layers(layers, cfg.vocab_size, "gpt (zerobubble's small GPT)")


def _layers(layers: list[nn.Module], vocab: int, summary: str) -> ModelSource:
    loss = ShiftedTokenLoss()

    def build(
        schedule: Schedule | str, m: int, mesh: PipelineMesh, options: ExecutorOptions
    ) -> Pipeline:
        return Pipeline(
            layers, loss, schedule, microbatches=_m(schedule, m), mesh=mesh, options=options,
            count_fn=loss.count_fn,
        )  # fmt: skip

    return ModelSource(
        build, len(layers), vocab, None, None, summary, plan_layers=lambda: (layers, loss)
    )


def _m(schedule: Schedule | str, m: int) -> int | None:
    """A kind needs the microbatch count; a Schedule carries its own."""
    return m if isinstance(schedule, str) else None


def _whole_hf(model: nn.Module, folder: str | None, summary: str) -> ModelSource:
    from zerobubble.interop import hf

    config: Any = model.config
    layers = hf.causal_lm_layers(model)
    loss = hf.CausalLMLoss(model, ignore_index=IGNORE_INDEX)

    def build(
        schedule: Schedule | str, m: int, mesh: PipelineMesh, options: ExecutorOptions
    ) -> Pipeline:
        return Pipeline(
            layers, loss, schedule, microbatches=_m(schedule, m), mesh=mesh, options=options,
        )  # fmt: skip

    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return ModelSource(
        build, len(layers), config.vocab_size, config, folder, summary, pad, _shape(model),
        lambda: (layers, loss),
    )  # fmt: skip


def _shape(model: nn.Module) -> tuple[int, int, int, int]:
    """What :func:`~zerobubble.train.metrics.flops_per_token` needs of an HF model (a meta
    model's sizes too), each parameter once."""
    config: Any = model.config
    params = {id(p): p.numel() for p in model.parameters()}
    embed = model.get_input_embeddings().weight.numel()  # type: ignore[operator]
    return sum(params.values()), embed, config.num_hidden_layers, config.hidden_size


def _directory(folder: Path) -> ModelSource:
    from zerobubble.interop import hf_pretrained as hp

    config = hp.load_config(folder)
    hp.weight_map(folder)  # no safetensors: refused here, before any rank builds
    why = hp.per_rank_refusal(config)
    if why:
        from zerobubble.interop.hf import _transformers

        warnings.warn(
            f"{folder}: every rank loads the whole model ({why}); export the trained model "
            "(--export) for a directory that loads per rank",
            stacklevel=2,
        )
        auto = _transformers().AutoModelForCausalLM
        model = auto.from_pretrained(str(folder), local_files_only=True)
        return _whole_hf(model, str(folder), f"{folder} ({type(model).__name__}, whole)")
    meta = hp.meta_model(config, torch.float32)
    from zerobubble.interop.hf import causal_lm_layers

    num_layers = len(causal_lm_layers(meta, check=False))
    shape = _shape(meta)
    del meta

    def build(
        schedule: Schedule | str, m: int, mesh: PipelineMesh, options: ExecutorOptions
    ) -> Pipeline:
        return hp.load_pipeline(
            folder, schedule, microbatches=_m(schedule, m), mesh=mesh, options=options,
        )  # fmt: skip

    def plan_layers() -> tuple[list[nn.Module], LossFn]:
        from zerobubble.interop.hf import CausalLMLoss

        model = hp.meta_model(config, torch.float32)  # sizes only: no tensor is read
        layers = causal_lm_layers(model, check=False)  # checking would run the meta model
        return layers, CausalLMLoss(model, ignore_index=IGNORE_INDEX)

    pad = config.pad_token_id if config.pad_token_id is not None else 0
    summary = f"{folder} ({config.model_type}, each rank reads its stages' tensors)"
    return ModelSource(
        build, num_layers, config.vocab_size, config, str(folder), summary, pad, shape,
        plan_layers,
    )  # fmt: skip


def factory_source(spec: str) -> ModelSource:
    """One's own model from ``module:function`` (a layer list, or a module with
    ``pipeline_layers()``: :func:`~zerobubble.parallel.partition.model_layers`); ValueError
    naming what the factory returned otherwise."""
    made: Any = _import_factory(spec)()
    try:
        layers = model_layers(made)
    except ValueError as exc:
        raise ValueError(f"model.name {spec!r}: {exc}") from None
    if isinstance(layers, nn.Sequential | nn.ModuleList):
        layers = list(layers)
    if not isinstance(layers, list) or not all(isinstance(x, nn.Module) for x in layers):
        raise ValueError(
            f"model.name {spec!r}: the factory returned {type(made).__name__}; return the "
            "model's layers (a list, nn.Sequential or nn.ModuleList), or a module with a "
            "pipeline_layers() method that returns them"
        )
    vocab = getattr(made, "vocab_size", 256)
    return _layers(layers, int(vocab), f"{spec} ({len(layers)} layers)")


def _import_factory(spec: str) -> Callable[[], object]:
    """The function ``module:function`` names; ValueError when it does not import."""
    module_name, _, fn_name = spec.partition(":")
    try:
        fn: Callable[[], object] = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"model.name {spec!r}: cannot import {fn_name} from {module_name} ({exc}); give "
            "module:function with the module importable (on PYTHONPATH)"
        ) from None
    return fn


def check_name(recipe: Recipe) -> None:
    """Refuse a ``model.name`` that names nothing, before any rank starts (a directory
    without config.json or safetensors, a factory that does not import)."""
    name = recipe.model.name
    if name == "gpt" or name in SHIPPED_HF:
        return
    if Path(name).is_dir() or "/" in name:
        from zerobubble.interop.hf_pretrained import load_config, weight_map

        load_config(name)
        weight_map(name)
        return
    if ":" not in name:
        raise ValueError(
            f"model.name {name!r} is no model: give a Hugging Face directory (config.json and "
            f"*.safetensors), one of gpt, {', '.join(SHIPPED_HF)}, or module:function"
        )
    _import_factory(name)
