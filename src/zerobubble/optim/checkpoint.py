"""Checkpoints at validated drain points, committed by an atomically written manifest.

With post-validation, parameters between an iteration's provisional step and
its validation are not a state anyone may observe. A checkpoint is therefore
taken only at a drain point (:meth:`PipelineTrainer.drain`: every rank's
newest step validated) and becomes visible only once every rank has confirmed
that it saved the same validated step::

    root/
      step_00000012/     torch.distributed.checkpoint files of all ranks
      manifest.json      {"step": 12, "path": "step_00000012", ...}: newest complete one

Rank 0 writes ``manifest.json.tmp``, fsyncs it and renames it over
``manifest.json`` (atomic on POSIX), after gathering every rank's
confirmation. A crash at any point before the rename leaves the previous
manifest, which names a complete checkpoint; :func:`load_checkpoint` reads only
what the manifest names.

Saved per rank: parameters and buffers of its stages, optimizer state (every
tensor, keyed by stage and parameter name), param-group settings, the
trainer's counters, the CPU RNG state and the caller's ``extra`` (e.g. the
data position).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from zerobubble.optim.faults import CrashPoint
from zerobubble.optim.trainer import PipelineTrainer, group_settings

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

MANIFEST = "manifest.json"


def save_checkpoint(
    trainer: PipelineTrainer, root: str | Path, *, extra: dict[str, Any] | None = None
) -> Path:
    """Drain, save every rank's state, and commit the manifest; returns the step directory.

    A collective: every rank calls it with the same ``root`` (a shared file
    system). ``extra`` is this rank's own data (plain numbers, strings, lists,
    dicts, tensors), handed back by :func:`load_checkpoint`.
    """
    trainer.drain()
    group = trainer.pipe.group
    step = trainer.versions.committed
    root = Path(root)
    name = f"step_{step:08d}"
    state, loose = _state_dict(trainer)
    meta = {"extra": extra or {}, "groups": group_settings(trainer.optimizer), "state": loose}
    state[f"rank{trainer.rank}.meta"] = _to_bytes(meta)
    state[f"rank{trainer.rank}.rng"] = torch.get_rng_state()
    dcp.save(state, checkpoint_id=root / name, process_group=group)
    trainer.faults.crash(trainer.rank, step, CrashPoint.DURING_SAVE)
    v = trainer.versions
    mine = (step, v.iteration, v.param_version, str(v.opt))
    confirmations: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(confirmations, mine, group=group)
    except Exception as e:
        raise RuntimeError(
            f"rank {trainer.rank}: checkpoint of step {step} is not committed: confirming the "
            f"save with the other ranks failed ({e}); the previous checkpoint stays the newest"
        ) from e
    if any(c != confirmations[0] for c in confirmations):
        raise RuntimeError(
            f"ranks saved different states {confirmations} (step, iteration, version, optimizer "
            f"state); the checkpoint {root / name} is not committed"
        )
    if trainer.rank == 0:
        manifest = {
            "step": step,
            "path": name,
            "world_size": trainer.world,
            "schedule": trainer.pipe.schedule.name,
            "num_stages": trainer.pipe.schedule.num_stages,
        }
        tmp = root / (MANIFEST + ".tmp")
        with open(tmp, "w") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, root / MANIFEST)
    dist.barrier(group=group)
    return root / name


def latest_checkpoint(root: str | Path) -> dict[str, Any] | None:
    """The committed manifest under ``root``, or None if nothing was committed yet."""
    path = Path(root) / MANIFEST
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def load_checkpoint(trainer: PipelineTrainer, root: str | Path) -> dict[str, Any] | None:
    """Restore the newest committed checkpoint into a fresh trainer; returns this rank's
    ``extra`` (None, and nothing changed, if no checkpoint was committed).

    A collective. The trainer must run the same schedule on the same number of
    ranks; it continues exactly where the saved run stood after its drain.
    """
    manifest = latest_checkpoint(root)
    if manifest is None:
        return None
    sched = trainer.pipe.schedule
    if (manifest["world_size"], manifest["num_stages"]) != (trainer.world, sched.num_stages):
        raise ValueError(
            f"checkpoint {manifest['path']} was saved by {manifest['world_size']} ranks with "
            f"{manifest['num_stages']} stages; this run has {trainer.world} ranks and "
            f"{sched.num_stages} stages: resume with the same pipeline layout"
        )
    path = Path(root) / manifest["path"]
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    state, _ = _state_dict(trainer, with_optimizer=False)
    names = _param_names(trainer)
    mine = {f"optim.{n}." for n in names.values()}
    for key, md in stored.items():
        owned = key in (f"rank{trainer.rank}.meta", f"rank{trainer.rank}.rng")
        if owned or any(key.startswith(prefix) for prefix in mine):
            assert isinstance(md, TensorStorageMetadata)
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, checkpoint_id=path, process_group=trainer.pipe.group)
    by_name = {n: p for p, n in ((p, names[id(p)]) for p in trainer.params)}
    opt_state: dict[Tensor, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("optim."):
            pname, field = key.removeprefix("optim.").rsplit(".", 1)
            p = by_name[pname]
            opt_state.setdefault(p, {})[field] = value.to(p.device) if field != "step" else value
    meta = _from_bytes(state[f"rank{trainer.rank}.meta"])
    for pname, fields in meta["state"].items():
        opt_state.setdefault(by_name[pname], {}).update(fields)
    trainer.optimizer.state.clear()
    trainer.optimizer.state.update(opt_state)
    for g, h in zip(trainer.optimizer.param_groups, meta["groups"], strict=True):
        g.update(h)
    torch.set_rng_state(state[f"rank{trainer.rank}.rng"])
    trainer.restore(manifest["step"])
    return meta["extra"]


def _param_names(trainer: PipelineTrainer) -> dict[int, str]:
    """``id(param) -> "s<stage>.<name>"``: unique across ranks."""
    return {
        id(p): f"s{s}.{n}"
        for s, chunk in trainer.pipe.chunks.items()
        for n, p in chunk.module.named_parameters()
    }


def _state_dict(
    trainer: PipelineTrainer, *, with_optimizer: bool = True
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Tensors to save (or load into, in place): parameters, buffers, optimizer state; and
    the optimizer state that is not a tensor (saved with the rank's metadata)."""
    out: dict[str, Any] = {}
    loose: dict[str, dict[str, Any]] = {}
    for s, chunk in trainer.pipe.chunks.items():
        for n, p in chunk.module.named_parameters():
            out[f"model.s{s}.{n}"] = p.detach()
        for n, b in chunk.module.named_buffers():
            out[f"buffer.s{s}.{n}"] = b
    if with_optimizer:
        names = _param_names(trainer)
        for p, st in trainer.optimizer.state.items():
            for field, value in st.items():
                if isinstance(value, Tensor):
                    out[f"optim.{names[id(p)]}.{field}"] = value
                else:
                    loose.setdefault(names[id(p)], {})[field] = value
    return out, loose


def _to_bytes(obj: Any) -> Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(t: Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
