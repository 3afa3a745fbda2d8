"""Checkpoints at validated drain points, committed by an atomically written manifest.

With post-validation, parameters between an iteration's provisional step and
its validation are not a state anyone may observe. A checkpoint is therefore
taken only at a drain point (:meth:`PipelineTrainer.drain`: every rank's
newest step validated) and becomes visible only once every rank has confirmed
that it saved the same validated step::

    root/
      step_00000012/       torch.distributed.checkpoint files of all ranks
      step_00000012.json   the commit record of step 12: its directory and every file's
                           size and SHA-256
      manifest.json        a copy of the newest commit record

Rank 0 writes the record, then ``manifest.json`` (each as a fsynced temporary
renamed over the target, atomic on POSIX), after gathering every rank's
confirmation. A crash at any point before the rename leaves the previous
manifest, which names a complete checkpoint; :func:`load_checkpoint` reads only
what a commit record names: by default the newest committed step's. A manifest
older than the newest record (a crash between the two renames, or a manifest
copied back) does not pick the step: the load warns (:class:`CheckpointWarning`)
and takes the newest record; ``step=`` names an older one.

Integrity: the files on disk are what a later run trusts, so every rank checks
the record's step against its directory and every file's size and checksum
before it reads anything (all ranks check the same files, so all fail together
instead of leaving some waiting in a collective). Damage raises
:class:`CheckpointError` naming the file, the step and the newest older
checkpoint that still verifies; ``load_checkpoint(trainer, root, step=N)``
falls back to it.

Saved per rank: parameters and buffers of its stages, optimizer state (every
tensor), param-group settings, the
trainer's counters, the CPU RNG state and the caller's ``extra`` (e.g. the
data position).

Over dp x pp (``mesh=``, a :class:`~zerobubble.parallel.mesh.PipelineMesh`) the
save and the load are collectives over the whole job rather than one pipeline:
the data-parallel replicas write one checkpoint. Model and optimizer entries are
keyed by one scheme, the model's names (``model.<name>``, ``buffer.<name>``,
``optim.<name>.<field>``; the trainer's :attr:`~PipelineTrainer.names`: a
:class:`~zerobubble.Pipeline`'s are the user's model's state-dict keys, a hand-built
executor's ``s<stage>.<name>``), and each holds the model's whole tensor as
:func:`~zerobubble.parallel.shards.global_view` gives it, so
``torch.distributed.checkpoint`` stores a replicated
tensor (DDP-style data parallelism: every replica holds the same) once, and
assembles FSDP's DTensor shards into the global tensor; loading reads each
rank's shard (or the whole tensor) back. The per-rank entries (metadata, RNG,
``extra``) are keyed by pipeline and dp rank. The record notes the dp size.

With tensor parallelism (stages parallelized over a tp mesh, see
:func:`~zerobubble.optim.trainer.tp_mesh_of`) every tp rank's pipeline saves into the
same checkpoint: the save is over the whole job, parameters and optimizer state are
stored as the DTensors they are (DCP writes each shard once and a replicated one once),
per-rank entries add the tp rank, and the record notes the tp size.

Resharding: a checkpoint loads into a job of another layout (pp, the stage cut, dp, tp,
FSDP or not) as long as its entries are keyed by the model's names (a
:class:`~zerobubble.Pipeline`'s trainer): every rank reads its parameters' and optimizer
entries' parts of the stored whole tensors (DCP reshards), the optimizer's non-tensor
state of every saved rank, and the param-group settings, ``extra`` and CPU RNG state of
the saving job's first rank (at the same layout each rank gets its own back). Stage-keyed
entries (a hand-built executor's) reload only into the same number of stages.

With expert parallelism a Hugging Face experts tensor, of which each ep rank holds rows,
is stored once, whole (a DTensor ``Shard(0)`` over the ``ep`` mesh: DCP writes each row
block once, whichever edp replica holds it); a per-expert module's parameters carry their
global expert index in their names. A tie's replicas are one entry (under the tie's first
name): every replica holds the same values.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import pickle
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import empty as dtensor_empty
from torch.futures import Future

from zerobubble.optim.faults import CrashPoint
from zerobubble.optim.trainer import PipelineTrainer, group_settings, stage_key
from zerobubble.parallel.mesh import PipelineMesh
from zerobubble.parallel.shards import global_view
from zerobubble.runtime.p2p.comm import exchange_bytes, set_timeout, transport_timeout

__all__ = [
    "CheckpointError",
    "CheckpointWarning",
    "committed_steps",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

MANIFEST = "manifest.json"
_RECORD = re.compile(r"step_(\d{8})\.json")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing or damaged.

    Attributes:
        file: The file that is missing or does not match its record.
        step: The step of the checkpoint that failed (None if none was found).
        fallback: The newest older committed step that verifies, or None.
    """

    def __init__(self, message: str, *, file: Path, step: int | None, fallback: int | None):
        super().__init__(message)
        self.file = file
        self.step = step
        self.fallback = fallback


class CheckpointWarning(UserWarning):
    """``manifest.json`` names an older step than the newest commit record: the newest is
    loaded (pass ``step=`` for another)."""


def save_checkpoint(
    trainer: PipelineTrainer,
    root: str | Path,
    *,
    extra: dict[str, Any] | None = None,
    mesh: PipelineMesh | None = None,
) -> Path:
    """Drain, save every rank's state, and commit the manifest; returns the step directory.

    A collective: every rank calls it with the same ``root`` (a shared file
    system). ``extra`` is this rank's own data (plain numbers, strings, lists,
    dicts, tensors), handed back by :func:`load_checkpoint`. ``mesh``: the job's
    mesh when the pipeline is one of several data-parallel replicas (every rank
    of the job then saves into one checkpoint).

    Waits are bounded by the executor's ``comm_timeout_s`` (the confirmation's by that
    plus this rank's time hashing its shards) and a rank that does not arrive, stalled or
    dead, is named in the :class:`~zerobubble.runtime.p2p.comm.PeerError`: at the start, at
    the confirmation and at the commit. ``torch.distributed.checkpoint``'s own collectives
    run inside torch: they get the group's transport timeout, ``comm_timeout_s`` while DCP
    plans and ``comm_timeout_s`` plus this rank's own write time once it wrote its shards
    (the wait for the slowest writer), and a rank that never arrives is named the same way.
    """
    _refuse_cp(mesh, "save")
    trainer.drain()
    group = _group(trainer, mesh)
    step = trainer.versions.committed
    root = Path(root)
    name = f"step_{step:08d}"
    state, loose = _state_dict(trainer)
    meta = {"extra": extra or {}, "groups": group_settings(trainer.optimizer), "state": loose}
    own = _own_key(trainer, mesh)
    state[f"{own}.meta"] = _to_bytes(meta)
    state[f"{own}.rng"] = torch.get_rng_state()
    timeout, device = trainer.pipe.p2p.timeout_s, trainer.pipe.device
    exchange = functools.partial(
        exchange_bytes, group=group, device=device, progress=trainer.pipe.p2p.progress
    )
    where = f"checkpoint of step {step} ({root / name})"
    # Every rank must be here before the save's own collectives, which only the process
    # group's timeout bounds: a rank that never comes is named within comm_timeout_s.
    exchange(
        b"",
        timeout_s=timeout,
        action=f"start of the {where}: nothing written yet",
        key=f"save/{root}/{name}/start",
    )
    _write_shards(trainer, group, state, root / name, step, timeout, where)
    trainer.faults.crash(trainer.rank, step, CrashPoint.DURING_SAVE)
    trainer.faults.stall(trainer.rank, step, CrashPoint.DURING_SAVE)
    files, confirmations, timeout = _hash_and_confirm(
        trainer, group, exchange, root, name, step, timeout, where
    )
    if dist.get_rank(group) == 0:
        for _, theirs in confirmations:
            files.update(theirs)
        files.update(_file_sums(root / name, "", skip=files))
        _write_records(trainer, mesh, root, name, step, files)
    exchange(
        b"",
        timeout_s=timeout,
        action=f"commit of the {where} by rank 0 (committed once its manifest.json is written)",
        key=f"save/{root}/{name}/commit",
    )
    return root / name


def _write_shards(
    trainer: PipelineTrainer,
    group: dist.ProcessGroup | None,
    state: dict[str, Any],
    folder: Path,
    step: int,
    timeout: float,
    where: str,
) -> None:
    """DCP's save of ``state`` into ``folder``, this rank's fault points before its write
    and the group's transport timeout raised by its duration after it."""

    def before_write() -> None:
        trainer.faults.crash(trainer.rank, step, CrashPoint.IN_WRITE)
        trainer.faults.stall(trainer.rank, step, CrashPoint.IN_WRITE)

    writer = _BoundedWriter(
        folder,
        before=before_write,
        after=lambda took: set_timeout(_pg(group), timedelta(seconds=timeout + took)),
    )
    with _dcp_bounded(trainer, group, f"torch.distributed.checkpoint's save of the {where}"):
        dcp.save(state, storage_writer=writer, process_group=group)


def _hash_and_confirm(
    trainer: PipelineTrainer,
    group: dist.ProcessGroup | None,
    exchange: Callable[..., list[bytes]],
    root: Path,
    name: str,
    step: int,
    timeout: float,
    where: str,
) -> tuple[dict[str, dict[str, Any]], list[Any], float]:
    """This rank's shards' sums, every rank's confirmation (its state and its sums) once
    all agree on the state saved, and the timeout the commit then waits.

    Each rank hashes the shards it wrote (DCP names them __<rank>_<n>.distcp, by rank in
    the group that saved), in parallel, before the confirmation; rank 0 hashes whatever
    is left (.metadata) afterwards. The confirmation waits comm_timeout_s past this rank's
    own hashing (a peer's shard of a similar size takes as long)."""
    v = trainer.versions
    mine = (step, v.iteration, v.param_version, str(v.opt))
    t0 = time.monotonic()
    files = _file_sums(root / name, f"__{dist.get_rank(group)}_")
    timeout += time.monotonic() - t0
    confirmations = [
        pickle.loads(c)
        for c in exchange(
            pickle.dumps((mine, files)),
            timeout_s=timeout,
            action=(
                f"confirmation of the {where}, which is not committed: the previous "
                "checkpoint stays the newest"
            ),
            key=f"save/{root}/{name}/confirm",
        )
    ]
    states = [c[0] for c in confirmations]
    if any(c != states[0] for c in states):
        raise RuntimeError(
            f"ranks saved different states {states} (step, iteration, version, optimizer "
            f"state); the checkpoint {root / name} is not committed"
        )
    return files, confirmations, timeout


def _write_records(
    trainer: PipelineTrainer,
    mesh: PipelineMesh | None,
    root: Path,
    name: str,
    step: int,
    files: dict[str, dict[str, Any]],
) -> None:
    """Rank 0's commit: the step's record, then the manifest (the same record)."""
    record = {
        "step": step,
        "path": name,
        "world_size": trainer.world,
        "schedule": trainer.pipe.schedule.name,
        "num_stages": trainer.pipe.schedule.num_stages,
        "dp_size": 1 if mesh is None else mesh.dp_size,
        "tp_size": _tp_size(trainer),
        "keys": _key_kind(trainer),
        "first": _own_key(trainer, mesh),
        "files": dict(sorted(files.items())),
    }
    _write_json(root / f"{name}.json", record)
    _write_json(root / MANIFEST, record)


def latest_checkpoint(root: str | Path) -> dict[str, Any] | None:
    """The committed manifest under ``root`` (not verified), or None if nothing was
    committed yet; a manifest that is not a readable record raises :class:`CheckpointError`."""
    root = Path(root)
    path = root / MANIFEST
    if not path.exists():
        if committed_steps(root):
            raise _error(root, path, None, "is missing")
        return None
    return _read_record(root, path, None)


def committed_steps(root: str | Path) -> list[int]:
    """Steps that have a commit record under ``root``, oldest first (not verified)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (_RECORD.fullmatch(f.name) for f in root.iterdir())
    return sorted(int(m.group(1)) for m in found if m)


def verify_checkpoint(root: str | Path, step: int | None = None) -> dict[str, Any]:
    """The commit record of ``step`` after checking that its directory is the step's and
    that every file it lists is there with its size and SHA-256; raises
    :class:`CheckpointError` naming the file, the step and the newest older checkpoint
    that verifies.

    ``step`` None: the newest committed step, which the manifest names; a manifest naming
    an older step than the newest commit record warns (:class:`CheckpointWarning`) and
    the newest record is checked instead (a newer record is only written once every rank
    confirmed its save, so it is complete unless damaged, which raises as above).
    """
    root = Path(root)
    if step is None:
        step = _newer_than_manifest(root)
    if step is None:
        record = latest_checkpoint(root)
        if record is None:
            raise CheckpointError(
                f"no checkpoint under {root}: {root / MANIFEST} does not exist; check the path, "
                "or pass missing_ok=True to load_checkpoint to start from scratch when none "
                "was saved yet",
                file=root / MANIFEST,
                step=None,
                fallback=None,
            )
        source = root / MANIFEST
    else:
        source = root / f"step_{step:08d}.json"
        if not source.exists():
            steps = committed_steps(root)
            raise CheckpointError(
                f"step {step} was never committed under {root} (no {source.name}); committed "
                f"steps: {steps or 'none'}",
                file=source,
                step=step,
                fallback=max((s for s in steps if s < step), default=None),
            )
        record = _read_record(root, source, step)
    problem = _problem(root, record, source, step)
    if problem is not None:
        file, what = problem
        raise _error(root, file, record["step"], what)
    return record


def _newer_than_manifest(root: Path) -> int | None:
    """The newest committed step when the manifest names an older one (with a warning),
    else None (the manifest's step is the newest, or there is no manifest)."""
    path = root / MANIFEST
    newest = max(committed_steps(root), default=None)
    if newest is None or not path.exists():
        return None
    named = _parse_record(path)
    if isinstance(named, str) or named["step"] >= newest:
        return None  # a damaged manifest is reported by latest_checkpoint
    warnings.warn(
        f"{path} names step {named['step']}, but step {newest} is committed too "
        f"({root / f'step_{newest:08d}.json'}): loading the newest committed step, "
        f"{newest}; pass step={named['step']} to load step {named['step']}",
        CheckpointWarning,
        stacklevel=3,
    )
    return newest


def load_checkpoint(
    trainer: PipelineTrainer,
    root: str | Path,
    *,
    step: int | None = None,
    missing_ok: bool = False,
    mesh: PipelineMesh | None = None,
) -> dict[str, Any] | None:
    """Restore a committed checkpoint into a fresh trainer; returns this rank's ``extra``.

    The newest committed step by default (a manifest naming an older one warns, see
    :func:`verify_checkpoint`), or the committed ``step`` (the way back to an older
    checkpoint when the newest is damaged: the error names the step to pass). A
    ``root`` without any checkpoint is a :class:`CheckpointError` unless
    ``missing_ok`` ("resume if present"), which returns None and changes nothing.
    Damage is a :class:`CheckpointError` (see :func:`verify_checkpoint`), raised on
    every rank before any collective.

    A collective (over the job with ``mesh``, as :func:`save_checkpoint`). The trainer
    continues exactly where the saved run stood after its drain. At another layout (see
    the module: pp, stage cut, dp, tp, FSDP) each rank reads its parts of the stored
    whole tensors, and ``extra`` is the saving job's first rank's.
    """
    _refuse_cp(mesh, "load")
    root = Path(root)
    if step is not None and (type(step) is not int or step < 0):
        raise ValueError(f"step must be a committed step number (an int >= 0), got {step!r}")
    if missing_ok and step is None and latest_checkpoint(root) is None:
        return None
    manifest = verify_checkpoint(root, step)
    same = _same_layout(trainer, manifest, mesh)
    group = _group(trainer, mesh)
    own = _own_key(trainer, mesh) if same else manifest["first"]
    path = Path(root) / manifest["path"]
    state, by_name = _load_targets(trainer, own, path)
    timeout = trainer.pipe.p2p.timeout_s
    reader = _BoundedReader(
        path,
        after=lambda took: set_timeout(_pg(group), timedelta(seconds=timeout + took)),
    )
    where = f"torch.distributed.checkpoint's load of checkpoint {manifest['path']} under {root}"
    with _dcp_bounded(trainer, group, where):
        dcp.load(state, storage_reader=reader, process_group=group)
    meta = _from_bytes(state[f"{own}.meta"])
    meta["state"] = {  # every rank's, by parameter name: this run's stages may hold others'
        k: v
        for key in sorted(state)
        if _is_meta(key)
        for k, v in _from_bytes(state[key])["state"].items()
    }
    _restore_optimizer(trainer, state, meta, by_name)
    torch.set_rng_state(state[f"{own}.rng"])
    trainer.restore(manifest["step"])
    return meta["extra"]


def _same_layout(
    trainer: PipelineTrainer, manifest: dict[str, Any], mesh: PipelineMesh | None
) -> bool:
    """Whether the checkpoint was saved by a run of this layout (ranks, stages, dp, tp):
    each rank then takes back its own entries. Another layout loads resharded where the
    entries are keyed by the model's names; stage-keyed entries (a hand-built executor's)
    need the same stages."""
    dp = 1 if mesh is None else mesh.dp_size
    saved = (
        manifest["world_size"],
        manifest["num_stages"],
        manifest.get("dp_size", 1),
        manifest.get("tp_size", 1),
    )
    this = (trainer.world, trainer.pipe.schedule.num_stages, dp, _tp_size(trainer))
    if saved == this:
        return True
    stage_keyed = "stage" in (manifest.get("keys", "stage"), _key_kind(trainer))
    if stage_keyed and saved[1] != this[1]:
        raise ValueError(
            f"checkpoint {manifest['path']} was saved with {saved[1]} stages and this run has "
            f"{this[1]}; entries keyed by stage (a trainer built on a hand-built executor) "
            "reload only into the same stages: build both runs with zerobubble.Pipeline, whose "
            "checkpoints are keyed by the model's names, to change the pipeline cut"
        )
    return False


def _is_meta(key: str) -> bool:
    """A saved rank's metadata entry (``rank<r>[.dp<d>][.tp<t>].meta``)."""
    return key.startswith("rank") and key.endswith(".meta")


def _key_kind(trainer: PipelineTrainer) -> str:
    return "stage" if trainer.names is stage_key else "model"


def _load_targets(
    trainer: PipelineTrainer, own: str, path: Path
) -> tuple[dict[str, Any], Mapping[str, Tensor]]:
    """What DCP loads into: the parameters, every rank's meta, ``own``'s RNG state, and a target
    for each stored optimizer entry of a parameter this rank holds; and the parameters by
    checkpoint name."""
    stored = FileSystemReader(path).read_metadata().state_dict_metadata
    state, _ = _state_dict(trainer, with_optimizer=False)
    names, ep_mesh = _param_names(trainer), _ep_mesh(trainer)
    by_name = {names[id(p)]: p for p in trainer.params if id(p) in names}
    for key, md in stored.items():
        if _is_meta(key) or key == f"{own}.rng":
            assert isinstance(md, TensorStorageMetadata)
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        elif key.startswith("optim."):
            p = by_name.get(key.removeprefix("optim.").rsplit(".", 1)[0])
            if p is not None:
                assert isinstance(md, TensorStorageMetadata)
                state[key] = _target(md, p, ep_mesh)
    return state, by_name


def _restore_optimizer(
    trainer: PipelineTrainer,
    state: dict[str, Any],
    meta: dict[str, Any],
    by_name: Mapping[str, Tensor],
) -> None:
    """The optimizer's state (loaded tensors and the loose entries of ``meta``) and its
    groups' settings."""
    opt_state: dict[Tensor, dict[str, Any]] = {}
    for key, value in state.items():
        if key.startswith("optim."):
            pname, field = key.removeprefix("optim.").rsplit(".", 1)
            p = by_name[pname]
            if isinstance(value, DTensor) and not isinstance(p, DTensor):
                value = value.to_local()  # an expert shard's rows of the whole tensor
            opt_state.setdefault(p, {})[field] = value.to(p.device) if field != "step" else value
    for pname, fields in meta["state"].items():
        opt_state.setdefault(by_name[pname], {}).update(fields)
    trainer.optimizer.state.clear()
    trainer.optimizer.state.update(opt_state)
    for g, h in zip(trainer.optimizer.param_groups, meta["groups"], strict=True):
        g.update(h)


def _group(trainer: PipelineTrainer, mesh: PipelineMesh | None) -> dist.ProcessGroup | None:
    """The ranks that save one checkpoint together: the pipeline, or with a mesh or with
    tensor parallelism the job (the tp ranks hold shards of the same DTensors)."""
    if mesh is None and _tp_size(trainer) > 1:
        pp, tp, world = trainer.world, _tp_size(trainer), dist.get_world_size()
        if world != pp * tp:
            raise ValueError(
                f"rank {trainer.pipe.p2p.name(trainer.rank)}: a checkpoint of a pipeline with "
                f"tensor parallelism is saved by the whole job, pp={pp} x tp={tp} ranks, but "
                f"the world has {world}: pass mesh= (the job's mesh with its dp dim)"
            )
        return None
    if mesh is None:
        return trainer.pipe.group
    if dist.get_world_size(trainer.pipe.group) != mesh.pp_size:
        raise ValueError(
            f"rank {trainer.pipe.p2p.name(trainer.rank)}: the trainer's pipeline has "
            f"{dist.get_world_size(trainer.pipe.group)} ranks but the mesh's pp dimension "
            f"{mesh.pp_size}: pass the mesh the pipeline was built with"
        )
    return None


def _pg(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return group if group is not None else dist.distributed_c10d._get_default_group()


@contextlib.contextmanager
def _dcp_bounded(
    trainer: PipelineTrainer, group: dist.ProcessGroup | None, what: str
) -> Iterator[None]:
    """DCP's collectives over ``group`` bounded by the comm timeout through the group's
    transport timeout (restored afterwards), a failure naming who never arrived."""
    p2p = trainer.pipe.p2p
    with (
        transport_timeout(group, p2p.timeout_s),
        p2p.arrivals.watch(group, lambda: what, timeout_s=p2p.timeout_s),
    ):
        yield


class _BoundedWriter(FileSystemWriter):
    """DCP's file writer, with this rank's fault points before its write and, after it, the
    group's transport timeout raised by the write's duration: the collective that follows
    waits for the slowest writer, whose shards take about as long as this rank's."""

    def __init__(
        self, path: Path, *, before: Callable[[], object], after: Callable[[float], None]
    ) -> None:
        super().__init__(path)
        self._before, self._after = before, after

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._before()
        t0 = time.monotonic()
        done = super().write_data(plan, planner)
        done.wait()
        self._after(time.monotonic() - t0)
        return done


class _BoundedReader(FileSystemReader):
    """DCP's file reader, raising the group's transport timeout by this rank's read time
    for the collective that waits for the slowest reader."""

    def __init__(self, path: Path, *, after: Callable[[float], None]) -> None:
        super().__init__(path)
        self._after = after

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        t0 = time.monotonic()
        done = super().read_data(plan, planner)
        done.wait()
        self._after(time.monotonic() - t0)
        return done


def _refuse_cp(mesh: PipelineMesh | None, what: str) -> None:
    """Checkpoints key each rank's own entries by pp, dp and tp rank: the cp ranks of one
    pipeline rank would write the same ones."""
    if mesh is not None and mesh.cp_size > 1:
        raise ValueError(
            f"cannot {what} a checkpoint of a mesh with cp={mesh.cp_size}: its entries are "
            "keyed by pp, dp and tp rank, and the cp ranks of a pipeline rank would share "
            "them (not supported yet); checkpoint a run with cp=1"
        )


def _own_key(trainer: PipelineTrainer, mesh: PipelineMesh | None) -> str:
    """The prefix of this rank's own entries (every rank of the saving group has one)."""
    key = f"rank{trainer.rank}"
    if mesh is not None and mesh.dp_size > 1:
        key += f".dp{mesh.dp_rank}"
    tp = trainer.layout.tp_mesh
    return key if tp is None or tp.size() == 1 else f"{key}.tp{tp.get_local_rank()}"


def _tp_size(trainer: PipelineTrainer) -> int:
    tp = trainer.layout.tp_mesh
    return 1 if tp is None else tp.size()


def _target(md: TensorStorageMetadata, param: Tensor, ep_mesh: DeviceMesh | None) -> Tensor:
    """Where an optimizer-state entry of ``param`` loads: sharded like the parameter is
    stored when it has the parameter's whole shape (Adam's moments of a tp, FSDP or expert
    shard), else a whole tensor (a step count)."""
    stored = global_view(param.detach(), ep_mesh, like=param)
    if isinstance(stored, DTensor) and tuple(md.size) == tuple(stored.shape):
        return dtensor_empty(
            md.size,
            dtype=md.properties.dtype,
            device_mesh=stored.device_mesh,
            placements=stored.placements,
        )
    return torch.empty(md.size, dtype=md.properties.dtype)


def _problem(
    root: Path, record: dict[str, Any], source: Path, step: int | None
) -> tuple[Path, str] | None:
    """The first file that contradicts ``record`` (read from ``source``), and how."""
    name = f"step_{record['step']:08d}"
    if record["path"] != name:
        return source, f"names directory {record['path']!r}, but step {record['step']} is {name!r}"
    if step is not None and record["step"] != step:
        return source, f"records step {record['step']}"
    if not (root / name).is_dir():
        return root / name, "(the step's directory) is missing"
    for fname, want in record["files"].items():
        f = root / name / fname
        if not f.is_file():
            return f, "is missing"
        size = f.stat().st_size
        if size != want["bytes"]:
            return f, f"has {size} bytes, {want['bytes']} were saved (truncated or overwritten)"
        if _sha256(f) != want["sha256"]:
            return f, "does not match its SHA-256 checksum (the bytes changed since the save)"
    return None


def _error(root: Path, file: Path, step: int | None, what: str) -> CheckpointError:
    """The damage message, with the newest older checkpoint that verifies (any committed one
    when ``step`` is None: the manifest itself is what is damaged)."""
    fallback = None
    for s in reversed(committed_steps(root)):
        if step is not None and s >= step:
            continue
        source = root / f"step_{s:08d}.json"
        record = _parse_record(source)
        if not isinstance(record, str) and _problem(root, record, source, s) is None:
            fallback = s
            break
    how = (
        f"the newest older checkpoint that verifies is step {fallback} "
        f"({root / f'step_{fallback:08d}'}): resume from it with "
        f"load_checkpoint(trainer, {str(root)!r}, step={fallback})"
        if fallback is not None
        else "no older checkpoint verifies: restore the files or start from scratch"
    )
    what_failed = f"checkpoint of step {step}" if step is not None else "the checkpoint manifest"
    return CheckpointError(
        f"{what_failed} under {root} is damaged: {file} {what}; {how}",
        file=file,
        step=step,
        fallback=fallback,
    )


def _read_record(root: Path, path: Path, step: int | None) -> dict[str, Any]:
    """A commit record (of ``step``, None for the manifest), or the damage error."""
    record = _parse_record(path)
    if isinstance(record, str):
        raise _error(root, path, step, record)
    return record


def _parse_record(path: Path) -> dict[str, Any] | str:
    """The record in ``path`` if it has the fields and types the loader relies on, else
    what is wrong with it."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"is not a readable commit record ({e})"
    fields = (("step", int), ("path", str), ("world_size", int), ("num_stages", int))
    ok = isinstance(record, dict) and isinstance(record.get("files"), dict)
    ok = ok and all(isinstance(record.get(k), t) for k, t in fields)
    ok = ok and all(
        isinstance(v, dict) and isinstance(v.get("bytes"), int) and "sha256" in v
        for v in record["files"].values()
    )
    if not ok:
        return "is not a commit record (fields step, path, world_size, num_stages, files)"
    return record


def _file_sums(
    folder: Path, prefix: str, skip: Mapping[str, Any] = MappingProxyType({})
) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of the files in ``folder`` whose names start with ``prefix``."""
    return {
        f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)}
        for f in sorted(folder.iterdir())
        if f.is_file() and f.name.startswith(prefix) and f.name not in skip
    }


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` to ``path`` atomically: a fsynced temporary renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _param_names(trainer: PipelineTrainer) -> dict[int, str]:
    """``id(param) -> key``: the model's name of each parameter this rank saves (a tie's
    replica after the first on a rank shares the first's memory and is not saved again)."""
    secondary = set() if trainer.tied is None else trainer.tied.secondary()
    return {
        id(p): trainer.names(s, n)
        for s, chunk in trainer.pipe.chunks.items()
        for n, p in chunk.module.named_parameters()
        if id(p) not in secondary
    }


def _ep_mesh(trainer: PipelineTrainer) -> DeviceMesh | None:
    """The 1-D ``ep`` mesh a stacked expert shard is stored over (None without ep)."""
    mesh = trainer.pipe.mesh
    return None if mesh is None or mesh.ep_mesh is None else mesh.ep_mesh["ep"]


def _state_dict(
    trainer: PipelineTrainer, *, with_optimizer: bool = True
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Tensors to save (or load into, in place): parameters, buffers, optimizer state, keyed
    by the model's names and held as the model's whole tensors
    (:func:`~zerobubble.parallel.shards.global_view`); and the optimizer state that is not
    a tensor (saved with the rank's metadata)."""
    out: dict[str, Any] = {}
    loose: dict[str, dict[str, Any]] = {}
    names, ep_mesh = _param_names(trainer), _ep_mesh(trainer)
    for s, chunk in trainer.pipe.chunks.items():
        for p in chunk.module.parameters():
            if id(p) in names:
                name = names[id(p)]
                out[f"model.{name}"] = global_view(p.detach(), ep_mesh, like=p, name=repr(name))
        for n, b in chunk.module.named_buffers():
            out[f"buffer.{trainer.names(s, n)}"] = b
    if with_optimizer:
        for param, st in trainer.optimizer.state.items():
            for field, value in st.items():
                key = names[id(param)]
                if isinstance(value, Tensor):
                    out[f"optim.{key}.{field}"] = global_view(
                        value, ep_mesh, like=param, name=repr(key)
                    )
                else:
                    loose.setdefault(key, {})[field] = value
    return out, loose


def _to_bytes(obj: Any) -> Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(t: Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)
