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

This module holds the torch reference (the spec) and the layout helpers; the Triton kernel, which
gives the same selection without the [H_q, S] score matrix, and the dispatch between the two are in
``kernels/reattention_triton.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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


# ----------------------------------------------------------------------------- layout


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
