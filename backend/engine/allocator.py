"""glibc's allocator, made to give a run's freed memory back to the system.

The engine allocates and frees arrays of a few MB for every block of queries and every layer (scores,
masks, spans). glibc serves them from its heap (it raises its mmap threshold, up to 32 MB, each time a
mapped block is freed), and its heap fragments and does not shrink: a run's RSS creeps up block after
block. Two remedies, measured in ``docs/performance.md`` with ``python -m benchmarks.row_memory``:

* ``give_back()``: ``malloc_trim`` after every forward call of a run (``runner._forward``) returns the
  free pages, at no measurable cost: SparQ's 2k needle row peaked 1.74 GB above the model instead of 2.24.
* ``bound_mmap_threshold()``: a fixed threshold keeps every array from 1 MB up on its own mapping,
  returned when freed (1.15 GB), but a fresh zeroed mapping per array made that row 1.37x slower on this
  CPU, so it is an operator's choice: ``KVLENS_MMAP_THRESHOLD=1048576`` (bytes; unset or 0 keeps glibc's).
"""
from __future__ import annotations

import ctypes
import os

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _glibc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, macOS): nothing to tune
        return None


LIBC = _glibc()


def give_back() -> bool:
    """Return the heap's free pages to the system; False where the C library is not glibc."""
    if LIBC is None or not hasattr(LIBC, "malloc_trim"):
        return False
    LIBC.malloc_trim(0)
    return True


def bound_mmap_threshold(threshold: int | None = None) -> bool:
    """Fix glibc's mmap threshold for this process (``threshold``, else ``KVLENS_MMAP_THRESHOLD``); False
    where it is left alone: no threshold, 0, or a C library that is not glibc."""
    if threshold is None:
        setting = os.environ.get("KVLENS_MMAP_THRESHOLD", "").strip()
        threshold = int(setting) if setting.isdigit() else 0
    if threshold <= 0 or LIBC is None or not hasattr(LIBC, "mallopt"):
        return False
    return LIBC.mallopt(M_MMAP_THRESHOLD, threshold) == 1
