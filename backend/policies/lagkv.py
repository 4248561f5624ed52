"""LagKV (Liang et al., 2025, *LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are
Important*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import register


def _lag_scores(x: np.ndarray) -> np.ndarray:
    """[P, lag, d] partitions -> [P - 1, lag]: each token of partition p, its channels scaled by the min and max of
    partition p + 1 (its lag reference), the spread (sample std) of those channels, softmaxed over the partition."""
    ref, cur = x[1:], x[:-1]
    low, high = ref.min(1, keepdims=True), ref.max(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = ((cur - low) / (high - low)).std(-1, ddof=1)
    spread = np.exp(spread - spread.max(-1, keepdims=True))
    return spread / spread.sum(-1, keepdims=True)


@register
@dataclass(frozen=True)
class LagKV(CompressionPolicy):
    """Score each token against the partition after it: the cached tokens after the ``sinks`` first are cut into
    partitions of ``lag``; a token's keys and values, each channel scaled by the next partition's minimum and
    maximum, score by their spread over the channels (softmax within the partition, keys' and values' averaged),
    then by their rank in the partition. The sinks and the last partition (with what is left over) always stay.

    Keys and values alone, no attention: the next tokens' range says how far a token stands out (the paper's
    lag-relative information). As kvpress's ``LagKVPress`` (its defaults: 4 sinks, lag 128, no cross-partition
    scoring), keys after RoPE: below ``sinks + 2 * lag`` cached tokens it keeps the sinks, then the latest tokens.
    ``ranked=False`` compares the softmaxed spreads across partitions instead of their ranks (kvpress's
    ``cross_scoring``, for a budget shared unevenly).

    budget: tokens kept per KV head at each compression. sinks: first tokens always kept. lag: partition size.
    ranked: score by rank within the partition (kvpress's default) or by the spread itself.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "lagkv"
    summary = "once the prompt is read, keep tokens whose keys and values stand out from the next partition's range"
    paper = ("Liang et al., 2025, *LagKV: Lag-Relative Information of the KV Cache Tells Which Tokens Are "
             "Important*")
    color = "#AA6677"
    uses_attention = False
    sinks: int = 4
    lag: int = 128
    ranked: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0 or self.lag < 2:
            raise ValueError(f"lagkv: need sinks >= 0 and lag >= 2, got sinks={self.sinks}, lag={self.lag}")

    @classmethod
    def for_budget(cls, budget: int):
        return cls(budget=budget, sinks=min(4, budget // 4), lag=max(2, min(128, budget // 2)))

    def score(self, view: CacheView) -> np.ndarray:
        out = np.full(view.kept.shape, -np.inf)
        for h in range(view.kept.shape[0]):
            cached = np.flatnonzero(view.kept[h])
            out[h, cached] = self._head_scores(view.keys[h, cached], view.values[h, cached])
        return out

    def _head_scores(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        m, sinks, lag = len(keys), self.sinks, self.lag
        score = np.ones(m)
        if m < sinks + 2 * lag:  # too short to partition: the sinks, then the latest tokens first
            if m > sinks:
                score[sinks:] = np.arange(m - sinks) / (m - sinks)
            return score
        end = sinks + (m - sinks) // lag * lag
        d = keys.shape[-1]
        parts = (_lag_scores(keys[sinks:end].reshape(-1, lag, d))
                 + _lag_scores(values[sinks:end].reshape(-1, lag, d))) / 2
        if self.ranked:
            parts = parts.argsort(-1, kind="stable").argsort(-1, kind="stable") / lag
        score[sinks:end - lag] = parts.ravel()  # the last partition and the rest stay (score 1), as the sinks
        return score
