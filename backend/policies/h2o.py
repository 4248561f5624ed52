"""H2O: heavy hitters by accumulated attention, plus a recent window (Zhang et al., 2023).

The accumulated attention score (A2S, A2SF paper Eq. 4) of token k after step n is the sum of the
attention it drew from queries k..n. Head-wise by default, as Zhang et al. (and TOVA Sec. 3.3) use.
GQA: a KV head accumulates the mean attention of its query heads (same ranking as their sum).
"""
from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, RunningScore, grow
from .registry import register


@register
@dataclass(frozen=True)
class H2O(EvictionPolicy):
    """Keep the ``recent`` latest tokens and, for the rest, the highest accumulated attention.

    budget: tokens each query reads, its own included.
    recent: size of the recent window that is never dropped; -1 means budget // 2 (the paper's split).
    heads: 'head' (each KV head keeps its own tokens) or 'layer' (scores averaged over heads).
    """

    name = "h2o"
    summary = 'accumulated attention (A2S) + recent window, head- or layer-wise'
    paper = 'Zhang et al., 2023'
    color = "#009E73"
    recent: int = -1
    heads: str = "head"

    @property
    def window(self) -> int:
        return self.budget // 2 if self.recent < 0 else self.recent

    def __post_init__(self):
        super().__post_init__()
        if self.recent < -1:
            raise ValueError(f"h2o: recent must be >= 0, or -1 for budget // 2, got {self.recent}")
        if self.window >= self.budget:
            raise ValueError(f"h2o: recent must be < budget, got recent={self.recent}, budget={self.budget}")

    def init_state(self, n_heads):
        return {"a2s": np.zeros((n_heads, 0))}

    def update(self, state, attn, t):
        return {"a2s": grow(state["a2s"], attn.shape[-1]) + attn}

    def score(self, state, attn, t, positions):
        return state["a2s"]

    def protected(self, t):
        return slice(max(0, t + 1 - self.window), t + 1)

    def running_score(self):
        return RunningScore(decay=1.0, recent=self.window, layer=self.heads == "layer", state="a2s")
