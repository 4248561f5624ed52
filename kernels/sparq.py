"""SparQ Attention for single-query decode (Ribar et al., "SparQ Attention", arXiv:2312.04985).

Shapes (one new query per sequence, grouped-query attention):

- ``q``       [B, H_q, d]      the new query of every sequence
- ``K``, ``V`` [B, H_kv, S, d]  the cache; query head ``h`` reads KV head ``h // G``, ``G = H_q // H_kv``
- ``v_mean``  [B, H_kv, d]      running mean of ``V`` over the S cached positions (the paper's v-bar)

The three steps (paper Sec. 2 and App. D, GQA variant of App. B):

1. Per KV head, sum ``|q|`` over the group's query heads and keep the ``r`` largest components
   ``i1``. Every query head ``h`` of the group approximates its scores with those components,
   ``s_hat_h = softmax(q_h[i1] . K[:, i1] / tau_h)`` (Eq. D1), with the temperature of Eq. D2,
   ``tau_h = sqrt(d * ||q_h[i1]||_1 / ||q_h||_1)``. As in App. B, the component set is shared by
   the group while the L1 ratio of Eq. D2 is taken per query head over that shared set.
2. Sum ``s_hat`` over the group's query heads and pick ``k`` positions per KV head: the ``l`` most
   recent positions always (the local window of Table J1, counted inside ``k``), plus the
   ``k - l`` best other positions by summed approximate score. Exact attention (scale
   ``1/sqrt(d)``, Eq. D3) over the chosen positions gives ``y``.
3. ``alpha_h = sum of s_hat_h over the chosen positions`` (Eq. D5, so alpha is per query head, as
   in App. B), and ``out = alpha * y + (1 - alpha) * v_mean`` (Eq. D4).

Tie rules (identical in the torch reference and the Triton path):

- components: equal summed ``|q|`` -> the lower component index wins;
- positions: equal summed approximate score -> the earlier position wins.

With ``k >= S`` every position is chosen, ``alpha`` is set to exactly 1 (the mass of all positions is
1 by definition; this avoids a rounding residue) and the output is dense attention.

Transfer cost per KV head (App. C): ``sparq_transfer_bytes``.

This module is the torch side: the reference (``sparq_attention_reference``, the spec) and
``sparq_attention_block``, the CPU's form for a whole prompt block. The Triton kernels and the dispatch
between them and the reference are in ``kernels/sparq_triton.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SparQResult:
    """What one SparQ decode step computed.

    out:        [B, H_q, d] attention output, dtype of ``q``.
    positions:  [B, H_kv, min(k, S)] int64, ascending: cache positions read in step 2.
    alpha:      [B, H_q] float32 (float64 for float64 inputs): per *query head* approximate mass
                of the chosen positions (Eq. D5); exactly 1 when ``k >= S``.
    scores:     [B, H_q, S] approximate scores ``s_hat`` (Eq. D1), or None if not requested.
    components: [B, H_kv, min(r, d)] int64, ascending: the query components ``i1`` of step 1.
    tau:        [B, H_q] softmax temperature of Eq. D2 per query head.
    """

    out: torch.Tensor
    positions: torch.Tensor
    alpha: torch.Tensor
    scores: Optional[torch.Tensor]
    components: torch.Tensor
    tau: torch.Tensor


# ----------------------------------------------------------------------------- shared helpers


def _shapes(q, K, V, v_mean):
    if q.dim() != 3 or K.dim() != 4:
        raise ValueError("expected q [B, H_q, d] and K, V [B, H_kv, S, d]")
    B, H_q, d = q.shape
    Bk, H_kv, S, dk = K.shape
    if Bk != B or dk != d or V.shape != K.shape or v_mean.shape != (B, H_kv, d):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, K {tuple(K.shape)}, "
                         f"V {tuple(V.shape)}, v_mean {tuple(v_mean.shape)}")
    if H_q % H_kv:
        raise ValueError(f"H_q={H_q} is not a multiple of H_kv={H_kv}")
    if S < 1:
        raise ValueError("empty cache")
    return B, H_q, H_kv, H_q // H_kv, S, d


def _check_params(k, r, l):
    if k < 1 or r < 1 or l < 0:
        raise ValueError(f"need k >= 1, r >= 1, l >= 0 (got k={k}, r={r}, l={l})")


def _acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _query_components(q, H_kv, r):
    """Step 1, query side: components ``i1`` per KV head and temperatures ``tau`` (Eq. D2).

    Returns (i1 [B, H_kv, r'] ascending, q_hat [B, H_kv, G, r'], tau [B, H_kv, G]) with r' = min(r, d).
    The group's summed ``|q|`` ranks the components; a stable sort makes the lower index win ties.
    """
    B, H_q, d = q.shape
    G = H_q // H_kv
    r = min(r, d)
    qg = q.to(_acc_dtype(q.dtype)).reshape(B, H_kv, G, d)
    magnitude = qg.abs().sum(dim=2)  # GQA: sum |q| over the group (paper Sec. 2)
    i1 = torch.sort(magnitude, dim=-1, descending=True, stable=True).indices[..., :r]
    i1 = torch.sort(i1, dim=-1).values  # ascending: the set is what matters, keep it readable
    q_hat = qg.gather(-1, i1[:, :, None, :].expand(B, H_kv, G, r))
    kept = q_hat.abs().sum(-1)
    total = qg.abs().sum(-1)
    # Eq. D2. A head with no mass on i1 has all-zero approximate logits; tau=1 keeps them 0, not NaN.
    tau = torch.where(kept > 0, torch.sqrt(d * kept / total.clamp_min(torch.finfo(qg.dtype).tiny)),
                      torch.ones_like(kept))
    return i1, q_hat, tau


def _row_lengths(lengths, B, S, k_eff, device):
    """``lengths`` as a [B] int tensor on ``device``, checked: each row's cache must hold k_eff..S positions."""
    lengths = torch.as_tensor(lengths, device=device)
    if lengths.shape != (B,) or int(lengths.min()) < k_eff or int(lengths.max()) > S:
        raise ValueError(f"lengths must be [B] ints within {k_eff}..{S}, got {lengths.tolist()}")
    return lengths


def _budget(S, k, l):
    """(k_eff, l_eff, n_top): positions read, local-window size, positions picked by score."""
    k_eff = min(k, S)
    l_eff = min(l, k_eff)
    return k_eff, l_eff, k_eff - l_eff


# ----------------------------------------------------------------------------- torch reference


def sparq_attention_reference(q, K, V, v_mean, k, r, l, *, K_t=None, return_scores=True, lengths=None):
    """SparQ decode attention in plain torch (the spec the Triton kernels are tested against).

    Args:
        q: [B, H_q, d]; K, V: [B, H_kv, S, d]; v_mean: [B, H_kv, d] (running mean of V).
        k: positions read per KV head (local window included); r: query components kept;
        l: local window, the l most recent positions always read.
        K_t: optional [B, H_kv, d, S] second copy of K (App. I, "storing K twice"); only used by
            the Triton path, accepted here so both functions share one signature.
        return_scores: keep the [B, H_q, S] approximate scores in the result.
        lengths: optional [B] ints: row b's cache is its first lengths[b] positions,
            the rest of K and V is ignored, so one call serves queries at several positions of one
            text (a prompt's queries). Each length must be >= min(k, S). Scores of ignored positions
            are 0; every row then computes exactly what a call on its own truncated cache computes.

    Returns a :class:`SparQResult`. Computation is in float32 (float64 for float64 inputs).
    """
    _check_params(k, r, l)
    B, H_q, H_kv, G, S, d = _shapes(q, K, V, v_mean)
    acc = _acc_dtype(q.dtype)
    k_eff, l_eff, n_top = _budget(S, k, l)
    lengths = torch.full((B,), S, device=q.device) if lengths is None else \
        _row_lengths(lengths, B, S, k_eff, q.device)
    position = torch.arange(S, device=q.device)

    # Step 1: approximate scores from r components of q and the same r components of K (Eq. D1).
    i1, q_hat, tau = _query_components(q, H_kv, r)
    r_eff = i1.shape[-1]
    K_hat = K.gather(-1, i1[:, :, None, :].expand(B, H_kv, S, r_eff)).to(acc)  # [B, H_kv, S, r]
    logits = (q_hat @ K_hat.transpose(-1, -2)) / tau[..., None]  # [B, H_kv, G, S]
    exists = position[None, :] < lengths[:, None]  # [B, S]
    s_hat = torch.softmax(logits.masked_fill(~exists[:, None, None, :], float("-inf")), dim=-1)

    # Step 2: local window + top-(k - l) of the group-summed approximate scores.
    start = lengths - l_eff  # first position of each row's local window
    candidate = position[None, :] < start[:, None]  # before the window
    group_score = s_hat.sum(dim=2).masked_fill(~candidate[:, None, :], float("-inf"))  # [B, H_kv, S]
    # Stable descending sort: among equal scores the earlier position comes first.
    best = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[..., :n_top]
    window = (start[:, None] + torch.arange(l_eff, device=q.device)[None, :])[:, None, :].expand(B, H_kv, l_eff)
    positions = torch.sort(torch.cat([best, window], dim=-1), dim=-1).values  # [B, H_kv, k_eff]

    gather_rows = positions[..., None].expand(B, H_kv, k_eff, d)
    K_sel = K.gather(2, gather_rows).to(acc)
    V_sel = V.gather(2, gather_rows).to(acc)
    qg = q.to(acc).reshape(B, H_kv, G, d)
    weights = torch.softmax((qg @ K_sel.transpose(-1, -2)) / math.sqrt(d), dim=-1)  # Eq. D3
    y = weights @ V_sel  # [B, H_kv, G, d]

    # Step 3: mass of the chosen positions under s_hat (Eq. D5), mixed with the mean value (Eq. D4).
    # A row that reads its whole cache has alpha exactly 1 (no rounding residue).
    alpha = s_hat.gather(-1, positions[:, :, None, :].expand(B, H_kv, G, k_eff)).sum(-1)
    alpha = torch.where((lengths == k_eff)[:, None, None], torch.ones_like(alpha), alpha)
    a = alpha[..., None]
    out = a * y + (1 - a) * v_mean.to(acc)[:, :, None, :]

    return SparQResult(
        out=out.reshape(B, H_q, d).to(q.dtype),
        positions=positions,
        alpha=alpha.reshape(B, H_q),
        scores=s_hat.reshape(B, H_q, S) if return_scores else None,
        components=i1,
        tau=tau.reshape(B, H_q),
    )


@dataclass
class SparQBlock:
    """What SparQ computed for a block of consecutive queries over one cache (``sparq_attention_block``).

    out:     [n, H_q, d] attention output, dtype of ``q``.
    reads:   bool [H_kv, n, S]: the positions each query read (its whole cache while that fits in ``k``).
    alpha:   [n, H_q] approximate mass of what was read (Eq. D5); exactly 1 where the cache fits in ``k``.
    scores:  [H_kv, G, n, S] approximate scores ``s_hat`` (Eq. D1), 0 past each query's own position.
    weights: [H_kv, G, n, S] exact attention over what was read (Eq. D3), 0 elsewhere.
    exact:   [H_kv, G, n, S] exact attention over each query's whole cache (what dense attention reads).
    """

    out: torch.Tensor
    reads: torch.Tensor
    alpha: torch.Tensor
    scores: torch.Tensor
    weights: torch.Tensor
    exact: torch.Tensor


def _top_earliest(score: torch.Tensor, m: int) -> torch.Tensor:
    """bool mask of the m highest entries along the last axis, the earlier position winning ties (what a
    stable descending sort keeps), in O(S) per row after one top-k instead of a sort."""
    if m == 0:
        return torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    kth = torch.topk(score, m, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # unsorted: the same set, sooner
    above = score > kth
    tie = score == kth
    need = m - above.sum(-1, keepdim=True)
    return above | (tie & (tie.cumsum(-1) <= need))


def sparq_attention_block(q, K, V, first, k, r, l, scale=None, window=None, softcap=None):
    """SparQ for a block of consecutive queries over one cache (a prompt's queries), in plain torch.

    q: [H_q, n, d], the queries at positions first .. first + n - 1; K, V: [H_kv, S', d], S' >= first + n.
    Query t = first + i reads within positions 0..t, with v_mean the mean of V over them: what
    ``sparq_attention_reference`` computes for it on ``K[:, :t + 1]`` (its ``lengths`` form), for the whole
    block at once and without a copy of the cache per query. Step 1 keeps the r components as a 0/1 mask
    on q, so the approximate logits of every query are one matmul per KV head (the other components add
    exact zeros). Ties as in the reference: the lower component index, the earlier position.
    Computation in float32 (float64 for float64 inputs). ``scale``: the model's attention scale where it is
    not the paper's ``1/sqrt(d)`` (Gemma's ``query_pre_attn_scalar``, Granite's multiplier); the approximate
    logits' temperature scales with it. ``window``: a sliding-window layer's, whose queries read only their
    latest ``window`` positions (their cache, and the mean value over it); ``softcap``: the layer's logit
    soft-capping, applied to the exact logits. Returns a :class:`SparQBlock`.
    """
    _check_params(k, r, l)
    H_q, n, d = q.shape
    H_kv = K.shape[0]
    G, S = H_q // H_kv, first + n
    acc = _acc_dtype(q.dtype)
    K, V = K[:, :S].to(acc), V[:, :S].to(acc)
    position = torch.arange(S, device=q.device)
    length = torch.arange(first + 1, S + 1, device=q.device)  # [n]: each query's cache
    exists = position[None, :] < length[:, None]  # [n, S]
    if window is not None:
        exists = exists & (position[None, :] >= length[:, None] - window)
    qg = q.to(acc).reshape(H_kv, G, n, d)

    # Step 1 (Eq. D1, D2): components per query and KV head, as a mask on the query.
    i1, _, tau = _query_components(qg.permute(2, 0, 1, 3).reshape(n, H_q, d), H_kv, r)  # [n, H_kv, r], [n, H_kv, G]
    kept = torch.zeros(n, H_kv, d, dtype=acc, device=q.device).scatter_(-1, i1, 1.0)
    q_hat = qg * kept.permute(1, 0, 2)[:, None]  # [H_kv, G, n, d]
    logits = (q_hat @ K[:, None].transpose(-1, -2)) / tau.permute(1, 2, 0)[..., None]
    if scale is not None:
        logits = logits * (scale * math.sqrt(d))
    s_hat = torch.softmax(logits.masked_fill_(~exists, float("-inf")), dim=-1)  # [H_kv, G, n, S]

    # Step 2: the local window plus the best earlier positions by the group's summed s_hat; a query
    # whose cache fits in k reads all of it.
    local = min(l, k)
    start = length - local  # [n]: first position of each query's local window
    candidate = position[None, :] < start[:, None]
    cached = length
    if window is not None:  # only what the window holds is a candidate, and the cache is that long
        candidate, cached = candidate & exists, length.clamp(max=window)
    picked = _top_earliest(s_hat.sum(1).masked_fill(~candidate, float("-inf")), min(k - local, S))
    whole = cached <= k  # [n]
    reads = (picked & candidate) | ((position[None, :] >= start[:, None]) & exists) | (whole[:, None] & exists)

    # Step 3: exact attention over what was read (Eq. D3), mixed with the mean value by alpha (Eq. D4, D5).
    exact_logits = (qg @ K[:, None].transpose(-1, -2))  # [H_kv, G, n, S]
    exact_logits = exact_logits / math.sqrt(d) if scale is None else exact_logits * scale
    if softcap is not None:
        exact_logits = torch.tanh(exact_logits / softcap) * softcap
    weights = torch.softmax(exact_logits.masked_fill(~reads[:, None], float("-inf")), dim=-1)
    exact = torch.softmax(exact_logits.masked_fill_(~exists, float("-inf")), dim=-1)
    alpha = torch.where(whole, torch.ones((), dtype=acc, device=q.device), (s_hat * reads[:, None]).sum(-1))
    if window is None:
        v_mean = V.cumsum(1)[:, first:S] / length[None, :, None].to(acc)  # [H_kv, n, d]
    else:  # the mean over each query's window
        summed = torch.cat([torch.zeros_like(V[:, :1]), V.cumsum(1)], 1)  # [H_kv, S + 1, d]
        v_mean = (summed[:, length] - summed[:, length - cached]) / cached[None, :, None].to(acc)
    out = alpha[..., None] * (weights @ V[:, None]) + (1 - alpha[..., None]) * v_mean[:, None]
    return SparQBlock(out=out.permute(2, 0, 1, 3).reshape(n, H_q, d).to(q.dtype), reads=reads,
                      alpha=alpha.permute(2, 0, 1).reshape(n, H_q), scores=s_hat, weights=weights, exact=exact)


# ----------------------------------------------------------------------------- cost


def sparq_transfer_bytes(S, d, k, r, *, n_kv_heads=1, batch=1, bytes_per_element=2):
    """Attention memory transfer of one decode step, dense vs SparQ (App. C, Eqs. C1 and C2).

    Per KV head, in elements: dense ``2*S*d + 2*d`` (read K and V, write the new k and v);
    SparQ ``S*r + 2*k*d + 4*d`` (r components of K at every position, k full rows of K and V,
    write the new k and v and read/write v_mean). ``k`` and ``r`` are capped at ``S`` and ``d``.
    Query reads are not counted (as in the paper). Returns a dict of bytes and their ratio.
    """
    k, r = min(k, S), min(r, d)
    scale = n_kv_heads * batch * bytes_per_element
    dense = (2 * S * d + 2 * d) * scale
    sparq = (S * r + 2 * k * d + 4 * d) * scale
    return {"dense": dense, "sparq": sparq, "ratio": sparq / dense}
