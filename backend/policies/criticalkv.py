"""CriticalKV (Feng et al., 2025, *Identify Critical KV Cache in LLM Inference from an Output Perturbation
Perspective*, Sec. 3-4)."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView, keep_top, latest
from .registry import register


def projected_norms(values: np.ndarray, output: np.ndarray, group: int) -> np.ndarray:
    """[H, n]: |W_o^j v|_1 of each token's value through each query head j's part of the output projection, the mean
    over the KV head's ``group`` query heads (values [H, n, d], output [hidden, H*group*d])."""
    heads, _, dim = values.shape
    norms = np.zeros(values.shape[:2])
    for h in range(heads):
        for g in range(group):
            j = h * group + g
            norms[h] += np.abs(values[h] @ output[:, j * dim:(j + 1) * dim].T).sum(-1)
    return norms / group


@register
@dataclass(frozen=True)
class CriticalKV(SharesBudget):
    """A scorer's tokens, re-weighed by what their values would change in the layer's output: the ``first`` share of
    the budget goes to the scorer's best (with its window), then the rest to the best of (score + epsilon) x
    |W_o v|_1, each token's value through the output projection (L1 norm, the mean over the KV head's query heads).

    The paper bounds the output's perturbation by attention times the projected value's norm (Sec. 3) and selects in
    two stages (Alg. 1); kvpress's ``CriticalKVPress`` wraps any scorer (its defaults: first 0.5, epsilon 1e-4), and
    so does this one (``scorer``, SnapKV by default as the paper's experiments, ``scorer_preset``). ``preset=kvpress``
    takes kvpress's SnapKV settings for the scorer (kvpress's ``CriticalKVPress(SnapKVPress(window_size=8))``).

    budget: tokens kept per KV head at each compression. scorer, scorer_preset: the scores it re-weighs.
    first: the budget's share the scorer alone fills. epsilon: added to the scores before weighing.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "criticalkv"
    summary = "a scorer's best tokens, then the rest by score times the value's norm through the output projection"
    paper = ("Feng et al., 2025, *Identify Critical KV Cache in LLM Inference from an Output Perturbation "
             "Perspective*, Sec. 3-4")
    color = "#35978F"
    presets = {"kvpress": {"scorer_preset": "kvpress"}}
    first: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.first <= 1.0 or self.epsilon < 0:
            raise ValueError(f"{self.name}: need first in 0..1 and epsilon >= 0, got first={self.first}, "
                             f"epsilon={self.epsilon}")

    def score(self, view: CacheView) -> np.ndarray:
        if view.output is None:
            raise ValueError(f"{self.name}: needs the layer's output projection, which this model does not expose")
        values = np.asarray(view.values)
        group = view.output.shape[1] // (values.shape[0] * values.shape[-1])
        # Per window query (kvpress's scorers average the window where KV Lens's sum it): epsilon's weight follows.
        scores = np.asarray(self.inner.score(view), np.float64) / max(1, view.attn_window.shape[1])
        base = np.where(latest(view.kept, self.recent), np.inf, scores)
        chosen = keep_top(base, view.kept, int(self.budget * self.first), 0)  # the scorer's best, its window first
        weighed = (np.where(np.isinf(base), 0.0, base) + self.epsilon) * projected_norms(values, view.output, group)
        return np.where(chosen, np.inf, weighed)
