"""ChunkKV (Liu et al., 2025, *ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM
Inference*)."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView, latest
from .registry import register


@register
@dataclass(frozen=True)
class ChunkKV(SharesBudget):
    """Keep whole chunks of ``chunk`` consecutive cached tokens: a chunk's score is the mean over its tokens of the
    scorer's scores summed over the KV heads, and every head keeps the same best chunks.

    A chunk keeps a phrase whole where a token-level top-k keeps its words apart (the paper's point). As kvpress's
    ``ChunkKVPress``: chunks count from the first cached token, the last one may be shorter and competes with the
    mean of what it holds; the scorer's window (SnapKV's) scores as the best token of any head, as kvpress pads
    it. How many chunks stay is ``count``: ``budget // chunk`` (the paper's; never more tokens than the budget), or
    kvpress's share ``budget / cached`` of all the chunks (``count=share``, ``preset=kvpress``: at budget 96 of 241
    tokens, 5 chunks of 20). With that and Knorm's scores its kept sets equal kvpress's
    (tests/test_kvpress_reference.py).

    budget: tokens kept per KV head, at most with ``count=budget``. chunk: tokens per chunk (kvpress's 20).
    count: budget or share (above).
    scorer, scorer_preset: whose scores (snapkv, as the paper; any registered compression policy).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "chunkkv"
    summary = "once the prompt is read, keep whole chunks of tokens, those the scorer rates best on average"
    paper = ("Liu et al., 2025, *ChunkKV: Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM "
             "Inference*")
    color = "#117777"
    presets = {"kvpress": {"count": "share"}}
    chunk: int = 20
    count: str = "budget"

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 1:
            raise ValueError(f"chunkkv: chunk must be >= 1, got {self.chunk}")
        if self.count not in ("budget", "share"):
            raise ValueError(f"chunkkv: count must be budget or share, got {self.count!r}")

    @classmethod
    def for_budget(cls, budget: int):
        return cls(budget=budget, chunk=max(1, min(20, budget // 2)))  # small budgets: at least two chunks

    def chunks_kept(self, n: int) -> int:
        """How many chunks of ``n`` cached tokens stay: ``budget // chunk`` (never more than the budget's tokens,
        the paper's count), or kvpress's share ``budget / n`` of all chunks (``count="share"``), at least one."""
        if self.count == "share":
            return max(1, int(-(-n // self.chunk) * self.budget / n))
        return max(1, self.budget // self.chunk)

    @property
    def recent(self) -> int:
        return 0  # the scorer's window competes as a chunk, as in kvpress

    def keep(self, view: CacheView) -> np.ndarray:
        held = view.kept
        inner = self.inner
        score = np.where(held, np.asarray(inner.score(view), np.float64), 0.0)
        window = latest(held, inner.recent)
        if window.any():  # the window scores as the best cached token of any head (kvpress pads it so)
            best = np.where(held & ~window, score, -np.inf).max()
            score = np.where(window, best if np.isfinite(best) else 0.0, score)
        cached = np.flatnonzero(held.any(0))  # every head holds the same tokens: the chunks are the layer's
        n = len(cached)
        if n <= self.budget:
            return held.copy()
        summed = score[:, cached].sum(0)  # [n]: over the KV heads
        starts = np.arange(0, n, self.chunk)
        means = np.add.reduceat(summed, starts) / np.diff(np.r_[starts, n])
        count = self.chunks_kept(n)
        chosen = np.argsort(-means, kind="stable")[:count]  # ties keep the earlier chunk
        keep = np.zeros(n, bool)
        for c in chosen:
            keep[starts[c]:starts[c] + self.chunk] = True
        out = np.zeros(held.shape, bool)
        out[:, cached[keep]] = True
        return out & held
