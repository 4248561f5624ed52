"""The eviction walk, compiled: one block of queries of one (layer, batch row), step by step, for the
eviction policies whose score is a running sum (``RunningScore`` in backend/policies/base.py: Window,
sinks, H2O, TOVA, A2SF).

At long texts the walk is the engine's cost: one decision per token, layer and row. Written in numpy
(``RowLayerState._walk_numpy`` in backend/engine/attention.py, which stays the reference and serves every other
eviction policy) each step is some thirty array calls over a few hundred columns; here it is one loop
that numba compiles, from the block's float64 exp(score) computed once in torch (vectorised), with the
block's attention output computed on the way (the float64 softmax, rounded to the model's dtype) instead
of a second masked softmax in torch.

What it computes is the numpy walk's, step for step (tests/test_eviction_walk.py compares them):

* query ``first + i`` reads the columns alive when it comes (those held at the block's start that are
  alive, then the block's tokens up to its own); its attention row is, per KV head, the mean over the
  group's query heads of their softmax over those columns, in float64;
* the running score is ``decay * score + attention`` over the columns (H2O: decay 1, A2SF: alpha, TOVA:
  0), or the token's position (Window and sinks);
* once a head holds ``budget`` tokens, each head (or the layer, from the score averaged over heads)
  drops its lowest-scored column among those that are not protected (the first ``sinks`` positions and
  the latest ``recent``); ties drop the earliest column, as ``argmin`` does.
"""
from __future__ import annotations

import numpy as np

try:
    import numba
except ImportError:  # the engine falls back to its numpy walk
    numba = None


def _walk(weights, alive, positions, state, first, held, budget, decay, by_position, sinks, recent, layer,
          probs, dropped_at, attn_rows):
    """weights float64 [H, G, n, C]: exp(score - row max) of the block, zero where a query cannot see a column
    (the engine's ``_block_weights``); alive bool [H, C] at the block's start (block columns False), updated
    in place; positions [H, C]; state float64 [H, C] running score, updated in place; probs [H, G, n, C] out
    (each query head's softmax over what it read); dropped_at int64 [H, C] in and out (the step after which
    a column left; n: still held, -1: gone before the block); attn_rows [H, n, C] out when it has n rows
    (recording), else empty."""
    n_heads, group, n, width = weights.shape
    record = attn_rows.shape[1] == n
    share = np.empty(group)
    victim = np.empty(n_heads, np.int64)
    combined = np.empty(width)
    for i in range(n):
        t, c = first + i, held + i + 1
        count_max = 0
        for h in range(n_heads):
            alive[h, c - 1] = True
            for g in range(group):
                total = 0.0
                for col in range(c):
                    if alive[h, col]:
                        total += weights[h, g, i, col]
                share[g] = 1.0 / (group * total)
                for col in range(c):
                    probs[h, g, i, col] = weights[h, g, i, col] / total if alive[h, col] else 0.0
                for col in range(c, width):
                    probs[h, g, i, col] = 0.0
            count = 0
            for col in range(c):
                a = 0.0
                if alive[h, col]:
                    count += 1
                    for g in range(group):
                        a += share[g] * weights[h, g, i, col]
                state[h, col] = decay * state[h, col] + a
                if record:
                    attn_rows[h, i, col] = a
            count_max = max(count_max, count)
        if c < budget or count_max < budget:
            continue
        if layer:
            for col in range(c):
                s = 0.0
                for h in range(n_heads):
                    s += positions[h, col] if by_position else state[h, col]
                combined[col] = s / n_heads
        for h in range(n_heads):
            if layer and h > 0:
                victim[h] = victim[0]
                continue
            best, where = np.inf, 0
            for col in range(c):
                p = positions[h, col]
                if not alive[h, col] or p < sinks or p >= t + 1 - recent:
                    s = np.inf
                elif layer:
                    s = combined[col]
                else:
                    s = np.float64(p) if by_position else state[h, col]
                if col == 0:
                    best = s
                elif s < best:
                    best, where = s, col
            victim[h] = where
        for h in range(n_heads):
            alive[h, victim[h]] = False
            dropped_at[h, victim[h]] = i


def _compiled():
    if numba is None:
        return None
    try:  # the compiled code is cached beside this file, or in the user's cache, when either is writable
        return numba.njit(cache=True, nogil=True)(_walk)
    except RuntimeError:  # nowhere to cache it: compile in each process (about a second)
        return numba.njit(nogil=True)(_walk)


walk = _compiled()
