"""What a caller plugs into a step: the optimizer protocol's and fault injection's hooks.

The executor calls them at the protocol instructions a pass inserted
(:class:`~zerobubble.program.instructions.VersionCheck`,
:class:`~zerobubble.program.instructions.Gate`) and on every message; it never
interprets what they decide. The defaults do nothing.
"""

from __future__ import annotations

import torch

from zerobubble.program.instructions import Message
from zerobubble.runtime.p2p.comm import TensorMeta
from zerobubble.schedule.ir import Action

__all__ = ["StepHooks"]


class StepHooks:
    """Callbacks of one :meth:`~zerobubble.executor.PipelineExecutor.step`."""

    def after_compute(self, action: Action) -> None:
        """Called after every compute action (fault injection uses it)."""

    def check_version(self, action: Action) -> None:
        """At a :class:`~zerobubble.program.instructions.VersionCheck`, before ``action`` runs."""

    def at_gate(self) -> bool:
        """At a :class:`~zerobubble.program.instructions.Gate` (once per step). True: discard
        the step's work so far and replay it."""
        return False

    def on_replay(self) -> None:
        """After the stale messages were drained, before the step runs again."""

    def wire_meta(self, msg: Message, meta: TensorMeta) -> TensorMeta:
        """The buffer a message of ``meta`` travels in (a header may enlarge it)."""
        return meta

    def encode(self, msg: Message, t: torch.Tensor) -> torch.Tensor:
        """What is sent for ``msg``'s payload ``t``."""
        return t

    def decode(
        self, msg: Message, buf: torch.Tensor, meta: TensorMeta, *, stale: bool
    ) -> torch.Tensor:
        """The payload of a received buffer (``stale``: drained before a replay)."""
        return buf
