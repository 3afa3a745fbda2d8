"""Hugging Face model directories into a pipeline and back, no rank holding the whole model.

:func:`load_pipeline` builds a :class:`~zerobubble.pipeline.Pipeline` from a local directory
as ``save_pretrained`` writes it (``config.json`` and ``*.safetensors``, one file or shards
listed in ``model.safetensors.index.json``). The model is built on the meta device and cut
into layers (:func:`~zerobubble.interop.hf.causal_lm_layers`); only the layers this rank's
stages hold get memory, their tensors read from the files under their HF names, their
non-persistent buffers (rotary tables: not in the files) recomputed from the config by the
model's own ``_init_weights``, as ``from_pretrained`` recomputes them. So a rank's parameter
memory is its stages' share of the model (about 1/P), and a model larger than one device
can be trained. :func:`save_pipeline` writes a trained pipeline back as such a directory
(each pipeline rank its stages' tensors, rank 0 the config and the index), which
``AutoModelForCausalLM.from_pretrained`` loads. Nothing is downloaded. See docs/hf.md,
"Pretrained directories".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from zerobubble.interop.hf import CausalLMLoss, _forked_rng, _transformers, causal_lm_layers
from zerobubble.interop.hf_experts import gather_hf_experts
from zerobubble.parallel.partition import layer_keys
from zerobubble.parallel.tied import find_shared
from zerobubble.pipeline import Pipeline, rank_layers
from zerobubble.runtime.stage import LossFn
from zerobubble.schedule.ir import Schedule

__all__ = [
    "CONFIG",
    "INDEX",
    "load_config",
    "load_pipeline",
    "meta_model",
    "per_rank_refusal",
    "save_pipeline",
    "weight_map",
    "whole_state",
]

CONFIG = "config.json"
"""The model's config in a Hugging Face directory."""

INDEX = "model.safetensors.index.json"
"""The index of a sharded checkpoint: ``weight_map`` gives each tensor's file."""


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Any:
    """The ``transformers`` config of the local model directory ``path`` (never downloads);
    ``overrides`` replace fields (e.g. ``attn_implementation="eager"``)."""
    folder = Path(path)
    if not (folder / CONFIG).is_file():
        what = "is not a directory" if not folder.is_dir() else f"has no {CONFIG}"
        raise ValueError(
            f"{folder} {what}: pass a Hugging Face model directory (save_pretrained writes "
            f"{CONFIG} and model*.safetensors there)"
        )
    auto = _transformers().AutoConfig
    return auto.from_pretrained(str(folder), local_files_only=True, **overrides)


def weight_map(path: str | os.PathLike[str]) -> dict[str, str]:
    """Every tensor name of the directory's safetensors files -> the file holding it: from
    :data:`INDEX` where there is one, else from the files' own headers."""
    folder = Path(path)
    index = folder / INDEX
    if index.is_file():
        found = json.loads(index.read_text()).get("weight_map")
        if not isinstance(found, dict):
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> file): re-save it")
        return {str(k): str(v) for k, v in found.items()}
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"{folder} has no *.safetensors files (nor {INDEX}): save the model with "
            "save_pretrained (safetensors is its default format)"
        )
    out: dict[str, str] = {}
    for file in files:
        with _safe_open(file) as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors reader, not a dict)
                out.setdefault(name, file.name)
    return out


def _safe_open(file: Path) -> Any:
    from safetensors import safe_open

    return safe_open(str(file), framework="pt")


def meta_model(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The causal LM of ``config`` on the meta device: every tensor a shape, no memory (its
    sizes, its layers' layout: :func:`load_pipeline` materialises a rank's share of it)."""
    with torch.device("meta"):
        model: nn.Module = _transformers().AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model


def _materialize(layers: Sequence[nn.Module], indices: Sequence[int], device: torch.device) -> None:
    """Give the layers at ``indices`` uninitialised memory on ``device``.

    Each meta Parameter becomes one new Parameter, put in place of every use of it in any
    layer, so a tie stays one object (``Module.to_empty`` makes a Parameter per module,
    which would untie a head from its embedding); the other layers stay on meta.
    """
    new: dict[int, Tensor] = {}
    old: list[Tensor] = []  # kept alive: their ids key ``new``
    for i in indices:
        for m in layers[i].modules():
            for p in m._parameters.values():
                if p is not None and p.is_meta and id(p) not in new:
                    empty = torch.empty_like(p, device=device)
                    new[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
                    old.append(p)
            for b in m._buffers.values():
                if b is not None and b.is_meta and id(b) not in new:
                    new[id(b)] = torch.empty_like(b, device=device)
                    old.append(b)
    for layer in layers:
        for m in layer.modules():
            stores: tuple[dict[str, Any], ...] = (m._parameters, m._buffers)
            for store in stores:
                for name, t in store.items():
                    if t is not None and id(t) in new:
                        store[name] = new[id(t)]


def _recompute_buffers(model: nn.Module, layer: nn.Module, where: str) -> None:
    """The non-persistent buffers of ``layer`` (not in the files), as ``from_pretrained``
    makes them: the model's ``_init_weights`` of each module holding one (its parameters
    are read from the files afterwards). Floating ones are NaN first, so one it leaves is
    found."""
    init_weights = getattr(model, "_init_weights")  # noqa: B009 (a transformers method)
    for name, m in layer.named_modules():
        held = [n for n in m._non_persistent_buffers_set if m._buffers.get(n) is not None]
        if not held:
            continue
        with torch.no_grad():
            for n in held:
                b = m._buffers[n]
                if b is not None and b.is_floating_point():
                    b.fill_(math.nan)
            init_weights(m)
        for n in held:
            b = m._buffers[n]
            if b is not None and b.is_floating_point() and bool(b.isnan().any()):
                raise ValueError(
                    f"{where}: non-persistent buffer {f'{name}.{n}'.lstrip('.')!r} is not in "
                    f"the safetensors files and {type(model).__name__}._init_weights does not "
                    "recompute it; load the whole model (AutoModelForCausalLM.from_pretrained) "
                    "and cut it with causal_lm_layers instead"
                )


def _wanted(
    layers: Sequence[nn.Module], indices: Sequence[int]
) -> dict[str, tuple[Tensor, tuple[str, ...]]]:
    """This rank's tensors to read: HF name -> (its tensor, the names to read it under: the
    name itself, then a tie's other names, as a tied head is saved once under the
    embedding's name)."""
    keys = layer_keys(list(layers))
    ties = find_shared(list(layers), keys, [range(len(layers))])
    aliases = {n: tp.source_names for tp in ties for n in tp.source_names}
    out: dict[str, tuple[Tensor, tuple[str, ...]]] = {}
    seen: set[int] = set()
    for i in indices:
        namer = getattr(layers[i], "source_name", None)
        for name, t in layers[i].state_dict(keep_vars=True).items():
            if id(t) in seen:
                continue
            seen.add(id(t))
            key = str(namer(name)) if namer is not None else f"{keys[i]}.{name}"
            out[key] = (t, (key, *(a for a in aliases.get(key, ()) if a != key)))
    return out


@dataclass(frozen=True)
class _Merged:
    """A model tensor that ``transformers`` assembles from several checkpoint tensors: each
    part's checkpoint names stacked on a new dim 0 (``MergeModulelist(dim=0)``: the experts in
    order), the parts then concatenated on dim 1 (``Concatenate(dim=1)``: gate, then up)."""

    parts: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class _Names:
    """Where each model tensor is in a directory written under the checkpoint's names."""

    renamed: dict[str, str]
    """Model name -> the one checkpoint name it is stored under."""
    merged: dict[str, _Merged]


_MERGES = (("MergeModulelist", 0), ("Concatenate", 1))
"""The converter operations read per rank, in this order (a prefix of it)."""


def _conversions(model: nn.Module) -> list[Any]:
    """``transformers``' weight conversions of ``model`` (what ``from_pretrained`` applies to
    the checkpoint's names: renamings and converters), fresh (they keep matching state)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    pretrained: Any = model  # a transformers PreTrainedModel
    return list(get_model_conversion_mapping(pretrained))


def per_rank_refusal(config: Any) -> str:
    """Why :func:`load_pipeline` cannot read a directory of ``config``'s family per rank;
    '' where it can: a family ``transformers`` loads by name, by renamings, or by converters
    that stack per-expert tensors and concatenate them (Mixtral, Qwen2/3-MoE, OLMoE,
    DeepSeek-V2/3 and the others on Qwen2-MoE's mapping). Any other conversion (splitting,
    transposing, interleaving, ...) names itself here."""
    from transformers.core_model_loading import WeightConverter

    for c in _conversions(meta_model(config)):
        if not isinstance(c, WeightConverter):
            continue
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in c.operations]
        if len(c.target_patterns) != 1 or not ops or ops != list(_MERGES[: len(ops)]):
            return (
                f"{getattr(config, 'model_type', '?')} checkpoints are converted on loading by "
                f"{c!r} with {ops}, which load_pipeline does not apply; load the model whole "
                "(from_pretrained), cut it with causal_lm_layers, and save_pipeline writes a "
                "directory under the modules' names that load_pipeline reads per rank"
            )
    return ""


def _checkpoint_names(model: nn.Module, files: Mapping[str, str]) -> _Names:
    """The model names of the files' tensors, as ``from_pretrained`` maps them: every
    checkpoint name through ``transformers``' renamings and at most one converter
    (``rename_source_key``, in its natural key order); names only, no tensor is read."""
    from transformers.core_model_loading import (
        WeightConverter,
        dot_natural_key,
        rename_source_key,
    )

    conversions = _conversions(model)
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    renamings = [c for c in conversions if not isinstance(c, WeightConverter)]
    meta = dict.fromkeys(model.state_dict(), True)
    prefix = getattr(model, "base_model_prefix", None)
    renamed: dict[str, str] = {}
    parts: dict[str, dict[str, list[str]]] = {}
    for name in sorted(files, key=dot_natural_key):
        key, pattern = rename_source_key(name, renamings, converters, prefix, meta)
        if key not in meta and name in meta:
            key, pattern = name, None
        if pattern is None:
            renamed.setdefault(key, name)
        else:
            parts.setdefault(key, {}).setdefault(pattern, []).append(name)
    order = {p: c.source_patterns for c in converters for p in c.source_patterns}
    merged = {
        key: _Merged(tuple(tuple(by[p]) for p in order[next(iter(by))] if p in by))
        for key, by in parts.items()
    }
    return _Names(renamed, merged)


def _read(
    folder: Path,
    files: Mapping[str, str],
    wanted: Mapping[str, Any],
    rank: int,
    model: nn.Module,
) -> None:
    """Copy every wanted tensor from its safetensors file, opening each file once. A name
    the files do not hold is looked up as ``from_pretrained`` maps the checkpoint's names
    (:func:`_checkpoint_names`, worked out once, on the first such name): renamed, or
    assembled from per-expert tensors."""
    by_file: dict[str, list[tuple[str, str]]] = {}
    merged: dict[str, _Merged] = {}
    names: _Names | None = None
    for key, (_, aliases) in wanted.items():
        found = next((n for n in aliases if n in files), None)
        if found is None:
            names = names or _checkpoint_names(model, files)
            found = next((names.renamed[n] for n in aliases if n in names.renamed), None)
            parts = next((names.merged[n] for n in aliases if n in names.merged), None)
            if found is None and parts is not None:
                merged[key] = parts
                continue
        if found is None or found not in files:
            why = per_rank_refusal(getattr(model, "config", None))
            raise ValueError(
                f"tensor {key!r} (rank {rank}'s stages) is in none of the safetensors files of "
                f"{folder} (they hold {len(files)} tensors)"
                + (f"; {why}" if why else f": the files are of another model than {CONFIG} says")
            )
        by_file.setdefault(files[found], []).append((key, found))
    for file, pairs in by_file.items():
        with _safe_open(folder / file) as f:
            held = set(f.keys())
            for key, name in pairs:
                if name not in held:
                    raise ValueError(
                        f"tensor {name!r} is not in {folder / file}, where {INDEX} says it is; "
                        "re-save the directory with save_pipeline or save_pretrained"
                    )
                _copy(f.get_tensor(name), wanted[key][0], f"tensor {name!r} of {folder / file}")
    for key, parts in merged.items():
        value = _assemble(folder, files, parts)
        _copy(value, wanted[key][0], f"{key!r} assembled from {parts.parts[0][0]!r}, ...")


def _assemble(folder: Path, files: Mapping[str, str], merged: _Merged) -> Tensor:
    """The model tensor of ``merged``: each part's tensors stacked, the stacks concatenated
    on dim 1, as ``transformers``' ``MergeModulelist(0)`` and ``Concatenate(1)`` do."""
    got: dict[str, Tensor] = {}
    needed = [n for part in merged.parts for n in part]
    for file in dict.fromkeys(files[n] for n in needed):
        with _safe_open(folder / file) as f:
            got.update((n, f.get_tensor(n)) for n in needed if files[n] == file)
    stacks = [torch.stack([got.pop(n) for n in part]) for part in merged.parts]
    return stacks[0] if len(stacks) == 1 else torch.cat(stacks, dim=1)


def _copy(value: Tensor, target: Tensor, what: str) -> None:
    if value.shape != target.shape:
        raise ValueError(
            f"{what} has shape {tuple(value.shape)} but the model of {CONFIG} has "
            f"{tuple(target.shape)}: the files are of another model; re-save the directory "
            "with save_pretrained"
        )
    with torch.no_grad():
        target.copy_(value)


def load_pipeline(
    path: str | os.PathLike[str],
    schedule: Schedule | str,
    *,
    microbatches: int | None = None,
    loss_fn: LossFn | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    config_overrides: Mapping[str, Any] | None = None,
    router_z_loss: float = 0.0,
    bias_update: float = 0.0,
    **pipeline_kwargs: Any,
) -> Pipeline:
    """This rank's :class:`~zerobubble.pipeline.Pipeline` of the HF causal LM saved at
    ``path``, holding only its stages' tensors.

    ``schedule``, ``microbatches`` and ``pipeline_kwargs`` (``boundaries``, ``group``,
    ``mesh``, ``options``, ...) are the Pipeline's; ``loss_fn`` defaults to
    :class:`~zerobubble.interop.hf.CausalLMLoss` of the model. The parameters take
    ``dtype`` (float32 by default: the master weights), on ``device`` (default CPU).
    ``config_overrides`` replace fields of ``config.json``; ``router_z_loss`` and
    ``bias_update`` go to :func:`~zerobubble.interop.hf.causal_lm_layers`, which runs
    without its check (a meta model cannot run; check the layout on a small config).
    Collective, like the Pipeline. Raises ValueError naming the directory, file or tensor
    where ``path`` is no model directory, or its files miss a tensor of the model.
    """
    folder = Path(path)
    config = load_config(folder, **dict(config_overrides or {}))
    files = weight_map(folder)
    model = meta_model(config, dtype)
    layers = causal_lm_layers(
        model, check=False, router_z_loss=router_z_loss, bias_update=bias_update
    )
    plan, mine = rank_layers(
        schedule,
        len(layers),
        microbatches=microbatches,
        boundaries=pipeline_kwargs.get("boundaries"),
        group=pipeline_kwargs.get("group"),
        mesh=pipeline_kwargs.get("mesh"),
    )
    rank = dist.get_rank()
    where = torch.device(device) if device is not None else torch.device("cpu")
    rng = _forked_rng(where)
    with rng:  # _init_weights may draw: the caller's generators are left as they were
        _materialize(layers, mine, where)
        for i in mine:
            _recompute_buffers(model, layers[i], f"{folder}: layer {i}")
    _read(folder, files, _wanted(layers, mine), rank, model)
    loss = loss_fn if loss_fn is not None else CausalLMLoss(model)
    return Pipeline(layers, loss, plan, device=device, copy_layers=False, **pipeline_kwargs)


def whole_state(pipe: Pipeline) -> dict[str, Tensor]:
    """``pipe``'s state dict with every entry the model's whole tensor (what
    :func:`save_pipeline` writes; detached, sharing memory where nothing was gathered): HF
    stacked experts gathered over ep, DTensors (tp, FSDP) over their meshes; collective
    over those peers, which hold the same stages and so the same entries in the same
    order."""
    mesh = pipe.executor.mesh
    state = gather_hf_experts(pipe, mesh) if mesh is not None else pipe.state_dict()
    return {
        name: (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        for name, t in state.items()
    }


def _file_of(pipe: Pipeline) -> str:
    """The safetensors file of ``pipe``'s pipeline rank, named as ``save_pretrained`` names
    shards."""
    return f"model-{pipe.rank + 1:05d}-of-{pipe.schedule.num_devices:05d}.safetensors"


def save_pipeline(pipe: Pipeline, path: str | os.PathLike[str], config: Any) -> None:
    """Write ``pipe``'s model to ``path`` as a Hugging Face directory, for
    ``AutoModelForCausalLM.from_pretrained``: ``config.json`` (``config``, the model's
    ``transformers`` config) and one safetensors file per pipeline rank with its stages'
    tensors under their HF names, listed in :data:`INDEX`.

    Every tensor is the model's whole one (tensor-parallel and FSDP shards and ep experts
    gathered); the first replica of each pipeline rank (dp, tp and ep rank 0) writes it.
    A tie (a head tied to the embedding) is written once, under its first name, where
    ``config.tie_word_embeddings`` ties them on loading; under each name otherwise. Every
    rank must see ``path`` (one file system). Collective over every rank of the job; call
    :meth:`~zerobubble.pipeline.Pipeline.drain` first where post-validation may still
    roll a step back.
    """
    folder = Path(path)
    if folder.is_dir() and (any(folder.glob("*.safetensors")) or (folder / INDEX).exists()):
        raise ValueError(
            f"{folder} already holds safetensors files: save into a new or empty directory "
            "(from_pretrained would read stale shards)"
        )
    dist.barrier()  # every rank has looked before any writes
    state = whole_state(pipe)
    if getattr(config, "tie_word_embeddings", False):
        later = {n for tp in pipe.shared for n in tp.source_names[1:]}
        state = {n: t for n, t in state.items() if n not in later}
    mesh = pipe.executor.mesh
    writer = mesh is None or (mesh.dp_rank == 0 and mesh.tp_rank == 0)
    file = _file_of(pipe)
    if writer:
        from safetensors.torch import save_file

        folder.mkdir(parents=True, exist_ok=True)
        tensors = {n: t.to("cpu").contiguous().clone() for n, t in state.items()}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
    every: list[dict[str, int] | None] = [None] * dist.get_world_size(pipe.executor.group)
    dist.all_gather_object(every, sizes, group=pipe.executor.group)
    if writer and pipe.rank == 0:
        _write_index(folder, config, every, pipe.schedule.num_devices)
    dist.barrier()  # the directory is whole when any rank returns


def _write_index(
    folder: Path, config: Any, every: Sequence[dict[str, int] | None], ranks: int
) -> None:
    """``config.json`` and :data:`INDEX` (each pipeline rank's names -> its file)."""
    config.save_pretrained(str(folder))
    files: dict[str, str] = {}
    total = 0
    for rank, sizes in enumerate(every):
        assert sizes is not None
        for name, size in sizes.items():
            files.setdefault(name, f"model-{rank + 1:05d}-of-{ranks:05d}.safetensors")
            total += size
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(files.items()))}
    (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
