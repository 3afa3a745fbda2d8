"""Which kernel-path settings really change the bits of the ops the B/W split issues.

Run: ``PYTHONPATH=src python bench/bench_kernel_paths.py``. Prints one JSON object.

The bitwise tests claim "same ops on the same shapes give the same bits", which holds on any
kernel; a split that differs from autograd in its ops can still pass where the two kernels
happen to accumulate alike. ``make test`` therefore runs the bitwise subset a second time
under the Makefile's ``OTHER_KERNELS``. This script checks, per setting, which ops' results
differ from the default run's on this machine, so that the setting is known to move kernels
here rather than assumed to. Each setting runs in its own process (the libraries read their
variables once, at load). ``capability`` is PyTorch's own report of its vector kernels.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS: dict[str, dict[str, str]] = {
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "mkl-enable-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "mkl-cbwr-avx2": {"MKL_CBWR": "AVX2"},
    "mkl-cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "onednn-avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2"},
    "onednn-sse41": {"ONEDNN_MAX_CPU_ISA": "SSE41"},
}


def other_kernels() -> dict[str, str]:
    """The Makefile's ``OTHER_KERNELS`` (the setting ``make test`` uses), as a mapping."""
    text = (ROOT / "Makefile").read_text()
    match = re.search(r"^OTHER_KERNELS\s*:=\s*(.+)$", text, re.M)
    if match is None:
        raise ValueError("Makefile: no OTHER_KERNELS line")
    return dict(word.split("=", 1) for word in shlex.split(match.group(1)))


def digests() -> dict[str, str]:
    """A digest of each op's result on fixed inputs (odd shapes, so no kernel is trivial)."""
    import torch
    import torch.nn.functional as F

    def h(t: torch.Tensor) -> str:
        data = t.detach().float().contiguous().numpy().tobytes()
        return hashlib.sha1(data).hexdigest()[:12]

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(37, 301, generator=g), torch.randn(301, 53, generator=g)
    bias = torch.randn(53, generator=g)
    x = torch.randn(16, 333, generator=g, requires_grad=True)
    ln = F.layer_norm(x, (333,), torch.ones(333), torch.zeros(333))
    gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
        torch.randn(16, 333, generator=g), x, [333], *torch.ops.aten.native_layer_norm(
            x, [333], torch.ones(333), torch.zeros(333), 1e-5
        )[1:], torch.ones(333), torch.zeros(333), [True, True, True]
    )  # fmt: skip
    idx = torch.randint(0, 50, (400,), generator=g)
    return {
        "mm": h(a @ b),
        "addmm": h(torch.addmm(bias, a, b)),
        "bmm": h(torch.randn(3, 37, 301, generator=g) @ torch.randn(3, 301, 53, generator=g)),
        "sum": h(torch.randn(1000, 333, generator=g).sum(0)),
        "layer_norm": h(ln),
        "layer_norm_backward": h(torch.cat([gx.flatten(), gw, gb])),
        "softmax": h(torch.softmax(torch.randn(64, 333, generator=g), -1)),
        "gelu_tanh": h(F.gelu(torch.randn(1000, generator=g), approximate="tanh")),
        "conv2d": h(
            F.conv2d(torch.randn(2, 3, 17, 17, generator=g), torch.randn(5, 3, 3, 3, generator=g))
        ),
        "embedding_backward": h(
            torch.ops.aten.embedding_dense_backward(
                torch.randn(400, 33, generator=g), idx, 50, -1, False
            )
        ),
        "bf16_mm": h(a.bfloat16() @ b.bfloat16()),
        "capability": torch.backends.cpu.get_cpu_capability(),
    }


def _run(env: dict[str, str]) -> dict[str, str]:
    full = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run(
        [sys.executable, __file__, "--digests"], env=full, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"{env}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout)


def main() -> None:
    base = _run({})
    ops = [k for k in base if k != "capability"]
    report: dict[str, object] = {"default": {"capability": base["capability"]}}
    for name, env in {**SETTINGS, "OTHER_KERNELS (make test)": other_kernels()}.items():
        got = _run(env)
        report[name] = {
            "env": env,
            "capability": got["capability"],
            "changed": [op for op in ops if got[op] != base[op]],
        }
    print(json.dumps(report))


if __name__ == "__main__":
    if sys.argv[1:] == ["--digests"]:
        print(json.dumps(digests()))
    else:
        main()
