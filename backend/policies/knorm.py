"""Knorm (Devoto et al., 2024, *A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import register


@register
@dataclass(frozen=True)
class Knorm(CompressionPolicy):
    """Keep the ``budget`` keys with the lowest L2 norm; it reads no attention.

    Low-norm keys draw high attention (the paper's finding), so the norm stands in for it. As kvpress,
    every layer compresses and no token is protected (the authors' example skips layers 0 and 1). The
    norm of a key is the same before and after RoPE (a rotation).

    budget: tokens kept per KV head at each compression.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "knorm"
    summary = "once the prompt is read, keep the keys with the lowest L2 norm (no attention needed)"
    paper = "Devoto et al., 2024, *A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression*"
    color = "#AA4499"
    uses_attention = False

    def score(self, view: CacheView) -> np.ndarray:
        return -np.linalg.norm(view.keys, axis=-1)
