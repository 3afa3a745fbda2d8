"""The single-process ground truth a pipeline run must reproduce bitwise."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor, nn

from zerobubble.runtime.microbatch import loss_scales, split_batch

__all__ = ["as_sequential", "reference_step"]


def as_sequential(layers: Sequence[nn.Module] | nn.Sequential) -> nn.Sequential:
    """``layers`` as one nn.Sequential; parameter names are ``"<layer index>.<name>"``.

    An nn.Sequential is returned as is (slices of one keep the original indices).
    """
    return layers if isinstance(layers, nn.Sequential) else nn.Sequential(*layers)


def reference_step(
    layers: Sequence[nn.Module] | nn.Sequential,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    x: Tensor,
    target: Tensor,
    m: int,
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """One step of plain autograd over ``m`` microbatches, in microbatch order.

    Clears ``.grad`` (to None), then for j = 0..m-1 runs the layers on
    microbatch j and back-propagates ``loss_j * scale_j`` (scales from
    :func:`loss_scales`), exactly what a pipeline computes. The gradients are
    left in ``.grad`` so an optimizer can step.

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
    scales = loss_scales([len(t) for t in xs])
    for p in model.parameters():
        p.grad = None
    losses = []
    for xj, tj, scale in zip(xs, targets, scales, strict=True):
        loss = loss_fn(model(xj), tj)
        (loss * scale).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads
