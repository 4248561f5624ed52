"""AdaKV (Feng et al., 2024, *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation*, Alg. 1)."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView, latest
from .registry import register


@register
@dataclass(frozen=True)
class AdaKV(SharesBudget):
    """Head-adaptive budgets around a scorer: a layer's heads share exactly budget x n_kv_heads slots.

    With B' = budget - the scorer's window: every head first keeps its floor(B' x alpha_floor) best tokens
    (the authors' safeguard, their runs' alpha 0.2); the rest of the n_kv_heads x B' slots go to the best
    remaining scores over all the layer's heads (Alg. 1's top-k across heads), so a head keeps what its
    scores earn, at least its floor, plus the window. This is the authors' code's and kvpress's
    ``AdaKVPress`` allocation. Scores come from ``scorer``, any registered compression policy at this budget
    (SnapKV, as the paper).

    kvpress counts the floor in the budget, window first: int(budget x alpha_floor) tokens per head
    (``floor_of=budget``; with SnapKV's window of 8 at budgets under 40 that is the window alone).
    ``preset=kvpress`` takes that and kvpress's SnapKV pooling.

    budget: mean tokens kept per KV head, the window included. scorer: e.g. snapkv or knorm. scorer_preset:
        the scorer's preset (kvpress).
    alpha_floor: the share of B' every head keeps whatever its scores (the paper's safeguard). floor_of:
        share (the floor is a share of B', besides the window) or budget (of the budget, window included).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "adakv"
    summary = "head-adaptive budgets: a layer's slots go to the best scores across its heads (scorer: SnapKV)"
    paper = "Feng et al., 2024, *Ada-KV*, Alg. 1"
    color = "#332288"
    allocation = "head-adaptive"
    version = 2
    presets = {"kvpress": {"floor_of": "budget", "scorer_preset": "kvpress"}}
    alpha_floor: float = 0.2
    floor_of: str = "share"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha_floor <= 1.0 or self.floor_of not in ("share", "budget"):
            raise ValueError(f"adakv: need alpha_floor in [0, 1] and floor_of share or budget, got alpha_floor="
                             f"{self.alpha_floor}, floor_of={self.floor_of!r}")

    def keep(self, view: CacheView) -> np.ndarray:
        kept, in_window = view.kept, latest(view.kept, self.recent)
        candidates, share = kept & ~in_window, self.budget - self.recent  # share: B'
        if candidates.sum(-1).max() <= share:
            return kept.copy()  # nothing to compress yet
        score = np.where(candidates, self.score(view), -np.inf)
        # The safeguard: each head's floor best candidates rank above every other score.
        floor = (int(share * self.alpha_floor) if self.floor_of == "share"
                 else max(0, int(self.budget * self.alpha_floor) - self.recent))
        order = np.argsort(-score, axis=1, kind="stable")[:, :floor]
        rows = np.arange(len(score))[:, None]
        score[rows, order] = np.where(candidates[rows, order], np.inf, -np.inf)
        slots = min(share * len(score), int(candidates.sum()))
        out = in_window.copy()
        out.flat[np.argsort(-score, axis=None, kind="stable")[:slots]] = True
        return out & kept
