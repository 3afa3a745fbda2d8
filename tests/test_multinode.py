"""Two "nodes" on one machine: ``torchrun --nnodes 2 --node-rank K --rdzv-backend c10d``.

Two torchrun agents (2 ranks each) rendezvous on a local c10d endpoint and run
examples/train_dp.py as one dp=2 x pp=2 job under zbv (V-shaped: two stages per
rank). Its parameters and losses must be bitwise those of the single-process
reference in the mesh's reduction order
(:func:`~zerobubble.reference.step.dp_reference_step`), which the single-node
launch of the same mesh reproduces bitwise (tests/test_dp.py); so the two-node run
equals the single-node one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from zerobubble.models import build_mlp, mlp_loss
from zerobubble.reference.step import dp_reference_step
from zerobubble.runtime.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_dp.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
TIMEOUT = 240

sys.path.insert(0, str(SCRIPT.parent))
from train_dp import SIZES  # noqa: E402

STEPS, M, LOCAL, DP = 3, 4, 8, 2


def reference() -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    """examples/train_dp.py's training, in one process, in the mesh's reduction order."""
    model = build_mlp(SIZES)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(0)
    losses: list[list[torch.Tensor]] = [[] for _ in range(DP)]
    for _ in range(STEPS):
        x = torch.randn(LOCAL * DP, SIZES[0], generator=data)
        y = torch.randn(LOCAL * DP, SIZES[-1], generator=data)
        parts = [
            (x[r * LOCAL : (r + 1) * LOCAL], y[r * LOCAL : (r + 1) * LOCAL]) for r in range(DP)
        ]
        step_losses, _ = dp_reference_step(model, mlp_loss, parts, M)
        for r in range(DP):
            losses[r].append(torch.stack(step_losses[r]))
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return dict(model.named_parameters()), [torch.stack(ls) for ls in losses]


def test_two_torchrun_nodes_train_bitwise_as_the_reference(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    agents = [
        subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                "--node-rank",
                str(k),
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                str(SCRIPT),
                "--kind",
                "zbv",
                "--pp",
                "2",
                "--dp",
                str(DP),
                "--steps",
                str(STEPS),
                "--out",
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for k in range(2)
    ]
    outputs = []
    try:
        for agent in agents:
            out, _ = agent.communicate(timeout=TIMEOUT)
            outputs.append(out)
    finally:  # SIGTERM first: torchrun passes it on to its workers, SIGKILL would orphan them
        for agent in agents:
            if agent.poll() is None:
                agent.terminate()
                try:
                    agent.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    agent.kill()
                    agent.wait()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
    params, losses = reference()
    got: dict[str, torch.Tensor] = {}
    for pp_rank in range(2):
        got.update(torch.load(tmp_path / f"params_pp{pp_rank}.pt"))
    assert sorted(got) == sorted(params)
    assert [n for n in params if not torch.equal(got[n], params[n])] == []
    for r in range(DP):
        assert torch.equal(torch.load(tmp_path / f"losses_dp{r}.pt"), losses[r])
