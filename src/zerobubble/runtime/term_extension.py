"""Loss terms on a stage: the sums travel with the activation and join the last stage's root.

Layers add terms during their forward (:func:`~zerobubble.runtime.loss_terms.add_loss_term`).
F, B and W do not change for them; what changes is the value path: a stage takes the
running sums off the value it received, collects its layers' terms on top, and sends the
sums on with its output; the last stage's root becomes the weighted objective, loss plus
terms (:func:`~zerobubble.runtime.loss_terms.weighted_objective`). That is the
:class:`~zerobubble.runtime.extension.StageExtension` here.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import Tensor, nn

from zerobubble.runtime.extension import Call, StageExtension, Unit
from zerobubble.runtime.loss_terms import (
    segments_refusal,
    split_terms,
    term_scope,
    weighted_objective,
    with_terms,
)

__all__ = ["LossTermExtension"]


class LossTermExtension(StageExtension):
    """The loss terms of a stage's layers, carried on and rooted on the last stage.

    Args:
        modules: The stage's modules, every one of which may add a term.
    """

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self.modules = modules
        self._sums: dict[str, Tensor] = {}
        """The last stage's term sums of the run that just ran (a replay's are dropped at
        the next forward)."""
        self._terms: dict[int, dict[str, Tensor]] = {}
        """Per microbatch forwarded on the last stage, its terms (detached), until taken."""

    def enter(self, unit: Unit) -> AbstractContextManager[object]:
        self._sums = {}
        return nullcontext()

    def call(self, unit: Unit, fn: Call) -> Call:
        """The run continues the sums a later stage received: an output carries them on; the
        last stage keeps them for :meth:`root` and :meth:`keep`."""

        def run(args: tuple, kw: dict) -> Any:
            carried: dict[str, Tensor] = {}
            if not unit.first:
                value, carried = split_terms(args[0])
                args = (value,)
            with term_scope(self.modules, carried) as sink:
                out = fn(args, kw)
            if unit.segment is not None and sink.sums:  # at the stage that adds them
                raise segments_refusal(f"stage {unit.stage}")
            if not unit.last:
                return with_terms(out, sink.sums)
            self._sums = sink.sums
            return out

        return run

    def root(self, unit: Unit, loss: Tensor) -> tuple[Tensor, Tensor] | None:
        return weighted_objective(loss, self._sums, unit.loss_scale, unit.term_weight)

    def keep(self, unit: Unit, out: Any) -> bool:
        """Keep the last stage's terms for :meth:`take` (refused with segments, where they
        are added: :meth:`call`)."""
        reported, self._sums = self._sums, {}
        if reported:
            self._terms[unit.mb] = {n: reported[n].detach() for n in sorted(reported)}
        return False

    def take(self, mb: int) -> dict[str, Tensor]:
        """The terms of microbatch ``mb``'s forward on the last stage, by name (empty if its
        layers added none)."""
        return self._terms.pop(mb, {})

    def discard(self) -> None:
        self._terms.clear()
