"""Leverage scores alone (Chari & Van Durme, 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with
Approximate Leverage Scores*, Sec. 3; kvpress's ``LeverageScorePress``)."""
from dataclasses import dataclass

import numpy as np
import torch

from .base import CacheView, CompressionPolicy
from .compactor import leverage, sketch
from .registry import register


@register
@dataclass(frozen=True)
class Leverage(CompressionPolicy):
    """Keep the keys that stand out of the keys' geometry: each held token's approximate statistical leverage among
    its head's held keys before RoPE (centred, sketched by a Gaussian of ``sketch`` columns, then the diagonal of
    X (X^T X)^-1 X^T through a Cholesky solve). Compactor's first score without its attention term, its sinks or
    its recent tokens, as kvpress's ``LeverageScorePress`` (which z-scores it, a ranking unchanged). Reads no
    attention. Its sketch draws from a generator seeded with ``seed``, the layers in turn, as one run of kvpress's
    prefill after ``torch.manual_seed(seed)``.

    budget: tokens kept per KV head at each compression. sketch: the sketch's columns. seed: the sketch's seed.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "leverage"
    summary = "once the prompt is read, keep the keys of largest approximate leverage (the keys' geometric outliers)"
    paper = ("Chari & Van Durme, 2025, *Compactor: Calibrated Query-Agnostic KV Cache Compression with Approximate "
             "Leverage Scores*, Sec. 3")
    color = "#BF812D"
    uses_attention = False
    sketch: int = 48
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.sketch < 1:
            raise ValueError(f"{self.name}: sketch must be >= 1, got {self.sketch}")

    def score(self, view: CacheView) -> np.ndarray:
        keys = np.asarray(view.keys)
        heads, dim = keys.shape[0], keys.shape[-1]
        phi = sketch(self.seed, view.layer, heads, dim, self.sketch)
        out = np.zeros(view.kept.shape)
        for h in range(heads):
            at = np.flatnonzero(view.kept[h])
            k = torch.from_numpy(keys[h:h + 1, at]).double()
            pre = view.rope(k, -torch.from_numpy(at)) if view.rope is not None else k  # the keys before RoPE
            out[h, at] = leverage(pre.float()[None], phi[:, h:h + 1])[0, 0].double().numpy()
        return out
