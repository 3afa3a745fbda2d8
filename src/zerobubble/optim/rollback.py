"""Undoing a provisional optimizer step.

A step changes more than the weights: Adam(W) also advances its moments and
its step count, SGD its momentum buffer, and the first step creates that
state. An undo must restore all of it, or the redone step diverges.

* :class:`Snapshot` copies parameters and state before the step and puts the
  copy back: exact, any optimizer.
* :class:`Inverse` applies the algebraic inverse of ``torch.optim.Adam``,
  ``AdamW`` and ``SGD`` in place (their single-tensor update, which is what
  they run on CPU by default; the foreach/fused kernels compute the same
  algebra with other roundings). The step count and the existence of state
  are restored exactly; the floating-point values are not: each inverse
  operation rounds, and recovering the moments divides by ``beta1``,
  ``beta2`` or ``momentum``, which amplifies the rounding of the newer state
  (docs/optim.md gives the bounds and the measured worst errors).

Both read the gradients the step used, so ``.grad`` must be unchanged between
the step and the undo (the trainer guarantees it), and both are told the
hyperparameters the step ran with.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor

from zerobubble.optim.config import Rollback

__all__ = ["Inverse", "Snapshot", "UnsupportedRollbackError", "make_undo"]


class UnsupportedRollbackError(ValueError):
    """The optimizer (or one of its options) has no in-place inverse."""


class Snapshot:
    """Exact undo by copying parameters and optimizer state before the step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._saved: list[tuple[Tensor, Tensor, dict[str, Any] | None]] | None = None

    def prepare(self) -> None:
        """Call right before the provisional step."""
        state = self.optimizer.state
        self._saved = [
            (p, p.detach().clone(), copy.deepcopy(state[p]) if p in state else None)
            for group in self.optimizer.param_groups
            for p in group["params"]
        ]

    def undo(self) -> None:
        """Restore what :meth:`prepare` saw, bitwise."""
        if self._saved is None:
            raise RuntimeError("undo() without a prepared step (protocol bug)")
        state = self.optimizer.state
        with torch.no_grad():
            for p, value, saved in self._saved:
                p.copy_(value)
                if saved is None:
                    state.pop(p, None)
                else:
                    state[p] = saved
        self._saved = None


class Inverse:
    """In-place algebraic undo of Adam, AdamW and SGD steps (see the module docstring)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        check_invertible(optimizer)
        self.optimizer = optimizer
        self._had_state: set[int] | None = None

    def prepare(self) -> None:
        """Remember which parameters had state: the first step creates it."""
        state = self.optimizer.state
        self._had_state = {
            id(p) for group in self.optimizer.param_groups for p in group["params"] if state.get(p)
        }

    def undo(self) -> None:
        """Invert the last step in place, with the hyperparameters now in ``param_groups``."""
        if self._had_state is None:
            raise RuntimeError("undo() without a prepared step (protocol bug)")
        adam = isinstance(self.optimizer, torch.optim.Adam)
        with torch.no_grad():
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    grad = p.grad
                    if grad is None:
                        continue
                    first = id(p) not in self._had_state
                    if adam:
                        _undo_adam(p, grad, self.optimizer.state[p], group, first)
                    else:
                        _undo_sgd(p, grad, self.optimizer.state[p], group, first)
                    if first:
                        self.optimizer.state.pop(p, None)
        self._had_state = None


def make_undo(optimizer: torch.optim.Optimizer, mode: Rollback) -> Snapshot | Inverse:
    """The undo strategy for ``mode``; refuses an optimizer the inverse does not cover."""
    return Snapshot(optimizer) if mode is Rollback.SNAPSHOT else Inverse(optimizer)


def check_invertible(optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`UnsupportedRollbackError` unless :class:`Inverse` can undo its steps."""
    kind = type(optimizer)
    fix = "use OptimConfig(rollback='snapshot'), which restores any optimizer exactly"
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        raise UnsupportedRollbackError(
            f"{kind.__module__}.{kind.__qualname__} has no in-place inverse (only "
            f"torch.optim.Adam, AdamW and SGD do); {fix}"
        )
    for i, group in enumerate(optimizer.param_groups):
        bad = [k for k in ("amsgrad", "capturable", "differentiable", "fused") if group.get(k)]
        if bad:
            raise UnsupportedRollbackError(
                f"param group {i} of {kind.__name__} sets {', '.join(bad)}=True, which the "
                f"inverse does not cover (amsgrad's running maximum cannot be undone); {fix}"
            )
        if kind is torch.optim.SGD and group["momentum"] != 0 and group["dampening"] == 1:
            raise UnsupportedRollbackError(
                f"param group {i} of SGD has dampening=1: the momentum buffer then forgets "
                f"the gradient and cannot be recovered; {fix}"
            )


def _scalar(x: float | Tensor) -> float:
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _undo_adam(
    p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any], first: bool
) -> None:
    """Inverse of torch.optim.adam._single_tensor_adam for one parameter and its gradient."""
    lr, eps, wd = _scalar(group["lr"]), group["eps"], group["weight_decay"]
    beta1, beta2 = (_scalar(b) for b in group["betas"])
    decoupled = group.get("decoupled_weight_decay", False)
    step_t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
    step = _scalar(step_t)
    # The update used the new moments; recompute its denominator the same way.
    bias1, bias2 = 1 - beta1**step, 1 - beta2**step
    denom = (v.sqrt() / bias2**0.5).add_(eps)
    p.addcdiv_(m, denom, value=lr / bias1)
    if wd != 0 and decoupled:
        p.div_(1 - lr * wd)
    if first:
        return  # the moments and step count did not exist before; the caller drops them
    g = -grad if group.get("maximize", False) else grad
    if wd != 0 and not decoupled:
        g = g.add(p, alpha=wd)
    # v_new = beta2 v + (1 - beta2) g^2;  m_new = m + (1 - beta1)(g - m) = beta1 m + (1 - beta1) g.
    # The g terms are computed by the step's own kernels on a zero state, so that an entry
    # whose moments were zero (an embedding row not yet seen) comes back exactly zero: a
    # fused multiply-subtract would leave the term's rounding there, ~1e-11 in m and ~1e-16
    # in v, and Adam divides m by sqrt(v) + eps, so each later step would move that row.
    v.sub_(torch.zeros_like(v).addcmul_(g, g, value=1 - beta2)).div_(beta2).clamp_(min=0)
    m.sub_(torch.zeros_like(m).lerp_(g, 1 - beta1)).div_(beta1)
    step_t -= 1


def _undo_sgd(
    p: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any], first: bool
) -> None:
    """Inverse of torch.optim.sgd._single_tensor_sgd for one parameter and its gradient."""
    lr, wd = _scalar(group["lr"]), group["weight_decay"]
    momentum, dampening, nesterov = group["momentum"], group["dampening"], group["nesterov"]
    g = -grad if group.get("maximize", False) else grad
    if momentum == 0:
        # p_new = p - lr (g + wd p)
        p.add_(g, alpha=lr).div_(1 - lr * wd)
        return
    buf = state["momentum_buffer"]
    if nesterov:
        # p_new = p - lr (g + wd p + momentum buf_new)
        p.add_(g, alpha=lr).add_(buf, alpha=lr * momentum).div_(1 - lr * wd)
    else:
        # p_new = p - lr buf_new
        p.add_(buf, alpha=lr)
    if first:
        return  # the buffer was created by this step; the caller drops it
    g = g.add(p, alpha=wd) if wd != 0 else g
    # buf_new = momentum buf + (1 - dampening) g
    buf.add_(g, alpha=-(1 - dampening)).div_(momentum)
