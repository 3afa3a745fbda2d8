"""Who an exception in a stage's forward blames: the stage itself, or its input.

A later stage's forward can fail because of its own code (a user bug, running out
of memory, an in-place op on its input, an attribute missing on a layer) or because
the previous stage sent it a value of the wrong structure or layout. Only the second,
raised in the stage's first layer, is a
:class:`~zerobubble.runtime.shapes.ShapeMismatchError` naming both stages; the
first names the stage, the microbatch and the layer that raised. Stage 0's own
exceptions keep their type and get a note naming the same (PEP 678).
"""

from __future__ import annotations

from typing import Any

from zerobubble.runtime.shapes import ShapeMismatchError, describe, flatten, is_layout_error
from zerobubble.runtime.stage import StageChunkError

__all__ = ["forward_failure", "where_failed"]

Layer = tuple[str, str]
"""Where an error was raised: the module path in the stage and the module's class."""


def where_failed(layer: Layer | None, rank: int) -> str:
    """``"forward (rank 0) failed in layer '2.conv' (Conv2d)"``."""
    where = "" if layer is None else f" in layer {layer[0]!r} ({layer[1]})"
    return f"forward (rank {rank}) failed{where}"


def forward_failure(
    error: Exception, stage: int, mb: int, layer: Layer | None, received: Any, rank: int
) -> Exception:
    """The exception to raise (``from error``) for ``error`` in F(stage, mb) of a stage
    > 0 that consumed ``received``; ``layer`` is where it was raised, if known. A layout
    error raised past the stage's first layer is the stage's own: the value it received
    went through that layer."""
    first = layer is None or layer[0].split(".")[0] == "0"
    if not (first and is_layout_error(error)):  # the stage's own failure, not its input's
        what = f"{where_failed(layer, rank)}: {type(error).__name__}: {error}"
        return StageChunkError(stage, mb, what)
    codes, _ = flatten(received, f"stage {stage} input")
    raised = "" if layer is None else f"; raised in layer {layer[0]!r} ({layer[1]})"
    return ShapeMismatchError(
        stage - 1,
        stage,
        f"stage {stage} (rank {rank}) cannot consume stage {stage - 1}'s output of "
        f"{describe(codes)} (microbatch {mb}): {type(error).__name__}: {error}{raised}",
    )
