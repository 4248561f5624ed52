"""ThinK (Xu et al., 2024, *ThinK: Thinner Key Cache by Query-Driven Pruning*, Sec. 3.2), on SnapKV's kept tokens."""
from dataclasses import dataclass, replace

import numpy as np

from .base import CacheView, Reform, latest
from .registry import register
from .snapkv import SnapKV


def channel_scores(queries: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """[H, d]: how much each key channel adds to the window's attention logits. ThinK scores channel j of a head by
    |Q[:, j] K[:, j]^T|_F = |Q[:, j]| |K[:, j]| (Eq. 4); as kvpress, the squares' means over the window's queries
    (averaged over the KV head's query heads) times over the held keys, which ranks a head's channels alike.
    queries [H, G, w, d]; keys [H, n, d], the held ones."""
    return (queries ** 2).mean(2).mean(1) * (keys ** 2).mean(1)


@register
@dataclass(frozen=True)
class ThinK(SnapKV):
    """SnapKV's choice of tokens, then the ``channels`` share of each KV head's key channels pruned: those whose
    product with the observation window's queries is smallest (Eq. 4), so queries read the held keys through the
    other channels only (a pruned channel is zero). The values are whole.

    As the paper's experiments, ThinK prunes what SnapKV keeps, once the prompt is read; its authors' code keeps the
    ``window`` latest keys whole (``whole_window``), kvpress's ``ThinKPress`` prunes every key. Tokens that arrive
    after a compression are held whole until the next one. ``preset=kvpress`` takes kvpress's settings (SnapKV's,
    and every key pruned); kvpress's ThinK scores channels over its own 32 queries, KV Lens over SnapKV's window.

    budget, window, kernel, pooling, order: SnapKV's (tokens kept per KV head, observation window, pooling).
    channels: share of each head's key channels pruned (the paper's lambda; 0 prunes none).
    whole_window: keep the window's latest keys whole (the authors' code), or prune them too (kvpress).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "think"
    summary = ("once the prompt is read, SnapKV's tokens with a share of each head's key channels pruned: those the "
               "window's queries read least")
    paper = "Xu et al., 2024, *ThinK: Thinner Key Cache by Query-Driven Pruning*, Sec. 3.2"
    color = "#225555"
    reforms = "channels"
    presets = {"kvpress": {**SnapKV.presets["kvpress"], "whole_window": False}}
    channels: float = 0.5
    whole_window: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.channels < 1.0:
            raise ValueError(f"{self.name}: channels must be at least 0 and below 1 (the share pruned), "
                             f"got {self.channels}")

    def whole(self) -> "ThinK":
        return replace(self, channels=0.0)

    def pruned(self, head_dim: int) -> int:
        """Key channels pruned per head (kvpress's int(d x ratio))."""
        return int(head_dim * self.channels)

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        keys = np.asarray(view.keys)
        head_dim = keys.shape[-1]
        if self.pruned(head_dim) == 0 or not keep.any():
            return None
        kept_channels = np.ones((keep.shape[0], head_dim), bool)
        error = np.zeros(keep.shape[0])
        queries = np.asarray(view.queries)
        positions = keep.copy()
        if self.whole_window:
            positions &= ~latest(keep, self.window)
        for h in range(keep.shape[0]):
            score = channel_scores(queries[h:h + 1], keys[h:h + 1, keep[h]])[0]
            # The lowest scores go; ties prune the earlier channel (a stable order).
            kept_channels[h, np.argsort(score, kind="stable")[: self.pruned(head_dim)]] = False
            error[h] = logit_error(queries[h], keys[h, positions[h]], kept_channels[h])
        return Reform(positions=positions, keys=keys * kept_channels[:, None, :], channels=kept_channels,
                      channel_error=error)


def logit_error(queries: np.ndarray, keys: np.ndarray, kept: np.ndarray) -> float:
    """What pruning cost the logits it was chosen for: |Q K^T - Q K'^T|_F / |Q K^T|_F over the window's queries
    [G, w, d] and the pruned keys [n, d] (ThinK's objective, Eq. 3); 0 when nothing is pruned."""
    whole = queries @ keys.T
    norm = np.linalg.norm(whole)
    return float(np.linalg.norm(queries @ (keys * ~kept).T) / norm) if norm > 0 else 0.0

