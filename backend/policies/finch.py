"""FINCH (Corallo & Papotti, 2024, *FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models*,
TACL, Sec. 3)."""
from dataclasses import dataclass, replace

import numpy as np
import torch

from .base import CacheView, Reform, WindowedCompression, keep_top, latest
from .registry import register


@register
@dataclass(frozen=True)
class FINCH(WindowedCompression):
    """Keep the tokens the question's queries attend to, each query's attention weighed by how many keys it sees,
    and re-rotate the kept keys to consecutive positions.

    FINCH reads the prompt as context + question and scores the context by the question's attention (Sec. 3): here
    the question is the ``window`` latest prompt tokens (KV Lens has no delimiter token; a task's question is its
    last tokens). Each window query's attention row is multiplied by its position (the keys it can see, kvpress's
    ``normalize_scores``), then averaged over the window and the KV head's query heads; the window is kept. With
    ``chunk`` > 0 the cache is cut into chunks of that many tokens, each keeping its share of the budget (FINCH's
    chunked prefill, as kvpress's ``chunk_length``). ``rerotate`` turns the kept keys to positions 0, 1, 2... as if
    the evicted were never there (kvpress's ``rerotate_keys``, its default): a held form, drawn in Held forms.

    budget: tokens kept per KV head at each compression. window: the question's tokens (queries that vote, kept).
    chunk: tokens per chunk with its own share of the budget (0: the cache at once). rerotate: re-rotate kept keys.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "finch"
    summary = "once the prompt is read, keep the tokens the question attends to (scaled by keys seen); re-rotate them"
    paper = ("Corallo & Papotti, 2024, *FINCH: Prompt-guided Key-Value Cache Compression for Large Language Models*, "
             "TACL, Sec. 3")
    color = "#1B7837"
    reforms = "rotation"
    window: int = 16
    chunk: int = 0
    rerotate: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.chunk < 0:
            raise ValueError(f"{self.name}: chunk must be >= 0, got {self.chunk}")

    @classmethod
    def for_budget(cls, budget: int) -> "FINCH":
        return cls(budget=budget, window=min(16, budget // 2))

    def whole(self) -> "FINCH":
        return replace(self, rerotate=False)

    def score(self, view: CacheView) -> np.ndarray:
        rows = view.attn_window * view.query_positions[None, :, None]  # [H, w, t+1], each row by the keys it sees
        return rows.mean(1)

    def keep(self, view: CacheView) -> np.ndarray:
        score = self.score(view)
        if not self.chunk:
            return keep_top(score, view.kept, self.budget, self.recent)
        out = latest(view.kept, self.recent)
        held = view.kept & ~out
        share = max(0, self.budget - self.recent) / max(1, int(held.sum(1).max()))
        for lo in range(0, held.shape[1], self.chunk):
            part = held[:, lo:lo + self.chunk]
            quota = int(part.sum(1).max() * share)
            out[:, lo:lo + self.chunk] |= keep_top(score[:, lo:lo + self.chunk], part, quota, 0)
        return out

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        """The kept keys turned from the positions they are rotated to to their ranks (RoPE composes: R(rank) =
        R(rank - p) R(p)); the state remembers where each key stands, for the next compression."""
        if not self.rerotate or view.rope is None:
            return None
        standing = view.state.setdefault("rotated_to", np.zeros((len(keep), 0), np.int64))
        if standing.shape[1] < keep.shape[1]:  # tokens that arrived since stand at their own positions
            grown = np.broadcast_to(np.arange(standing.shape[1], keep.shape[1]), (len(keep), keep.shape[1] -
                                                                                   standing.shape[1]))
            standing = view.state["rotated_to"] = np.concatenate([standing, grown], 1)
        keys = np.array(view.keys)
        moved = np.zeros(keep.shape, bool)
        for h in range(len(keep)):
            positions = np.flatnonzero(keep[h])
            shift = np.arange(len(positions)) - standing[h, positions]
            if not shift.any():
                continue
            turned = view.rope(torch.from_numpy(keys[h:h + 1, positions]), torch.from_numpy(shift))
            keys[h, positions] = turned[0].numpy()
            standing[h, positions] += shift
            moved[h, positions] = shift != 0
        return Reform(positions=moved, keys=keys) if moved.any() else None
