"""Swapping a module's layers for their B/W-split versions, in place."""

from __future__ import annotations

from torch import nn

from zerobubble.runtime.split.kernels import SplitEmbedding, SplitLinear
from zerobubble.runtime.split.store import WeightGradStore

__all__ = ["enable_bw_split", "is_split"]


def _split_of(module: nn.Module, store: WeightGradStore) -> nn.Module | None:
    # Exact types only: subclasses may override forward, and modules such as
    # nn.MultiheadAttention read their Linear's weights without calling it.
    if type(module) is nn.Linear:
        return SplitLinear.from_linear(module, store)
    if type(module) is nn.Embedding:
        return SplitEmbedding(module, store)
    if isinstance(module, SplitLinear | SplitEmbedding):
        module.store = store  # re-split: bind to the new store
    return None


def enable_bw_split(module: nn.Module, store: WeightGradStore) -> nn.Module:
    """Swap every ``nn.Linear`` / ``nn.Embedding`` in ``module`` for its split version, in place.

    The swapped layers keep the original Parameter objects and state_dict keys;
    a module shared at several places is replaced by one shared split module.
    Only modules of exactly these types are swapped (subclasses, and layers used
    through their weights rather than their forward, e.g. inside
    ``nn.MultiheadAttention``, are left alone); forward hooks registered on a
    swapped module are dropped.

    Parameters of all other modules (LayerNorm, attention internals, custom
    ops) keep plain autograd: their gradients are produced during B, not W.
    :class:`~zerobubble.runtime.chunk.StageChunk` still adds them to ``.grad``
    in microbatch order.

    Returns ``module``, or its split replacement if ``module`` itself is a
    Linear or Embedding.
    """
    replaced: dict[int, nn.Module] = {}

    def swap(m: nn.Module) -> nn.Module | None:
        if id(m) not in replaced:
            new = _split_of(m, store)
            replaced[id(m)] = new if new is not None else m
        new = replaced[id(m)]
        return None if new is m else new

    root = swap(module)
    if root is not None:
        return root
    for parent in list(module.modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            new = swap(child)
            if new is not None:
                parent._modules[name] = new
    return module


def is_split(module: nn.Module) -> bool:
    """True if ``module`` or a submodule defers weight gradients to a store."""
    return any(isinstance(m, SplitLinear | SplitEmbedding) for m in module.modules())
