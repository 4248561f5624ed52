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

    def mask(self, b: int, total: int) -> torch.Tensor:
        """bool [H_kv, total]: the positions batch row ``b`` selected, per KV head."""
        positions = self.positions[b]
        at = torch.where(positions >= 0, positions, total)  # the -1 padding lands in an extra last column
        mask = torch.zeros(positions.shape[0], total + 1, dtype=torch.bool, device=positions.device)
        return mask.scatter_(-1, at, True)[:, :total]


def middle_segment(S, global_size, local_size):
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
    lo, hi = middle_segment(S, global_size, local_size)
    return B, H_q, d, H_kv, H_q // H_kv, lo, hi, min(per_head_k if per_head_k is not None else topk, hi - lo)


# ----------------------------------------------------------------------------- reference


def _scores(q, K, repeats=None):
    """Eq. 2's q . k in float64: [H_kv, V, S] for voters q [H_kv, V, d] and keys K [H_kv, S, d].

    Equal keys get equal scores, so the tie rule holds: a matrix product may round one key's score an ulp apart
    at different columns (its tiles), so a key that repeats an earlier one (a repeated token's, in the first
    layer) takes the earlier one's score. ``repeats``: each head's ``_repeats`` of these keys or of more (the
    ones past S are left out)."""
    S = K.shape[1]
    scores = q.double() @ K.double().transpose(-1, -2)
    for h, (copies, first) in enumerate(repeats if repeats is not None else map(_repeats, K)):
        inside = copies < S
        if inside.any():
            scores[h][:, copies[inside]] = scores[h][:, first[inside]]
    return scores


_MIX = torch.randint(-2 ** 62, 2 ** 62, (4096,), generator=torch.Generator().manual_seed(0)) | 1  # odd multipliers


def _repeats(keys):
    """(positions whose key [S, d] equals an earlier one, the first position holding that key), both [R]: the
    keys' bits hashed exactly (integer arithmetic), grouped by a stable sort, and neighbours compared."""
    S, d = keys.shape
    if S < 2:
        return keys.new_zeros(0, dtype=torch.long), keys.new_zeros(0, dtype=torch.long)
    bits = keys.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[keys.element_size()]).long()
    hashed = (bits * _MIX[:d].to(keys.device)).sum(-1)  # wraps around in int64, the same for equal bits
    order = torch.sort(hashed, stable=True).indices  # equal keys adjacent, earliest first
    ordered = keys[order]
    same = (hashed[order[1:]] == hashed[order[:-1]]) & (ordered[1:] == ordered[:-1]).all(-1)
    start = torch.cat([torch.ones(1, dtype=torch.bool, device=keys.device), ~same])
    first = order[start][torch.cumsum(start.long(), 0) - 1]  # each sorted entry's earliest equal key
    repeat = order != first
    return order[repeat], first[repeat]


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
    scores = torch.stack([_scores(qg[b], K_norope[b, :, lo:hi]) for b in range(B)])  # [B, H_kv, G, hi - lo]
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


def _vote_and_widen(head_pos, head_sc, H_kv, topk, span, lo, hi):
    """Vectorised steps 2-3 (vote, widen, merge) on the small nomination lists.

    head_pos / head_sc: [B, H_q, kh] nominations best first (-1 / -inf padding). Same rules as the
    reference's Python loop: rank by (votes desc, best score desc, position asc). lo, hi: the middle
    segment, one for all B or a LongTensor [B] each.
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
    lo, hi = (torch.as_tensor(x, device=dev).reshape(-1, 1).repeat_interleave(H_kv if torch.is_tensor(x) else 1, 0)
              for x in (lo, hi))
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


def chunk_groups(costs, limit):
    """Consecutive chunks in groups that are computed as one batch: [(start, stop)] over ``costs``, each chunk's
    (rows, columns). A batch pads every chunk to its most rows and most columns, so a group holds as many
    chunks as keep ``len * rows * columns`` within ``limit``; a chunk over it alone goes alone. A prompt's
    opening chunk (Algorithm 1's global + local, thousands of queries) thus never pads the 16-query chunks
    after it to its own size."""
    groups, start, rows, columns = [], 0, 0, 0
    for i, (r, c) in enumerate(costs):
        rows_with, columns_with = max(rows, r), max(columns, c)
        if i > start and (i - start + 1) * rows_with * columns_with > limit:
            groups.append((start, i))
            start, rows_with, columns_with = i, r, c
        rows, columns = rows_with, columns_with
    if costs:
        groups.append((start, len(costs)))
    return groups


def reattention_select_chunks(q_norope, K_norope, chunks, first, global_size, local_size, span, topk,
                              max_scores=None):
    """Algorithm 1's selection for several chunks of one block at once, as ``reattention_select_reference``
    selects for each chunk alone: chunk (s, e)'s queries, every head of the group for each, vote over the
    middle segment of keys 0..e-1.

    Args:
        q_norope: [H_q, n, d] the block's queries without RoPE, query ``first + i`` in row i.
        K_norope: [H_kv, M, d] the keys without RoPE (M >= every chunk's end).
        chunks: [(s, e)] absolute query ranges within the block.
        max_scores: float64 scores held at once; chunks go through in groups that fit (``chunk_groups``). By
            default 2^26 on a GPU (few launches) and 2^19 on a CPU, where a chunk's scores then stay in the
            caches through the ranking's passes: one chunk at a time there at 4k tokens on the default model.
    Returns bool [C, H_kv, M]: each chunk's selected middle positions.
    """
    H_q = q_norope.shape[0]
    if max_scores is None:
        max_scores = 1 << (26 if K_norope.is_cuda else 19)
    reaches = [middle_segment(e, global_size, local_size)[1] for _, e in chunks]
    keys = K_norope[:, :max(reaches)].double()  # once for every group, as the equal keys
    repeats = [_repeats(k) for k in keys]
    groups = chunk_groups([(H_q * (e - s), reach) for (s, e), reach in zip(chunks, reaches)], max_scores)
    return torch.cat([_select_chunks(q_norope, keys, repeats, K_norope.shape[1], chunks[a:b], first, global_size,
                                     local_size, span, topk) for a, b in groups])


def _select_chunks(q_norope, keys, repeats, M, chunks, first, global_size, local_size, span, topk):
    H_q, _, d = q_norope.shape
    H_kv = keys.shape[0]
    G, C, dev = H_q // H_kv, len(chunks), keys.device
    width = max(e - s for s, e in chunks)
    bounds = [middle_segment(e, global_size, local_size) for _, e in chunks]
    reach = max(h for _, h in bounds)  # no middle goes further: the keys after it are not scored
    # Each chunk's queries as rows of one batch; a shorter chunk's padding rows repeat its last query and vote not.
    rows = torch.tensor([[min(s + j, e - 1) - first for j in range(width)] for s, e in chunks], device=dev)
    real = torch.tensor([[j < e - s for j in range(width)] for s, e in chunks], device=dev)
    lo = torch.tensor([b[0] for b in bounds], device=dev)
    hi = torch.tensor([b[1] for b in bounds], device=dev)
    kh = min(topk, reach)  # a middle shorter than topk nominates all it has: the -inf picks past it vote not
    if kh == 0:
        return torch.zeros(C, H_kv, M, dtype=torch.bool, device=dev)
    # Eq. 2 without positions, in float64: [H_kv, C, G * width, reach], voters ordered (group head, query).
    q = q_norope.double()[:, rows].reshape(H_kv, G, C, width, d).transpose(1, 2).reshape(H_kv, C * G * width, d)
    scores = _scores(q, keys[:, :reach], repeats).view(H_kv, C, G * width, reach)
    position = torch.arange(reach, device=dev)
    outside = (position < lo[:, None]) | (position >= hi[:, None])  # [C, reach]: not the chunk's middle
    values, indices = _ranked_top(scores.masked_fill_(outside[:, None, :], float("-inf")), kh)
    values, indices = values.transpose(0, 1), indices.transpose(0, 1)  # [C, H_kv, G * width, kh]
    voting = real[:, None, None, :, None].expand(C, H_kv, G, width, kh).reshape(values.shape) & (values > float("-inf"))
    head_pos = torch.where(voting, indices, -1).reshape(C, H_q * width, kh)
    head_sc = torch.where(voting, values, float("-inf")).reshape(C, H_q * width, kh)
    positions, _, _, _ = _vote_and_widen(head_pos, head_sc, H_kv, topk, span, lo, hi)
    chosen = torch.zeros(C, H_kv, M + 1, dtype=torch.bool, device=dev)
    chosen.scatter_(-1, torch.where(positions >= 0, positions, M), True)  # -1 pads land in the extra last column
    return chosen[..., :M]


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
    lo, hi = middle_segment(S, global_size, local_size)
    dev = selected_row.device
    original = torch.cat([torch.arange(lo, device=dev), selected_row.to(torch.int64),
                          torch.arange(hi, S, device=dev)])
    return original, rerotate_positions(original.numel(), device=dev)
