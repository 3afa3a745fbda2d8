"""The B/W split's public names, kept at their original import path.

The implementation lives in :mod:`zerobubble.runtime.split` (store, kernels, swap).
"""

from zerobubble.runtime.split import (
    GradList,
    SplitEmbedding,
    SplitLinear,
    State,
    WeightGradStore,
    enable_bw_split,
    is_split,
)

__all__ = [
    "GradList",
    "SplitEmbedding",
    "SplitLinear",
    "State",
    "WeightGradStore",
    "enable_bw_split",
    "is_split",
]
