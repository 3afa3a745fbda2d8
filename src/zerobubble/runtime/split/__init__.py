"""Operator-level split of backward into B (input gradient) and W (weight gradient).

A pipeline stage must send the gradient of its input upstream as early as
possible; the gradient of its own weights is only needed before the optimizer
step. Five parts:

* :mod:`~zerobubble.runtime.split.store`: the :class:`WeightGradStore`, one
  record per (chunk, microbatch), that keeps W's operands from B to W and adds
  gradients to ``.grad`` in microbatch order;
* :mod:`~zerobubble.runtime.split.kernels`: the split layers, whose B and W
  call the kernels plain autograd calls (bitwise equal gradients);
* :mod:`~zerobubble.runtime.split.grouped`: grouped matmuls over stacked (expert)
  weights, split the same way;
* :mod:`~zerobubble.runtime.split.fallback`: the graph-level split of any other
  parameterised module;
* :mod:`~zerobubble.runtime.split.swap`: :func:`enable_bw_split`, which swaps a
  module's layers for their split versions in place, by :class:`SplitRules`.
"""

from zerobubble.runtime.split.grouped import SplitGrouped, grouped_linear, grouped_mm_supported
from zerobubble.runtime.split.kernels import Kernel, SplitEmbedding, SplitLinear, SplitOp
from zerobubble.runtime.split.store import GradList, State, WeightGradStore
from zerobubble.runtime.split.swap import (
    SplitRule,
    SplitRules,
    SplitShare,
    SplitShareWarning,
    enable_bw_split,
    is_split,
    split_share,
    unsplit_modules,
)

__all__ = [
    "GradList",
    "Kernel",
    "SplitEmbedding",
    "SplitGrouped",
    "SplitLinear",
    "SplitOp",
    "SplitRule",
    "SplitRules",
    "SplitShare",
    "SplitShareWarning",
    "State",
    "WeightGradStore",
    "enable_bw_split",
    "grouped_linear",
    "grouped_mm_supported",
    "is_split",
    "split_share",
    "unsplit_modules",
]
