"""Per-layer costs: F, B, W and activation memory of every layer, for stage balancing.

Each layer runs as its own one-layer :class:`~zerobubble.runtime.stage.StageChunk`
(B/W split, exactly what a pipeline stage runs), on copies of the layers so
the caller's modules are neither split nor trained. The microbatch flows
forward through all layers, then the input gradients flow back (B), then
every W runs; each op is timed on its own. A plain copy of each layer also
runs a full and an input-only backward, whose difference is the layer's
weight-gradient time: W's part of it is the time share the split defers.
Per-op bookkeeping of a one-layer chunk is counted once per layer, so sums
over many small layers slightly overstate a stage; balancing only needs the
ratios.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.profile.stats import OpStats
from zerobubble.runtime.shapes import map_tensors, tensor_leaves
from zerobubble.runtime.split import SplitShare, SplitShareWarning
from zerobubble.runtime.stage import StageChunk


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of each layer (times in milliseconds, memory in bytes).

    Attributes:
        f, b, w: Timing statistics of F, B and W per layer.
        mem_b: Bytes a layer holds after F until B (its M_B), median over iterations.
        mem_w: Bytes it holds after B until W (its M_W).
        w_share: Share of each layer's weight-gradient work (by parameter size) that its
            split defers to W; the rest is computed in B (see
            :class:`~zerobubble.runtime.split.SplitShare`).
        w_time_share: Share of each layer's weight-gradient time spent in W: median W over
            (median W + the B time its unsplit parameters add), measured.
        params: Parameter elements of each layer that need a gradient.
        w_grad_ms: Median weight-gradient time of each layer under plain autograd.
    """

    f: tuple[OpStats, ...]
    b: tuple[OpStats, ...]
    w: tuple[OpStats, ...]
    mem_b: tuple[int, ...]
    mem_w: tuple[int, ...]
    w_share: tuple[float, ...] = ()
    w_time_share: tuple[float, ...] = ()
    params: tuple[int, ...] = ()
    w_grad_ms: tuple[float, ...] = ()

    def stage_w_share(self, lo: int, hi: int) -> tuple[float, float]:
        """(parameter share, time share) deferred to W by layers ``lo..hi-1`` as one stage:
        deferred over total elements, and summed W over summed plain weight-gradient
        time (capped at 1, as per layer)."""
        params = self.params[lo:hi]
        total = sum(params)
        deferred = sum(n * sh for n, sh in zip(params, self.w_share[lo:hi], strict=True))
        wgrad = sum(self.w_grad_ms[lo:hi])
        w = sum(
            s.median
            for s, sh in zip(self.w[lo:hi], self.w_share[lo:hi], strict=True)
            if sh > 0  # W of a layer that defers nothing is only its own overhead
        )
        return (deferred / total if total else 1.0), (min(w / wgrad, 1.0) if wgrad > 0 else 1.0)

    @property
    def num_layers(self) -> int:
        return len(self.f)

    def costs(self) -> list[float]:
        """Median F + B + W of each layer: the per-layer cost a balanced cut evens out."""
        return [
            f.median + b.median + w.median for f, b, w in zip(self.f, self.b, self.w, strict=True)
        ]

    def to_dict(self) -> dict[str, list[float] | list[int]]:
        return {
            "F": [s.median for s in self.f],
            "B": [s.median for s in self.b],
            "W": [s.median for s in self.w],
            "F_p95": [s.p95 for s in self.f],
            "B_p95": [s.p95 for s in self.b],
            "W_p95": [s.p95 for s in self.w],
            "mem_B": list(self.mem_b),
            "mem_W": list(self.mem_w),
            "W_param_share": list(self.w_share),
            "W_time_share": list(self.w_time_share),
        }


def profile_layers(
    layers: Sequence[nn.Module],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Any,
    target: Tensor,
    *,
    warmup: int = 1,
    iters: int = 5,
) -> LayerProfile:
    """Time F, B and W of every layer on one microbatch ``x`` (the first ``warmup`` runs dropped).

    ``x`` is the first layer's input: a tensor or a pytree (a dict of ids and mask).

    ``loss_fn(output, target)`` is the loss after the last layer; it is timed
    with the last layer, as in a pipeline's last stage.
    """
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    n = len(layers)
    plain = [copy.deepcopy(layer) for layer in layers]
    with warnings.catch_warnings():
        # One layer alone often has nothing to split (a norm, an activation): the stage
        # warning is about pipeline stages, and the profile reports each layer's share.
        warnings.simplefilter("ignore", SplitShareWarning)
        chunks = [
            StageChunk(
                copy.deepcopy(layer), i, n, loss_fn=loss_fn if i == n - 1 else None, split=True
            )
            for i, layer in enumerate(layers)
        ]
    times: dict[str, list[list[float]]] = {op: [[] for _ in range(n)] for op in "FBW"}
    mem_b: list[list[int]] = [[] for _ in range(n)]
    mem_w: list[list[int]] = [[] for _ in range(n)]
    wgrad: list[list[float]] = [[] for _ in range(n)]
    for it in range(warmup + iters):
        keep = it >= warmup
        h = x
        for i, c in enumerate(chunks):
            if keep:
                last = (loss_fn, target) if i == n - 1 else None
                wgrad[i].append(_plain_weight_grad_ms(plain[i], h, last))
            t0 = time.perf_counter()
            h = c.forward(it, h, target=target if i == n - 1 else None)
            _record(times["F"][i], t0, keep)
            if keep:
                mem_b[i].append(c.held_bytes())
        g: Tensor | None = None
        for i in reversed(range(n)):
            t0 = time.perf_counter()
            g = chunks[i].backward_input(it, g)
            _record(times["B"][i], t0, keep)
            if keep:
                mem_w[i].append(chunks[i].held_bytes())
        for i, c in enumerate(chunks):
            t0 = time.perf_counter()
            c.backward_weight(it)
            _record(times["W"][i], t0, keep)
    w_med = [statistics.median(t) for t in times["W"]]
    share = [c.split_share for c in chunks]
    return LayerProfile(
        f=tuple(OpStats.of(s) for s in times["F"]),
        b=tuple(OpStats.of(s) for s in times["B"]),
        w=tuple(OpStats.of(s) for s in times["W"]),
        mem_b=tuple(int(statistics.median(m)) for m in mem_b),
        mem_w=tuple(int(statistics.median(m)) for m in mem_w),
        w_share=tuple(1.0 if sh is None else sh.fraction for sh in share),
        w_time_share=tuple(
            _time_share(w, statistics.median(g), sh)
            for w, g, sh in zip(w_med, wgrad, share, strict=True)
        ),
        params=tuple(sum(p.numel() for p in m.parameters() if p.requires_grad) for m in layers),
        w_grad_ms=tuple(statistics.median(g) for g in wgrad),
    )


def _plain_weight_grad_ms(
    layer: nn.Module, x: Any, last: tuple[Callable[[Tensor, Tensor], Tensor], Tensor] | None
) -> float:
    """Time (ms) plain autograd spends on ``layer``'s weight gradients for input ``x``: a
    full backward minus one that asks for the input gradient only."""
    spent = []
    for inputs_only in (False, True):
        # A pytree input (a first layer's dict of ids and mask) has float leaves or none.
        inp = map_tensors(x, lambda t: t.detach().requires_grad_(t.is_floating_point()))
        leaves = tensor_leaves(inp)
        with torch.enable_grad():
            out = layer(inp)
            root = last[0](out, last[1]) if last is not None else _sum(out)
        targets = [*leaves] if inputs_only else [*leaves, *layer.parameters()]
        targets = [t for t in targets if t.requires_grad]
        t0 = time.perf_counter()
        if targets:
            torch.autograd.grad([root], targets, allow_unused=True)
        spent.append(time.perf_counter() - t0)
    return max(spent[0] - spent[1], 0.0) * 1e3


def _sum(out: Any) -> Tensor:
    """A scalar over a layer's output (its float leaves, where it is a pytree)."""
    return sum((t.sum() for t in tensor_leaves(out) if t.is_floating_point()), torch.zeros(()))


def _time_share(w_ms: float, wgrad_ms: float, share: SplitShare | None) -> float:
    """W's part of the weight-gradient time, capped at 1 (W carries its own overhead)."""
    if share is None or share.total == 0:
        return 1.0
    if share.deferred == 0:
        return 0.0
    return min(w_ms / wgrad_ms, 1.0) if wgrad_ms > 0 else 1.0


def _record(samples: list[float], t0: float, keep: bool) -> None:
    if keep:
        samples.append((time.perf_counter() - t0) * 1e3)
