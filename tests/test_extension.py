"""The stage-extension seam: a new feature riding on a StageChunk's ops is one class.

The chunk's own extensions (loss terms, sequence segments) are tested by their features'
tests; here a probe shows the protocol itself: which hooks run when, and that an extra
input an extension adds at B gets its gradient back.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from zerobubble.runtime.extension import Call, Roots, StageExtension, Unit
from zerobubble.runtime.stage import StageChunk


class Shift(StageExtension):
    """Adds a learnable shift of its own to the stage's output, and takes its gradient at B."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.shift = torch.zeros(4, requires_grad=True)
        self.grads: dict[int, Tensor | None] = {}

    def enter(self, unit: Unit) -> AbstractContextManager[object]:
        self.calls.append(("enter", unit.mb))
        return nullcontext()

    def call(self, unit: Unit, fn: Call) -> Call:
        def run(args: tuple, kw: dict) -> Any:
            self.calls.append(("call", unit.mb))
            return fn(args, kw) + self.shift

        return run

    def keep(self, unit: Unit, out: Any) -> bool:
        self.calls.append(("keep", unit.mb))
        return True

    def backward(
        self, unit: Unit, roots: Roots, grads: list[Tensor] | None
    ) -> tuple[Roots, list[Tensor] | None, Sequence[Tensor]]:
        self.calls.append(("backward", unit.mb))
        return roots, grads, [self.shift]

    def hand_back(self, unit: Unit, grads: Sequence[Tensor | None]) -> None:
        self.calls.append(("hand_back", unit.mb))
        (self.grads[unit.mb],) = grads


def test_an_extension_is_one_class_and_its_extra_input_gets_its_gradient():
    torch.manual_seed(0)
    chunk = StageChunk(nn.Linear(4, 4), 0, 2)
    probe = Shift()
    chunk.extensions.append(probe)
    x = torch.randn(3, 4)
    out = chunk.forward(0, x)
    expected = chunk.module(x) + probe.shift
    assert torch.equal(out, expected.detach())
    g = torch.randn(3, 4)
    chunk.backward_full(0, g)  # kept by an extension: B then W, so B calls it
    assert probe.calls == [
        ("enter", 0),
        ("call", 0),
        ("keep", 0),
        ("backward", 0),
        ("hand_back", 0),
    ]
    torch.testing.assert_close(probe.grads[0], g.sum(0))
    assert chunk.pending() == {}
