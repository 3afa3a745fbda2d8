"""How far the tied-parameter order is from plain autograd's, on our GPT with tie_embeddings.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_tied_order.py [--steps N]``
Prints one JSON object.

A pipeline sums a tied parameter's gradient per holder stage (microbatch order),
then over the stages in stage order (:mod:`zerobubble.parallel.tied`); plain
autograd on the whole model adds the embedding's and the head's contributions
inside every microbatch. Both are computed here on identical weights and
batches, for each stage count (the tie spans the first and the last stage), and
the tied gradient's max absolute, elementwise relative (large where the two
uses nearly cancel) and normwise relative (``|d| / |g|``) differences are
reported, with whether every other gradient is bitwise equal (it must be).
"""

from __future__ import annotations

import argparse
import copy
import json

import torch

from zerobubble.models import GPTConfig, build_gpt, gpt_loss
from zerobubble.parallel.partition import stage_bounds
from zerobubble.parallel.tied import tied_reference_step
from zerobubble.reference.step import reference_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="batches per stage count")
    args = parser.parse_args()
    cfg = GPTConfig(
        vocab_size=256, max_seq_len=32, d_model=64, n_heads=4, n_layers=4, tie_embeddings=True
    )
    model = build_gpt(cfg)
    gen = torch.Generator().manual_seed(0)
    out: dict[str, object] = {"model": vars(cfg), "microbatches": 8, "batch": 16, "stages": {}}
    for stages in (2, 3, 6):
        abs_diff = rel_diff = norm_diff = grad_max = 0.0
        others_equal = True
        for _ in range(args.steps):
            x = torch.randint(0, cfg.vocab_size, (16, cfg.max_seq_len), generator=gen)
            y = torch.randint(0, cfg.vocab_size, (16, cfg.max_seq_len), generator=gen)
            ours, plain = copy.deepcopy(model), copy.deepcopy(model)
            tied_reference_step(ours, gpt_loss, x, y, 8, stage_bounds(len(model), stages))
            reference_step(plain, gpt_loss, x, y, 8)
            pairs = zip(ours.named_parameters(), plain.named_parameters(), strict=True)
            for (name, p), (_, q) in pairs:
                if name != "0.tok.weight":
                    others_equal &= torch.equal(p.grad, q.grad)
                    continue
                d = (p.grad - q.grad).abs()
                abs_diff = max(abs_diff, d.max().item())
                rel_diff = max(rel_diff, (d / q.grad.abs().clamp_min(1e-30)).max().item())
                norm_diff = max(norm_diff, (d.norm() / q.grad.norm()).item())
                grad_max = max(grad_max, q.grad.abs().max().item())
        out["stages"][str(stages)] = {
            "max_abs_diff": abs_diff,
            "max_rel_diff": rel_diff,
            "max_normwise_rel_diff": norm_diff,
            "max_abs_grad": grad_max,
            "other_grads_bitwise_equal": others_equal,
        }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
