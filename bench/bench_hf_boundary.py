"""What a Hugging Face decoder block costs to rebuild its mask and rotary embedding, and
what would travel instead if they were sent.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_hf_boundary.py [--repeats N]``
Prints one JSON object. Needs ``transformers``.

The adapter (``zerobubble.interop.hf``) sends ``{"hidden", "attention_mask" (B x S bool),
"position_ids" (None unless given)}`` between layers, and every block rebuilds the
causal + padding mask (``transformers``' mask utilities) and cos/sin from them. The
alternative sends the built mask and cos/sin once per boundary. For a Llama block
(padded batch, so the mask is materialised) this measures, as thread CPU time (one
thread; medians after a warm-up, forward only):

* ``rebuild_s``: building the mask and cos/sin, as a block does before its layer;
* ``block_s``: the whole adapter block (rebuild + the decoder layer);
* ``rebuild_share = rebuild_s / block_s``: what recomputing costs;
* ``bytes_sent``: the boundary's tensors as the adapter sends them, and
  ``bytes_if_sent``: the same with the built mask and cos/sin added (for eager the
  mask is float, for sdpa bool).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import statistics
import time

import torch

from zerobubble.interop import hf
from zerobubble.interop.hf_layers import _MASKS, _positions

SHAPES = [  # (hidden, heads, kv heads, batch, sequence)
    (64, 4, 2, 8, 64),
    (256, 8, 4, 4, 256),
    (512, 8, 8, 2, 512),
]


def _median(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def measure(hidden: int, heads: int, kv: int, batch: int, length: int, impl: str, repeats: int):
    model = hf.tiny_model(
        "hf-llama",
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=1,
        max_position_embeddings=length,
        attn_implementation=impl,
    ).eval()
    embed, block, _ = hf.causal_lm_layers(model)
    ids = torch.randint(3, 256, (batch, length))
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, -length // 4 :] = 0
    with torch.no_grad():
        x = embed(ids, attention_mask=mask)
        h = x["hidden"]

        def rebuild():
            positions = _positions(h, x["position_ids"])
            built = _MASKS[block.attention_type](
                config=block.config,
                inputs_embeds=h,
                attention_mask=x["attention_mask"],
                cache=None,
                position_ids=positions,
            )
            return built, block.rotary_emb(h, positions)

        built, (cos, sin) = rebuild()
        rebuild_s = _median(rebuild, repeats)
        block_s = _median(lambda: block(x), repeats)
    sent = _nbytes(h, x["attention_mask"], x["position_ids"])
    return {
        "hidden": hidden,
        "heads": heads,
        "batch": batch,
        "seq": length,
        "attn": impl,
        "rebuild_s": rebuild_s,
        "block_s": block_s,
        "rebuild_share": rebuild_s / block_s,
        "bytes_sent": sent,
        "bytes_if_sent": sent + _nbytes(built, cos, sin),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = [measure(*shape, impl, args.repeats) for shape in SHAPES for impl in ("sdpa", "eager")]
    print(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
