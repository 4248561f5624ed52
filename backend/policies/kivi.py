"""KIVI (Liu et al., 2024, *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*, Sec. 3-4)."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, CompressionPolicy, Reform
from .registry import register

WHOLE_BITS = 16  # the model's own 16-bit cache: nothing is quantised


def quantise(x: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """Round ``x`` to ``bits`` bits and back, asymmetrically: each slice along ``axis`` keeps its own minimum and
    step (max - min) / (2^bits - 1) (KIVI's round-to-nearest, Eq. 1). A constant slice comes back as it was."""
    low, high = x.min(axis, keepdims=True), x.max(axis, keepdims=True)
    step = (high - low) / (2 ** bits - 1)
    safe = np.where(step > 0, step, 1.0)
    levels = np.clip(np.round((x - low) / safe), 0, 2 ** bits - 1)
    return np.where(step > 0, levels * safe + low, x)


def quantise_keys(keys: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Keys per channel: each channel of each run of ``group`` tokens shares a minimum and a step ([H, n, d], n a
    multiple of ``group``), as KIVI quantises keys (their outlier channels then cost one group, not every token)."""
    heads, n, dim = keys.shape
    grouped = keys.reshape(heads, n // group, group, dim)
    return quantise(grouped, bits, axis=2).reshape(heads, n, dim)


def quantise_values(values: np.ndarray, bits: int, group: int) -> np.ndarray:
    """Values per token: each run of ``group`` channels of a token shares a minimum and a step ([H, n, d])."""
    out = np.empty_like(values)
    for lo in range(0, values.shape[-1], group):
        out[..., lo:lo + group] = quantise(values[..., lo:lo + group], bits, axis=-1)
    return out


@register
@dataclass(frozen=True)
class KIVI(CompressionPolicy):
    """Hold every token, its key and value at ``bits`` bits once it is older than the ``residual`` latest: keys
    quantised per channel over runs of ``group`` tokens, values per token over runs of ``group`` channels
    (asymmetric round-to-nearest, Sec. 3-4). Nothing is evicted: a quantised token is held, and read in its
    rounded form.

    KIVI quantises the residual's tokens when it has filled (R of them) and starts it again, so between 0 and R
    tokens are whole; KV Lens quantises whole groups as they leave the ``residual`` latest, so ``residual`` to
    ``residual + group - 1`` are: each quantised token is rounded once, as in KIVI. ``bits`` 16 holds the model's own
    cache (nothing quantised). A compression ratio (the share of the cache's bits removed, minimum and step aside)
    stands for ``bits``: 16 x (1 - ratio), so 0.875 is KIVI's 2 bits and 0.75 its 4.

    bits: bits per quantised key and value entry (1-16; 16: none quantised).
    group: tokens per key group and channels per value group (KIVI's G).
    residual: the latest tokens held whole (KIVI's R).
    interval, every: when it quantises (see CompressionPolicy): every ``group`` tokens by default.
    """

    name = "kivi"
    summary = "hold every token, quantised to `bits` (keys per channel, values per token) once past the recent residual"
    paper = "Liu et al., 2024, *KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache*, Sec. 3-4"
    color = "#4B0092"
    reforms = "precision"
    uses_attention = False
    reads_every_key = True  # it holds every token: each query reads them all (limits.row_cost)
    budget: int | None = None
    bits: int = 2
    group: int = 32
    residual: int = 128
    interval: int = 32
    every: int = 32

    def __post_init__(self):
        super().__post_init__()
        if self.budget is not None:
            raise ValueError(f"{self.name}: holds every token (its budget is its bits), so it takes no budget")
        if not 1 <= self.bits <= WHOLE_BITS:
            raise ValueError(f"{self.name}: bits must be 1 to {WHOLE_BITS}, got {self.bits}")
        if self.group < 1 or self.residual < 0:
            raise ValueError(f"{self.name}: need group >= 1 and residual >= 0, got group={self.group}, "
                             f"residual={self.residual}")

    @classmethod
    def for_budget(cls, budget: int) -> "KIVI":
        """The app's budget slider sets the tokens held whole (the residual; KIVI's 128 at most), in groups of a
        quarter of it (KIVI's 32 at most)."""
        group = min(32, max(1, budget // 4))
        return cls(residual=min(128, budget), group=group, interval=group, every=group)

    @classmethod
    def for_ratio(cls, ratio: float, context: int) -> "KIVI":
        return cls(bits=min(WHOLE_BITS, max(1, round(WHOLE_BITS * (1.0 - ratio)))))

    def whole(self) -> "KIVI":
        return replace(self, bits=WHOLE_BITS)

    def schedule(self, mode: str | None = None) -> str:
        return f"quantises every {self.group} tokens past the latest {self.residual}"

    def rounded(self, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The held forms of whole groups of tokens' keys and values [H, n, d] (n a multiple of ``group``)."""
        return (quantise_keys(keys, self.bits, self.group),
                quantise_values(values, self.bits, min(self.group, values.shape[-1])))

    def init_state(self, n_heads: int):
        return {"quantised": np.zeros(1, np.int64)}  # positions 0..quantised-1 are held quantised

    def keep(self, view: CacheView) -> np.ndarray:
        return view.kept.copy()

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        done = int(view.state["quantised"][0])
        count = (view.t + 1 - self.residual - done) // self.group * self.group
        if self.bits >= WHOLE_BITS or count <= 0:
            return None
        end = done + count
        keys, values = np.array(view.keys), np.array(view.values)
        keys[:, done:end], values[:, done:end] = self.rounded(keys[:, done:end], values[:, done:end])
        positions = np.zeros(keep.shape, bool)
        positions[:, done:end] = True
        view.state["quantised"][0] = end
        return Reform(positions=positions & keep, keys=keys, values=values)
