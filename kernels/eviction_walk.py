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
  0), or the token's position (Window and sinks); Keyformer adds, in place of the attention a, the softmax
  over the columns read of (log a + g) / tau, g its seeded Gumbel noise (``GumbelSoftmax``);
* once a head holds ``budget`` tokens, each head (or the layer, from the score averaged over heads)
  drops its lowest-scored column among those that are not protected (the first ``sinks`` positions and
  the latest ``recent``); ties drop the earliest column, as ``argmin`` does.
"""
from __future__ import annotations

import math

import numpy as np

try:
    import numba
except ImportError:  # the engine falls back to its numpy walk
    numba = None


_C1, _C2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S32, _S11 = (np.uint64(s) for s in (30, 27, 31, 32, 11))


def _splitmix64(x):
    """``splitmix64`` of backend/policies/base.py on one uint64 (which wraps around)."""
    x = (x ^ (x >> _S30)) * _C1
    x = (x ^ (x >> _S27)) * _C2
    return x ^ (x >> _S31)


def _walk(weights, alive, positions, state, first, held, budget, decay, by_position, sinks, recent, layer,
          probs, dropped_at, attn_rows, gumbel=False, seed=0, layer_index=0, tau_init=1.0, tau_end=1.0, steps=1):
    """weights float64 [H, G, n, C]: exp(score - row max) of the block, zero where a query cannot see a column
    (the engine's ``_block_weights``); alive bool [H, C] at the block's start (block columns False), updated
    in place; positions [H, C]; state float64 [H, C] running score, updated in place; probs [H, G, n, C] out
    (each query head's softmax over what it read); dropped_at int64 [H, C] in and out (the step after which
    a column left; n: still held, -1: gone before the block); attn_rows [H, n, C] out when it has n rows
    (recording), else empty. ``gumbel``: the score grows by Keyformer's Gumbel-softmax of the attention
    (seed, the layer's index and the temperature's schedule: ``GumbelSoftmax``) instead of the attention."""
    n_heads, group, n, width = weights.shape
    record = attn_rows.shape[1] == n
    share = np.empty(group)
    victim = np.empty(n_heads, np.int64)
    combined = np.empty(width)
    added = np.empty(width)  # what a head's step adds to each column's score
    layer_hash = _splitmix64(np.uint64(layer_index))
    for i in range(n):
        t, c = first + i, held + i + 1
        count_max = 0
        step_hash = _splitmix64(_splitmix64((np.uint64(seed) << _S32) | np.uint64(t)) ^ layer_hash)
        tau = tau_init + (tau_end - tau_init) * min(t, steps) / steps
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
                added[col] = a
                if record:
                    attn_rows[h, i, col] = a
            count_max = max(count_max, count)
            if gumbel:
                _gumbel_softmax(added, alive, positions, h, c, _splitmix64(step_hash ^ np.uint64(h)), tau)
            for col in range(c):
                state[h, col] = decay * state[h, col] + added[col]
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


def _gumbel_softmax(added, alive, positions, h, c, head_hash, tau):
    """Head h's attention row ``added`` [:c] -> softmax((log a + g) / tau) over the columns it read (a > 0), in
    place: Keyformer's ``step``, g its noise for the column's position (``keyformer.gumbel``)."""
    top = -np.inf
    for col in range(c):
        a = added[col]
        if alive[h, col] and a > 0:
            x = _splitmix64(np.uint64(positions[h, col]) ^ head_hash)
            u = np.float64(x >> _S11) * 2.0 ** -53 + 2.0 ** -54  # in (0, 1)
            z = (math.log(a) + -math.log(-math.log(u))) / tau
            added[col] = z
            top = max(top, z)
        else:
            added[col] = -np.inf
    total = 0.0
    for col in range(c):
        added[col] = math.exp(added[col] - top)
        total += added[col]
    for col in range(c):
        added[col] = added[col] / total


def _compiled(function):
    if numba is None:
        return None
    try:  # the compiled code is cached beside this file, or in the user's cache, when either is writable
        return numba.njit(cache=True, nogil=True)(function)
    except RuntimeError:  # nowhere to cache it: compile in each process (about a second)
        return numba.njit(nogil=True)(function)


if numba is not None:  # what the walk calls, compiled with it
    _splitmix64, _gumbel_softmax = _compiled(_splitmix64), _compiled(_gumbel_softmax)
walk = _compiled(_walk)
