"""Random: the baseline of KV-cache leaderboards (kvpress's ``RandomPress``), as a seeded eviction policy."""
from dataclasses import dataclass

import numpy as np

from .base import UINT64_MASK, EvictionPolicy, splitmix64
from .registry import register

_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
LAYERS = ("shared", "each")  # every layer drops alike, or each layer draws its own


def uniform(seed: int, t: int, positions: np.ndarray, layer: int | None = None) -> np.ndarray:
    """A uniform number in [0, 1) for each (seed, step t, KV head h, position) of ``positions`` [H, m], and
    ``layer`` unless None: a counter-based hash, so a draw never depends on the order columns come in or on
    earlier draws. Only the positions' round runs on arrays: the seed's, the layer's, the step's and each head's
    are a few numbers, on Python ints (this runs once per token, layer and row)."""
    positions = np.asarray(positions, dtype=np.int64)
    gamma = int(_GAMMA)
    x = splitmix64((seed + gamma) & UINT64_MASK)
    for value in (t,) if layer is None else (layer, t):
        x = splitmix64(((x ^ value) + gamma) & UINT64_MASK)
    heads = np.array([splitmix64(((x ^ h) + gamma) & UINT64_MASK) for h in range(positions.shape[0])], np.uint64)
    x = splitmix64((heads[:, None] ^ positions.astype(np.uint64)) + _GAMMA)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


@register
@dataclass(frozen=True)
class Random(EvictionPolicy):
    """Once the cache is full, each KV head drops a uniformly random cached token at every step.

    No token is protected, as in kvpress's ``RandomPress`` (no sinks, no recent window; the current token
    may leave too). Each draw is a hash of (seed, step, KV head, position), not a random stream: the same
    seed gives the same trace, and the prompt path and token-by-token decoding draw alike. By default the
    layers share the draws, so a head index drops the same tokens in every layer: so does kvpress's
    ``RandomPress`` with a seed, which re-seeds its generator in every layer (without one its layers draw
    apart). ``layers="each"`` mixes the layer into the hash, so every layer draws its own.

    budget: tokens each query reads, its own included.
    seed: which random draws.
    layers: "shared" (every layer draws alike) or "each" (every layer draws its own).
    """

    name = "random"
    summary = "drop a uniformly random cached token each step once full (seeded, nothing protected)"
    paper = "the leaderboards' baseline (kvpress `RandomPress`)"
    color = "#888888"
    uses_attention = False
    seed: int = 0
    layers: str = "shared"

    def __post_init__(self):
        super().__post_init__()
        if self.seed < 0:
            raise ValueError(f"random: seed must be >= 0, got {self.seed}")
        if self.layers not in LAYERS:
            raise ValueError(f"random: layers must be one of {LAYERS}, got {self.layers!r}")

    def init_state(self, n_heads):
        return self.layer_state(n_heads, 0)

    def decides_alike_in_every_layer(self) -> bool:
        return self.layers == "shared"  # the draws ignore the layer, and it keeps no state

    def layer_state(self, n_heads, layer):
        return {"layer": np.array([layer])} if self.layers == "each" else {}

    def score(self, state, attn, t, positions):
        return uniform(self.seed, t, positions, int(state["layer"][0]) if self.layers == "each" else None)
