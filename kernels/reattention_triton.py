"""ReAttention's selection as a Triton kernel (Sec. 3.4), and the dispatch between it and the torch reference.

The kernel scores the middle segment block by block and keeps only each block's best ``per_head_k``
candidates per query head, so global memory holds O(S / block * per_head_k) candidates instead of the
[H_q, S] score matrix; a merge of those candidates gives each head's top-k, exactly as the reference
(``kernels/reattention.py``, which states the selection and its tie rule) computes it.
"""
from __future__ import annotations

import os

import torch

from kernels.reattention import ReAttentionSelection, _check, _vote_and_widen, reattention_select_reference

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False

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


# ----------------------------------------------------------------------------- dispatch


def reattention_select(q_norope, K_norope, global_size, local_size, span, topk, per_head_k=None):
    """ReAttention selection: Triton on CUDA (or under TRITON_INTERPRET=1), torch otherwise."""
    use_triton = HAS_TRITON and (q_norope.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
    fn = reattention_select_triton if use_triton else reattention_select_reference
    return fn(q_norope, K_norope, global_size, local_size, span, topk, per_head_k)
