"""Per-layer costs: F, B, W and activation memory of every layer, for stage balancing.

Each layer runs as its own one-layer :class:`~zerobubble.runtime.chunk.StageChunk`
(B/W split, exactly what a pipeline stage runs), on copies of the layers so
the caller's modules are neither split nor trained. The microbatch flows
forward through all layers, then the input gradients flow back (B), then
every W runs; each op is timed on its own. Per-op bookkeeping of a one-layer
chunk is counted once per layer, so sums over many small layers slightly
overstate a stage; balancing only needs the ratios.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch import Tensor, nn

from zerobubble.profile.stats import OpStats
from zerobubble.runtime.chunk import StageChunk


@dataclass(frozen=True)
class LayerProfile:
    """Measured costs of each layer (times in milliseconds, memory in bytes).

    Attributes:
        f, b, w: Timing statistics of F, B and W per layer.
        mem_b: Bytes a layer holds after F until B (its M_B), median over iterations.
        mem_w: Bytes it holds after B until W (its M_W).
    """

    f: tuple[OpStats, ...]
    b: tuple[OpStats, ...]
    w: tuple[OpStats, ...]
    mem_b: tuple[int, ...]
    mem_w: tuple[int, ...]

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
        }


def profile_layers(
    layers: Sequence[nn.Module],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    target: Tensor,
    *,
    warmup: int = 1,
    iters: int = 5,
) -> LayerProfile:
    """Time F, B and W of every layer on one microbatch ``x`` (the first ``warmup`` runs dropped).

    ``loss_fn(output, target)`` is the loss after the last layer; it is timed
    with the last layer, as in a pipeline's last stage.
    """
    if not layers:
        raise ValueError("profile_layers needs at least one layer")
    if warmup < 0 or iters < 1:
        raise ValueError(f"need warmup >= 0 and iters >= 1, got warmup={warmup}, iters={iters}")
    n = len(layers)
    chunks = [
        StageChunk(copy.deepcopy(layer), i, n, loss_fn=loss_fn if i == n - 1 else None, split=True)
        for i, layer in enumerate(layers)
    ]
    times: dict[str, list[list[float]]] = {op: [[] for _ in range(n)] for op in "FBW"}
    mem_b: list[list[int]] = [[] for _ in range(n)]
    mem_w: list[list[int]] = [[] for _ in range(n)]
    for it in range(warmup + iters):
        keep = it >= warmup
        h = x
        for i, c in enumerate(chunks):
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
    return LayerProfile(
        f=tuple(OpStats.of(s) for s in times["F"]),
        b=tuple(OpStats.of(s) for s in times["B"]),
        w=tuple(OpStats.of(s) for s in times["W"]),
        mem_b=tuple(int(statistics.median(m)) for m in mem_b),
        mem_w=tuple(int(statistics.median(m)) for m in mem_w),
    )


def _record(samples: list[float], t0: float, keep: bool) -> None:
    if keep:
        samples.append((time.perf_counter() - t0) * 1e3)
