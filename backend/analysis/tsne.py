"""2-D t-SNE maps of cached keys before and after RoPE (ReAttention Fig. 8-9); the figure is viz/tsne.py.

Keys of one layer and KV head ([S, d]: ``Trace.keys[r, head]``, stored before RoPE at up to 512
sampled positions, and the same keys rotated to their positions) are embedded with scikit-learn's
t-SNE with a fixed seed, each set on its own, so the two
maps can be compared side by side: after RoPE, keys tend to line up by position; before it, by
content.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from sklearn.manifold import TSNE
from threadpoolctl import threadpool_limits

DEFAULT_PERPLEXITY = 30.0
MIN_TSNE_POINTS = 5  # below this t-SNE is meaningless; a PCA projection is returned instead


def clip_perplexity(perplexity: float, n: int) -> float:
    """Perplexity usable for n points: at most (n - 1) / 3 (scikit-learn needs perplexity < n), at least 1."""
    return float(max(1.0, min(perplexity, (n - 1) / 3.0)))


def _pca_2d(x: np.ndarray) -> np.ndarray:
    """Deterministic 2-D projection for too few points (signs fixed so the result does not flip)."""
    centered = x - x.mean(axis=0, keepdims=True)
    out = np.zeros((len(x), 2))
    if len(x) < 2 or not np.any(centered):
        return out
    u, s, vt = np.linalg.svd(centered, full_matrices=False)
    k = min(2, len(s))
    proj = u[:, :k] * s[:k]
    signs = np.sign(proj[np.argmax(np.abs(proj), axis=0), np.arange(k)])
    out[:, :k] = proj * np.where(signs == 0, 1.0, signs)
    return out


def embed(x: np.ndarray, seed: int = 0, perplexity: float = DEFAULT_PERPLEXITY, max_iter: int = 500) -> np.ndarray:
    """t-SNE of the rows of x [N, d] -> float64 [N, 2].

    Deterministic: the same input and seed give the same map (``seed`` is scikit-learn's
    ``random_state``; with the PCA initialisation used here the map barely depends on it). Exact
    gradients up to 200 points, Barnes-Hut above (T = 1024 takes ~10-20 s on two CPU cores).
    """
    x = np.asarray(x, np.float64)
    if x.ndim != 2:
        raise ValueError(f"expected [N, d] keys, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("keys contain NaN or inf")
    n = len(x)
    if n < MIN_TSNE_POINTS or not np.ptp(x, axis=0).any():  # identical points: t-SNE's gradient is NaN
        return _pca_2d(x)
    tsne = TSNE(n_components=2, perplexity=clip_perplexity(perplexity, n), init="pca", learning_rate="auto",
                max_iter=max(250, int(max_iter)), random_state=seed, method="barnes_hut" if n > 200 else "exact")
    return tsne.fit_transform(x).astype(np.float64)


def embed_keys(keys_before: np.ndarray, keys_after: np.ndarray, seed: int = 0,
               perplexity: float = DEFAULT_PERPLEXITY, max_iter: int = 500) -> tuple[np.ndarray, np.ndarray]:
    """2-D coordinates of the same tokens' keys before and after RoPE: (coords_before, coords_after), each [T, 2].

    ``keys_before`` / ``keys_after``: [T, d] for one layer and KV head. Each set is embedded on its
    own with the same seed and a perplexity clipped to the number of tokens.
    """
    keys_before, keys_after = np.asarray(keys_before), np.asarray(keys_after)
    if keys_before.shape[0] != keys_after.shape[0]:
        raise ValueError(f"before/after keys must cover the same tokens, got {keys_before.shape} "
                         f"and {keys_after.shape}")
    # The two maps side by side, one OpenMP thread each: scikit-learn's threaded Barnes-Hut spins against
    # torch's threads on a small machine (512 keys: 20 s with its default threads on a busy 2-core
    # machine, 1.8 s with one).
    with threadpool_limits(1), ThreadPoolExecutor(2) as pool:
        before, after = (pool.submit(embed, keys, seed, perplexity, max_iter) for keys in (keys_before, keys_after))
        return before.result(), after.result()
