"""torch.compile for B/W-split stages: compile the regions between split layers.

A compiled graph has one backward node that computes input and weight gradients
together, so a layer inside it cannot defer its weight gradient to W. The split
layers therefore stay eager (their forwards run ``torch.compiler.disable``-d when traced,
see :mod:`zerobubble.runtime.split.kernels`) and everything between them is
compiled: dynamo breaks the graph at each split layer, so a compiled block
becomes compiled regions (norms, rotary, attention, activations, residuals)
joined by eager split matmuls whose ``dW`` still waits for W.

Graph-level splits (:mod:`zerobubble.runtime.split.fallback`) work by forward
hooks that swap parameters and record the call; a compiled frame would trace
them once. Grouped experts (:class:`~zerobubble.runtime.split.grouped.SplitGrouped`)
record their calls and exchange rows with their ep peers in their forward.
:func:`compile_between_splits` therefore keeps such a module and all its ancestors
uncompiled, and compiles the outermost modules below them that hold none.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from zerobubble.runtime.split.fallback import GraphSplit
from zerobubble.runtime.split.grouped import SplitGrouped
from zerobubble.runtime.split.kernels import SplitEmbedding, SplitLinear, SplitOp

__all__ = ["compile_between_splits"]


def _stays_eager(m: nn.Module) -> bool:
    return GraphSplit.of(m) is not None or isinstance(m, SplitGrouped)


def _holds_eager(module: nn.Module) -> bool:
    return any(_stays_eager(m) for m in module.modules())


def compile_between_splits(module: nn.Module, **compile_kwargs: Any) -> list[str]:
    """Compile ``module`` in place (``nn.Module.compile``) around its split layers.

    Split layers stay eager and break the compiled graphs (their gradients keep
    the B/W split); a module holding a graph-level split is not compiled
    itself, its children are considered instead (so is one holding grouped experts);
    split layers, graph-split modules and grouped experts are left as they are.
    ``compile_kwargs`` go to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...).
    Parameters and state_dict keys are unchanged. Apply it after the split (e.g. to
    ``StageChunk.module``, or to blocks shared with the chunks): it needs to see
    which modules carry a graph-level split. Returns the names of the
    compiled modules (``""`` for ``module`` itself).
    """
    compiled: list[str] = []

    def visit(name: str, m: nn.Module) -> None:
        if _stays_eager(m) or isinstance(m, (SplitLinear, SplitEmbedding, SplitOp)):
            return  # eager by design (a split layer's forward is compiler-disabled anyway)
        if not _holds_eager(m):
            m.compile(**compile_kwargs)
            compiled.append(name)
            return
        for child_name, child in m.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", module)
    return compiled
