"""CaM (Zhang et al., 2024, *CaM: Cache Merging for Memory-efficient LLMs Inference*, ICML, Sec. 3-4), on SnapKV's
choice of tokens or another scorer's."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, CompressionPolicy, Reform, grow, keep_top
from .registry import POLICIES, register
from .snapkv import SnapKV

SAMPLES = ("bernoulli", "expected")
MERGED = ("all", "arrived")
VOTES = ("window", "running")


def merge_shares(evicted: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """How much of each evicted token's value is merged: its attention over its targets' mean, clamped to 0..1 (CaM's
    merge probability; as kvpress, 0/0 gives 0 and x/0 gives 1)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.clip(evicted / mean, 0.0, 1.0)
    return np.where(mean == 0.0, (evicted != 0.0).astype(float), share)


@register
@dataclass(frozen=True)
class CaM(SnapKV):
    """A scorer's tokens (SnapKV's by default); each token it evicts gives its value to the ``merge`` held tokens that
    follow it, each 1/m of it, with a probability: its attention over those tokens' mean attention (clamped to 1), so
    a token the queries still read is merged rather than lost, and a forgotten one is not. The keys stay as they were.

    The attention (``votes``): the window's summed attention (SnapKV's votes before pooling), or, as kvpress's
    ``CAMPress`` and the paper's accumulated attention, the attention summed over every query decoded since the
    prompt (``running``; the prompt's own queries count nothing, so a compression at the prompt merges nothing). As
    the paper and kvpress a merge is drawn (``sample=bernoulli``; the draws are seeded by ``seed``, the layer, the
    step and the head, so runs repeat); ``sample=expected`` merges each value scaled by its probability instead.
    Every evicted token merges (``merged=all``; the paper evicts one token a step); kvpress merges, at each
    compression, as many of the evicted as tokens arrived since the last one that evicted, the best-scored first and
    of equal scores the later (``merged=arrived``). ``heads=layer`` evicts the same tokens from every KV head, by the
    heads' mean score (kvpress), ``head`` per head. ``prefill=false`` compresses while decoding only (kvpress).

    ``preset=kvpress`` is ``CAMPress`` with ``compression_interval=1`` (its doc's "original per-step CaM"; its
    default interval is 512, ``every=512``): heads=layer, merged=arrived, votes=running, prefill=false, every=1.
    ``cam:budget=B,scorer=knorm,window=0,preset=kvpress,sample=expected`` is ``CAMPress(KnormPress(),
    target_size=B, compression_interval=1)`` with its draws replaced by their expectation.

    budget, window, kernel, pooling, order: SnapKV's (tokens kept per KV head, observation window, pooling); with
    another scorer the window's latest tokens are still always kept, and its queries' attention is the votes.
    scorer: whose scores choose the tokens: snapkv (its own), or any registered compression policy at this budget
    (e.g. knorm). merge: held tokens after an evicted one that share its value (the paper's m; kvpress's
    merge_budget; 0 merges nothing). sample: bernoulli or expected. seed: the draws' seed. heads: head or layer.
    merged: all or arrived. votes: window or running. prefill: compress once the prompt is read (true) or not.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "cam"
    summary = "once the prompt is read, SnapKV's tokens; each evicted value merged into the held tokens after it"
    paper = "Zhang et al., 2024, *CaM: Cache Merging for Memory-efficient LLMs Inference*, ICML, Sec. 3-4"
    color = "#997700"
    reforms = "merge"
    uses_attention = True  # the merges weigh attention whatever the scorer reads
    presets = {"kvpress": {"heads": "layer", "merged": "arrived", "votes": "running", "prefill": False, "every": 1}}
    scorer: str = "snapkv"
    merge: int = 32
    sample: str = "bernoulli"
    seed: int = 0
    heads: str = "head"
    merged: str = "all"
    votes: str = "window"
    prefill: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.merge < 0 or self.sample not in SAMPLES:
            raise ValueError(f"{self.name}: need merge >= 0 and sample in {', '.join(SAMPLES)}, got merge={self.merge}, "
                             f"sample={self.sample!r}")
        for field, value, allowed in (("merged", self.merged, MERGED), ("votes", self.votes, VOTES)):
            if value not in allowed:
                raise ValueError(f"{self.name}: {field} must be one of {', '.join(allowed)}, got {value!r}")
        # A policy that scores tokens (SimLayerKV decides per layer), from the cache and the window's queries alone
        # (KVzip's extra pass would be a run of its own).
        scorers = [n for n, c in POLICIES.items() if c.kind == "compression" and not c.reforms and not c.rereads
                   and c.score is not CompressionPolicy.score and n != self.name]
        if self.scorer not in scorers:
            raise ValueError(f"{self.name}: scorer must be one of {', '.join(scorers)}, got {self.scorer!r}")
        if not self.prefill and self.every < 1:
            raise ValueError(f"{self.name}: prefill=false compresses while decoding only: give every >= 1 (kvpress's "
                             f"compression_interval)")

    @classmethod
    def for_budget(cls, budget: int) -> "CaM":
        base = SnapKV.for_budget(budget)
        return cls(budget=budget, window=base.window, merge=max(1, min(32, budget // 4)))

    def whole(self) -> "CaM":
        return replace(self, merge=0)

    @property
    def inner(self) -> CompressionPolicy | None:
        """The scorer when it is not SnapKV's own scores."""
        return None if self.scorer == "snapkv" else POLICIES[self.scorer].for_budget(self.budget)

    @property
    def window_queries(self) -> int:
        running = max(self.every, self.interval) if self.votes == "running" else 0
        return max(self.window, running, self.inner.window_queries if self.inner else 0)

    @property
    def window_by_query_head(self) -> bool:
        return self.inner.window_by_query_head if self.inner else super().window_by_query_head

    @property
    def reads_every_key(self) -> bool:  # what a row costs (limits.row_cost): the scorer's reading
        return self.inner is not None and self.inner.reads_every_key

    def compresses_after(self, t: int, n_prompt: int | None) -> bool:
        if not self.prefill and n_prompt is not None and t + 1 == n_prompt:
            return False
        return super().compresses_after(t, n_prompt)

    def score(self, view: CacheView) -> np.ndarray:
        scores = super().score(view) if self.inner is None else np.asarray(self.inner.score(view), np.float64)
        if self.heads == "layer":  # every head holds the same tokens: the heads' mean decides for all
            scores = np.broadcast_to(np.where(view.kept, scores, 0.0).mean(0), scores.shape)
        return scores

    def keep(self, view: CacheView) -> np.ndarray:
        keep = keep_top(self.score(view), view.kept, self.budget, self.recent)
        # What ``reform`` weighs merges by, noted once at each compression, merging or not: the running votes take
        # the rows of the queries decoded since the last compression; ``arrived`` counts the tokens read since the
        # last one that evicted.
        state = view.state
        if state.get("noted_at") == view.t:
            return keep
        start = -1 if view.n_prompt is None else view.n_prompt - 1
        if self.votes == "running":
            fresh = np.flatnonzero(view.query_positions > state.get("noted_at", start))
            running = grow(state.get("running", np.zeros((view.kept.shape[0], 0))), view.t + 1)
            state["running"] = running + view.attn_window[:, fresh].sum(1)
        state["arrived"] = view.t - state.get("last_eviction", start)
        if (view.kept & ~keep).any():
            state["last_eviction"] = view.t
        state["noted_at"] = view.t
        return keep

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        dropped = view.kept & ~keep
        if self.merge == 0 or not dropped.any():
            return None
        attention = view.attn_window.sum(1) if self.votes == "window" else view.state["running"]
        arrived = view.state["arrived"]
        score = self.score(view) if self.merged == "arrived" else None
        given = np.asarray(view.values)
        values = given.copy()
        into = np.full(keep.shape, -1, np.int64)
        weight = np.zeros(keep.shape)
        changed = np.zeros(keep.shape, bool)
        offsets = np.arange(self.merge)
        for h in range(keep.shape[0]):
            held, gone = np.flatnonzero(keep[h]), np.flatnonzero(dropped[h])
            if score is not None:  # the best-scored ``arrived`` of them, of equal scores the later
                best = np.lexsort((-gone, -score[h, gone]))[:arrived]
                gone = np.sort(gone[best])
            if not len(held) or not len(gone):
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
