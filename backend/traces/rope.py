"""How a recorded layer rotated its keys, as numbers a trace keeps (docs/trace-format.md).

RoPE turns pairs of key dimensions by an angle that grows with the position. Which dimensions pair up and how
fast each pair turns differs by model and by layer: transformers' ``rotate_half`` pairs dimension i with
i + d/2 (Llama), Cohere pairs neighbours, GLM turns only part of each head, Gemma 3's local layers have their
own base, a NoPE layer turns nothing. ``KeyRope`` describes any of them the same way, per dimension.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class KeyRope:
    """One layer's RoPE: at position p, key dimension i becomes
    ``scaling * (k[i] * cos(p * freq[i]) - k[partner[i]] * sin(p * freq[i]))``; a dimension that is its own
    partner keeps its value (the part a partial rotary leaves, every dimension of a NoPE layer).

    ``freq`` is signed: of a pair (i, j) turned by +theta, i < j, ``freq[i] = theta`` and ``freq[j] = -theta``."""

    freq: np.ndarray  # float [d]: angle per position, signed
    partner: np.ndarray  # int [d]: the dimension each turns with (itself where it does not turn)
    scaling: float = 1.0  # cos and sin are multiplied by this (YaRN-style attention scaling)

    @classmethod
    def halves(cls, inv_freq: np.ndarray, scaling: float = 1.0) -> "KeyRope":
        """transformers' ``rotate_half`` layout: dimension i < d/2 turns with i + d/2 by ``inv_freq[i]``."""
        inv_freq = np.asarray(inv_freq, np.float64)
        half = len(inv_freq)
        partner = np.concatenate([np.arange(half, 2 * half), np.arange(half)])
        return cls(freq=np.concatenate([inv_freq, -inv_freq]), partner=partner, scaling=float(scaling))

    def rotate(self, keys: np.ndarray, positions: np.ndarray | None = None, inverse: bool = False) -> np.ndarray:
        """Keys ``[..., S, d]`` at ``positions`` (default ``0..S-1``) turned as the layer turns them, or with
        ``inverse`` turned back (before RoPE)."""
        keys = np.asarray(keys, np.float64)
        pos = np.arange(keys.shape[-2]) if positions is None else np.asarray(positions)
        angle = pos[:, None].astype(np.float64) * np.asarray(self.freq, np.float64)[None, :]
        turns = np.asarray(self.partner) != np.arange(keys.shape[-1])
        sign, scale = (-1.0, 1.0 / self.scaling) if inverse else (1.0, self.scaling)
        turned = (keys * np.cos(angle) - sign * keys[..., self.partner] * np.sin(angle)) * scale
        return np.where(turns, turned, keys)
