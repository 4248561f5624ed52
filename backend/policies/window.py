"""Window: first in, first out (TOVA Sec. 3.3, after Beltagy et al., 2020)."""
from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, RunningScore
from .registry import register


@register
@dataclass(frozen=True)
class Window(EvictionPolicy):
    """The most recent ``budget`` tokens: when full, the oldest cached token leaves.

    budget: tokens each query reads, its own included.
    """

    name = "window"
    summary = 'the most recent `budget` tokens'
    paper = 'Beltagy et al., 2020 (Longformer); TOVA Sec. 3.3'
    color = "#E69F00"
    uses_attention = False

    def score(self, state, attn, t, positions):
        # Older = lower score, so argmin picks the earliest cached position.
        return positions.astype(np.float64)

    def running_score(self):
        return RunningScore(by_position=True)
