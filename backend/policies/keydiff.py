"""KeyDiff (Park et al., 2025, *KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference in
Resource-Constrained Environments*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import register


@register
@dataclass(frozen=True)
class KeyDiff(CompressionPolicy):
    """Keep the ``budget`` tokens whose keys are least like the others: a token's score is minus the cosine of its
    key with the anchor, the mean of the held keys scaled to unit length, per KV head; it reads no attention.

    Keys that point where most keys point draw attention alike, so the distinctive ones are kept (the paper's
    finding). As kvpress's ``KeyDiffPress``: the keys as cached (after RoPE), every layer, no token protected. The
    paper compresses block by block as the prompt arrives (kvpress's ``BlockPress``): that is ``interval`` here,
    the tokens between compressions; the default compresses once, after the prompt, as kvpress does alone.

    budget: tokens kept per KV head at each compression.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "keydiff"
    summary = "once the prompt is read, keep the keys least like the mean key (cosine; no attention needed)"
    paper = ("Park et al., 2025, *KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM Inference "
             "in Resource-Constrained Environments*")
    color = "#661100"
    uses_attention = False

    def score(self, view: CacheView) -> np.ndarray:
        keys = np.asarray(view.keys, np.float64)  # [H, n, d]
        unit = keys / np.maximum(np.linalg.norm(keys, axis=-1, keepdims=True), 1e-12)
        held = view.kept[..., None]
        anchor = (unit * held).sum(1) / np.maximum(held.sum(1), 1)  # [H, d]: mean unit key of what is held
        anchor /= np.maximum(np.linalg.norm(anchor, axis=-1, keepdims=True), 1e-12)
        return -(unit @ anchor[..., None])[..., 0]  # [H, n]
