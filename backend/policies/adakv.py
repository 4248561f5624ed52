"""AdaKV (Feng et al., 2024, *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation*, Alg. 1)."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView, latest
from .registry import register


@register
@dataclass(frozen=True)
class AdaKV(SharesBudget):
    """Head-adaptive budgets around a scorer: a layer's heads share budget x n_kv_heads slots.

    With B' = budget - the scorer's window: the top n_kv_heads x B' scores over the layer's heads count
    the slots each head earned; head h keeps round(earned_h (1 - alpha_floor) + floor(B' alpha_floor)) of
    its best tokens plus the window (the authors' code and their runs' alpha 0.2). Scores come from
    ``scorer``, any registered compression policy at this budget (SnapKV, as the paper).

    budget: mean tokens kept per KV head, the window included. scorer: e.g. snapkv or knorm.
    alpha_floor: the share of B' every head keeps whatever its scores (the paper's safeguard).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "adakv"
    summary = "head-adaptive budgets: a layer's slots go to the best scores across its heads (scorer: SnapKV)"
    paper = "Feng et al., 2024, *Ada-KV*, Alg. 1"
    color = "#332288"
    allocation = "head-adaptive"
    alpha_floor: float = 0.2

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha_floor <= 1.0:
            raise ValueError(f"adakv: alpha_floor must be in [0, 1], got {self.alpha_floor}")

    def keep(self, view: CacheView) -> np.ndarray:
        kept, in_window = view.kept, latest(view.kept, self.recent)
        candidates, share = kept & ~in_window, self.budget - self.recent  # share: B'
        if candidates.sum(-1).max() <= share:
            return kept.copy()  # nothing to compress yet
        score = np.where(candidates, self.score(view), -np.inf)
        flat = np.argsort(-score, axis=None, kind="stable")[: share * kept.shape[0]]
        earned = np.bincount(np.unravel_index(flat, score.shape)[0], minlength=kept.shape[0])
        capacity = np.rint(earned * (1 - self.alpha_floor) + int(share * self.alpha_floor)).astype(int)
        out = in_window.copy()
        for h, cap in enumerate(capacity):
            best = np.argsort(-score[h], kind="stable")[: min(cap, int(candidates[h].sum()))]
            out[h, best] = True
        return out
