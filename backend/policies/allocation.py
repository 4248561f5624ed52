"""What the budget-sharing policies (PyramidKV across layers, AdaKV across heads) have in common: they
wrap another compression policy, any registered one, and take its scores; only the sharing is theirs."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import POLICIES


@dataclass(frozen=True)
class SharesBudget(CompressionPolicy):
    """Scores come from ``scorer`` (a registered compression policy, at this budget with its defaults: its
    window, if it has one, is kept), with ``scorer_preset`` (one of the scorer's presets, e.g. kvpress's
    pooling for SnapKV; the window stays the one for this budget); subclasses decide how the budget is
    shared."""

    scorer: str = "snapkv"
    scorer_preset: str = ""

    def __post_init__(self):
        super().__post_init__()
        cls = POLICIES.get(self.scorer)
        if cls is None or cls.kind != "compression" or issubclass(cls, SharesBudget):
            names = ", ".join(n for n, c in POLICIES.items() if c.kind == "compression"
                              and not issubclass(c, SharesBudget))
            raise ValueError(f"{self.name}: scorer must be one of {names}, got {self.scorer!r}")
        if self.scorer_preset and self.scorer_preset not in cls.presets:
            raise ValueError(f"{self.name}: scorer_preset must be one of {', '.join(cls.presets) or 'none'} for "
                             f"{self.scorer}, got {self.scorer_preset!r}")
        self.inner  # a budget the scorer refuses is refused here

    @property
    def inner(self) -> CompressionPolicy:
        inner = POLICIES[self.scorer].for_budget(self.budget)
        settings = {k: v for k, v in inner.presets.get(self.scorer_preset, {}).items() if k != "window"}
        return replace(inner, **settings) if settings else inner

    @property
    def uses_attention(self) -> bool:
        return self.inner.uses_attention

    @property
    def recent(self) -> int:
        return self.inner.recent

    @property
    def window_queries(self) -> int:
        return self.inner.window_queries

    @property
    def window_by_query_head(self) -> bool:
        return self.inner.window_by_query_head

    def score(self, view: CacheView) -> np.ndarray:
        return self.inner.score(view)
