"""ReAttention's position-agnostic cache selection for single-query decode
(Liu et al., "ReAttention: Training-Free Infinite Context with Finite Attention Scope").

The cache is split into ``[global | middle | local]`` (Eq. 1): the first ``global_size`` positions
and the last ``local_size`` positions are always kept; from the middle segment
``global_size .. S - local_size - 1`` a few spans are selected with scores ``q . k`` computed on
queries and keys **without** RoPE (Eq. 2, Sec. 4.2). The kept cache ``[global, selected, local]`` is
then re-numbered 0..L-1 and RoPE is applied with those new positions (Eq. 3); the engine does that,
``rerotate_positions`` / ``reattention_layout`` state the numbering.

Selection, as implemented here for one query vector per sequence and GQA (query head ``h`` reads KV
head ``h // G``), per (batch row, KV head):

1. Nominate: every query head ``h`` of the group scores every middle position, ``q_h . k_j``
   accumulated in float64, and nominates its ``per_head_k`` best positions (the paper's per-head
   top-k; default ``per_head_k = topk``).
2. Vote (Sec. 2.1, "votes based on the top-k selections from different heads"): a position's vote
   count is the number of the group's heads that nominated it. The ``topk`` centres (the paper's
   k') are the nominated positions ranked by (votes desc, highest score it got from a nominating
   head desc, position asc). With G = 1 this is simply the head's top-``topk``.
3. Widen: each centre ``c`` becomes the span ``c - span//2 .. c - span//2 + span - 1`` (``span``
   positions including ``c``), clipped to the middle segment; overlapping spans are merged
   ("deduplicated"), and the union is returned in ascending order.

Tie rule (reference and Triton alike): scores accumulate in float64 and among equal scores the
earlier position wins, both for a head's nominations and for the final ranking.

The Triton kernel (Sec. 3.4) scores the middle segment block by block and keeps only each block's
best ``per_head_k`` candidates per query head, so global memory holds O(S / block * per_head_k)
candidates instead of the [H_q, S] score matrix; a merge of those candidates gives each head's
top-k, exactly as the reference computes it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

_BIG = torch.iinfo(torch.int64).max  # sentinel position, sorts after every real one


@dataclass
class ReAttentionSelection:
    """Selected middle positions for one decode step.

    positions:      [B, H_kv, L_max] int64, ascending per row, padded with -1.
    counts:         [B, H_kv] int64, number of valid entries of each row of ``positions``.
    centres:        [B, H_kv, topk] int64 voted positions before widening, best first, -1 padded.
    votes:          [B, H_kv, topk] int64 number of heads that nominated each centre (0 = pad).
    head_positions: [B, H_q, per_head_k'] int64 each query head's nominations, best first.
    head_scores:    [B, H_q, per_head_k'] float64 their scores ``q . k`` (no RoPE).
    ``per_head_k' = min(per_head_k, middle length)``.
    """

    positions: torch.Tensor
    counts: torch.Tensor
    centres: torch.Tensor
    votes: torch.Tensor
    head_positions: torch.Tensor
    head_scores: torch.Tensor

    def row(self, b: int, h: int) -> torch.Tensor:
        """Selected positions of batch row ``b``, KV head ``h`` (ascending)."""
        return self.positions[b, h, : int(self.counts[b, h])]


def _segment(S, global_size, local_size):
    """Middle segment [lo, hi): after the global prefix, before the local suffix."""
    if global_size < 0 or local_size < 0:
        raise ValueError("global_size and local_size must be >= 0")
    lo = min(global_size, S)
    hi = max(S - local_size, lo)
    return lo, hi


def _check(q, K, span, topk, per_head_k, global_size, local_size):
    """Checked shapes and the middle segment: (B, H_q, d, H_kv, G, lo, hi, nominations per query head)."""
    if q.dim() != 3 or K.dim() != 4 or q.shape[0] != K.shape[0] or q.shape[2] != K.shape[3]:
        raise ValueError(f"expected q [B, H_q, d], K [B, H_kv, S, d]; got {tuple(q.shape)}, {tuple(K.shape)}")
    if q.shape[1] % K.shape[1]:
        raise ValueError("H_q must be a multiple of H_kv")
    if span < 1 or topk < 1 or (per_head_k is not None and per_head_k < 1):
        raise ValueError("span, topk and per_head_k must be >= 1")
    B, H_q, d = q.shape
    H_kv, S = K.shape[1], K.shape[2]
    lo, hi = _segment(S, global_size, local_size)
    return B, H_q, d, H_kv, H_q // H_kv, lo, hi, min(per_head_k if per_head_k is not None else topk, hi - lo)


# ----------------------------------------------------------------------------- reference


def _ranked_top(scores, k):
    """Each row's k best entries, ranked by score descending and, among equal scores, earlier
    position first: the first k of a stable descending sort, without sorting whole rows.
    Returns (values, indices), both [..., k]."""
    if k == 0:
        return scores[..., :0], torch.zeros(scores.shape[:-1] + (0,), dtype=torch.int64, device=scores.device)
    n = scores.shape[-1]
    kth = torch.topk(scores, k, dim=-1).values[..., -1:]
    above = scores > kth
    equal = scores == kth
    picked = above | (equal & (equal.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    position = torch.arange(n, device=scores.device)
    indices = torch.sort(torch.topk(torch.where(picked, n - position, 0), k, dim=-1).indices, dim=-1).values
    values = scores.gather(-1, indices)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices  # ties keep position order
    return values.gather(-1, order), indices.gather(-1, order)


def reattention_select_reference(q_norope, K_norope, global_size, local_size, span, topk,
                                 per_head_k=None):
    """ReAttention selection in plain torch + Python (the spec for the Triton path).

    Args:
        q_norope: [B, H_q, d] queries without RoPE; K_norope: [B, H_kv, S, d] keys without RoPE.
        global_size, local_size: lengths of the always-kept prefix and suffix.
        span: positions kept around each centre (the paper's m). topk: centres kept per KV head
            after voting (the paper's k'). per_head_k: nominations per query head (default topk).
    Returns a :class:`ReAttentionSelection`.
    """
    B, H_q, d, H_kv, G, lo, hi, kh = _check(q_norope, K_norope, span, topk, per_head_k, global_size, local_size)

    # Eq. 2 without positions: every head's scores over the middle segment, in float64.
    qg = q_norope.double().reshape(B, H_kv, G, d)
    scores = qg @ K_norope[:, :, lo:hi].double().transpose(-1, -2)  # [B, H_kv, G, hi - lo]
    values, indices = _ranked_top(scores, kh)
    head_pos = (indices + lo).reshape(B, H_q, kh)
    head_sc = values.reshape(B, H_q, kh)

    rows, centre_rows, vote_rows = [], [], []
    for b in range(B):
        for h in range(H_kv):
            votes, best = {}, {}
            for g in range(G):
                for p, s in zip(head_pos[b, h * G + g].tolist(), head_sc[b, h * G + g].tolist()):
                    votes[p] = votes.get(p, 0) + 1
                    best[p] = max(best.get(p, float("-inf")), s)
            centres = sorted(votes, key=lambda p: (-votes[p], -best[p], p))[:topk]
            kept = set()
            for c in centres:
                start = c - span // 2
                kept.update(range(max(start, lo), min(start + span, hi)))
            rows.append(sorted(kept))
            centre_rows.append(centres)
            vote_rows.append([votes[c] for c in centres])

    def pad(lists, width, fill):
        t = torch.full((B * H_kv, width), fill, dtype=torch.int64)
        for i, xs in enumerate(lists):
            t[i, : len(xs)] = torch.tensor(xs, dtype=torch.int64)
        return t.reshape(B, H_kv, width).to(q_norope.device)

    counts = torch.tensor([len(x) for x in rows], dtype=torch.int64).reshape(B, H_kv)
    return ReAttentionSelection(
        positions=pad(rows, max([len(x) for x in rows] + [0]), -1),
        counts=counts.to(q_norope.device),
        centres=pad(centre_rows, topk, -1),
        votes=pad(vote_rows, topk, 0),
        head_positions=head_pos,
        head_scores=head_sc,
    )


# ----------------------------------------------------------------------------- Triton

if HAS_TRITON:

    @triton.jit
    def _reatt_block_topk_kernel(
        q_ptr, stride_qb, stride_qh, stride_qd,
        k_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
        val_ptr, pos_ptr,  # [B*H_q, NB, KK] float64 / int32 candidates
        H_kv, LO, HI, D, NB,
        G: tl.constexpr, KK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DC: tl.constexpr,
    ):
        """Fused scoring + per-block top-KK for one KV head and one block of middle positions.

        Every query head of the group scores the block (float64, head dim in chunks of BLOCK_DC
        so a large block fits in registers; the block's K stays in L1/L2 between heads), then
        writes its KK best positions of the block in rank order (ties: smaller position first).
        Only these candidates reach global memory, never an [H, S] score matrix.
        """
        pid = tl.program_id(0)
        blk = tl.program_id(1)
        b = (pid // H_kv).to(tl.int64)
        h = pid % H_kv
        offs_s = LO + blk * BLOCK_S + tl.arange(0, BLOCK_S)
        s_ok = offs_s < HI
        offs_c = tl.arange(0, BLOCK_DC)
        k_rows = k_ptr + b * stride_kb + h * stride_kh + offs_s[:, None].to(tl.int64) * stride_ks
        for g in tl.static_range(G):
            q_row = q_ptr + b * stride_qb + (h * G + g) * stride_qh
            sc = tl.zeros([BLOCK_S], tl.float64)
            for d0 in range(0, D, BLOCK_DC):
                d_ok = (d0 + offs_c) < D
                kt = tl.load(k_rows + (d0 + offs_c)[None, :] * stride_kd,
                             mask=s_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float64)
                qv = tl.load(q_row + (d0 + offs_c) * stride_qd, mask=d_ok, other=0.0).to(tl.float64)
                sc += tl.sum(kt * qv[None, :], axis=1)  # q . k in float64 (no RoPE)
            alive = s_ok
            base = ((b * H_kv + h) * G + g) * NB * KK + blk * KK
            for i in range(KK):
                cur = tl.where(alive, sc, float("-inf"))
                m = tl.max(cur, axis=0)
                p = tl.min(tl.where(alive & (cur == m), offs_s, 2147483647), axis=0)
                found = p < 2147483647
                tl.store(val_ptr + base + i, tl.where(found, m, float("-inf")))
                tl.store(pos_ptr + base + i, tl.where(found, p, -1))
                alive = alive & (offs_s != p)


def _vote_and_widen(head_pos, head_sc, H_kv, topk, span, lo, hi):
    """Vectorised steps 2-3 (vote, widen, merge) on the small nomination lists.

    head_pos / head_sc: [B, H_q, kh] nominations best first (-1 / -inf padding). Same rules as the
    reference's Python loop: rank by (votes desc, best score desc, position asc).
    """
    B, H_q, kh = head_pos.shape
    G = H_q // H_kv
    N, M = B * H_kv, G * kh
    dev = head_pos.device
    pos = head_pos.reshape(N, M)
    sc = head_sc.reshape(N, M)
    valid = pos >= 0
    pos_key = torch.where(valid, pos, torch.full_like(pos, _BIG))
    order = torch.sort(pos_key, dim=1, stable=True).indices  # equal positions become runs
    ps, ss, vs = pos_key.gather(1, order), sc.gather(1, order), valid.gather(1, order)
    first = torch.ones_like(vs)
    first[:, 1:] = ps[:, 1:] != ps[:, :-1]
    run = torch.cumsum(first.long(), dim=1) - 1  # run index within the row
    votes = torch.zeros(N, M, dtype=torch.int64, device=dev).scatter_add_(1, run, vs.long())
    best = torch.full((N, M), float("-inf"), dtype=torch.float64, device=dev)
    best = best.scatter_reduce(1, run, ss.double(), reduce="amax")
    rpos = torch.full((N, M), _BIG, dtype=torch.int64, device=dev).scatter(1, run, ps)
    # Runs are in ascending position; stable sorts from the least to the most significant key.
    o = torch.sort(best, dim=1, descending=True, stable=True).indices
    votes, rpos = votes.gather(1, o), rpos.gather(1, o)
    o = torch.sort(votes, dim=1, descending=True, stable=True).indices
    votes, rpos = votes.gather(1, o), rpos.gather(1, o)
    width = min(topk, M)
    votes, rpos = votes[:, :width], rpos[:, :width]
    ok = votes > 0
    centres = torch.full((N, topk), -1, dtype=torch.int64, device=dev)
    centres[:, :width] = torch.where(ok, rpos, torch.full_like(rpos, -1))
    vote_out = torch.zeros(N, topk, dtype=torch.int64, device=dev)
    vote_out[:, :width] = torch.where(ok, votes, torch.zeros_like(votes))

    # Widen each centre to its span, clip to the middle segment, merge duplicates.
    offs = torch.arange(span, device=dev) - span // 2
    cand = (rpos[:, :, None] + offs).reshape(N, width * span)
    keep = (ok[:, :, None].expand(N, width, span).reshape(N, -1) & (cand >= lo) & (cand < hi))
    cand = torch.sort(torch.where(keep, cand, torch.full_like(cand, _BIG)), dim=1).values
    dup = torch.zeros_like(keep)
    dup[:, 1:] = cand[:, 1:] == cand[:, :-1]
    cand = torch.sort(torch.where(dup, torch.full_like(cand, _BIG), cand), dim=1).values
    counts = (cand != _BIG).sum(1)
    n_max = int(counts.max()) if N else 0
    positions = torch.where(cand[:, :n_max] != _BIG, cand[:, :n_max], torch.full_like(cand[:, :n_max], -1))
    return (positions.reshape(B, H_kv, n_max), counts.reshape(B, H_kv),
            centres.reshape(B, H_kv, topk), vote_out.reshape(B, H_kv, topk))


def reattention_select_triton(q_norope, K_norope, global_size, local_size, span, topk,
                              per_head_k=None, *, block_s=None):
    """ReAttention selection with the fused Triton scoring + blockwise top-k kernel (Sec. 3.4).

    Same arguments and result as :func:`reattention_select_reference`. ``block_s`` is the number
    of middle positions per program (default: 8 x per_head_k rounded up to a power of two, within
    128..1024); candidates kept in global memory: ``ceil(M / block_s) * min(per_head_k, block_s)``
    per query head (M = middle length), about M / 8 or less for the default (for per_head_k <=
    128), never the [H_q, M] score matrix.
    """
    if not HAS_TRITON:  # pragma: no cover
        raise RuntimeError("triton is not installed")
    B, H_q, d, H_kv, G, lo, hi, kh = _check(q_norope, K_norope, span, topk, per_head_k, global_size, local_size)
    dev = q_norope.device
    if block_s is None:
        block_s = min(1024, max(128, 8 * triton.next_power_of_2(max(kh, 1))))
    if kh == 0:
        head_pos = torch.full((B, H_q, 0), -1, dtype=torch.int64, device=dev)
        head_sc = torch.empty((B, H_q, 0), dtype=torch.float64, device=dev)
    else:
        kk = min(kh, block_s)
        nb = triton.cdiv(hi - lo, block_s)
        vals = torch.empty(B * H_q, nb, kk, dtype=torch.float64, device=dev)
        cpos = torch.empty(B * H_q, nb, kk, dtype=torch.int32, device=dev)
        _reatt_block_topk_kernel[(B * H_kv, nb)](
            q_norope, *q_norope.stride(), K_norope, *K_norope.stride(), vals, cpos,
            H_kv, lo, hi, d, nb,
            G=G, KK=kk, BLOCK_S=block_s, BLOCK_DC=min(16, triton.next_power_of_2(d)),
            num_warps=8 if block_s >= 512 else 4,
        )
        # Merge: blocks are in position order and each block's list is (score desc, position
        # asc), so one stable sort by score keeps the earlier position first among ties.
        vals = vals.view(B * H_q, nb * kk)
        order = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :kh]
        head_sc = vals.gather(1, order).view(B, H_q, kh)
        head_pos = cpos.view(B * H_q, nb * kk).gather(1, order).to(torch.int64).view(B, H_q, kh)
    positions, counts, centres, votes = _vote_and_widen(head_pos, head_sc, H_kv, topk, span, lo, hi)
    return ReAttentionSelection(positions=positions, counts=counts, centres=centres, votes=votes,
                                head_positions=head_pos, head_scores=head_sc)


# ----------------------------------------------------------------------------- dispatch & layout


def reattention_select(q_norope, K_norope, global_size, local_size, span, topk, per_head_k=None):
    """ReAttention selection: Triton on CUDA (or under TRITON_INTERPRET=1), torch otherwise."""
    use_triton = HAS_TRITON and (q_norope.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    fn = reattention_select_triton if use_triton else reattention_select_reference
    return fn(q_norope, K_norope, global_size, local_size, span, topk, per_head_k)


def rerotate_positions(n_selected_total, device=None):
    """New RoPE positions of the kept cache ``[global, selected, local]``: simply 0..L-1.

    ReAttention keeps the relative order of the kept entries and drops the gaps between them
    (Sec. 2.2, Eq. 3), so entry ``i`` of the concatenation gets position ``i``; the query gets ``L``.
    """
    return torch.arange(int(n_selected_total), device=device)


def reattention_layout(selected_row, S, global_size, local_size):
    """Original and new positions of one row's kept cache ``[global, selected, local]``.

    selected_row: ascending middle positions of one (batch row, KV head), e.g. ``sel.row(b, h)``.
    Returns (original positions [L] int64, new positions 0..L-1 [L] int64).
    """
    lo, hi = _segment(S, global_size, local_size)
    dev = selected_row.device
    original = torch.cat([torch.arange(lo, device=dev), selected_row.to(torch.int64),
                          torch.arange(hi, S, device=dev)])
    return original, rerotate_positions(original.numel(), device=dev)
