"""A KV Lens plugin of the precision kind (KVLENS_PLUGINS=precision_plugin, this folder on PYTHONPATH): every key and
value past a recent window rounded to 8-bit integers with one scale per token. It holds every token, as KIVI."""
from dataclasses import dataclass, replace

import numpy as np

from backend.policies import CacheView, KIVI, Reform, register


def absmax(x: np.ndarray, bits: int) -> np.ndarray:
    """Symmetric rounding of each token's vector to ``bits``-bit integers (one scale per token)."""
    scale = np.abs(x).max(-1, keepdims=True) / (2 ** (bits - 1) - 1)
    return np.where(scale > 0, np.round(x / np.where(scale > 0, scale, 1)) * scale, x)


@register
@dataclass(frozen=True)
class PerTokenInt(KIVI):
    """KIVI's schedule and residual, but keys and values rounded per token, symmetrically, to ``bits`` (8).

    bits: bits per entry (16: held whole). group, residual, interval, every: KIVI's.
    """

    name = "per_token_int"
    summary = "every token past the residual rounded to 8-bit integers, one scale per token (a precision plugin example)"
    bits: int = 8

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        end = max(0, view.t + 1 - self.residual)
        if self.bits >= 16 or end == 0:
            return None
        positions = keep & (np.arange(keep.shape[1]) < end)
        keys, values = absmax(np.asarray(view.keys), self.bits), absmax(np.asarray(view.values), self.bits)
        return Reform(positions=positions, keys=keys, values=values)
