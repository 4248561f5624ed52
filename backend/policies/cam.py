"""CaM (Zhang et al., 2024, *CaM: Cache Merging for Memory-efficient LLMs Inference*, ICML, Sec. 3-4), on SnapKV's
choice of tokens."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, Reform
from .registry import register
from .snapkv import SnapKV

SAMPLES = ("bernoulli", "expected")


def merge_shares(evicted: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """How much of each evicted token's value is merged: its attention over its targets' mean, clamped to 0..1 (CaM's
    merge probability; as kvpress, 0/0 gives 0 and x/0 gives 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(evicted / mean, 0.0, 1.0)
    return np.where(mean == 0.0, (evicted != 0.0).astype(float), share)


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
        offsets = np.arange(self.merge)
        for h in range(keep.shape[0]):
            held, gone = np.flatnonzero(keep[h]), np.flatnonzero(dropped[h])
            if not len(held):
                continue
            # Each evicted token's targets: the ``merge`` held tokens after it ([gone, merge], ``valid`` where one is).
            slots = np.searchsorted(held, gone, side="right")[:, None] + offsets
            valid = slots < len(held)
            targets = held[np.minimum(slots, len(held) - 1)]
            count = valid.sum(1)
            mean = np.where(count > 0, (attention[h, targets] * valid).sum(1) / np.maximum(count, 1), 0.0)
            share = merge_shares(attention[h, gone], mean)
            if self.sample == "bernoulli":
                draws = np.random.default_rng([self.seed, view.layer, view.t, h]).random(len(gone))
                share = (draws < share).astype(float)
            share = np.where(count > 0, share, 0.0)
            part = (share / np.maximum(count, 1))[:, None] * valid  # [gone, merge]: each target's share
            np.add.at(values[h], targets[valid], (part[..., None] * given[h, gone][:, None, :])[valid])
            merged = share > 0
            into[h, gone[merged]], weight[h, gone[merged]] = targets[merged, 0], part[merged, 0]
            changed[h, targets[valid & (part > 0)]] = True
        return Reform(positions=changed, values=values, merged_into=into, merge_weight=weight)
