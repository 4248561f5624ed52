"""SnapKV (Li et al., 2024, *SnapKV: LLM Knows What You are Looking for Before Generation*, Sec. 4, Alg. 1)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, WindowedCompression
from .registry import register


def pool(x: np.ndarray, kernel: int, how: str) -> np.ndarray:
    """1-D pooling along the last axis, stride 1, padding kernel // 2 (as SnapKV's max/avg_pool1d)."""
    pad = kernel // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], constant_values=-np.inf if how == "max" else 0.0)
    windows = np.lib.stride_tricks.sliding_window_view(padded, kernel, axis=-1)
    return windows.max(-1) if how == "max" else windows.mean(-1)


ORDERS = ("mean-pool", "pool-mean")


@register
@dataclass(frozen=True)
class SnapKV(WindowedCompression):
    """Keep the observation window (the last ``window`` tokens) and the prompt tokens its queries attend to.

    Score of a cached token: the attention it draws from the ``window`` latest queries, summed, then
    pooled along the cached positions (``pooling`` over ``kernel`` neighbours, so a kept token keeps its
    neighbourhood); per KV head the window plus the ``budget - window`` best others stay (Alg. 1).
    Defaults (8, 7, max) are KVCache-Factory's, for small budgets (docs/policies.md says why, and what the
    SnapKV repository and kvpress use). GQA (``order``): ``mean-pool`` pools the mean attention of the KV
    head's query heads (AdaKV's GQA mode); ``pool-mean`` pools each query head's attention, then takes the
    mean (kvpress). The two agree for average pooling only. ``preset=kvpress`` takes kvpress's settings
    (window 64, kernel 5, avg, pool-mean).

    budget: tokens kept per KV head at each compression, the window included (SnapKV's capacity).
    window: observation window: queries that vote, and latest tokens always kept.
    kernel: pooling width (odd). pooling: 'max' or 'avg'. order: mean-pool or pool-mean (GQA).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "snapkv"
    summary = "once the prompt is read, keep the tokens the last `window` queries attend to (pooled) + the window"
    paper = "Li et al., 2024, *SnapKV*, Sec. 4, Alg. 1"
    color = "#6699CC"
    presets = {"kvpress": {"window": 64, "kernel": 5, "pooling": "avg", "order": "pool-mean"}}
    kernel: int = 7
    pooling: str = "max"
    order: str = "mean-pool"

    def __post_init__(self):
        super().__post_init__()
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be an odd number >= 1, got {self.kernel}")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"{self.name}: pooling must be 'max' or 'avg', got {self.pooling!r}")
        if self.order not in ORDERS:
            raise ValueError(f"{self.name}: order must be one of {', '.join(ORDERS)}, got {self.order!r}")

    @property
    def window_by_query_head(self) -> bool:
        return self.order == "pool-mean"

    def score(self, view: CacheView) -> np.ndarray:
        if self.order == "pool-mean" and view.attn_window_heads is not None:
            votes = view.attn_window_heads.sum(2)  # [H, G, t+1]: each query head's own
        else:
            votes = view.attn_window.sum(1)[:, None]  # [H, 1, t+1]: the group's mean
        out = np.zeros(view.kept.shape)
        for h in range(votes.shape[0]):
            cached = np.flatnonzero(view.kept[h])
            prefix = cached[: max(0, len(cached) - self.window)]  # the window itself is kept anyway
            if len(prefix):
                out[h, prefix] = pool(votes[h][:, prefix], self.kernel, self.pooling).mean(0)
        return out
