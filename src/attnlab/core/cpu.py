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
    """Have glibc's malloc keep freed blocks (up to 32 MiB) in an untrimmed heap, so steps do not fault
    the same activations in again; whether it took (False off glibc)."""
    libc = glibc()
    if libc is None:
        return False
    settings = (
        (_M_MMAP_THRESHOLD, 32 << 20),  # the largest threshold glibc allows on 64-bit
        (_M_TRIM_THRESHOLD, 1 << 30),
        (_M_TOP_PAD, 64 << 20),
    )
    # a list, not a generator: every setting applied, even after one is refused
    return all([libc.mallopt(param, value) == 1 for param, value in settings])


def release_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel (glibc's ``malloc_trim``); False off glibc."""
    libc = glibc()
    return libc is not None and libc.malloc_trim(0) in (0, 1)


def tune_cpu_for_training() -> None:
    """Flush denormals to zero (Adam's moments of rare embedding rows decay through them, slowly) and
    keep freed memory (``keep_freed_memory``)."""
    torch.set_flush_denormal(True)
    keep_freed_memory()
