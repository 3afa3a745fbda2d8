"""The Makefile's second bitwise run really runs other kernels (bench/bench_kernel_paths.py
measures which ops' bits each setting changes; PyTorch promises only its capability report)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_kernel_paths import other_kernels


def test_other_kernels_select_atens_scalar_kernels_and_restrict_onednn() -> None:
    env = other_kernels()
    assert env == {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41"}
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert out.stdout.strip() == "DEFAULT", out.stderr
