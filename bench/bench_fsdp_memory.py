"""Per-rank model-state memory with and without FSDP2, at dp=2 x pp=2 (gloo, 4 processes).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_fsdp_memory.py [--quick]``
Prints one JSON object.

Workload: an MLP of ``--layers`` Linear(width, width) layers (zb-h1, 4 microbatches,
AdamW), cut into 2 stages, run by 2 data-parallel replicas; once with
``build_mesh(pp, dp, fsdp=True)``
and once replicated (``fsdp=False``: the DDP-style path, where every replica holds
whole parameters, gradients and optimizer state). After ``--steps`` steps each
rank reports the bytes it holds of

* ``params``: its parameters (the local shard of a DTensor),
* ``grads``: their gradients (kept until the next step's zero_grad),
* ``optim``: the AdamW state (moments and step counts),

and ``ratio = total(fsdp) / total(replicated)`` per rank (goal <= 0.55 at dp=2: the
shards are halves, the rest is FSDP's padding of odd dim-0 sizes and the unsharded
step counts). ``peak_rss_delta`` is the rise of the process's resident-set high-water
mark over its size before the pipeline was built (``ru_maxrss``, a whole-process
figure: it includes the gathered parameters and gradients of a stage while its step
runs, the activations and the allocator's slack), measured in a separate launch per
configuration so one does not hide the other.
"""

from __future__ import annotations

import argparse
import json
import os
import resource

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from zerobubble.executor import ExecutorOptions
from zerobubble.optim.config import OptimConfig
from zerobubble.parallel.mesh import build_mesh
from zerobubble.pipeline import Pipeline
from zerobubble.runtime.launcher import init_distributed, launch

PP, DP, M = 2, 2, 4


def nbytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def job(fsdp: bool, width: int, layers: int, steps: int) -> dict:
    init_distributed()
    mesh = build_mesh(PP, DP, fsdp=fsdp)
    torch.manual_seed(0)
    model = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    before = rss_bytes()
    pipe = Pipeline(
        model,
        nn.functional.mse_loss,
        "zb-h1",
        microbatches=M,
        mesh=mesh,
        options=ExecutorOptions(trace=False),
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    pipe.set_optimizer(opt, OptimConfig(max_norm=1.0))
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    for _ in range(steps):
        x = torch.randn(4 * M, width, generator=gen)
        pipe.step(x, target=torch.randn(4 * M, width, generator=gen))
    params = list(pipe.parameters())
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params),
        "optim": sum(nbytes(v) for p in params for v in opt.state[p].values()),
        "peak_rss_delta": peak - before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="width 256, 4 layers, 1 step")
    args = ap.parse_args()
    if args.quick:
        args.width, args.layers, args.steps = 256, 4, 1
    runs = {}
    for name, fsdp in (("replicated", False), ("fsdp", True)):
        ranks = launch(job, PP * DP, fsdp, args.width, args.layers, args.steps, timeout=600)
        for r in ranks:
            r["total"] = r["params"] + r["grads"] + r["optim"]
        runs[name] = ranks
    ratios = [
        f["total"] / r["total"] for f, r in zip(runs["fsdp"], runs["replicated"], strict=True)
    ]
    out = {
        "pp": PP,
        "dp": DP,
        "width": args.width,
        "layers": args.layers,
        "steps": args.steps,
        "per_rank": runs,
        "ratio": ratios,
        "max_ratio": max(ratios),
        "goal": 0.55,
        "meets_goal": max(ratios) <= 0.55,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
