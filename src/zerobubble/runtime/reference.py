"""The single-process ground truth a pipeline run must reproduce bitwise.

With random ops (dropout) the ground truth is the model run stage by stage on each
microbatch, every stage's forward seeded as the executor seeds it
(:class:`~zerobubble.runtime.rng.StageRng`): pass the executor's seed, its step
number and the pipeline's cut (``num_stages``, ``boundaries``) to
:func:`reference_step`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext

from torch import Tensor, nn

from zerobubble.runtime.microbatch import CountFn, batch_count, loss_scales, split_batch
from zerobubble.runtime.partition import stage_bounds
from zerobubble.runtime.rng import StageRng

__all__ = ["as_sequential", "dp_reference_step", "reference_step"]


def as_sequential(layers: Sequence[nn.Module] | nn.Sequential) -> nn.Sequential:
    """``layers`` as one nn.Sequential; parameter names are ``"<layer index>.<name>"``.

    An nn.Sequential is returned as is (slices of one keep the original indices).
    """
    return layers if isinstance(layers, nn.Sequential) else nn.Sequential(*layers)


def reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    x: Tensor,
    target: Tensor,
    m: int,
    *,
    seed: int | None = None,
    step: int = 0,
    num_stages: int = 1,
    boundaries: Sequence[int] | None = None,
    count_fn: CountFn | None = None,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of plain autograd over ``m`` microbatches, in microbatch order.

    Clears ``.grad`` (to None), then for j = 0..m-1 runs the layers on
    microbatch j and back-propagates ``loss_j * scale_j`` (scales from
    :func:`loss_scales`), exactly what a pipeline computes. The gradients are
    left in ``.grad`` so an optimizer can step.

    With a ``seed``, the layers of each stage (``num_stages`` cut as
    :func:`~zerobubble.runtime.partition.stage_bounds` cuts them, with
    ``boundaries``) run under the generator state of ``(seed, step, stage, j)``,
    as :attr:`~zerobubble.runtime.executor.ExecutorOptions.seed` makes the
    pipeline do in its step number ``step``; without one they draw from the
    process's generators as they are. With ``count_fn``, every microbatch's loss is
    ``loss_fn(output, target_j, count_fn(target))`` and is back-propagated
    unscaled, as the executor does with the same ``count_fn``.

    Returns:
        The unscaled per-microbatch losses (detached 0-dim tensors) and a copy
        of every gradient, keyed by parameter name (see :func:`as_sequential`).
    """
    if target.dim() == 0 or target.shape[0] != x.shape[0]:
        raise ValueError(
            f"target has shape {tuple(target.shape)} and x {tuple(x.shape)}: "
            "they must share the batch (first) dimension"
        )
    model = as_sequential(layers)
    xs, targets = split_batch(x, m), split_batch(target, m)
    bounds = stage_bounds(len(model), num_stages, boundaries)
    # Random ops draw on the device the layers live on, as on a pipeline's stages.
    device = next((p.device for p in model.parameters()), x.device)
    rng = None if seed is None else StageRng(seed, device)
    extra: tuple[Tensor | int, ...]
    if count_fn is None:
        scales, extra = loss_scales([len(t) for t in xs]), ()
    else:
        scales, extra = [1.0] * m, (batch_count(count_fn, target),)
    for p in model.parameters():
        p.grad = None
    losses = []
    for j, (xj, tj, scale) in enumerate(zip(xs, targets, scales, strict=True)):
        h = xj
        for s, layer_range in enumerate(bounds):
            with nullcontext() if rng is None else rng.scope(step, s, j):
                for i in layer_range:
                    h = model[i](h)
                if s == num_stages - 1:
                    h = loss_fn(h, tj, *extra)  # the last stage's forward holds the loss
        loss = h
        (loss * scale).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads


def dp_reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[..., Tensor],
    parts: Sequence[tuple[Tensor, Tensor]],
    m: int,
) -> tuple[list[list[Tensor]], dict[str, Tensor]]:
    """One data-parallel step in the order a ``(pp, dp)`` mesh computes it (no random ops).

    ``parts[r]`` is replica ``r``'s ``(x, target)``. Per replica, in microbatch order,
    ``loss_j * n_j / N`` is back-propagated (``N`` the global batch: all parts
    together) into fresh gradients; the replicas' gradients are then summed in rank
    order, ``((g_0 + g_1) + g_2) + ...``, which is what the dp all-reduce gives
    bitwise for two replicas (see :mod:`zerobubble.runtime.dp` for more). The sums
    are left in ``.grad``.

    Returns:
        Each replica's unscaled per-microbatch losses, and a copy of every summed gradient.
    """
    model = as_sequential(layers)
    total = sum(len(x) for x, _ in parts)
    summed: dict[str, Tensor] = {}
    losses: list[list[Tensor]] = []
    for x, target in parts:
        for p in model.parameters():
            p.grad = None
        mine = []
        for xj, tj in zip(split_batch(x, m), split_batch(target, m), strict=True):
            loss = loss_fn(model(xj), tj)
            (loss * (len(xj) / total)).backward()
            mine.append(loss.detach())
        losses.append(mine)
        for n, p in model.named_parameters():
            if p.grad is not None:
                summed[n] = p.grad.clone() if n not in summed else summed[n] + p.grad
    for n, p in model.named_parameters():
        p.grad = summed.get(n)
    return losses, {n: g.clone() for n, g in summed.items()}
