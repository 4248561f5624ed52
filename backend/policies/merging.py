"""Merging on eviction, as kvpress's ``MergingPress`` (after D2O, Wan et al., 2024, *D2O: Dynamic Discriminative
Operations for Efficient Long-Context Inference of Large Language Models*, and token merging, Bolya et al., 2023)."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView, Reform
from .registry import register

EPS = 1e-6  # kvpress's, on the key norms and the weights' denominator


@register
@dataclass(frozen=True)
class Merging(SharesBudget):
    """A scorer's tokens; each token it evicts folds its value into the held token whose key is most like its own
    (cosine), weighted by that likeness and by its value's norm against the target's: w = max(cos, 0) |v_e| /
    (|v_e| + |v_t|). A target then holds (v_t + sum w v_e) / (1 + sum w), a mean that leans to its own value; the
    keys stay, so no rotation moves (D2O's merge, kvpress's ``MergingPress``, which D2O's and ToMe's inspired).

    D2O merges by a threshold on the similarity kept as a moving average of past evictions; kvpress fixes it
    (``similarity``) and may merge only the most similar ``fraction`` of the evicted (the quantile of their best
    similarities, the ones under ``similarity`` counting as -inf, as kvpress). With ``scorer=knorm`` the held tokens
    and their values are kvpress's ``MergingPress(KnormPress())`` (tests/test_kvpress_reference.py).

    budget: tokens kept per KV head. scorer, scorer_preset: whose scores choose them (snapkv by default; any
    registered compression policy). similarity: the least cosine that merges (kvpress's similarity_threshold).
    fraction: the share of the evicted that merge, the most similar (kvpress's merge_fraction).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "merging"
    summary = "once the prompt is read, a scorer's tokens; each evicted value folded into the held token of the nearest key"
    paper = ("kvpress's MergingPress, after Wan et al., 2024, *D2O: Dynamic Discriminative Operations for Efficient "
             "Long-Context Inference of Large Language Models*")
    color = "#775500"
    reforms = "merge"
    similarity: float = 0.0
    fraction: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.similarity <= 1.0 or not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"{self.name}: need 0 <= similarity <= 1 and 0 < fraction <= 1, got similarity="
                             f"{self.similarity}, fraction={self.fraction}")

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        dropped = view.kept & ~keep
        if not dropped.any():
            return None
        keys, given = np.asarray(view.keys, np.float64), np.asarray(view.values, np.float64)
        unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), EPS)
        norms = np.linalg.norm(given, axis=-1)
        values = given.copy()
        into = np.full(keep.shape, -1, np.int64)
        share = np.zeros(keep.shape)
        changed = np.zeros(keep.shape, bool)
        for h in range(keep.shape[0]):
            held, gone = np.flatnonzero(keep[h]), np.flatnonzero(dropped[h])
            if not len(held) or not len(gone):
                continue
            likeness = unit[h, gone] @ unit[h, held].T  # [gone, held]
            target, best = likeness.argmax(1), likeness.max(1)
            merges = best >= self.similarity
            if self.fraction < 1.0 and merges.any():
                merges &= best >= np.quantile(np.where(merges, best, -np.inf), 1.0 - self.fraction)
            weight = np.maximum(best, 0.0) * merges * norms[h, gone] / (norms[h, gone] + norms[h, held[target]] + EPS)
            added = np.zeros((len(held), given.shape[-1]))
            total = np.zeros(len(held))
            np.add.at(added, target, weight[:, None] * given[h, gone])
            np.add.at(total, target, weight)
            took = total > 0
            values[h, held[took]] = (given[h, held[took]] + added[took]) / (1.0 + total[took, None])
            changed[h, held[took]] = True
            merged = weight > 0
            into[h, gone[merged]] = held[target[merged]]
            share[h, gone[merged]] = weight[merged] / (1.0 + total[target[merged]])
        return Reform(positions=changed, values=values, merged_into=into, merge_weight=share)
