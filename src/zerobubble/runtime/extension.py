"""The stage-extension seam: what a :class:`~zerobubble.runtime.stage.StageChunk` calls
around its F/B core.

Some features ride on a stage's ops without changing F, B, W or the weight-gradient
store: loss terms that layers add travel with the activation and join the last stage's
root (:mod:`~zerobubble.runtime.term_extension`); sequence segments keep keys and values
between a microbatch's segments and add roots and inputs to B
(:mod:`~zerobubble.runtime.sequence.extension`). Each is one :class:`StageExtension`; the
chunk calls its extensions in a loop at a few fixed points, so it keeps only F/B/W/BW
and the store, and a new feature of that kind (ring-attention keys and values,
activation offload) is one new class and one entry in the chunk's list.

The points, per unit (one microbatch, or one segment of it):

* F: :meth:`~StageExtension.enter` (checks, and a scope around F's module call),
  :meth:`~StageExtension.call` (wraps every run of the module, F's and a recompute's
  replay in B), :meth:`~StageExtension.root` (the last stage's root and objective),
  :meth:`~StageExtension.keep` (after F: whether B needs the extension for this unit);
* B, for the extensions that kept the unit: :meth:`~StageExtension.backward` (extra
  roots, their gradients, extra inputs) and :meth:`~StageExtension.hand_back` (the
  gradients of those inputs);
* the chunk's life: :meth:`~StageExtension.held_tensors` (for ``held_bytes``) and
  :meth:`~StageExtension.discard` (every unit in flight dropped, before a replay).

An extension keeps its per-unit state itself (keyed by :attr:`Unit.mb`), so the chunk's
records stay the same for every feature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.autograd.graph import GradientEdge

from zerobubble.runtime.sequence.kv import SegmentOf

__all__ = ["Call", "Roots", "StageChunkError", "StageExtension", "Unit"]

Call = Callable[[tuple, dict], Any]
"""A run of the stage's module: ``(args, kwargs) -> output``."""

Roots = list[Tensor | GradientEdge]
"""The tensors (or their graph nodes) a backward starts from."""


class StageChunkError(RuntimeError):
    """An op called out of protocol or with mismatched data; names the stage and microbatch."""

    def __init__(self, stage: int, mb: int, message: str) -> None:
        super().__init__(f"stage {stage}, microbatch {mb}: {message}")
        self.stage = stage
        self.mb = mb


@dataclass(frozen=True)
class Unit:
    """One F of a stage as its extensions see it (and B and W of the same unit later)."""

    stage: int
    mb: int
    """The unit's id on the chunk: a microbatch, or a unit of a segment schedule."""
    first: bool
    last: bool
    segment: SegmentOf | None = None
    """The unit's place in its microbatch's sequence (None: the whole sequence)."""
    loss_scale: float = 1.0
    """The weight of the last stage's loss in its root."""
    term_weight: float | None = None
    """Each loss term's weight in the root (None: as the loss)."""


class StageExtension:
    """Base class of a stage extension: every hook does nothing; override the ones needed."""

    def enter(self, unit: Unit) -> AbstractContextManager[object]:
        """F of ``unit`` begins: check it (raising before anything ran) and return the scope
        F's module call runs in (entered once; a recompute's replay does not re-enter it)."""
        return nullcontext()

    def call(self, unit: Unit, fn: Call) -> Call:
        """``fn``, the module's run, as this extension wraps it: F's run and every
        recompute replay of it go through the wrapper."""
        return fn

    def root(self, unit: Unit, loss: Tensor) -> tuple[Tensor, Tensor] | None:
        """On the last stage, the backward's root and the objective reported for the scalar
        ``loss`` (detached, unscaled); None leaves them to the chunk or another extension."""
        return None

    def keep(self, unit: Unit, out: Any) -> bool:
        """F of ``unit`` ran (``out``: the module's value, or the root on the last stage);
        keep what B needs. True: B calls :meth:`backward` and :meth:`hand_back` for it (and
        BW then runs as B then W)."""
        return False

    def backward(
        self, unit: Unit, roots: Roots, grads: list[Tensor] | None
    ) -> tuple[Roots, list[Tensor] | None, Sequence[Tensor]]:
        """B of ``unit`` begins: the roots and their gradients (None: ones, on the last
        stage) with this extension's added, and extra inputs whose gradients it wants."""
        return roots, grads, []

    def hand_back(self, unit: Unit, grads: Sequence[Tensor | None]) -> None:
        """B of ``unit`` ran: the gradients of the extra inputs :meth:`backward` gave
        (None for one the backward did not reach); drop the unit's state."""

    def held_tensors(self) -> Iterable[Tensor]:
        """The tensors this extension holds between ops (counted by ``held_bytes``)."""
        return ()

    def discard(self) -> None:
        """Every unit in flight is dropped (speculative work replayed after a rollback)."""
