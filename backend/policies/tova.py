"""TOVA: Token Omission Via Attention (Oren et al., 2024, Sec. 3.4 and App. A)."""
from dataclasses import dataclass

from .base import EvictionPolicy, RunningScore
from .registry import register


@register
@dataclass(frozen=True)
class TOVA(EvictionPolicy):
    """At each step, drop the token that drew the lowest attention from the current query.

    The current token competes too, so it may be the one dropped. Layer-wise (the attention averaged
    over all heads, one token dropped from every head) is the paper's default; head-wise is its
    ablation (App. A).

    budget: tokens each query reads, its own included (the paper's multi-state size is budget - 1).
    heads: 'layer' (paper default) or 'head'.
    sinks: keep the first ``sinks`` tokens for good ("TOVA + first i", App. A); 0 = pure TOVA.
    """

    name = "tova"
    summary = 'drop the token the current query attends to least; layer-wise by default'
    paper = 'Oren et al., 2024, *Transformers are Multi-State RNNs*, Sec. 3.4'
    color = "#0072B2"
    heads: str = "layer"
    sinks: int = 0

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"tova: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")

    def score(self, state, attn, t, positions):
        return attn

    def protected(self, t):
        return slice(0, self.sinks) if self.sinks else None

    def running_score(self):
        return RunningScore(decay=0.0, sinks=self.sinks, layer=self.heads == "layer")
