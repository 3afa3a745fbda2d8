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

import zerobubble
from zerobubble import models


def train(steps: int, microbatches: int, batch_size: int) -> None:
    info = zerobubble.init_distributed()
    corpus = models.stdlib_corpus(max_chars=200_000)
    cfg = models.GPTConfig(vocab_size=corpus.vocab_size, max_seq_len=32, d_model=32, n_layers=4)
    schedule = zerobubble.generate("zb-h1", info.world_size, microbatches)
    pipe = zerobubble.Pipeline(models.build_gpt(cfg), models.gpt_loss, schedule, device=info.device)
    pipe.set_optimizer(torch.optim.AdamW(pipe.parameters(), lr=3e-3))
    data = torch.Generator().manual_seed(0)  # same batches on every rank
    for step in range(steps):
        x, y = corpus.batch(batch_size, cfg.max_seq_len, data)
        start = time.perf_counter()
        losses = pipe.step(x, target=y)  # forward, backward and the optimizer step
        if losses is not None:  # this rank holds the last stage
            loss = torch.stack(losses).mean().item()
            took = time.perf_counter() - start
            print(f"step {step}: loss {loss:.4f} ({took * 1000:.0f} ms)", flush=True)
    pipe.drain()
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
        zerobubble.launch_local(train, args.procs, *job, timeout=600)


if __name__ == "__main__":
    main()
