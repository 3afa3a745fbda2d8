"""``zerobubble train --dry-run``: what each pipeline rank will hold, before any rank starts.

The recipe's model is built without memory (an HF directory as a meta model: no tensor is
read), its layers' saved activations are measured on fake tensors, and the schedule's peak
comes from the simulator's memory model (:mod:`zerobubble.train.estimate`). One process, no
distributed job: a user learns whether a run fits before asking for the devices.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from zerobubble.schedule.ir import Schedule
from zerobubble.train.auto import MEM_RATIO
from zerobubble.train.estimate import MemoryEstimate, estimate_memory
from zerobubble.train.recipe import Recipe
from zerobubble.train.sources import model_source
from zerobubble.train.trainer import build_schedule


def dry_run(recipe: Recipe, device_bytes: int | None = None) -> MemoryEstimate:
    """The memory estimate of ``recipe``'s run per pipeline rank (one data-parallel replica:
    every replica holds the same). ``device_bytes``: the device memory to compare with
    (default: the first CUDA device's, or none known on a CPU). ValueError for a recipe the
    estimate cannot price (sequence segments). ``auto`` is priced at its bound: the trial's
    candidates are planned within :data:`~zerobubble.train.auto.MEM_RATIO` x 1F1B's
    activation peak."""
    par = recipe.parallelism
    source = model_source(recipe)
    if source.plan_layers is None:
        raise ValueError(f"{source.summary}: no layers to measure; --dry-run needs them")
    layers, loss_fn = source.plan_layers()
    schedule: Schedule | str = build_schedule(recipe)
    auto = schedule == "auto"
    if auto:  # its trial picks at run time; every candidate is held to MEM_RATIO x 1F1B's
        schedule = "1f1b"
    rows = par.pipeline_parallel_microbatch_size
    ids = torch.zeros(rows, recipe.training.seq_len, dtype=torch.long)
    example: object = ids if source.hf_config is None else {"input_ids": ids}
    if device_bytes is None and torch.cuda.is_available():
        device_bytes = torch.cuda.get_device_properties(0).total_memory
    found = estimate_memory(
        layers,
        loss_fn,
        schedule,
        example,
        ids,
        pp=par.pipeline_parallel_degree,
        microbatches=recipe.microbatches,
        dp_shard=par.shard,
        tp=par.tensor_parallel_degree,
        ep=par.expert_parallel_degree,
        recompute="layers" if recipe.activation_checkpoint.mode == "full" else "none",
        device_bytes=device_bytes,
    )
    if not auto:
        return found
    ranks = tuple(replace(r, activations=int(MEM_RATIO * r.activations)) for r in found.ranks)
    return replace(found, schedule=f"auto (at most {MEM_RATIO:g} x 1F1B's activations)",
                   ranks=ranks)  # fmt: skip
