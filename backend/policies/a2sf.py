"""A2SF: accumulated attention score with a forgetting factor (Jo and Shin, 2024, Sec. 3.3)."""
from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, RunningScore, grow
from .registry import register


@register
@dataclass(frozen=True)
class A2SF(EvictionPolicy):
    """Score A_n,k = sum_q alpha^(n-q) S_q,k (Eq. 5), kept per step as A_n = alpha * A_(n-1) + S_n.

    alpha = 1 is H2O's A2S. The paper gives A2SF no separate recent window ("allocated all to the
    selective cache", Sec. 4.1), so ``window`` defaults to 0.

    budget: tokens each query reads, its own included.
    alpha: forgetting factor in [0, 1]; the paper's best range is 0.1-0.3 (Fig. 5).
    window: recent tokens never dropped (0 = the paper's setting).
    heads: 'head' (A^h per head, Eq. 5) or 'layer'.
    """

    name = "a2sf"
    summary = 'accumulated attention with forgetting factor `alpha`'
    paper = 'Jo & Shin, 2024, *A2SF*, Eq. 5'
    color = "#D55E00"
    alpha: float = 0.1
    window: int = 0
    heads: str = "head"

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"a2sf: alpha must be in [0, 1], got {self.alpha}")
        if not 0 <= self.window < self.budget:
            raise ValueError(f"a2sf: need 0 <= window < budget, got window={self.window}, budget={self.budget}")

    def init_state(self, n_heads):
        return {"score": np.zeros((n_heads, 0))}

    def update(self, state, attn, t):
        return {"score": self.alpha * grow(state["score"], attn.shape[-1]) + attn}

    def score(self, state, attn, t, positions):
        return state["score"]

    def protected(self, t):
        return slice(t + 1 - self.window, t + 1) if self.window else None

    def running_score(self):
        return RunningScore(decay=self.alpha, recent=self.window, layer=self.heads == "layer", state="score")
