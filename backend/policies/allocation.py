"""What the budget-sharing policies (PyramidKV across layers, AdaKV across heads) have in common: they
wrap another compression policy, any registered one, and take its scores; only the sharing is theirs."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import POLICIES


@dataclass(frozen=True)
class SharesBudget(CompressionPolicy):
    """Scores come from ``scorer`` (a registered compression policy, at this budget with its defaults: its
    window, if it has one, is kept); subclasses decide how the budget is shared."""

    scorer: str = "snapkv"

    def __post_init__(self):
        super().__post_init__()
        cls = POLICIES.get(self.scorer)
        if cls is None or cls.kind != "compression" or issubclass(cls, SharesBudget):
            names = ", ".join(n for n, c in POLICIES.items() if c.kind == "compression"
                              and not issubclass(c, SharesBudget))
            raise ValueError(f"{self.name}: scorer must be one of {names}, got {self.scorer!r}")
        self.inner  # a budget the scorer refuses is refused here

    @property
    def inner(self) -> CompressionPolicy:
        return POLICIES[self.scorer].for_budget(self.budget)

    @property
    def uses_attention(self) -> bool:
        return self.inner.uses_attention

    @property
    def recent(self) -> int:
        return self.inner.recent

    @property
    def window_queries(self) -> int:
        return self.inner.window_queries

    def score(self, view: CacheView) -> np.ndarray:
        return self.inner.score(view)
