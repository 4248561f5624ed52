"""What the queries read, as intervals: one shape for every kind of trace, and counts and bins from it.

An **interval** ``(pos, start, end)`` says token ``pos`` was read by queries ``start .. end - 1``. An
eviction trace gives one per token (from its arrival to its eviction step, or ``T``), Full one per token
up to ``T``, a selection trace its spans (``backend/traces/spans.py``). Counting what each query read,
intersecting two traces' reads and binning the step x position mask for a heatmap are then sums over
intervals, never a [T, T] mask (at 8k tokens that is 67 M cells per layer and KV head).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from ..traces.trace import Trace

MAX_BINS = 256  # cells per axis of a binned heatmap: 256 x 256 float32 is ~350 kB of plotly JSON per panel


def intervals(trace: Trace, layer: int, heads: Sequence[int] | None = None) -> tuple[np.ndarray, ...]:
    """(pos, start, end) int64 arrays of one layer's reads, the chosen KV heads' one after another."""
    n = len(trace.tokens)
    heads = range(trace.meta["n_kv_heads"]) if heads is None else heads
    if trace.spans is not None:
        parts = [trace.spans.head(layer, h) for h in heads]
        return tuple(np.concatenate([np.zeros(0, np.int64)] + [p[i].astype(np.int64) for p in parts]) for i in range(3))
    pos = np.tile(np.arange(n, dtype=np.int64), len(heads))
    if trace.evicted_at is None:  # Full: every token from its arrival on
        end = np.full(len(pos), n, np.int64)
    else:
        gone = trace.evicted_at[layer][list(heads)].astype(np.int64).ravel()
        # max(): a token dropped on arrival was never read (an empty interval, not a negative one).
        end = np.maximum(np.where(gone < 0, n, gone), pos)
    window = trace.window(layer)
    if window is not None:  # a sliding-window layer: token j is read by queries j .. j + window - 1 at most
        end = np.minimum(end, pos + window)
    return pos, pos.copy(), end


def per_step(start: np.ndarray, end: np.ndarray, n: int) -> np.ndarray:
    """int64 [n]: how many intervals each query ``0..n-1`` lies in (a difference array over the steps)."""
    opened = np.bincount(start, minlength=n + 1)[: n + 1]
    closed = np.bincount(end, minlength=n + 1)[: n + 1]
    return np.cumsum(opened - closed)[:n]


def overlaps(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(start, end) of the queries that read the same token under both ``a`` and ``b`` (interval sets of one
    layer and head): every pair of intervals on the same position, cut to their common steps."""
    for one, other in ((a, b), (b, a)):
        if np.array_equal(one[0], np.arange(len(one[0]))):  # eviction or Full: token j's interval is one[.][j]
            pos, start, end = other
            start, end = np.maximum(start, one[1][pos]), np.minimum(end, one[2][pos])
            keep = start < end
            return start[keep], end[keep]
    a_pos, a_start, a_end = a
    order = np.argsort(b[0], kind="stable")
    b_pos, b_start, b_end = (x[order] for x in b)
    lo, hi = np.searchsorted(b_pos, a_pos, "left"), np.searchsorted(b_pos, a_pos, "right")
    counts = hi - lo
    ia = np.repeat(np.arange(len(a_pos)), counts)
    # The b index of each pair: lo of its a interval, plus its rank among that interval's pairs.
    ib = np.repeat(lo - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())
    start, end = np.maximum(a_start[ia], b_start[ib]), np.minimum(a_end[ia], b_end[ib])
    keep = start < end
    return start[keep], end[keep]


def bin_size(n: int, max_bins: int = MAX_BINS) -> int:
    """Tokens per cell (on both axes) for a text of ``n`` tokens."""
    return max(1, math.ceil(n / max_bins))


def _pairs_before_edges(pos: np.ndarray, start: np.ndarray, end: np.ndarray, n: int, size: int) -> np.ndarray:
    """float64 [position bins, bins + 1]: per position bin, the (query, token) pairs read with the query
    before each cell edge ``e_k = min(k * size, n)``.

    An interval holds ``max(0, e - start) - max(0, e - end)`` pairs before edge ``e``; summed over
    intervals, ``max(0, e - x)`` is ``e * #{x < e} - sum{x < e}``: two running sums over the edges. So
    the work is one pass over the intervals plus bins x bins numbers, whatever the text's length."""
    bins = math.ceil(n / size)
    edges = np.minimum(np.arange(bins + 1) * size, n).astype(np.float64)
    row = pos // size * (bins + 2)

    def ramps(x: np.ndarray) -> np.ndarray:  # sum over intervals of max(0, e_k - x), per position bin
        key = row + x // size + 1  # the first edge after x (bins + 1 for x = n: no edge is after it)
        count = np.bincount(key, minlength=bins * (bins + 2)).reshape(bins, bins + 2)[:, : bins + 1]
        total = np.bincount(key, weights=x, minlength=bins * (bins + 2)).reshape(bins, bins + 2)[:, : bins + 1]
        return edges * np.cumsum(count, axis=1) - np.cumsum(total, axis=1)

    return ramps(start) - ramps(end)


@functools.lru_cache(maxsize=8)
def causal_pairs(n: int, size: int) -> np.ndarray:
    """float64 [bins, bins]: the (query t, token j <= t) pairs in each cell (zero above the diagonal).
    Read-only: kept for the next panel of the same text."""
    pos = np.arange(n, dtype=np.int64)
    pairs = np.diff(_pairs_before_edges(pos, pos, np.full(n, n, np.int64), n, size), axis=1).T
    pairs.flags.writeable = False
    return pairs


def binned_reads(trace: Trace, layers: Sequence[int], heads: Sequence[int], size: int) -> np.ndarray:
    """float32 [bins, bins]: per cell of ``size`` x ``size`` (steps x positions), the share of its pairs
    ``(t, j <= t)`` that were read, over the given layers and KV heads (0 where the cell has no such pair)."""
    n = len(trace.tokens)
    before = sum(_pairs_before_edges(*intervals(trace, layer, heads), n, size) for layer in layers)
    arrived = causal_pairs(n, size) * len(layers) * len(heads)
    return (np.diff(before, axis=1).T / np.maximum(arrived, 1)).astype(np.float32)


def binned_attention(trace: Trace, layer: int, head: int, size: int) -> np.ndarray:
    """float32 [bins, bins]: the recorded attention of one layer and head per cell, summed over the cell's
    tokens and averaged over its queries (only the stored top-k entries of each row count)."""
    n = len(trace.tokens)
    r = trace.meta["recorded_layers"].index(layer)
    pos, val = trace.attention.pos[r, head], trace.attention.val[r, head].astype(np.float64)
    rows = np.broadcast_to(np.arange(n)[:, None], pos.shape)
    hit = pos >= 0
    bins = math.ceil(n / size)
    mass = np.bincount(rows[hit] // size * bins + pos[hit] // size, weights=val[hit], minlength=bins * bins)
    starts = np.arange(0, n, size)
    queries = (np.minimum(starts + size, n) - starts)[:, None]  # the last row bin may be short
    return (mass.reshape(bins, bins) / queries).astype(np.float32)


def window_reads(trace: Trace, layers: Sequence[int], heads: Sequence[int], steps: slice,
                 positions: slice) -> np.ndarray:
    """[s, p] of a window at full resolution: bool for one layer and head, else the share that read each cell."""
    total = None
    for layer in layers:
        window = trace.reads(layer, steps, positions)[list(heads)].sum(0, dtype=np.int32)
        total = window if total is None else total + window
    if len(layers) * len(heads) == 1:
        return total > 0
    return (total / (len(layers) * len(heads))).astype(np.float32)


def read_share_at(trace: Trace, layers: Sequence[int], heads: Sequence[int], step: int) -> np.ndarray:
    """[T]: what query ``step`` read: bool for one layer and head, else the share of them that read each token."""
    total = sum(trace.reads_at(layer, step)[list(heads)].sum(0, dtype=np.int32) for layer in layers)
    if len(layers) * len(heads) == 1:
        return total > 0
    return (total / (len(layers) * len(heads))).astype(np.float32)


def binned_row(values: np.ndarray, step: int, size: int) -> np.ndarray:
    """float32 [ceil(T / size)]: a row of the masks (``values`` [T], e.g. ``read_share_at``) in cells of ``size``
    positions, each the mean over its positions up to ``step``; NaN for cells wholly after the step."""
    values = np.asarray(values, np.float64)
    cells = math.ceil(len(values) / size)
    cell = np.arange(step + 1) // size
    total = np.bincount(cell, weights=values[: step + 1], minlength=cells)
    count = np.bincount(cell, minlength=cells)
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan).astype(np.float32)
