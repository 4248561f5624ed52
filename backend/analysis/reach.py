"""How far back each cache reaches: what one query reads along the text, and what is read at each distance.

* ``reach_at``: for one step t, one row per (layer, KV head) and one column per bin of positions 0..t: the
  share of the bin's tokens that the query at t read there, and which bins lie wholly beyond the layer's
  sliding window (the model's own limit: nothing a policy does reaches past it).
* ``read_by_distance`` / ``share_by_distance``: over every step, layer and KV head, the share of the
  (query t, token j) pairs at distance ``t - j`` that were read. From the read intervals
  (``backend/analysis/reads.py``) with a difference array over distances: O(intervals + T), never [T, T].
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..traces.trace import Trace
from .reads import intervals

MAX_COLUMNS = 512  # bins of positions in a reach row: 90 rows x 512 float32 is ~250 kB of plotly JSON
DISTANCES_PER_DECADE = 24  # distance bins per factor of ten, for a log axis


@dataclasses.dataclass(frozen=True)
class Reach:
    """What the query at ``step`` read, per (layer, KV head) row and per column of ``size`` positions.

    ``shares``: float32 [rows, columns], the share of each column's tokens read (the last column may hold
    fewer than ``size``); ``beyond_window``: bool [rows, columns], every token of the column lies beyond
    the row's sliding window; ``labels``: ``'L12 H1'`` per row; ``windows``: the row's window or None.
    """

    step: int
    size: int
    labels: list[str]
    windows: list[int | None]
    shares: np.ndarray
    beyond_window: np.ndarray


def column_size(step: int, max_columns: int = MAX_COLUMNS) -> int:
    """Positions per column for the positions 0..step."""
    return max(1, math.ceil((step + 1) / max_columns))


def reach_at(trace: Trace, step: int, max_columns: int = MAX_COLUMNS) -> Reach:
    """What the query at ``step`` read in every layer and KV head, binned to at most ``max_columns`` columns."""
    n_layers, n_heads = trace.meta["n_layers"], trace.meta["n_kv_heads"]
    count = step + 1
    size = column_size(step, max_columns)
    columns = math.ceil(count / size)
    per_column = np.minimum(np.arange(1, columns + 1) * size, count) - np.arange(columns) * size
    last = np.minimum(np.arange(1, columns + 1) * size, count) - 1  # each column's newest position
    shares, beyond, labels, windows = [], [], [], []
    for layer in range(n_layers):
        read = np.zeros((n_heads, columns * size), np.float32)
        read[:, :count] = trace.reads_at(layer, step)[:, :count]
        shares.append(read.reshape(n_heads, columns, size).sum(-1) / per_column)
        window = trace.window(layer)
        # Query t sees token j only while j > t - window (Trace.reads): a column is past it when its newest is.
        outside = np.zeros(columns, bool) if window is None else last <= step - window
        beyond.append(np.broadcast_to(outside, (n_heads, columns)))
        labels += [f"L{layer} H{head}" for head in range(n_heads)]
        windows += [window] * n_heads
    return Reach(step=step, size=size, labels=labels, windows=windows,
                 shares=np.concatenate(shares).astype(np.float32), beyond_window=np.concatenate(beyond))


def read_by_distance(trace: Trace) -> np.ndarray:
    """int64 [T]: over every step, layer and KV head, the read (query t, token j) pairs at each distance t - j.

    An interval (pos, start, end) reads its token at distances ``start - pos .. end - 1 - pos``: +1 at the
    first, -1 after the last, and a running sum over the distances counts them all."""
    n = len(trace.tokens)
    change = np.zeros(n + 1, np.int64)
    for layer in range(trace.meta["n_layers"]):
        pos, start, end = intervals(trace, layer)
        read = end > start
        change += np.bincount(start[read] - pos[read], minlength=n + 1)[: n + 1]
        change -= np.bincount(end[read] - pos[read], minlength=n + 1)[: n + 1]
    return np.cumsum(change)[:n]


def distance_edges(n: int, per_decade: int = DISTANCES_PER_DECADE) -> np.ndarray:
    """int64 edges of log-spaced distance bins over 1..n-1: bin i holds distances ``edges[i] .. edges[i+1] - 1``
    (one distance per bin where the log spacing is finer than 1). Distance 0, the query's own token, has no
    place on a log axis."""
    if n < 2:
        return np.array([1], np.int64)
    steps = max(1, math.ceil(per_decade * math.log10(n)))
    return np.unique(np.concatenate([np.round(np.logspace(0, math.log10(n), steps + 1)), [1, n]]).astype(np.int64))


def share_by_distance(trace: Trace, per_decade: int = DISTANCES_PER_DECADE) -> tuple[np.ndarray, np.ndarray]:
    """(edges, share): per distance bin (``distance_edges``), the read pairs over the causal pairs
    ``(t, t - d)`` of its distances, over every step, layer and KV head (float64 [bins])."""
    n = len(trace.tokens)
    edges = distance_edges(n, per_decade)
    groups = trace.meta["n_layers"] * trace.meta["n_kv_heads"]
    pairs = (n - np.arange(n)) * groups  # query t >= d has the token t - d at distance d
    if len(edges) < 2:
        return edges, np.zeros(0)
    read = np.add.reduceat(read_by_distance(trace), edges[:-1])
    return edges, read / np.add.reduceat(pairs, edges[:-1])
