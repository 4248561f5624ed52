"""A KV Lens plugin: one policy, registered on import (KVLENS_PLUGINS=vnorm_plugin, with this folder on
PYTHONPATH). Every list, view, test and the docs' table generators pick it up from the registry."""
from dataclasses import dataclass

import numpy as np

from backend.policies import CacheView, CompressionPolicy, register


@register
@dataclass(frozen=True)
class ValueNorm(CompressionPolicy):
    """Keep the tokens whose values have the largest L2 norm, plus the latest ``recent_tokens``.

    budget: tokens kept per KV head. recent_tokens: latest tokens always kept.
    """

    name = "vnorm"
    summary = "keep the tokens with the largest value norms (a plugin example)"
    uses_attention = False
    recent_tokens: int = 4

    @property
    def recent(self) -> int:
        return self.recent_tokens

    def score(self, view: CacheView) -> np.ndarray:
        return np.linalg.norm(view.values, axis=-1)
