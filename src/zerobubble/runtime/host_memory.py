"""Keep freed host memory inside the process, so pipeline steps do not page-fault.

A pipeline rank allocates and frees many activation-sized blocks (hundreds of
KiB to MiB) per step, and a split schedule frees them at other times than it
allocates them (W long after B). glibc's malloc serves blocks above its
``M_MMAP_THRESHOLD`` (128 KiB at start, adapted at run time) with a fresh
``mmap`` and unmaps them on free, and it gives the top of the heap back to the
OS once more than ``M_TRIM_THRESHOLD`` of it is free. Either way the next
allocation touches pages the kernel must fault in and zero. PyTorch's CPU
allocator does not cache, so every step pays for them again.

:func:`retain_freed_memory` fixes both thresholds (no mmap below 32 MiB, no
trimming): freed blocks stay in the heap and are reused. On bench_runtime's
model (2 ranks, M = 8, see ``bench/bench_runtime.py``) that removed 2,700 to
9,000 minor faults per rank and step (11-33 ms of system time) from zb-h1 and
zb-h2, and ~150 from 1f1b. The price is the CUDA caching allocator's: the
process's resident memory stays near its peak instead of shrinking between
steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["MMAP_THRESHOLD", "retain_freed_memory"]

MMAP_THRESHOLD = 32 << 20
"""Blocks below this many bytes come from the heap (glibc's largest adaptive value)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_NO_TRIM = 2**31 - 1  # mallopt takes an int


@functools.cache
def retain_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; True if it took effect.

    Process-wide and permanent (what the allocator does for every thread), and
    idempotent: later calls return the first call's result. False, with nothing
    changed, where the C library is not glibc (musl, macOS, Windows).
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _NO_TRIM)
    )
