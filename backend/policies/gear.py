"""GEAR (Kang et al., 2024, *GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative Inference
of LLM*, Sec. 3)."""
from dataclasses import dataclass

import numpy as np

from .kivi import KIVI, quantise, quantise_values
from .registry import register


def outliers(x: np.ndarray, share: float, axis: int) -> np.ndarray:
    """bool like ``x``: in each slice along ``axis``, the round(share / 2 x length) largest and as many smallest
    entries (GEAR's Filter_s, Eq. 3), which GEAR holds exact in a sparse matrix."""
    length = x.shape[axis]
    count = int(round(share / 2 * length))
    mask = np.zeros(x.shape, bool)
    if count == 0:
        return mask
    order = np.argsort(x, axis=axis, kind="stable")
    ends = np.concatenate([np.take(order, np.arange(count), axis), np.take(order, np.arange(length - count, length),
                                                                           axis)], axis)
    np.put_along_axis(mask, ends, True, axis)
    return mask


def low_rank(residual: np.ndarray, rank: int) -> np.ndarray:
    """The best rank-``rank`` approximation of each matrix of ``residual`` [..., n, d] (truncated SVD: what GEAR's
    power iteration approximates, Eq. 4)."""
    if rank <= 0:
        return np.zeros_like(residual)
    u, s, vt = np.linalg.svd(residual, full_matrices=False)
    r = min(rank, s.shape[-1])
    return (u[..., :r] * s[..., None, :r]) @ vt[..., :r, :]


@register
@dataclass(frozen=True)
class GEAR(KIVI):
    """KIVI's rounding with its error reduced, as GEAR holds each group of tokens: ``outliers`` of the entries kept
    exact (the largest and smallest half each, per channel of the keys and per token of the values, as KIVI groups
    them), the rest rounded to ``bits`` (KIVI's quantiser, GEAR's backbone), and each head's rounding error
    approximated at ``rank`` and added back: X = D + L + S (Sec. 3, Eq. 2-4).

    GEAR computes L by a few power iterations; KV Lens takes the truncated SVD they converge to. ``outliers`` 0 is
    GEAR-L (the low-rank part alone); the paper's full GEAR also keeps a sparse 2%.
    A compression ratio sets ``bits`` as KIVI's does (16 x (1 - ratio)); the low-rank factors (rank x (n + d) per
    head and group) and the outliers are held besides, as GEAR counts them.

    bits, group, residual, interval, every: KIVI's (Sec. 4 of KIVI; GEAR's streaming buffer is KIVI's residual).
    rank: the rank of each head's error approximation per group of tokens (0: KIVI's rounding alone).
    outliers: the share of each key channel's and value token's entries held exact (0-1): round(share / 2 x length)
    at each end, so over a key group of 32 tokens a share under 1/32 holds none.
    """

    name = "gear"
    summary = ("KIVI's rounding with its error approximated at `rank` per head and the `outliers` share of entries "
               "held exact")
    paper = ("Kang et al., 2024, *GEAR: An Efficient KV Cache Compression Recipe for Near-Lossless Generative "
             "Inference of LLM*, Sec. 3")
    color = "#7A3E9D"
    rank: int = 4
    outliers: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        if self.rank < 0 or not 0.0 <= self.outliers < 1.0:
            raise ValueError(f"{self.name}: need rank >= 0 and 0 <= outliers < 1, got rank={self.rank}, "
                             f"outliers={self.outliers}")

    def schedule(self, mode: str | None = None) -> str:
        return f"{super().schedule(mode)}, each group's error approximated at rank {self.rank}"

    def rounded(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Group by group of ``group`` tokens (KIVI's unit, GEAR's streaming chunk), each head apart."""
        heads, n, dim = keys.shape
        shape = (heads, n // self.group, self.group, dim)
        value_group = min(self.group, dim)
        keys = self._reduced(keys.reshape(shape), lambda x: quantise(x, self.bits, axis=2), axis=2)
        values = self._reduced(values.reshape(shape), lambda x: quantise_values(x, self.bits, value_group), axis=-1)
        return keys.reshape(heads, n, dim), values.reshape(heads, n, dim)

    def _reduced(self, x: np.ndarray, quantiser, axis: int) -> np.ndarray:
        """D + L + S for x [..., group, d]: S the outliers along ``axis``, D the rest rounded, L the error's
        rank-``rank`` part."""
        exact = outliers(x, self.outliers, axis)
        sparse = np.where(exact, x, 0.0)
        rounded = quantiser(x - sparse)
        return rounded + low_rank(x - rounded - sparse, self.rank) + sparse
