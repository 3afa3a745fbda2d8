"""A zerobubble schedule for PyTorch's own pipelining runtime: ``zerobubble plan``.

torchtitan (``[parallelism] pipeline_parallel_schedule_csv``) and any user of
``torch.distributed.pipelining._PipelineScheduleRuntime._load_csv`` run a schedule given as
PyTorch's compute-only CSV (:mod:`zerobubble.schedule.formats.torch_csv`). This module plans
one for a model: from unit costs, from a costs file (``zerobubble profile``), or from the
model itself, whose layers are profiled here in one process
(:func:`~zerobubble.profile.layers.profile_layers`: F, B, W and activation bytes per layer)
and summed over the stages of an even cut (the cut PyTorch's users make by default).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from zerobubble.parallel.partition import stage_bounds
from zerobubble.profile.layers import LayerProfile, profile_layers
from zerobubble.runtime.stage import LossFn
from zerobubble.schedule.costs import CostModel, CostSpec, Number
from zerobubble.schedule.generators import GENERATORS, NoPairWarning, generate
from zerobubble.schedule.ir import Schedule
from zerobubble.schedule.simulate import SimResult
from zerobubble.schedule.validate import validate

__all__ = ["model_layers", "plan_for_torch", "profiled_costs", "stage_cost_model"]


def stage_cost_model(profile: LayerProfile, bounds: Sequence[range]) -> CostModel:
    """The per-stage cost model (ms, bytes) of layers profiled one by one, cut at ``bounds``:
    each stage's F, B, W medians and M_B, M_W summed over its layers."""

    def total(xs: Sequence[Any], r: range, median: bool = True) -> float:
        return float(sum(xs[i].median if median else xs[i] for i in r))

    mem_f = [int(total(profile.mem_b, r, median=False)) for r in bounds]
    mem_w = [int(total(profile.mem_w, r, median=False)) for r in bounds]
    return CostModel(
        f=tuple(total(profile.f, r) for r in bounds),
        b=tuple(total(profile.b, r) for r in bounds),
        w=tuple(total(profile.w, r) for r in bounds),
        mem_f=tuple(mem_f),
        mem_w=tuple(mem_w),
        recompute=any(w > f for f, w in zip(mem_f, mem_w, strict=True)),  # B may allocate
    )


def model_layers(model: str) -> tuple[list[nn.Module], LossFn, int]:
    """``(layers, loss, vocabulary size)`` of a shipped tiny Hugging Face config (``hf-llama``,
    ...), of a local Hugging Face directory's ``config.json`` (freshly initialised: costs do
    not depend on the weights, nothing is read or downloaded), or of one's own model as
    ``module:function`` (the trainer's factory: :mod:`zerobubble.train.sources`; its first
    layer takes the token ids, its loss the logits and the ids)."""
    from zerobubble.interop import hf

    shipped = hf.TINY_CONFIGS + hf.TINY_MOE_CONFIGS
    if ":" in model and not Path(model).is_dir():
        from zerobubble.train.sources import factory_source

        source = factory_source(model)
        assert source.plan_layers is not None  # a factory's layers are at hand
        layers, loss = source.plan_layers()
        return list(layers), _TokenMean(loss), source.vocab_size
    if model in shipped:
        net = hf.tiny_model(model)
    elif Path(model).is_dir():
        from transformers import AutoModelForCausalLM

        from zerobubble.interop.hf_pretrained import load_config

        config = load_config(model)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            net = AutoModelForCausalLM.from_config(config)
    else:
        raise ValueError(
            f"--model {model!r} is neither a shipped tiny config ({', '.join(shipped)}) nor a "
            "directory: pass one of those names, a Hugging Face model directory or one's own "
            "model as module:function"
        )
    vocab = int(getattr(net, "config").vocab_size)  # noqa: B009 (a transformers model)
    return hf.causal_lm_layers(net), hf.CausalLMLoss(net), vocab


class _TokenMean:
    """A factory model's token loss as one microbatch's mean (the profiler passes no count);
    its first layer takes the ids themselves, not HF's keyword dict."""

    def __init__(self, loss: Any) -> None:
        self.loss = loss

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(logits, labels, self.loss.count_fn(labels))


def profiled_costs(
    layers: Sequence[nn.Module],
    loss_fn: LossFn,
    num_stages: int,
    *,
    vocab: int,
    seq_len: int,
    microbatch_size: int,
    iters: int = 3,
) -> CostModel:
    """Profile ``layers`` on one random microbatch of token ids and cut the result into
    ``num_stages`` even stages (:func:`stage_cost_model`)."""
    bounds = stage_bounds(len(layers), num_stages)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (microbatch_size, seq_len), generator=gen)
    example = ids if isinstance(loss_fn, _TokenMean) else {"input_ids": ids}  # HF: kwargs
    profile = profile_layers(layers, loss_fn, example, ids, iters=iters)
    return stage_cost_model(profile, bounds)


def stages_of(kind: str, num_devices: int, num_microbatches: int, max_stages: int) -> int:
    """How many stages ``kind`` cuts the model into: ``auto`` plans one per device (as the
    trainer's planner does from its profile), any other kind what its schedule has."""
    if kind == "auto":
        return num_devices
    return generate(kind, num_devices, num_microbatches, max_stages=max_stages).num_stages


def plan_for_torch(
    kind: str,
    num_devices: int,
    num_microbatches: int,
    *,
    costs: CostSpec | None = None,
    mem_limit: Number | None = None,
    max_stages: int | None = None,
) -> tuple[Schedule, SimResult]:
    """The validated schedule of ``kind`` for PyTorch's CSV runtime, and its simulation under
    ``costs`` (unit costs if None). Refuses (ValueError) what the CSV cannot say (sequence
    segments) and a memory limit the schedule exceeds."""
    spec = costs if costs is not None else CostSpec()
    gen = GENERATORS.get(kind)
    takes_limit = gen is not None and "mem_limit" in gen.options
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoPairWarning)
        sched = generate(
            kind,
            num_devices,
            num_microbatches,
            costs=spec,
            mem_limit=mem_limit if takes_limit else None,
            max_stages=max_stages,
        )
    if sched.segments > 1:
        raise ValueError(
            f"{kind} chose {sched.segments} sequence segments per microbatch, which PyTorch's "
            "runtime cannot run; pick a kind without segments"
        )
    result = validate(sched, mem_limit=mem_limit, costs=spec.resolve(sched.placement))
    return sched, result
