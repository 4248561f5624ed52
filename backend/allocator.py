"""glibc's allocator, told to give big blocks back to the system when they are freed.

glibc serves an allocation from its own mmap only above a threshold, and by default raises that
threshold (up to 32 MB) each time such a block is freed. The engine allocates and frees arrays of a
few MB for every block of queries (scores, masks, spans), so after the first ones they come from the
heap, which fragments and does not shrink: a selection run held about twice its live memory (at 2k
tokens, ReAttention's row peaked 2.46 GB above the model instead of 1.20 GB). A fixed threshold
turns the raising off, so big arrays stay on mmap and are returned when freed.
"""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD = 1 << 20  # bytes: blocks from 1 MB up come from (and go back to) the system


def bound_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold for this process; False where the C library is not glibc."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError):
        return False
