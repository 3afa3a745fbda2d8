"""Per-rank memory of loading a Hugging Face directory at pp=4: each rank holds its stages only.

Run: ``OMP_NUM_THREADS=1 PYTHONPATH=src python bench/bench_load_rss.py [--quick]``
Prints one JSON object.

Workload: a Llama of ``--layers`` blocks, hidden ``--hidden``, vocabulary ``--vocab`` (untied
head; default 8 x 256 x 8192, about 50 MB of fp32 parameters), saved by ``save_pretrained`` in
shards of 5 MB to a temporary directory, then loaded by
:func:`zerobubble.interop.hf_pretrained.load_pipeline` on 4 gloo ranks (zb-h1). Each rank
reports

* ``param_bytes``: the parameters of its stage modules (each memory once, read from the
  built modules), and ``param_share``: that over the whole model's parameter bytes (the
  must-show of issue 43: at most 0.3 at pp=4; an even share is 0.25);
* ``peak_rss_delta``: the rise of the process's resident-set high-water mark
  (``VmHWM``, reset just before the load) over its resident size then, with the imports, the
  process group and one meta model of the config already made (:func:`warm`): what loading
  cost the process, the pipeline's own structures, safetensors' reads and the allocator's
  slack included;
* ``rss_delta``: its resident size after the load less before.

For comparison one process loads the whole model the same way (``whole``: ``load_pipeline``
at pp=1, in a launch of its own). ``from_pretrained`` is no fair baseline: it may leave the
weights memory-mapped from the files, untouched and so not resident.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from zerobubble.runtime.launcher import init_distributed, launch

PP, M = 4, 4


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak() -> None:
    """Start the resident-set high-water mark afresh (Linux: ``clear_refs`` 5): a rank
    inherits its parent's at fork, which wrote the model."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes() -> int:
    """The resident-set high-water mark since :func:`reset_peak` (``VmHWM``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def write_model(folder: Path, layers: int, hidden: int, vocab: int) -> int:
    """Save the model; return its parameter bytes."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, max_shard_size="5MB")
    return sum(p.numel() * p.element_size() for p in model.parameters())


def warm(folder: str) -> None:
    """What any process that loads a model pays before its first tensor, left out of the
    baseline: the imports (transformers' modeling code among them, imported on first use)
    and a meta model of the config (no memory)."""
    import safetensors.torch  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM

    import zerobubble.pipeline  # noqa: F401

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(config)


def load_job(folder: str) -> dict:
    from zerobubble.interop.hf_pretrained import load_pipeline

    init_distributed()
    warm(folder)
    reset_peak()
    before = rss_bytes()
    pipe = load_pipeline(folder, "zb-h1", microbatches=M)
    peak, after = peak_bytes(), rss_bytes()
    seen = {
        p.data_ptr(): p.numel() * p.element_size()
        for c in pipe.executor.chunks.values()
        for p in c.module.parameters()
    }
    return {
        "rank": pipe.rank,
        "stages": list(pipe.schedule.stages_of_device[pipe.rank]),
        "param_bytes": sum(seen.values()),
        "peak_rss_delta": peak - before,
        "rss_delta": after - before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--quick", action="store_true", help="hidden 128, vocabulary 2048")
    args = ap.parse_args()
    if args.quick:
        args.hidden, args.vocab = 128, 2048
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        whole = write_model(folder, args.layers, args.hidden, args.vocab)
        ranks = launch(load_job, PP, str(folder), timeout=600)
        alone = launch(load_job, 1, str(folder), timeout=600)[0]
    for r in ranks:
        r["param_share"] = r["param_bytes"] / whole
        r["peak_rss_share"] = r["peak_rss_delta"] / alone["peak_rss_delta"]
        r["rss_share"] = r["rss_delta"] / alone["rss_delta"]
    worst = max(r["param_share"] for r in ranks)
    out = {
        "pp": PP,
        "layers": args.layers,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "whole_param_bytes": whole,
        "per_rank": ranks,
        "whole": alone,
        "max_param_share": worst,
        "goal": 0.3,
        "meets_goal": worst <= 0.3,
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
