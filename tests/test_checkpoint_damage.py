"""Checkpoint damage matrix: every kind of damage fails on every rank before any collective,
naming the file, the step and the newest older checkpoint that verifies, and loading that
one (``step=``) restores its state exactly.

One launch (P=3, zb-h1, AdamW) saves steps 2 and 4, then damages copies of the checkpoint
directory one kind at a time; ranks return plain summaries. A copy whose manifest is step 2's
record loads step 4 (the newest commit record), with a warning.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ranks import launch
from zerobubble.executor import ExecutorOptions, PipelineExecutor
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.checkpoint import (
    CheckpointError,
    committed_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from zerobubble.optim.config import OptimConfig
from zerobubble.optim.trainer import PipelineTrainer
from zerobubble.parallel.partition import build_stage_modules
from zerobubble.runtime.launcher import init_distributed
from zerobubble.schedule.generators import generate

pytestmark = pytest.mark.slow

P, M = 3, 3
SHARD = "__1_0.distcp"  # rank 1's tensors


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 8] = bytes(b ^ 0xFF for b in data[mid : mid + 8])
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def zero(path: Path) -> None:
    path.write_bytes(bytes(path.stat().st_size))


def wrong_dir(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["path"] = "step_00000002"
    (root / "manifest.json").write_text(json.dumps(manifest))


def swapped_dirs(root: Path) -> None:
    """Step 4's directory holds step 2's files: the record's checksums catch it."""
    shutil.rmtree(root / "step_00000004")
    shutil.copytree(root / "step_00000002", root / "step_00000004")


# name -> (damage, the file the error must name, the step it must name); the fallback is
# step 2, or step 4 itself when only the manifest (a copy of step 4's record) is damaged.
DAMAGE = {
    "flipped_shard": (lambda r: flip(r / "step_00000004" / SHARD), f"step_00000004/{SHARD}", 4),
    "truncated_shard": (
        lambda r: truncate(r / "step_00000004" / SHARD),
        f"step_00000004/{SHARD}",
        4,
    ),
    "zeroed_shard": (lambda r: zero(r / "step_00000004" / SHARD), f"step_00000004/{SHARD}", 4),
    "missing_shard": (
        lambda r: (r / "step_00000004" / SHARD).unlink(),
        f"step_00000004/{SHARD}",
        4,
    ),
    "flipped_metadata": (
        lambda r: flip(r / "step_00000004" / ".metadata"),
        "step_00000004/.metadata",
        4,
    ),
    "truncated_metadata": (
        lambda r: truncate(r / "step_00000004" / ".metadata"),
        "step_00000004/.metadata",
        4,
    ),
    "missing_dir": (lambda r: shutil.rmtree(r / "step_00000004"), "step_00000004", 4),
    "swapped_dirs": (swapped_dirs, "step_00000004/.metadata", 4),
    "wrong_step_dir": (wrong_dir, "manifest.json", 4),
    "garbage_manifest": (
        lambda r: (r / "manifest.json").write_text("{not json"),
        "manifest.json",
        None,
    ),
    "missing_manifest": (lambda r: (r / "manifest.json").unlink(), "manifest.json", None),
}
FALLBACK = {name: 2 if step == 4 else 4 for name, (_, _, step) in DAMAGE.items()}


def make_trainer(rank: int) -> tuple[PipelineTrainer, list[torch.Tensor]]:
    sched = generate("zb-h1", P, M)
    layers = list(build_mlp([6] * 5, seed=0))
    pipe = PipelineExecutor(
        sched,
        build_stage_modules(layers, sched, rank),
        loss_fn=mlp_loss,
        options=ExecutorOptions(comm_timeout_s=30),
    )
    params = [q for s in sorted(pipe.chunks) for q in pipe.chunks[s].module.parameters()]
    opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    return PipelineTrainer(pipe, opt, OptimConfig(max_norm=1.0)), params


def state_of(trainer: PipelineTrainer, params: list[torch.Tensor]) -> list[torch.Tensor]:
    opt = trainer.optimizer.state
    return [p.detach().clone() for p in params] + [
        v.clone() for p in params for v in opt[p].values()
    ]


def damage_job(root: str) -> dict:
    info = init_distributed(timeout_s=60)
    rank, base = info.rank, Path(root) / "saved"
    out: dict = {"cases": {}}
    trainer, params = make_trainer(rank)
    saved = {}
    for i in range(4):
        gen = torch.Generator().manual_seed(i)
        trainer.step(torch.randn(7, 6, generator=gen), target=torch.randn(7, 6, generator=gen))
        if i % 2 == 1:
            save_checkpoint(trainer, base, extra={"next": i + 1, "rank": rank})
            saved[i + 1] = state_of(trainer, params)
    out["committed"] = committed_steps(base)
    fresh, fparams = make_trainer(rank)
    out["intact"] = load_checkpoint(fresh, base) == {"next": 4, "rank": rank} and all(
        torch.equal(a, b) for a, b in zip(state_of(fresh, fparams), saved[4], strict=True)
    )
    for name, (damage, _, _) in DAMAGE.items():
        case = Path(root) / name
        if rank == 0:
            shutil.copytree(base, case)
            damage(case)
        dist.barrier()
        fresh, fparams = make_trainer(rank)
        try:
            load_checkpoint(fresh, case)
            out["cases"][name] = {"loaded": True}
        except CheckpointError as e:
            out["cases"][name] = {
                "message": str(e),
                "file": str(e.file.relative_to(case)),
                "step": e.step,
                "fallback": e.fallback,
            }
            # The documented way back: the step the message names.
            extra = load_checkpoint(fresh, case, step=e.fallback)
            back = e.fallback
            out["cases"][name]["fallback_exact"] = extra["next"] == back and all(
                torch.equal(a, b)
                for a, b in zip(state_of(fresh, fparams), saved[back], strict=True)
            )
        dist.barrier()
    # An older manifest (step 2's record) next to step 4's committed record: the newest
    # committed step loads, with a warning naming both; step=2 still loads step 2.
    case = Path(root) / "old_manifest"
    if rank == 0:
        shutil.copytree(base, case)
        shutil.copyfile(case / "step_00000002.json", case / "manifest.json")
    dist.barrier()
    fresh, fparams = make_trainer(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(fresh, case)
    out["old_manifest"] = {
        "next": extra["next"],
        "exact": all(
            torch.equal(a, b) for a, b in zip(state_of(fresh, fparams), saved[4], strict=True)
        ),
        "warnings": [(w.category.__name__, str(w.message)) for w in caught],
    }
    fresh, fparams = make_trainer(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = load_checkpoint(fresh, case, step=2)
    out["old_manifest"]["named"] = (extra["next"], len(caught)) == (2, 0) and all(
        torch.equal(a, b) for a, b in zip(state_of(fresh, fparams), saved[2], strict=True)
    )
    missing = Path(root) / "mistyped"
    fresh, _ = make_trainer(rank)
    try:
        load_checkpoint(fresh, missing)
    except CheckpointError as e:
        out["missing"] = str(e)
    out["missing_ok"] = load_checkpoint(fresh, missing, missing_ok=True)
    try:
        load_checkpoint(fresh, base, step=3)
    except CheckpointError as e:
        out["never"] = (str(e), e.fallback)
    try:
        load_checkpoint(fresh, base, step=-1)
    except ValueError as e:
        out["negative"] = str(e)
    out["record_files"] = sorted(latest_checkpoint(base)["files"])
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(damage_job, P, str(tmp_path_factory.mktemp("ckpt")), timeout=240)


def test_intact_checkpoints_load_exactly(results):
    for r in results:
        assert r["committed"] == [2, 4] and r["intact"] is True


@pytest.mark.parametrize("name", sorted(DAMAGE))
def test_damage_fails_on_every_rank_naming_file_step_and_fallback(results, name):
    _, file, step = DAMAGE[name]
    for r in results:
        case = r["cases"][name]
        assert "loaded" not in case, f"{name}: damaged checkpoint loaded"
        msg = case["message"]
        assert case["file"] == file, msg
        assert case["step"] == step, msg
        back = FALLBACK[name]
        assert case["fallback"] == back, msg
        assert "is damaged" in msg and file.split("/")[-1] in msg, msg
        if step is not None:
            assert f"checkpoint of step {step}" in msg, msg
        assert f"step_{back:08d}" in msg and "load_checkpoint(trainer, " in msg, msg
        assert msg.endswith(f", step={back})"), msg
        assert case["fallback_exact"] is True  # the fallback restores its step bitwise
    assert len({r["cases"][name]["message"] for r in results}) == 1  # every rank, same words


def test_an_older_manifest_loads_the_newest_committed_step_and_says_so(results):
    for r in results:
        got = r["old_manifest"]
        assert (got["next"], got["exact"], got["named"]) == (4, True, True), got
        assert len(got["warnings"]) == 1, got
        category, message = got["warnings"][0]
        assert category == "CheckpointWarning"
        assert re.fullmatch(
            r"\S+/old_manifest/manifest\.json names step 2, but step 4 is committed too "
            r"\(\S+/old_manifest/step_00000004\.json\): loading the newest committed step, 4; "
            r"pass step=2 to load step 2",
            message,
        ), message


def test_missing_path_is_an_error_unless_resume_if_present(results):
    for r in results:
        assert "no checkpoint under" in r["missing"] and "mistyped" in r["missing"]
        assert "missing_ok=True" in r["missing"]
        assert r["missing_ok"] is None
        msg, fallback = r["never"]
        assert "step 3 was never committed" in msg and "[2, 4]" in msg and fallback == 2
        assert r["negative"] == "step must be a committed step number (an int >= 0), got -1"


def test_the_record_covers_every_file_of_every_rank(results):
    want = [".metadata", *(f"__{r}_0.distcp" for r in range(P))]
    assert all(r["record_files"] == want for r in results)


def test_latest_checkpoint_on_an_empty_root_is_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None and latest_checkpoint(tmp_path / "no") is None
    assert committed_steps(tmp_path / "no") == []
