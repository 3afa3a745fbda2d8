"""What seeding every forward costs (:class:`~zerobubble.runtime.rng.StageRng`).

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_rng.py [--rounds N]``.
Prints one JSON object.

The executor enters ``StageRng.scope`` around every F (derive a seed, save the
caller's generator states, seed, restore). This times the scope alone and one
stage's F (:class:`~zerobubble.runtime.stage.StageChunk`, a 4-layer MLP block of
width 256 on 8 x 128 tokens, with dropout), in thread CPU time (medians over
``--rounds``), on the CPU; ``scope_share`` is the scope's time over the F's. (The
difference of two timed F, with and without the scope, is below this machine's
noise, so it is not what is reported.)
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import time

import torch
from torch import nn

from zerobubble.runtime.rng import StageRng
from zerobubble.runtime.stage import StageChunk


def _median_us(fn, rounds: int) -> float:
    times = []
    for i in range(rounds):
        t0 = time.thread_time_ns()
        fn(i)
        times.append(time.thread_time_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    rng = StageRng(0, "cpu")

    def scope_only(i: int) -> None:
        with rng.scope(i, 1, 0):
            pass

    width = 256
    block = nn.Sequential(
        *[m for _ in range(4) for m in (nn.Linear(width, width), nn.GELU(), nn.Dropout(0.1))]
    )
    chunk = StageChunk(block, 1, 3, track_memory=False)
    x = torch.randn(8, 128, width)

    def forward(i: int) -> None:
        chunk.forward(0, x)
        chunk.discard()

    for i in range(10):
        forward(i)
    scope = _median_us(scope_only, args.rounds * 10)
    plain = _median_us(forward, args.rounds)
    out = {
        "scope_us": round(scope, 2),
        "forward_us": round(plain, 1),
        "scope_share": round(scope / plain, 5),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
