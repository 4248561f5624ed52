"""CaM (Zhang et al., 2024, *CaM: Cache Merging for Memory-efficient LLMs Inference*, ICML, Sec. 3-4), on SnapKV's
choice of tokens."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, Reform
from .registry import register
from .snapkv import SnapKV

SAMPLES = ("bernoulli", "expected")


def merge_share(evicted: float, targets: np.ndarray) -> float:
    """How much of an evicted token's value is merged: its attention over its targets' mean, clamped to 0..1 (CaM's
    merge probability; as kvpress, 0/0 gives 0 and x/0 gives 1)."""
    mean = float(targets.mean())
    if mean == 0.0:
        return 0.0 if evicted == 0.0 else 1.0
    return min(1.0, max(0.0, evicted / mean))


@register
@dataclass(frozen=True)
class CaM(SnapKV):
    """SnapKV's tokens; each token it evicts gives its value to the ``merge`` held tokens that follow it, each 1/m of
    it, with a probability: its attention over those tokens' mean attention (clamped to 1), so a token the window's
    queries still read is merged rather than lost, and a forgotten one is not. The keys stay as they were.

    Attention is the window's summed attention (SnapKV's votes before pooling). As the paper and kvpress a merge is
    drawn (``sample=bernoulli``; the draws are seeded by ``seed``, the layer, the step and the head, so runs repeat);
    ``sample=expected`` merges each value scaled by its probability instead. Every evicted token merges (the paper
    merges each token it evicts); kvpress's ``CAMPress`` merges, at each of its decoding compressions, as many of the
    evicted as tokens arrived since the last, the best-scored first, and evicts the same tokens from every head.

    budget, window, kernel, pooling, order: SnapKV's (tokens kept per KV head, observation window, pooling).
    merge: held tokens after an evicted one that share its value (the paper's m; kvpress's merge_budget; 0 merges
    nothing). sample: bernoulli or expected. seed: the draws' seed.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "cam"
    summary = "once the prompt is read, SnapKV's tokens; each evicted value merged into the held tokens after it"
    paper = "Zhang et al., 2024, *CaM: Cache Merging for Memory-efficient LLMs Inference*, ICML, Sec. 3-4"
    color = "#997700"
    reforms = "merge"
    merge: int = 32
    sample: str = "bernoulli"
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self.merge < 0 or self.sample not in SAMPLES:
            raise ValueError(f"{self.name}: need merge >= 0 and sample in {', '.join(SAMPLES)}, got merge={self.merge}, "
                             f"sample={self.sample!r}")

    @classmethod
    def for_budget(cls, budget: int) -> "CaM":
        base = SnapKV.for_budget(budget)
        return cls(budget=budget, window=base.window, merge=max(1, min(32, budget // 4)))

    def whole(self) -> "CaM":
        return replace(self, merge=0)

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        dropped = view.kept & ~keep
        if self.merge == 0 or not dropped.any():
            return None
        attention = view.attn_window.sum(1)  # [H, t+1]
        given = np.asarray(view.values)
        values = given.copy()
        into = np.full(keep.shape, -1, np.int64)
        weight = np.zeros(keep.shape)
        changed = np.zeros(keep.shape, bool)
        for h in range(keep.shape[0]):
            held = np.flatnonzero(keep[h])
            draws = np.random.default_rng([self.seed, view.layer, view.t, h])
            for i in np.flatnonzero(dropped[h]):
                start = np.searchsorted(held, i, side="right")
                targets = held[start:start + self.merge]
                if not len(targets):
                    continue
                share = merge_share(attention[h, i], attention[h, targets])
                if self.sample == "bernoulli":
                    share = float(draws.random() < share)
                if share == 0.0:
                    continue
                values[h, targets] += share * given[h, i] / len(targets)
                into[h, i], weight[h, i] = targets[0], share / len(targets)
                changed[h, targets] = True
        return Reform(positions=changed, values=values, merged_into=into, merge_weight=weight)
