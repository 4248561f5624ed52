"""R-KV (Cai et al., 2025, *R-KV: Redundancy-aware KV Cache Compression for Reasoning Models*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, WindowedCompression, latest
from .registry import register
from .snapkv import pool


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def redundancy(keys: np.ndarray, threshold: float, retain: int) -> np.ndarray:
    """[m]: the redundancy of each of a head's m cached keys [m, d], a softmax over them (R-KV's step 3).

    S = cosine similarities between the keys, zero on the diagonal. For each key i, its ``retain`` latest
    near-duplicates (S_ij > ``threshold``) are the copies that stay: S_ij is zeroed for them. A key's
    redundancy is then the mean of its column, so of a group of near-duplicates the latest scores lowest
    (it is every other member's retained copy) and the oldest highest.
    """
    unit = keys / (np.linalg.norm(keys, axis=-1, keepdims=True) + 1e-8)
    sim = unit @ unit.T
    np.fill_diagonal(sim, 0.0)
    m = len(keys)
    near = np.where(sim > threshold, np.arange(m), -1)  # column index of each near-duplicate, -1 elsewhere
    # Each row's latest near-duplicates (-1: fewer than retain), as a set: a partition finds them without sorting.
    keep_from = max(m - retain, 0)
    copies = np.partition(near, keep_from, axis=1)[:, keep_from:]
    rows = np.repeat(np.arange(m), copies.shape[1])
    cols = copies.ravel()
    sim[rows[cols >= 0], cols[cols >= 0]] = 0.0
    return softmax(sim.mean(0))


@register
@dataclass(frozen=True)
class RKV(WindowedCompression):
    """Each time the cache reaches budget + buffer, keep the ``budget`` most important, least redundant tokens.
    Score = lambda x importance - (1 - lambda) x redundancy; the ``window`` latest tokens (the observation
    window) are always kept.

    Importance (step 2): the attention the ``window`` latest queries pay to the cached tokens before the
    window, a softmax over those tokens, averaged over the window's queries and max-pooled over ``kernel``
    neighbouring cached tokens (SnapKV's pooling). Redundancy (step 3): see ``redundancy``; cosine
    similarity of the keys after RoPE, near-duplicates above ``threshold``, the ``retain`` latest of them
    (beta) kept, column means, softmax over the cache. When: a decode-time method; generated tokens fill a
    buffer of ``every`` tokens (B_buffer), then the cache is compressed back to ``budget`` (Sec. 3).

    Paper (README's table) and authors' code (github:Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py``,
    ``rkv/utils.py``): B_buffer 128, alpha (window) 8, lambda 0.1; the code's run script uses lambda 0.07
    (a parameter here). From the code, where the paper leaves it open: threshold 0.5, beta = 1 (the most
    recent copy), kernel 7 max-pooling, GQA pooling by the max over the group's query heads of q.k/sqrt(d)
    before the softmax, and a first compression once the prompt is read when it exceeds the budget.
    When (``compresses_after``), as the paper (Sec. 3.1): whenever the cache reaches budget + buffer, so it
    holds budget + 1 to budget + buffer tokens between compressions. Generate mode: once the prompt is read
    if it holds more than ``budget`` tokens, then each time ``every`` tokens have been added since; a
    shorter prompt first fills up to budget + ``every``. Prompt mode: after budget + k x ``interval``
    tokens, k >= 1. The code buffers by total length instead (compresses when the length is a multiple of
    128, doing nothing below the budget). Not followed: the code zeroes a key's similarity to token 0 when
    it has no near-duplicate (an argmax over an all-false row).

    budget: tokens kept per KV head at each compression, the window included (B_budget).
    window: the observation window (alpha): queries that score, and latest tokens kept.
    mix_lambda: the weight of importance against redundancy. threshold: cosine similarity above which two
    keys are near-duplicates. retain: near-duplicates kept as the recent copies (beta). kernel: pooling
    width (odd).
    every: the buffer (B_buffer): tokens added between compressions in generate mode, the cache then holding
    budget + every; 0: only the prompt is compressed. interval: the same in prompt mode (teacher-forced
    text, no prompt boundary): the first compression comes after budget + interval tokens.
    """

    name = "rkv"
    summary = ("when the decoding buffer fills, keep the tokens with the best lambda x attention - (1 - lambda) x "
               "key redundancy (cosine similarity) + the observation window")
    paper = "Cai et al., 2025, *R-KV: Redundancy-aware KV Cache Compression for Reasoning Models*, Sec. 3"
    color = "#EE8866"
    version = 2
    interval: int = 128
    every: int = 128
    mix_lambda: float = 0.1
    threshold: float = 0.5
    retain: int = 1
    kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ValueError(f"{self.name}: mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if not -1.0 <= self.threshold <= 1.0 or self.retain < 1:
            raise ValueError(f"{self.name}: need -1 <= threshold <= 1 and retain >= 1, got threshold="
                             f"{self.threshold}, retain={self.retain}")
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel must be an odd number >= 1, got {self.kernel}")

    def compresses_after(self, t: int, n_prompt: int | None) -> bool:
        """After query t, does the cache hold budget + buffer tokens (or, in generate mode, a prompt over the
        budget just read)? Until the first compression the cache holds every token so far."""
        if n_prompt is None:
            added, buffer = t + 1 - self.budget, self.interval
        elif t + 1 == n_prompt:
            return n_prompt > self.budget
        else:
            added, buffer = t + 1 - max(n_prompt, self.budget), self.every
        return buffer > 0 and added > 0 and added % buffer == 0

    def schedule(self, mode: str | None = None) -> str:
        reaches = f"when the cache reaches {self.budget} + "
        generate = (f"once after a prompt over {self.budget} tokens"
                    + (f", then {reaches}{self.every}" if self.every else ""))
        prompt = f"{reaches}{self.interval} tokens"
        return {"generate": generate, "prompt": prompt}.get(mode, f"{generate} (prompt mode: {prompt})")

    def score(self, view: CacheView) -> np.ndarray:
        """Per KV head, over its cached tokens: lambda x importance - (1 - lambda) x redundancy."""
        keys, queries = view.keys, view.queries  # [H, n, d], [H, G, w, d] (the window's queries)
        window = latest(view.kept, self.window)
        out = np.zeros(view.kept.shape)
        for h in range(len(out)):
            cached = np.flatnonzero(view.kept[h])
            prefix = cached[~window[h, cached]]  # cached tokens before the window
            importance = np.zeros(len(cached))
            if len(prefix) and queries.shape[2]:
                # GQA: the max over the group's query heads of q.k / sqrt(d), then a softmax over the prefix.
                logits = np.einsum("gwd,nd->gwn", queries[h], keys[h, prefix]).max(0) / np.sqrt(keys.shape[-1])
                importance[: len(prefix)] = pool(softmax(logits).mean(0), self.kernel, "max")
            redundant = redundancy(keys[h, cached], self.threshold, self.retain)
            out[h, cached] = self.mix_lambda * importance - (1 - self.mix_lambda) * redundant
        return out
