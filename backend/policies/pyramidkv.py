"""PyramidKV (Cai et al., 2024, *PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling*, Sec. 3.3): a scorer's scores (SnapKV's, as the paper), with budgets that shrink with depth."""
from dataclasses import dataclass

import numpy as np

from .allocation import SharesBudget
from .base import CacheView
from .registry import register


def pyramid(mean: int, available: int, n_layers: int, beta: int) -> np.ndarray:
    """Tokens each layer keeps besides the window: an arithmetic sequence from the first layer down to the
    last, with mean ``mean`` (so the layers' total is n_layers x mean, rounded by largest remainder) and
    last layer ``mean / beta`` (Sec. 3.3); the first layer never exceeds what is ``available``."""
    if n_layers == 1:
        return np.array([mean])
    low = mean / beta
    high = 2 * mean - low
    if high > available:  # the first layer cannot keep more than there is: flatten the pyramid
        high, low = available, 2 * mean - available
    exact = high - np.arange(n_layers) * (high - low) / (n_layers - 1)
    floor = np.floor(exact).astype(int)
    short = n_layers * mean - int(floor.sum())
    floor[np.argsort(-(exact - floor), kind="stable")[:short]] += 1
    return floor


def kvpress_layer_budget(budget: int, length: int, window: int, n_layers: int, layer: int, beta: int) -> int:
    """kvpress's ``PyramidKVPress.get_layer_budget``: tokens layer ``layer`` keeps, its window included, on a
    cache of ``length`` tokens compressed to ``budget`` on average. The pyramid's mean is the budget, window
    included, and its ends are rounded per layer (Python's round); where the last layer would keep fewer
    than the window (``budget / beta < window``) every layer keeps ``budget``: plain SnapKV."""
    low = budget / beta
    high = 2 * budget - low
    if high >= length - window:
        high = length - window
        low = 2 * budget - high
    if n_layers == 1 or not length >= high >= low >= window:
        return budget
    return round(high - layer * (high - low) / (n_layers - 1))


@register
@dataclass(frozen=True)
class PyramidKV(SharesBudget):
    """A budget per layer: layer l keeps the scorer's window + a share that falls linearly with depth.

    The shares (``plan=factory``) are the paper's schedule as KVCache-Factory computes it: the last layer
    gets (budget - window) / beta, the first 2 (budget - window) minus that, capped by what is cached; the
    total over layers is budget x n_layers (KVCache-Factory floors the step and overshoots by up to ~5%;
    the largest-remainder rounding here hits the total exactly). A cache of at most ``budget`` tokens is
    kept whole. ``plan=kvpress`` is kvpress's ``PyramidKVPress`` (``kvpress_layer_budget``): the window
    inside the pyramid's mean, each layer rounded on its own, and plain SnapKV (``budget`` in every layer)
    whenever budget / beta < window. ``preset=kvpress`` takes that plan and kvpress's SnapKV pooling.

    budget: mean tokens kept per KV head and layer, the window included.
    beta: the first-to-last ratio parameter (20, the authors' default).
    scorer: whose scores (snapkv, as the paper; any registered compression policy). scorer_preset: the
        scorer's preset (kvpress). plan: factory or kvpress (how the layers' budgets are computed).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "pyramidkv"
    summary = "SnapKV's scores with per-layer budgets that shrink with depth (total = budget x layers)"
    paper = "Cai et al., 2024, *PyramidKV*, Sec. 3.3"
    color = "#117733"
    allocation = "pyramid across layers"
    presets = {"kvpress": {"plan": "kvpress", "scorer_preset": "kvpress"}}
    beta: int = 20
    plan: str = "factory"

    def __post_init__(self):
        super().__post_init__()
        if self.beta < 1 or self.plan not in ("factory", "kvpress"):
            raise ValueError(f"pyramidkv: need beta >= 1 and plan factory or kvpress, got beta={self.beta}, "
                             f"plan={self.plan!r}")

    def layer_budget(self, view: CacheView) -> int:
        if self.plan == "kvpress":
            return kvpress_layer_budget(self.budget, view.t + 1, self.recent, view.n_layers, view.layer, self.beta)
        # Every layer plans with the same length (the tokens read so far, KVCache-Factory's prompt length),
        # so the layers' shares add up even when, compressing again, each holds a different cache.
        available = view.t + 1 - self.recent
        mean = self.budget - self.recent
        if available <= mean:
            return self.budget
        return self.recent + int(pyramid(mean, available, view.n_layers, self.beta)[view.layer])
