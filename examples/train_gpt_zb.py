"""Train the small GPT with the ZB-H1 schedule on 4 local CPU processes.

Any of these works (the script launches itself when started directly)::

    python examples/train_gpt_zb.py
    python -m zerobubble.launch -n 4 examples/train_gpt_zb.py --steps 5
    torchrun --standalone --nproc-per-node 4 examples/train_gpt_zb.py

Every rank builds the same seeded model and keeps only its own stages; the
rank holding the last stage prints the mean loss of each step.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.models.corpus import stdlib_corpus
from zerobubble.runtime.executor import PipelineExecutor
from zerobubble.runtime.launcher import init_distributed, launch
from zerobubble.runtime.partition import build_stage_modules
from zerobubble.schedule.generators import generate


def train(steps: int, microbatches: int, batch_size: int) -> None:
    info = init_distributed()
    schedule = generate("zb-h1", info.world_size, microbatches)
    corpus = stdlib_corpus(max_chars=200_000)
    cfg = GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=32, d_model=32, n_layers=4)
    stages = build_stage_modules(build_gpt(cfg), schedule, info.rank, device=info.device)
    pipe = PipelineExecutor(schedule, stages, loss_fn=gpt_loss, device=info.device)
    params = [p for chunk in pipe.chunks.values() for p in chunk.module.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    data = torch.Generator().manual_seed(0)  # same batches on every rank
    for step in range(steps):
        x, y = corpus.batch(batch_size, cfg.max_seq_len, data)
        start = time.perf_counter()
        opt.zero_grad()
        losses = pipe.step(x, target=y)
        opt.step()
        pipe.param_version += 1
        if losses is not None:
            loss = torch.stack(losses).mean().item()
            took = time.perf_counter() - start
            print(f"step {step}: loss {loss:.4f} ({took * 1000:.0f} ms)", flush=True)
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--procs", type=int, default=4, help="ranks when launching itself")
    args = parser.parse_args()
    job = (args.steps, args.microbatches, args.batch_size)
    if "RANK" in os.environ:  # started by a launcher: this process is one rank
        train(*job)
    else:
        launch(train, args.procs, *job, timeout=600)


if __name__ == "__main__":
    main()
