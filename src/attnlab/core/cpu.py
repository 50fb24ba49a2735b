"""Process-wide CPU settings for training."""

from __future__ import annotations

import ctypes
import sys
from functools import cache

import torch

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


@cache
def glibc() -> ctypes.CDLL | None:
    """glibc, for its malloc settings; None elsewhere (not Linux, or another libc such as musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


def keep_freed_memory() -> bool:
    """Have glibc's malloc reuse freed blocks instead of handing them back to the kernel.

    torch's CPU allocator is plain malloc, which by default maps each block over its mmap
    threshold afresh and unmaps it on free, so every training step faults in (and the kernel
    zeroes) the same activations again. Serving blocks up to 32 MiB from the heap and not
    trimming it cuts those faults (figures: benchmarks/RESULTS.md). Returns whether the settings
    took (False off glibc).
    """
    libc = glibc()
    if libc is None:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, 32 << 20),  # the largest threshold glibc allows on 64-bit
        (_M_TRIM_THRESHOLD, 1 << 30),
        (_M_TOP_PAD, 64 << 20),
    )
    # apply every setting, even after one is refused
    accepted = [libc.mallopt(param, value) == 1 for param, value in settings]
    return all(accepted)


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``); False off glibc.

    Batches of varying shapes (token budgets, every step another (B, T)) leave free blocks of
    every size inside the heap; malloc reuses them only where the next blocks fit, and returns
    memory to the kernel only from the top of the heap. The free pages in between stay resident,
    so a process grew step after step, with or without ``keep_freed_memory``; trimming every few
    dozen steps keeps it flat (``benchmarks/memory_growth.py``) at the cost of faulting those
    pages in again once.
    """
    libc = glibc()
    return libc is not None and libc.malloc_trim(0) in (0, 1)


def tune_cpu_for_training() -> None:
    """Flush denormal floats to zero and keep freed memory (``keep_freed_memory``).

    Adam's moments of rarely seen embedding rows decay through the denormal range, where each
    float operation costs far more (figures: benchmarks/RESULTS.md). The freed memory kept is
    released every few dozen steps (``attnlab.training.callbacks.ReleaseFreedMemory``).
    """
    torch.set_flush_denormal(True)
    keep_freed_memory()
