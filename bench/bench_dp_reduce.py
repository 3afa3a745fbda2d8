"""Exposed gradient-reduction time: async per-stage reduce against reducing after the step.

Four CPU ranks on gloo (one thread each) as a dp=2 x pp=2 mesh; an MLP wide enough
that a stage's gradient all-reduce takes a visible share of a step. Per schedule kind
(zb-h1: one stage per rank; zbv: two, so the first-finished stage's reduction can hide
behind the other's backwards):

* ``async``: ``Pipeline(mesh=...)``: the lowering pass's ``reduce_grads`` right after
  each stage's last W/BW, one ``wait_reduce`` at the program's end. Exposed time per
  rank: its ``reduce_grads`` launches (bucket copies, on the compute thread) plus its
  ``wait_reduce``, from the trace.
* ``after_step``: the same pipeline on ``mesh.pp_group`` alone, then every stage's
  gradients all-reduced over ``mesh.dp_group`` once the step is over: all of it exposed.

``exposed_ms`` is the per-rank median over ``--steps`` timed steps (after one warm-up);
``step_ms`` the median wall time of a step on global rank 0 including its reduction.

    PYTHONPATH=src python bench/bench_dp_reduce.py [--steps 5] [--width 768]

Figures on a shared or loaded machine are noisy; compare on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

import zerobubble
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.parallel.dp import GradReducer
from zerobubble.parallel.mesh import build_mesh
from zerobubble.runtime.launcher import init_distributed, launch

PP, DP, M, LAYERS, LOCAL = 2, 2, 8, 8, 32
KINDS = ("zb-h1", "zbv")


def run(kind: str, width: int, steps: int) -> dict:
    init_distributed()
    mesh = build_mesh(PP, DP)
    sizes = [width] * (LAYERS + 1)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    x, y = torch.randn(LOCAL, width, generator=gen), torch.randn(LOCAL, width, generator=gen)
    out: dict = {}
    for variant in ("async", "after_step"):
        if variant == "async":
            pipe = zerobubble.Pipeline(build_mlp(sizes), mlp_loss, kind, microbatches=M, mesh=mesh)
        else:
            pipe = zerobubble.Pipeline(
                build_mlp(sizes), mlp_loss, kind, microbatches=M, group=mesh.pp_group
            )
        chunks = pipe.executor.chunks
        assert mesh.dp_group is not None
        after = GradReducer(
            mesh.dp_group, {s: list(c.module.parameters()) for s, c in chunks.items()}, 60.0
        )
        exposed, wall = [], []
        for k in range(steps + 1):
            for p in pipe.parameters():
                p.grad = None
            pipe.executor.trace.clear()
            dist.barrier()
            t0 = time.perf_counter()
            pipe.step(x, target=y)
            if variant == "after_step":
                r0 = time.perf_counter()
                for s in sorted(chunks):
                    after.launch(s, k)
                after.wait(k)
                exposed_s = time.perf_counter() - r0
            else:
                exposed_s = sum(
                    (e.end_ns - e.start_ns) / 1e9
                    for e in pipe.executor.trace.events
                    if e.op in ("reduce_grads", "wait_reduce")
                )
            t1 = time.perf_counter()
            if k:  # the first step warms up
                exposed.append(exposed_s)
                wall.append(t1 - t0)
        out[variant] = (statistics.median(exposed), statistics.median(wall))
    out["params"] = sum(p.numel() for p in pipe.parameters())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=768)
    args = parser.parse_args()
    report: dict = {
        "mesh": {"pp": PP, "dp": DP},
        "microbatches": M,
        "width": args.width,
        "layers": LAYERS,
        "local_batch": LOCAL,
        "kinds": {},
    }
    for kind in KINDS:
        ranks = launch(run, PP * DP, kind, args.width, args.steps, timeout=900)
        report["kinds"][kind] = {
            "params_per_rank": [r["params"] for r in ranks],
            **{
                variant: {
                    "exposed_ms": [round(r[variant][0] * 1e3, 2) for r in ranks],
                    "step_ms": round(ranks[0][variant][1] * 1e3, 2),
                }
                for variant in ("async", "after_step")
            },
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
