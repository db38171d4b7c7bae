"""glibc malloc settings for CPU runs: freed activation memory is kept for the next step, not handed back.

By default glibc serves a large request with a fresh memory map (or trims freed memory off the top of its
heap), so each engine step's activations (a [2048, 3072] fp32 MLP intermediate is 25 MB) come back as new
pages: the kernel faults in and zeroes every 4 KiB page again (what that costs: docs/benchmarks.md,
"Numbers that used to live in docstrings"). Requests up to 32 MiB (glibc's ceiling for this setting on
64-bit) are served from the heap instead, and up to 1 GiB of free heap is kept. Larger buffers (the
logprob chunks) are reused (apcscore/kernels/buffers.py).

This changes the whole process's malloc, once. It is done for CPU engines only; elsewhere (not glibc: macOS,
musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # the largest value glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**30

@functools.lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Apply the settings above (once per process); True when glibc took them."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
