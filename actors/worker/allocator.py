"""glibc malloc settings for the CPU forward pass.

A CPU forward allocates and frees activations of a few MB per op. By default glibc serves such
blocks with fresh mmap'd pages (above its mmap threshold) and hands a freed heap top back to the
OS (above its trim threshold), so every step page-faults and zeroes its activations again: a third
of a decode step's time on SmolLM2. Raising both thresholds keeps freed memory in the process for the
next step, the effect CPU serving engines get by preloading tcmalloc or jemalloc.
"""
from __future__ import annotations

import ctypes
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20   # glibc's ceiling for this setting on 64-bit (half its heap size)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Applies the thresholds on glibc; False where the C library has no mallopt (musl, macOS)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
