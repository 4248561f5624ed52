"""What the queries of a selection policy read, stored as spans instead of a [T, T] mask per head.

A **span** ``(pos, start, end)`` says: token ``pos`` was read by queries ``start .. end - 1`` and not by
query ``end`` (or ``end`` is the text's length). A selection policy reads about ``budget`` tokens per
query and its choice changes little from one query to the next, so a head's spans number a few per
token instead of ``T`` bits per query: at 8k tokens the mask would be 8 MB per head and layer.

``SpanRecorder`` turns the engine's read masks, one block of queries at a time, into spans; ``ReadSpans``
holds a trace's spans and answers windows of the mask, one query's reads, and read counts.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ReadSpans:
    """Spans of every (layer, KV head): those of ``(l, h)`` are ``[offsets[l*H + h], offsets[l*H + h + 1])``."""

    n_layers: int
    n_heads: int
    length: int  # T: queries and positions are 0..T-1
    offsets: np.ndarray  # int64 [L*H + 1]
    pos: np.ndarray  # int32 [N]
    start: np.ndarray  # int32 [N]
    end: np.ndarray  # int32 [N]

    def head(self, layer: int, head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pos, start, end) of one layer and KV head."""
        lo, hi = self.offsets[layer * self.n_heads + head], self.offsets[layer * self.n_heads + head + 1]
        return self.pos[lo:hi], self.start[lo:hi], self.end[lo:hi]

    def window(self, layer: int, steps: slice = slice(None), positions: slice = slice(None)) -> np.ndarray:
        """bool [H, s, p]: ``out[h, i, k]`` is True when query ``steps.start + i`` read token ``positions.start + k``."""
        s0, s1, _ = steps.indices(self.length)
        p0, p1, _ = positions.indices(self.length)
        s1, p1 = max(s0, s1), max(p0, p1)
        out = np.zeros((self.n_heads, s1 - s0 + 1, p1 - p0), np.int32)
        for h in range(self.n_heads):
            pos, start, end = self.head(layer, h)
            hit = (start < s1) & (end > s0) & (pos >= p0) & (pos < p1)
            col = pos[hit] - p0
            # A difference array along the steps: +1 where a span opens, -1 where it closes.
            np.add.at(out[h], (np.maximum(start[hit], s0) - s0, col), 1)
            np.add.at(out[h], (np.minimum(end[hit], s1) - s0, col), -1)
        return np.cumsum(out, axis=1)[:, :-1] > 0

    def at(self, layer: int, step: int) -> np.ndarray:
        """bool [H, T]: the tokens query ``step`` read."""
        out = np.zeros((self.n_heads, self.length), bool)
        for h in range(self.n_heads):
            pos, start, end = self.head(layer, h)
            out[h, pos[(start <= step) & (step < end)]] = True
        return out

    def counts(self) -> np.ndarray:
        """int64 [L, H, T]: how many queries read each token."""
        out = np.zeros((self.n_layers * self.n_heads, self.length), np.int64)
        for row in range(len(out)):  # one (layer, head) at a time: no temporaries the size of every span
            lo, hi = int(self.offsets[row]), int(self.offsets[row + 1])
            reads = self.end[lo:hi] - self.start[lo:hi]
            out[row] = np.bincount(self.pos[lo:hi], weights=reads, minlength=self.length)
        return out.reshape(self.n_layers, self.n_heads, self.length)

    def dense(self) -> np.ndarray:
        """bool [L, H, T, T] (small texts and tests only: T * T bits per head)."""
        return np.stack([self.window(layer) for layer in range(self.n_layers)])

    def arrays(self) -> dict[str, np.ndarray]:
        """The stored form (trace format 3), small integers that compress well, for policies such as SparQ
        whose choice flickers from one query to the next (at 2k tokens over half its spans are one query
        long): per (layer, head) and position the number of spans, and per span the gap since the previous
        span of its position closed (or since the position itself) and its length. Built one (layer, head) at a
        time: a flickering row at 8k holds ~10^8 spans, and whole-array temporaries cost ~7 times the
        spans' own 12 bytes each."""
        n_rows = self.n_layers * self.n_heads
        counts = np.zeros((n_rows, self.length), np.int64)
        wide = np.min_scalar_type(self.length)  # gaps and lengths are at most T
        gap, size = np.empty(len(self.pos), wide), np.empty(len(self.pos), wide)
        for row in range(n_rows):
            lo, hi = int(self.offsets[row]), int(self.offsets[row + 1])
            pos, start, end = (a[lo:hi].astype(np.int64) for a in (self.pos, self.start, self.end))
            counts[row] = np.bincount(pos, minlength=self.length)
            same = np.r_[False, pos[1:] == pos[:-1]]
            gap[lo:hi] = start - np.where(same, np.r_[0, end[:-1]], pos)
            size[lo:hi] = end - start
        return {"span_counts": _narrow(counts), "span_gap": _narrow(gap), "span_length": _narrow(size)}

    @classmethod
    def from_arrays(cls, arrays: dict, n_layers: int, n_heads: int, length: int) -> "ReadSpans":
        """Back from ``arrays``, one (layer, head) at a time for the same reason."""
        counts = arrays["span_counts"].reshape(n_layers * n_heads, length)
        gap, size = arrays["span_gap"], arrays["span_length"]
        per_row = counts.sum(1, dtype=np.int64)
        offsets = np.r_[0, np.cumsum(per_row)].astype(np.int64)
        pos, start, end = (np.empty(int(offsets[-1]), np.int32) for _ in range(3))
        for row in range(len(counts)):
            lo, hi = int(offsets[row]), int(offsets[row + 1])
            flat = counts[row].astype(np.int64)
            mine = np.repeat(np.arange(length), flat)
            # Within a position's spans, start_j = pos + sum(gap_0..j) + sum(length_0..j-1).
            run = np.cumsum(gap[lo:hi].astype(np.int64) + size[lo:hi])
            first = (np.cumsum(flat) - flat)[flat > 0]  # index of each position's first span
            base = np.repeat(np.r_[0, run][first], flat[flat > 0])
            pos[lo:hi] = mine
            start[lo:hi] = mine + run - size[lo:hi] - base
            end[lo:hi] = start[lo:hi] + size[lo:hi]
        return cls(n_layers, n_heads, length, offsets, pos, start, end)

    @classmethod
    def join(cls, per_layer: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]], length: int) -> "ReadSpans":
        """From ``per_layer[l][h] = (pos, start, end)``."""
        flat = [spans for layer in per_layer for spans in layer]
        sizes = [len(p) for p, _, _ in flat]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

        def cat(i: int) -> np.ndarray:
            return np.concatenate([np.zeros(0, np.int32)] + [s[i] for s in flat], dtype=np.int32)

        return cls(len(per_layer), len(per_layer[0]), length, offsets, cat(0), cat(1), cat(2))

    @classmethod
    def from_masks(cls, masks: np.ndarray) -> "ReadSpans":
        """From a bool mask [L, H, T, T] (row t = the positions query t read)."""
        n_layers, n_heads, length, _ = masks.shape
        per_layer = []
        for layer in range(n_layers):
            recorder = SpanRecorder(n_heads)
            recorder.add(masks[layer], 0)
            per_layer.append(recorder.finish(length))
        return cls.join(per_layer, length)


def _narrow(values: np.ndarray) -> np.ndarray:
    """The smallest unsigned integer type that holds every (non-negative) value."""
    return values.astype(np.min_scalar_type(int(values.max(initial=0))))


class SpanRecorder:
    """Builds one (layer, row)'s spans from its read masks, one block of consecutive queries at a time."""

    def __init__(self, n_heads: int):
        self.n_heads = n_heads
        self.open_since = np.full((n_heads, 0), -1, np.int64)  # [H, M]: the step a running span opened, or -1
        self.closed: list[list[np.ndarray]] = [[] for _ in range(n_heads)]  # per head: [pos, start, end] blocks

    def add(self, reads: np.ndarray, first: int) -> None:
        """reads: bool [H, n, M], row i = what query ``first + i`` read (positions beyond a row's reach False)."""
        n_heads, n, total = reads.shape
        if total > self.open_since.shape[1]:  # room to spare, so decoding's one more position a step copies nothing
            grown = np.full((n_heads, total + max(total // 4, n)), -1, np.int64)
            grown[:, : self.open_since.shape[1]] = self.open_since
            self.open_since = grown
        if n == 1:
            self._add_step(reads[:, 0], first)
            return
        before = self.open_since[:, None, :total] >= 0
        changed = np.concatenate([before, reads], axis=1)
        # Events of one (head, position) together, in step order: nonzero walks the [H, M, n] view in that order.
        h, p, i = np.nonzero((changed[:, 1:] != changed[:, :-1]).transpose(0, 2, 1))
        if h.size == 0:  # every query read what the one before it read
            return
        opens = reads[h, i, p]
        steps = first + i
        same = np.r_[False, (h[1:] == h[:-1]) & (p[1:] == p[:-1])]
        # A span that closes opened at the previous event of its (head, position), or before this block.
        opened = np.where(same, np.r_[0, steps[:-1]], self.open_since[h, p])
        closes = ~opens
        for head in range(n_heads):
            mine = closes & (h == head)
            if mine.any():
                self.closed[head].append(np.stack([p[mine], opened[mine], steps[mine]]).astype(np.int32))
        last = np.r_[~same[1:], True]
        self.open_since[h[last], p[last]] = np.where(opens[last], steps[last], -1)

    def _add_step(self, read: np.ndarray, t: int) -> None:
        """``add`` for one query (a decoding step): read bool [H, M]. The spans it does not continue close at t, in
        position order; those it starts open at t."""
        open_since = self.open_since[:, : read.shape[1]]  # a view: what is set here is the recorder's
        was = open_since >= 0
        closes = was & ~read
        for head in np.flatnonzero(closes.any(1)):
            p = np.flatnonzero(closes[head])
            self.closed[head].append(np.stack([p, open_since[head, p], np.full(len(p), t)]).astype(np.int32))
        open_since[closes] = -1
        open_since[read & ~was] = t

    def finish(self, length: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Close the spans still open at the end of the text; return (pos, start, end) per head, sorted by position
        (the recorder itself is unchanged: recording may go on)."""
        out = []
        for head in range(self.n_heads):
            still = np.flatnonzero(self.open_since[head] >= 0)
            still_open = np.stack([still, self.open_since[head, still], np.full(len(still), length)]).astype(np.int32)
            pieces = self.closed[head] + [still_open]
            spans = np.concatenate(pieces, axis=1)
            order = np.lexsort((spans[1], spans[0]))
            out.append(tuple(spans[:, order]))
        return out
