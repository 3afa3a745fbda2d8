"""Train a small MLP with pipeline x data parallelism: ``pp`` stages, ``dp`` replicas.

Run it as ``pp * dp`` ranks, on one node or several::

    python -m zerobubble.launch -n 4 examples/train_dp.py --pp 2 --dp 2
    torchrun --standalone --nproc-per-node 4 examples/train_dp.py --pp 2 --dp 2
    # two nodes (here both on one machine), the same command with K = 0 and K = 1:
    torchrun --nnodes 2 --nproc-per-node 2 --node-rank K --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:29511 examples/train_dp.py --pp 2 --dp 2

Every rank builds the same seeded model and draws the same global batches; each dp
replica trains on its slice of the batch. With ``--out DIR`` the replicas of dp rank 0
save their parameters (``params_pp<r>.pt``) and the last stage's ranks their losses
(``losses_dp<r>.pt``), so runs can be compared bitwise.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import zerobubble
from zerobubble.models import build_mlp, mlp_loss
from zerobubble.runtime.mesh import build_mesh

SIZES = (16, 32, 32, 32, 32, 32, 32, 32, 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages (devices)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel replicas")
    parser.add_argument("--kind", default="zb-h1", help="schedule kind")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--local-batch", type=int, default=8, help="samples per replica")
    parser.add_argument("--out", type=Path, help="directory for parameters and losses")
    args = parser.parse_args()

    info = zerobubble.init_distributed()
    mesh = build_mesh(args.pp, args.dp)
    pipe = zerobubble.Pipeline(
        build_mlp(SIZES),
        mlp_loss,
        args.kind,
        microbatches=args.microbatches,
        mesh=mesh,
        device=info.device,
    )
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    pipe.set_optimizer(opt, zerobubble.OptimConfig(max_norm=1.0))
    data = torch.Generator().manual_seed(0)  # the same global batches on every rank
    n = args.local_batch
    losses = []
    for step in range(args.steps):
        x = torch.randn(n * args.dp, SIZES[0], generator=data)
        y = torch.randn(n * args.dp, SIZES[-1], generator=data)
        part = slice(mesh.dp_rank * n, (mesh.dp_rank + 1) * n)
        got = pipe.step(x[part], target=y[part])
        if got is not None:
            losses.append(torch.stack(got))
            print(f"step {step} dp {mesh.dp_rank}: loss {losses[-1].mean().item():.5f}", flush=True)
    pipe.drain()
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        if mesh.dp_rank == 0:
            params = {k: p.detach().clone() for k, p in pipe.named_parameters()}
            torch.save(params, args.out / f"params_pp{mesh.pp_rank}.pt")
        if losses:
            torch.save(torch.stack(losses), args.out / f"losses_dp{mesh.dp_rank}.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
