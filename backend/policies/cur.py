"""CurDKV (Sengupta et al., 2025, *Value-Guided KV Compression for LLMs via Approximated CUR Decomposition*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy
from .registry import register

LEVERAGES = ("key", "value", "kv_avg", "kv_product")


def local_leverage(squares: np.ndarray, window: int) -> np.ndarray:
    """[n] squared norms -> each token's share of its run of ``window`` tokens (the last run may be shorter): the
    leverage score of a row, approximated within its neighbourhood (CurDKV's local approximation)."""
    out = np.empty_like(squares)
    for lo in range(0, len(squares), window):
        run = squares[lo:lo + window]
        total = run.sum()
        out[lo:lo + window] = run / total if total > 0 else 0.0
    return out


@register
@dataclass(frozen=True)
class CUR(CompressionPolicy):
    """Keep the tokens with the largest approximate leverage: a row's leverage in a CUR decomposition of the keys
    and values, approximated by its squared norm over the squared norms of its ``local`` neighbours (the paper's
    local approximation), of the keys times of the values (``leverage=kv_product``, the default), or the keys',
    the values', or their mean. The first ``sinks`` tokens always stay; no attention is read.

    As kvpress's ``CURPress`` (4 sinks, windows of 16, the product), over the tokens held, in order; kvpress's
    random projection before the norms (``use_random_leverage``, off by default) is not offered.

    budget: tokens kept per KV head at each compression. sinks: first tokens always kept. leverage: key, value,
    kv_avg or kv_product. local: tokens per neighbourhood (0: the whole cache, one leverage over all tokens).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "cur"
    summary = "once the prompt is read, keep the tokens of largest approximate leverage (key and value norms, CUR)"
    paper = ("Sengupta et al., 2025, *Value-Guided KV Compression for LLMs via Approximated CUR Decomposition* "
             "(CurDKV)")
    color = "#5E3C99"
    uses_attention = False
    sinks: int = 4
    leverage: str = "kv_product"
    local: int = 16

    def __post_init__(self):
        super().__post_init__()
        if self.leverage not in LEVERAGES or self.sinks < 0 or self.local < 0:
            raise ValueError(f"{self.name}: need leverage in {', '.join(LEVERAGES)}, sinks >= 0 and local >= 0, got "
                             f"leverage={self.leverage!r}, sinks={self.sinks}, local={self.local}")

    def score(self, view: CacheView) -> np.ndarray:
        keys, values = np.asarray(view.keys), np.asarray(view.values)
        out = np.zeros(view.kept.shape)
        for h in range(len(out)):
            held = np.flatnonzero(view.kept[h])
            k2, v2 = (keys[h, held] ** 2).sum(-1), (values[h, held] ** 2).sum(-1)
            window = self.local or len(held)
            k2, v2 = local_leverage(k2, window), local_leverage(v2, window)
            score = {"key": k2, "value": v2, "kv_avg": (k2 + v2) / 2, "kv_product": k2 * v2}[self.leverage]
            out[h, held] = score / max(score.sum(), 1e-300)
            out[h, held[: self.sinks]] = np.inf  # the first tokens held (the sinks, once the prompt is read)
        return out
