"""What a Hugging Face decoder block saves over k sequence segments, against one pass.

A tiny HF Llama block (``--width`` hidden, 4 heads over 2 kv heads: grouped-query attention)
at ``--seq`` tokens cut into ``--k`` equal segments. Per block, summed over the segments,
the bytes its forward saves for the backward (``profile.segments.span_memory``: distinct
storages, less parameters, buffers and the earlier segments' keys and values, as a stage's
``held_bytes`` counts them), three ways:

- ``pieces``: as the adapter runs it (the joined keys and values saved as their pieces,
  ``kv.saving_joined``; the own keys and values repeated to the query heads once);
- ``copies``: the joined keys and values saved as copies (what the block saved before);
- ``whole``: one pass over the whole sequence (no segments).

Run: ``PYTHONPATH=src .venv/bin/python bench/bench_segment_kv.py [--seq 4096] [--k 8]
[--attn sdpa]``; prints one JSON line (MiB). Memory is exact; nothing is timed.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from zerobubble.interop import hf
from zerobubble.profile.segments import span_memory


@contextmanager
def _copies() -> Iterator:
    """The join without its saved-tensor hooks: the joined tensors saved as they are."""
    yield lambda pieces, dim: torch.cat(list(pieces), dim=dim)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    args = parser.parse_args()
    model = hf.tiny_model(
        "hf-llama", num_hidden_layers=1, hidden_size=args.width, attn_implementation=args.attn
    ).train()
    layers = hf.causal_lm_layers(model, check=False)
    x = {"input_ids": torch.randint(3, 200, (1, args.seq), generator=torch.Generator())}
    cuts = [args.seq * i // args.k for i in range(args.k + 1)]

    def segments() -> int:
        return sum(span_memory(layers, x, a, b)[1][0] for a, b in itertools.pairwise(cuts))

    pieces = segments()
    with mock.patch("zerobubble.interop.hf_layers.saving_joined", _copies):
        copies = segments()
    whole = span_memory(layers, x, 0, args.seq)[1][0]
    mib = 2.0**20
    print(
        json.dumps(
            {
                "seq": args.seq,
                "k": args.k,
                "width": args.width,
                "attn": args.attn,
                "pieces_MiB": round(pieces / mib, 2),
                "copies_MiB": round(copies / mib, 2),
                "whole_MiB": round(whole / mib, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
