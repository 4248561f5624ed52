"""Recorded attention that stays small at 8k tokens: each query's ``k`` largest attention weights.

A full row per query is T * T numbers per head (128 MB per head and layer at 8k in float16). Attention
is concentrated, so the ``k`` largest entries of a row carry most of it; rows with at most ``k`` entries
(the first ``k`` queries, and every query of an eviction policy whose budget is at most ``k``) are kept
exactly. ``choose_top_k`` sizes ``k`` so that a trace's recorded attention holds at most 2 MiB of entries,
whatever the text's length: with the sampled keys (``KEY_SAMPLES``, ~0.5 MB compressed for the default
model) a stored eviction trace stays within ``evicted_at``'s 4 bytes per layer, KV head and token plus 2 MiB.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RECORD_BYTES = 2 * 2 ** 20  # entries a trace holds, 4 bytes each: k = 7 at 8k for 3 layers x 3 KV heads
MIN_TOP_K = 4  # binds only past ~14.5k tokens for 3 layers x 3 KV heads
NO_POSITION = 65535  # an empty entry, as stored
KEY_SAMPLES = 512  # positions whose keys a trace keeps (every position up to this length): what t-SNE embeds


def choose_top_k(length: int, n_recorded: int, n_heads: int) -> int:
    """k for a text of ``length`` tokens: the largest whose entries fit in RECORD_BYTES (4 bytes an entry: a
    uint16 position and a float16 weight; query t holds min(t + 1, k) of them, the rest is padding that
    compresses to nothing), at least MIN_TOP_K; every entry (k = length) when the whole triangle fits."""
    entries = RECORD_BYTES // max(1, 4 * n_recorded * n_heads)  # per recorded layer and head

    def held(k: int) -> int:
        return k * length - k * (k - 1) // 2

    if held(length) <= entries:
        return length
    k = entries // max(1, length)
    while held(k + 1) <= entries:  # the first k queries hold fewer than k: a few more fit
        k += 1
    return int(min(length, max(MIN_TOP_K, k)))


def key_positions(length: int) -> np.ndarray:
    """int32 positions whose keys a trace keeps: all, or KEY_SAMPLES spread evenly (first and last included)."""
    if length <= KEY_SAMPLES:
        return np.arange(length, dtype=np.int32)
    return np.unique(np.linspace(0, length - 1, KEY_SAMPLES).round().astype(np.int32))


@dataclass
class TopAttention:
    """Attention rows of R recorded layers: ``pos[r, h, t]`` are the positions of query t's ``k`` largest
    weights (-1 pads rows with fewer entries), ``val`` the weights (mean over the KV head's query heads,
    zero where not read)."""

    pos: np.ndarray  # int32 [R, H, T, k]
    val: np.ndarray  # float16 [R, H, T, k]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(R, H, T, T): the shape of the dense rows this stands for."""
        r, h, n, _ = self.pos.shape
        return r, h, n, n

    @property
    def top_k(self) -> int:
        return self.pos.shape[-1]

    @property
    def exact(self) -> bool:
        """True when every row is whole (k >= T)."""
        return self.top_k >= self.pos.shape[2]

    def rows(self, r: int, head: int, steps: slice = slice(None), positions: slice = slice(None)) -> np.ndarray:
        """float32 [s, p]: rows ``steps`` over columns ``positions`` (entries beyond the top k read as 0)."""
        n = self.pos.shape[2]
        s0, s1, _ = steps.indices(n)
        p0, p1, _ = positions.indices(n)
        pos, val = self.pos[r, head, s0:s1], self.val[r, head, s0:s1].astype(np.float32)
        out = np.zeros((max(0, s1 - s0), max(0, p1 - p0)), np.float32)
        hit = (pos >= p0) & (pos < p1)
        rows = np.nonzero(hit)[0]
        out[rows, pos[hit] - p0] = val[hit]
        return out

    def column(self, r: int, head: int, j: int) -> np.ndarray:
        """float64 [T]: the weight every query gave token ``j`` (0 before j, and where j was not in a row's top k)."""
        hit = self.pos[r, head] == j
        return (self.val[r, head].astype(np.float64) * hit).sum(-1)

    def covered(self, r: int, head: int) -> np.ndarray:
        """float64 [T]: the share of each row's weight the stored entries hold (1 where the row is whole)."""
        return self.val[r, head].astype(np.float64).sum(-1)

    def dense(self, r: int) -> np.ndarray:
        """float32 [H, T, T] of one recorded layer (small texts and tests)."""
        return np.stack([self.rows(r, h) for h in range(self.pos.shape[1])])

    def arrays(self) -> dict[str, np.ndarray]:
        """As stored: positions as uint16 (65535 = none) when the text allows, else int32."""
        pos = self.pos
        if self.pos.shape[2] < NO_POSITION:
            pos = np.where(self.pos >= 0, self.pos, NO_POSITION).astype(np.uint16)
        return {"attn_pos": pos, "attn_val": self.val}

    @classmethod
    def from_arrays(cls, pos: np.ndarray, val: np.ndarray) -> "TopAttention":
        if pos.dtype == np.uint16:
            pos = np.where(pos == NO_POSITION, -1, pos.astype(np.int32))
        return cls(pos=pos.astype(np.int32), val=val)

    @classmethod
    def from_dense(cls, attention: np.ndarray) -> "TopAttention":
        """From rows [R, H, T, T] (zero above the diagonal), every entry kept."""
        attention = np.asarray(attention)
        r, h, n, _ = attention.shape
        pos = np.broadcast_to(np.arange(n, dtype=np.int32), (r, h, n, n)).copy()
        pos[..., np.triu_indices(n, 1)[0], np.triu_indices(n, 1)[1]] = -1
        return cls(pos=pos, val=np.where(pos >= 0, attention, 0).astype(np.float16))
