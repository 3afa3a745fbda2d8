"""Checkpoints and resume over dp=2 x pp=2 with torch.distributed.checkpoint (gloo, 4
processes): FSDP2-sharded state and replicated state.

Run 1 trains 2 steps, saves (one checkpoint for the whole job, every dp replica and
pipeline rank), trains 2 more; run 2, in fresh processes, loads it and trains the same 2
steps: parameters and AdamW state after step 4 are bitwise those of run 1, and each
rank gets its own ``extra`` back. The replicated run is the DDP-style path (the dp
reduce keeps the replicas identical; DCP stores their state once). The commit record
lists every rank's files with their SHA-256 (damage is refused).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from ranks import launch
from zerobubble.executor import ExecutorOptions
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.optim.checkpoint import (
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from zerobubble.optim.config import OptimConfig
from zerobubble.parallel.mesh import build_mesh
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.launcher import init_distributed

PP, DP, M = 2, 2, 4
SIZES = [5, 7, 6, 5, 3]
SAVE_AT, STEPS = 2, 4
FLAVOURS = ("fsdp", "replicated")


def batch(step: int, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + replica)
    return torch.randn(8, SIZES[0], generator=gen), torch.randn(8, SIZES[-1], generator=gen)


def full(t: torch.Tensor) -> bytes:
    """The whole tensor's bytes (tensors themselves would cross processes as shared memory)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).numpy().tobytes()


def job(root: str, resume: bool) -> dict:
    init_distributed()
    mesh = build_mesh(PP, DP)
    out: dict = {}
    for flavour in FLAVOURS:
        fsdp = flavour == "fsdp"
        pipe = Pipeline(
            list(build_mlp(SIZES, seed=3)),
            mlp_loss,
            "zb-h1",
            microbatches=M,
            mesh=mesh.with_fsdp(fsdp),
            options=ExecutorOptions(comm_timeout_s=60, trace=False),
        )
        opt = torch.optim.AdamW(pipe.parameters(), lr=0.01, weight_decay=0.1)
        trainer = pipe.set_optimizer(opt, OptimConfig(max_norm=0.05))
        where = Path(root) / flavour
        extra = None
        if resume:
            extra = load_checkpoint(trainer, where, mesh=mesh)
        for k in range(SAVE_AT if resume else 0, STEPS):
            x, y = batch(k, mesh.dp_rank)
            pipe.step(x, target=y)
            if not resume and k + 1 == SAVE_AT:
                mine = {"pp": mesh.pp_rank, "dp": mesh.dp_rank}
                save_checkpoint(trainer, where, extra=mine, mesh=mesh)
        out[flavour] = {
            "extra": extra,
            "sharded": all(isinstance(p, DTensor) for p in pipe.parameters()),
            "state": {
                n: (full(p.detach()), {f: full(v) for f, v in opt.state[p].items()})
                for n, p in pipe.named_parameters()
            },
        }
    return out


def test_resume_over_dp_x_pp_is_bitwise(tmp_path: Path) -> None:
    first = launch(job, PP * DP, str(tmp_path), False, timeout=300)
    for flavour in FLAVOURS:
        record = verify_checkpoint(tmp_path / flavour)
        assert record["step"] == SAVE_AT and record["dp_size"] == DP
        ranks = {name.split("_")[2] for name in record["files"] if name.startswith("__")}
        assert ranks == {"0", "1", "2", "3"}, record["files"].keys()
    second = launch(job, PP * DP, str(tmp_path), True, timeout=300)
    for rank, (a, b) in enumerate(zip(first, second, strict=True)):
        for flavour in FLAVOURS:
            assert a[flavour]["sharded"] == (flavour == "fsdp")
            assert b[flavour]["extra"] == {"pp": rank // DP, "dp": rank % DP}, (rank, flavour)
            for name, (p, st) in a[flavour]["state"].items():
                q, qst = b[flavour]["state"][name]
                assert p == q, (rank, flavour, name)
                assert st == qst, (rank, flavour, name)
    # A damaged shard of any rank is refused before anything is read.
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "fsdp", damaged)
    shard = next(f for f in sorted((damaged / f"step_{SAVE_AT:08d}").iterdir()) if "__3_" in f.name)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=shard.name):
        verify_checkpoint(damaged)
