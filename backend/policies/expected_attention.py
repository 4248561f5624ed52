"""Expected Attention (Devoto et al., 2025, *Expected Attention: KV Cache Compression by Estimating Attention
from Future Queries Distribution*; NVIDIA kvpress ``ExpectedAttentionPress``)."""
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from .base import CacheView, CompressionPolicy
from .registry import register


@lru_cache(maxsize=8)
def mean_rotation(rope, start: int, count: int, dim: int) -> np.ndarray:
    """[d, d]: the mean of RoPE's rotation matrices at positions start..start+count-1, read off the model's
    own ``rope`` applied to the basis vectors (one matrix per compression step, shared by the layers)."""
    basis = torch.eye(dim, dtype=torch.float64)[:, None, :].expand(dim, count, dim)  # [d, count, d]
    rotated = rope(basis, torch.arange(start, start + count))  # rotated[j, i] = R_i e_j
    return rotated.mean(1).numpy().T  # column j = mean_i R_i e_j


@register
@dataclass(frozen=True)
class ExpectedAttention(CompressionPolicy):
    """Keep the keys future queries are expected to attend to most, weighted by their value norms.

    Future queries are a Gaussian: per query head, the mean mu and covariance S (divided by N, as kvpress) of
    the ``window`` latest queries before RoPE (the view's queries rotated back by -position; queries at
    positions < ``sinks`` are left out, as kvpress leaves out the first hidden states). RoPE for the coming
    positions t+1..t+``n_future`` is their mean rotation R (Sec. 3; kvpress ``apply_avg_rope``), so mu' =
    R mu and S' = R S R^T. A key k then draws E[exp(q.k / sqrt(d))] = exp(mu'.k / sqrt(d) + k^T S' k / 2d),
    normalised by a softmax over the cached keys past the sinks; score = (that + ``epsilon``) x ||v||.
    GQA: each query head has its own statistics and softmax; a KV head scores with their mean (kvpress).
    The first ``sinks`` tokens are always kept (kvpress's n_sink). No recent window is protected (kvpress).

    Choices: kvpress takes the statistics of every prompt query at prefill and of its decoding buffer (256
    hidden states) later; KV Lens reads the ``window`` latest queries, 64 by default (one covariance
    sample per channel of a 64-wide head; a larger window costs memory at every compression). kvpress's
    decoding press starts the future at the buffer's length; here it starts at the true next position.
    ``epsilon`` 0.01 is the authors' benchmark setting (kvpress ``evaluate_registry``; the class default
    is 0); ``adakv:scorer=expected_attention`` is their leaderboard entry (AdaKV around these scores).

    budget: tokens kept per KV head at each compression, the sinks included.
    window: latest queries whose statistics model the future ones. n_future: coming positions averaged
    over in RoPE (kvpress's n_future_positions). sinks: first tokens always kept. epsilon: added to the
    expected attention before the value-norm weighting.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "expected_attention"
    summary = ("keep the keys with the highest expected attention of future queries (a Gaussian fitted to "
               "recent queries, RoPE averaged over the next positions) x value norm")
    paper = ("Devoto et al., 2025, *Expected Attention: KV Cache Compression by Estimating Attention from Future "
             "Queries Distribution* (kvpress)")
    color = "#88CCEE"
    window: int = 64
    n_future: int = 512
    sinks: int = 4
    epsilon: float = 0.01

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or self.n_future < 1:
            raise ValueError(f"{self.name}: need window >= 1 and n_future >= 1, got window={self.window}, "
                             f"n_future={self.n_future}")
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"{self.name}: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")
        if self.epsilon < 0:
            raise ValueError(f"{self.name}: epsilon must be >= 0, got {self.epsilon}")

    @classmethod
    def for_budget(cls, budget: int):
        return cls(budget=budget, sinks=min(4, budget - 1))

    @property
    def window_queries(self) -> int:
        return self.window

    def score(self, view: CacheView) -> np.ndarray:
        queries, positions = view.queries, view.query_positions  # [H, G, w, d] after RoPE, [w]
        if (positions >= self.sinks).any():
            queries, positions = queries[:, :, positions >= self.sinks], positions[positions >= self.sinks]
        n_heads, group, w, d = queries.shape
        pre = view.rope(torch.from_numpy(queries.reshape(n_heads * group, w, d)), torch.from_numpy(-positions))
        pre = pre.numpy().reshape(n_heads, group, w, d)  # before RoPE
        mu = pre.mean(2)  # [H, G, d]
        centred = pre - mu[:, :, None]
        cov = np.einsum("hgwi,hgwj->hgij", centred, centred) / w
        rot = mean_rotation(view.rope, view.t + 1, self.n_future, d)
        mu, cov = mu @ rot.T, rot @ cov @ rot.T
        keys, norms = view.keys, np.linalg.norm(view.values, axis=-1)  # [H, n, d], [H, n]
        score = np.full(view.kept.shape, np.inf)  # the sinks
        for h in range(n_heads):
            cached = np.flatnonzero(view.kept[h, self.sinks:]) + self.sinks
            if not len(cached):
                continue
            k = keys[h, cached]  # [m, d]
            logits = mu[h] @ k.T / np.sqrt(d) + np.einsum("gmi,mi->gm", k @ cov[h], k) / (2 * d)  # [G, m]
            expected = np.exp(logits - logits.max(-1, keepdims=True))
            expected = (expected / expected.sum(-1, keepdims=True)).mean(0)  # softmax per query head, then mean
            score[h, cached] = (expected + self.epsilon) * norms[h, cached]
        return score
