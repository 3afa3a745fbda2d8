"""Who an exception in a stage's forward blames: the stage itself, or its input.

A later stage's forward can fail because of its own code (a user bug, running out
of memory, an in-place op on its input) or because the previous stage sent it a
value of the wrong structure or layout. Only the second is a
:class:`~zerobubble.runtime.shapes.ShapeMismatchError` naming both stages; the
first names the stage, the microbatch and the layer that raised.
"""

from __future__ import annotations

from typing import Any

from zerobubble.runtime.shapes import ShapeMismatchError, describe, flatten, is_layout_error
from zerobubble.runtime.stage import StageChunkError

__all__ = ["forward_failure"]


def forward_failure(
    error: Exception, stage: int, mb: int, layer: str | None, received: Any, rank: int
) -> Exception:
    """The exception to raise (``from error``) for ``error`` in F(stage, mb) of a stage
    > 0 that consumed ``received``; ``layer`` is where it was raised, if known."""
    if not is_layout_error(error):  # the stage's own failure, not its input's
        where = "" if layer is None else f" in {layer}"
        return StageChunkError(
            stage, mb, f"forward (rank {rank}) failed{where}: {type(error).__name__}: {error}"
        )
    codes, _ = flatten(received, f"stage {stage} input")
    return ShapeMismatchError(
        stage - 1,
        stage,
        f"stage {stage} (rank {rank}) cannot consume stage {stage - 1}'s output of "
        f"{describe(codes)} (microbatch {mb}): {type(error).__name__}: {error}",
    )
