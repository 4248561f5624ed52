"""SparQ decode attention as Triton kernels, and the dispatch between them and the torch reference.

The algorithm, its shapes and its tie rules are described in ``kernels/sparq.py``, which holds the torch
reference the kernels are tested against (tests/test_kernels_sparq.py, on the CPU under
``TRITON_INTERPRET=1``) and the CPU's block form.
"""
from __future__ import annotations

import math
import os

import torch

from kernels.sparq import SparQResult, _budget, _check_params, _row_lengths, _shapes, sparq_attention_reference

try:  # Triton is a runtime dependency, but keep the torch path importable without it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover
    HAS_TRITON = False


# ----------------------------------------------------------------------------- Triton kernels
#
# Device functions (no torch kernels in between, so a decode step can be captured in a CUDA graph):
#   prep    query side of step 1: components i1 (rank of the group's summed |q|), tau (Eq. D2),
#           q[i1] / tau
#   step1   per KV head x block of positions: gather r components of K, approximate logits
#           (Eq. D1), per-block softmax partials (max, sum of exp)
#   select  per KV head x chunk of positions: normalise s_hat, sum it over the group, keep the
#           chunk's best n_top positions as candidates
#   finish  per KV head: merge the candidates into the n_top best, append the local window, exact
#           attention over the chosen rows (Eq. D3), alpha and mean-value mixing (Eqs. D4, D5)
#
# Four launches, one per phase (a fused variant, in which the last program of a row to finish
# step 1 ran that row's select and finish, measured slower: see docs/performance.md, "Kernels").
# Selection compares (score, position) with "higher score first, then earlier position": two
# binary searches, first on the float bits of the score (non-negative floats order like their
# bit patterns), then on the position among the scores equal to the threshold.

if HAS_TRITON:

    @triton.jit
    def _sparq_prep_kernel(
        q_ptr, stride_qb, stride_qh, stride_qd,
        comp_ptr, qhat_ptr, tau_ptr,  # [B*H_kv, R] int64, [B*H_kv, G, R] fp32, [B*H_q] fp32
        H_kv, D, R,
        G: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    ):
        """Step 1, query side: top-r components of the group's summed |q| (lower index wins
        ties), written in ascending order, tau per query head (Eq. D2) and q[i1] / tau."""
        pid = tl.program_id(0)
        b = (pid // H_kv).to(tl.int64)
        h = pid % H_kv
        offs_g = tl.arange(0, G_PAD)
        g_ok = offs_g < G
        offs_d = tl.arange(0, D_PAD)
        d_ok = offs_d < D
        qv = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh
                     + offs_d[None, :] * stride_qd,
                     mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        aq = tl.abs(qv)
        mag = tl.where(d_ok, tl.sum(aq, axis=0), -1.0)
        # Rank of component i = number of components that beat it (larger summed |q|, or equal
        # and a lower index): one comparison matrix instead of r rounds of argmax.
        beats = (mag[None, :] > mag[:, None]) | ((mag[None, :] == mag[:, None])
                                                 & (offs_d[None, :] < offs_d[:, None]))
        rank = tl.sum(beats.to(tl.int32), axis=1)
        chosen = d_ok & (rank < R)
        slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # ascending component order
        tl.store(comp_ptr + pid.to(tl.int64) * R + slot, offs_d.to(tl.int64), mask=chosen)
        kept = tl.sum(tl.where(chosen[None, :], aq, 0.0), axis=1)
        total = tl.maximum(tl.sum(aq, axis=1), 1.1754943508222875e-38)
        tau = tl.where(kept > 0, tl.sqrt_rn(tl.div_rn(D * kept, total)), 1.0)
        tl.store(tau_ptr + b * H_kv * G + h * G + offs_g, tau, mask=g_ok)
        qs = tl.div_rn(qv, tau[:, None])
        tl.store(qhat_ptr + (pid.to(tl.int64) * G + offs_g[:, None]) * R + slot[None, :], qs,
                 mask=g_ok[:, None] & chosen[None, :])

    @triton.jit
    def _row_length(len_ptr, b, S, HAS_LEN: tl.constexpr):
        """Positions in row b's cache: lengths[b] (prompt path, several queries on one text) or S."""
        if HAS_LEN:
            length = tl.load(len_ptr + b).to(tl.int32)
        else:
            length = S
        return length

    @triton.jit
    def _step1_block(
        qhat_ptr, comp_ptr,  # [B*H_kv, G, R] fp32 (q[i1] / tau), [B*H_kv, R] int64
        k_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
        logit_ptr, bmax_ptr, bsum_ptr,  # [B*H_q, S], [B*H_q, NB], [B*H_q, NB] fp32
        len_ptr, row, blk, H_kv, S, NB,
        G: tl.constexpr, G_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_S: tl.constexpr, S_CONTIG: tl.constexpr, HAS_LEN: tl.constexpr,
    ):
        """Step 1 for one KV head (row = b * H_kv + h) x one block of positions: gather r
        components of K, approximate logits (Eq. D1). The K tile is read once for the whole
        query group. Writes logits and per-block softmax partials (max, sum of exp); positions
        past the row's length are neither read nor written (their block partials are -inf, 0)."""
        row64 = row.to(tl.int64)
        b = row64 // H_kv
        h = row64 % H_kv
        offs_s = blk * BLOCK_S + tl.arange(0, BLOCK_S)
        s_ok = offs_s < _row_length(len_ptr, b, S, HAS_LEN)
        offs_g = tl.arange(0, G_PAD)
        g_ok = offs_g < G
        k_head = k_ptr + b * stride_kb + h * stride_kh  # 64-bit base, 32-bit offsets inside a head
        qhat_row = qhat_ptr + row64 * G * R
        rows = row64 * G + offs_g
        if S_CONTIG:
            # K_t (S-contiguous copy, App. I): each component is one contiguous row segment.
            # Outer-product accumulation: every element read once for the whole group, no
            # cross-thread reduction.
            acc = tl.zeros([G_PAD, BLOCK_S], tl.float32)
            for j in tl.static_range(R):
                c = tl.load(comp_ptr + row64 * R + j).to(tl.int32)
                krow = tl.load(k_head + c * stride_kd + offs_s, mask=s_ok, other=0.0)
                qcol = tl.load(qhat_row + offs_g * R + j, mask=g_ok, other=0.0)
                acc += qcol[:, None] * krow.to(tl.float32)[None, :]  # Eq. D1 numerator / tau
        else:
            # K only ([S, d] rows): gather an [r, BLOCK_S] tile, one dot per query head.
            offs_r = tl.arange(0, R_PAD)
            r_ok = offs_r < R
            comp = tl.load(comp_ptr + row64 * R + offs_r, mask=r_ok, other=0).to(tl.int32)
            tile = tl.load(k_head + comp[:, None] * stride_kd + offs_s[None, :] * stride_ks,
                           mask=r_ok[:, None] & s_ok[None, :], other=0.0).to(tl.float32)
            acc = tl.zeros([G_PAD, BLOCK_S], tl.float32)
            for g in tl.static_range(G):
                qv = tl.load(qhat_row + g * R + offs_r, mask=r_ok, other=0.0)
                logit = tl.sum(tile * qv[:, None], axis=0)
                acc = tl.where(offs_g[:, None] == g, logit[None, :], acc)
        acc = tl.where(s_ok[None, :], acc, float("-inf"))
        tl.store(logit_ptr + rows[:, None] * S + offs_s[None, :], acc,
                 mask=g_ok[:, None] & s_ok[None, :])
        m = tl.max(acc, axis=1)
        shift = tl.where(m == float("-inf"), 0.0, m)  # a block wholly past the length sums to 0
        tl.store(bmax_ptr + rows * NB + blk, m, mask=g_ok)
        tl.store(bsum_ptr + rows * NB + blk, tl.sum(tl.exp(acc - shift[:, None]), axis=1), mask=g_ok)

    @triton.jit
    def _softmax_stats(bmax_ptr, bsum_ptr, rows, g_ok, NB, NB_PAD: tl.constexpr):
        """Merge per-block (max, sum exp) partials into the softmax max and normaliser per row."""
        offs_nb = tl.arange(0, NB_PAD)
        msk = g_ok[:, None] & (offs_nb[None, :] < NB)
        bm = tl.load(bmax_ptr + rows[:, None] * NB + offs_nb[None, :], mask=msk,
                     other=float("-inf"), cache_modifier=".cg")
        bs = tl.load(bsum_ptr + rows[:, None] * NB + offs_nb[None, :], mask=msk, other=0.0,
                     cache_modifier=".cg")
        m = tl.max(bm, axis=1)
        m = tl.where(g_ok, m, 0.0)
        z = tl.sum(bs * tl.exp(bm - m[:, None]), axis=1)
        z = tl.where(g_ok, z, 1.0)
        return m, z

    @triton.jit
    def _top_n_mask(bits, pos, n):
        """Mask of the n best entries by (bits desc, pos asc); invalid entries have bits < 0.

        bits are float bit patterns of non-negative scores, so they order like the scores.
        If there are at most n valid entries, all of them are selected.
        """
        valid = (bits >= 0) & (bits * 0 + n > 0)  # nothing is valid when n == 0
        n_valid = tl.sum(valid.to(tl.int32), axis=0)
        # Threshold T, by binary search on the bits: the n-th largest value, or any value with
        # exactly n entries >= it (the search stops there early; then no tie needs breaking).
        lo = tl.min(tl.where(valid, bits, 2147483647), axis=0)
        hi = tl.max(bits, axis=0)
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = tl.sum((bits >= mid).to(tl.int32), axis=0)
            lo = tl.where(cnt >= n, mid, lo)
            hi = tl.where(cnt > n, hi, mid - 1)
            hi = tl.where(cnt == n, mid, hi)  # exactly n at or above mid: done (mid = T will do)
        need = n - tl.sum((bits > lo).to(tl.int32), axis=0)
        # Among entries equal to T keep the `need` earliest positions.
        eq = bits == lo
        plo = tl.min(tl.where(eq, pos, 2147483647), axis=0)
        phi = tl.max(tl.where(eq, pos, -1), axis=0)
        while plo < phi:
            mid = plo + (phi - plo) // 2
            ok = tl.sum((eq & (pos <= mid)).to(tl.int32), axis=0) >= need
            phi = tl.where(ok, mid, phi)
            plo = tl.where(ok, plo, mid + 1)
        picked = (bits > lo) | (eq & (pos <= plo))
        return tl.where(n_valid > n, picked & valid, valid)

    @triton.jit
    def _select_chunk(
        logit_ptr, bmax_ptr, bsum_ptr, score_ptr,
        cbits_ptr, cpos_ptr, cand_base,  # candidates: N_CAND int32 slots at cand_base, -1 if unused
        len_ptr, row, blk, H_kv, S, L_EFF, NB, N_CAND,
        G: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr, N_PAD: tl.constexpr,
        WRITE_SCORES: tl.constexpr, HAS_LEN: tl.constexpr,
    ):
        """Normalise s_hat (Eq. D1), sum it over the group (paper Sec. 2, GQA) and keep this
        chunk's N_CAND best positions outside the local window (the last L_EFF positions of the
        row), compacted in position order. One query head at a time, so only [BLOCK] vectors are
        live. Scores past the row's length are 0."""
        length = _row_length(len_ptr, row.to(tl.int64) // H_kv, S, HAS_LEN)
        offs_s = blk * BLOCK + tl.arange(0, BLOCK)
        s_ok = offs_s < S
        exists = offs_s < length
        offs_nb = tl.arange(0, NB_PAD)
        nb_ok = offs_nb < NB
        group = tl.zeros([BLOCK], tl.float32)
        for g in tl.static_range(G):
            hrow = row.to(tl.int64) * G + g
            bm = tl.load(bmax_ptr + hrow * NB + offs_nb, mask=nb_ok, other=float("-inf"),
                         cache_modifier=".cg")
            bs = tl.load(bsum_ptr + hrow * NB + offs_nb, mask=nb_ok, other=0.0,
                         cache_modifier=".cg")
            m = tl.max(bm, axis=0)
            z = tl.sum(bs * tl.exp(bm - m), axis=0)
            x = tl.load(logit_ptr + hrow * S + offs_s, mask=exists, other=float("-inf"),
                        cache_modifier=".cg")
            p = tl.exp(x - m) / z  # s_hat of query head g
            if WRITE_SCORES:
                tl.store(score_ptr + hrow * S + offs_s, p, mask=s_ok)
            group += p
        bits = tl.where(offs_s < length - L_EFF, group.to(tl.int32, bitcast=True), -1)
        sel = _top_n_mask(bits, offs_s, N_CAND)
        slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(cbits_ptr + cand_base + slot, bits, mask=sel)
        tl.store(cpos_ptr + cand_base + slot, offs_s, mask=sel)
        offs_n = tl.arange(0, N_PAD)
        unused = (offs_n >= tl.sum(sel.to(tl.int32), axis=0)) & (offs_n < N_CAND)
        tl.store(cbits_ptr + cand_base + offs_n, tl.full([N_PAD], -1, tl.int32), mask=unused)

    @triton.jit
    def _count(cbits_ptr, cpos_ptr, base, C, T, P, MODE: tl.constexpr, CHUNK: tl.constexpr):
        """Count candidates of one row: MODE 0: bits >= T; 1: bits > T; 2: bits == T, pos <= P."""
        total = 0
        for start in range(0, C, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            bt = tl.load(cbits_ptr + base + offs, mask=offs < C, other=-1)
            if MODE == 0:
                hit = bt >= T
            elif MODE == 1:
                hit = bt > T
            else:
                ps = tl.load(cpos_ptr + base + offs, mask=offs < C, other=0)
                hit = (bt == T) & (ps <= P)
            total += tl.sum(hit.to(tl.int32), axis=0)
        return total

    @triton.jit
    def _merge_candidates(cbits_ptr, cpos_ptr, base, C, out, length, N_TOP, N_SEL,
                          CHUNK: tl.constexpr, ONE_TILE: tl.constexpr):
        """Merge a row's chunk candidates into its N_TOP best (same order and tie rule as
        _top_n_mask), write them in ascending position order (candidates are stored in position
        order), then the local window. ONE_TILE (C <= CHUNK): all candidates in registers, one
        _top_n_mask. Otherwise chunked, so C may exceed a register tile; with at most N_TOP
        valid candidates both searches are skipped."""
        if ONE_TILE:
            offs = tl.arange(0, CHUNK)
            bt = tl.load(cbits_ptr + base + offs, mask=offs < C, other=-1)
            ps = tl.load(cpos_ptr + base + offs, mask=offs < C, other=0)
            sel = _top_n_mask(bt, ps, N_TOP)
            slot = tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out + slot, ps.to(tl.int64), mask=sel)
        else:
            _merge_chunked(cbits_ptr, cpos_ptr, base, C, out, N_TOP, CHUNK)
        for start in range(N_TOP, N_SEL, CHUNK):  # local window, after every other position
            offs = start + tl.arange(0, CHUNK)
            tl.store(out + offs, (length - N_SEL + offs).to(tl.int64), mask=offs < N_SEL)

    @triton.jit
    def _merge_chunked(cbits_ptr, cpos_ptr, base, C, out, N_TOP, CHUNK: tl.constexpr):
        lo = 2147483647
        hi = -1
        n_valid = 0
        for start in range(0, C, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            bt = tl.load(cbits_ptr + base + offs, mask=offs < C, other=-1)
            lo = tl.minimum(lo, tl.min(tl.where(bt >= 0, bt, 2147483647), axis=0))
            hi = tl.maximum(hi, tl.max(bt, axis=0))
            n_valid += tl.sum((bt >= 0).to(tl.int32), axis=0)
        take_all = n_valid <= N_TOP
        hi = tl.where(take_all, lo, hi)  # at most N_TOP valid: take them all, skip the searches
        while lo < hi:
            mid = lo + (hi - lo + 1) // 2
            cnt = _count(cbits_ptr, cpos_ptr, base, C, mid, 0, 0, CHUNK)
            lo = tl.where(cnt >= N_TOP, mid, lo)
            hi = tl.where(cnt > N_TOP, hi, mid - 1)
            hi = tl.where(cnt == N_TOP, mid, hi)  # exactly N_TOP at or above mid: done
        need = N_TOP - _count(cbits_ptr, cpos_ptr, base, C, lo, 0, 1, CHUNK)
        plo = 2147483647
        phi = -1
        for start in range(0, C, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            bt = tl.load(cbits_ptr + base + offs, mask=offs < C, other=-1)
            ps = tl.load(cpos_ptr + base + offs, mask=offs < C, other=0)
            plo = tl.minimum(plo, tl.min(tl.where(bt == lo, ps, 2147483647), axis=0))
            phi = tl.maximum(phi, tl.max(tl.where(bt == lo, ps, -1), axis=0))
        phi = tl.where(take_all, plo, phi)
        while plo < phi:
            mid = plo + (phi - plo) // 2
            ok = _count(cbits_ptr, cpos_ptr, base, C, lo, mid, 2, CHUNK) >= need
            phi = tl.where(ok, mid, phi)
            plo = tl.where(ok, plo, mid + 1)
        written = 0
        for start in range(0, C, CHUNK):
            offs = start + tl.arange(0, CHUNK)
            bt = tl.load(cbits_ptr + base + offs, mask=offs < C, other=-1)
            ps = tl.load(cpos_ptr + base + offs, mask=offs < C, other=0)
            sel = (bt > lo) | ((bt == lo) & (ps <= plo))
            sel = tl.where(take_all, bt >= 0, sel) & (bt >= 0) & (bt * 0 + N_TOP > 0)
            slot = written + tl.cumsum(sel.to(tl.int32), axis=0) - 1
            tl.store(out + slot, ps.to(tl.int64), mask=sel)
            written += tl.sum(sel.to(tl.int32), axis=0)

    @triton.jit
    def _attend(
        q_ptr, stride_qb, stride_qh, stride_qd,
        k_ptr, v_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
        vm_ptr, stride_mb, stride_mh, stride_md,
        pos_ptr, logit_ptr, bmax_ptr, bsum_ptr, out_ptr, alpha_ptr,
        row, H_kv, S, length, D, NB, N_SEL, sm_scale,
        G: tl.constexpr, G_PAD: tl.constexpr, NB_PAD: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    ):
        """Steps 2 + 3 for one KV head: gather the chosen K/V rows, exact attention (online
        softmax, Eq. D3), alpha from the step-1 logits (Eq. D5), mean-value mix (Eq. D4).

        IEEE: float32 inputs, exact float32 products. Otherwise (16-bit inputs) the two products
        run on tensor cores in the input dtype with float32 accumulation; q.k products of 16-bit
        numbers are exact in float32, and the probabilities are rounded to the input dtype
        before p @ V, as flash attention does (an error below the 16-bit output's own rounding).
        """
        row64 = row.to(tl.int64)
        b = row64 // H_kv
        h = row64 % H_kv
        offs_g = tl.arange(0, G_PAD)
        g_ok = offs_g < G
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        hq = h * G + offs_g
        rows = row64 * G + offs_g
        qv = tl.load(q_ptr + b * stride_qb + hq[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                     mask=g_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            qv = qv.to(tl.float32)
        m_hat, z_hat = _softmax_stats(bmax_ptr, bsum_ptr, rows, g_ok, NB, NB_PAD)

        m_i = tl.full([G_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([G_PAD], tl.float32)
        acc = tl.zeros([G_PAD, BLOCK_D], tl.float32)
        mass = tl.zeros([G_PAD], tl.float32)
        k_head = k_ptr + b * stride_kb + h * stride_kh
        v_head = v_ptr + b * stride_kb + h * stride_kh
        for start in range(0, N_SEL, BLOCK_K):
            offs_k = start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < N_SEL
            pos = tl.load(pos_ptr + row64 * N_SEL + offs_k, mask=k_ok, other=0).to(tl.int32)
            # K tile loaded transposed ([d, k]) so the first product needs no layout change.
            kt = tl.load(k_head + offs_d[:, None] * stride_kd + pos[None, :] * stride_ks,
                         mask=d_ok[:, None] & k_ok[None, :], other=0.0)
            kv_msk = k_ok[:, None] & d_ok[None, :]
            vt = tl.load(v_head + pos[:, None] * stride_ks + offs_d[None, :] * stride_kd,
                         mask=kv_msk, other=0.0)
            if IEEE:
                s = tl.dot(qv, kt.to(tl.float32), input_precision="ieee")
            else:
                s = tl.dot(qv, kt)
            s = tl.where(k_ok[None, :], s * sm_scale, float("-inf"))  # [G_PAD, BLOCK_K]
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            corr = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * corr + tl.sum(p, axis=1)
            if IEEE:
                pv = tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                pv = tl.dot(p.to(vt.dtype), vt)
            acc = acc * corr[:, None] + pv
            m_i = m_new

            lg = tl.load(logit_ptr + rows[:, None] * S + pos[None, :],
                         mask=g_ok[:, None] & k_ok[None, :], other=float("-inf"),
                         cache_modifier=".cg")
            mass += tl.sum(tl.exp(lg - m_hat[:, None]) / z_hat[:, None], axis=1)

        y = acc / l_i[:, None]
        alpha = tl.where(length == N_SEL, 1.0, mass)  # the whole cache read: exactly 1
        vm = tl.load(vm_ptr + b * stride_mb + h * stride_mh + offs_d * stride_md,
                     mask=d_ok, other=0.0).to(tl.float32)
        out = alpha[:, None] * y + (1.0 - alpha[:, None]) * vm[None, :]
        tl.store(out_ptr + rows[:, None] * D + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        tl.store(alpha_ptr + rows, alpha, mask=g_ok)

    # ------------------------------------------------------------------ kernels

    @triton.jit
    def _sparq_step1_kernel(
        qhat_ptr, comp_ptr, k_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
        logit_ptr, bmax_ptr, bsum_ptr, len_ptr, H_kv, S, NB,
        G: tl.constexpr, G_PAD: tl.constexpr, R: tl.constexpr, R_PAD: tl.constexpr,
        BLOCK_S: tl.constexpr, S_CONTIG: tl.constexpr, HAS_LEN: tl.constexpr,
    ):
        _step1_block(qhat_ptr, comp_ptr, k_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
                     logit_ptr, bmax_ptr, bsum_ptr, len_ptr, tl.program_id(0), tl.program_id(1),
                     H_kv, S, NB, G, G_PAD, R, R_PAD, BLOCK_S, S_CONTIG, HAS_LEN)

    @triton.jit
    def _sparq_select_kernel(
        logit_ptr, bmax_ptr, bsum_ptr, score_ptr, cbits_ptr, cpos_ptr, len_ptr,
        H_kv, S, L_EFF, NB, NCH, N_CAND,
        G: tl.constexpr, NB_PAD: tl.constexpr, BLOCK: tl.constexpr, N_PAD: tl.constexpr,
        WRITE_SCORES: tl.constexpr, HAS_LEN: tl.constexpr,
    ):
        row = tl.program_id(0)
        blk = tl.program_id(1)
        _select_chunk(logit_ptr, bmax_ptr, bsum_ptr, score_ptr, cbits_ptr, cpos_ptr,
                      (row.to(tl.int64) * NCH + blk) * N_CAND, len_ptr, row, blk, H_kv, S, L_EFF,
                      NB, N_CAND, G, NB_PAD, BLOCK, N_PAD, WRITE_SCORES, HAS_LEN)

    @triton.jit
    def _sparq_finish_kernel(
        q_ptr, stride_qb, stride_qh, stride_qd,
        k_ptr, v_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
        vm_ptr, stride_mb, stride_mh, stride_md,
        cbits_ptr, cpos_ptr, pos_ptr, logit_ptr, bmax_ptr, bsum_ptr, out_ptr, alpha_ptr, len_ptr,
        H_kv, S, D, NB, C, N_TOP, N_SEL, sm_scale,
        G: tl.constexpr, G_DOT: tl.constexpr, NB_PAD: tl.constexpr, CHUNK: tl.constexpr,
        ONE_TILE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
        IEEE: tl.constexpr, HAS_LEN: tl.constexpr,
    ):
        row = tl.program_id(0)
        length = _row_length(len_ptr, row.to(tl.int64) // H_kv, S, HAS_LEN)
        _merge_candidates(cbits_ptr, cpos_ptr, row.to(tl.int64) * C, C,
                          pos_ptr + row.to(tl.int64) * N_SEL, length, N_TOP, N_SEL, CHUNK, ONE_TILE)
        tl.debug_barrier()  # positions were written by other threads of this program
        _attend(q_ptr, stride_qb, stride_qh, stride_qd,
                k_ptr, v_ptr, stride_kb, stride_kh, stride_ks, stride_kd,
                vm_ptr, stride_mb, stride_mh, stride_md,
                pos_ptr, logit_ptr, bmax_ptr, bsum_ptr, out_ptr, alpha_ptr,
                row, H_kv, S, length, D, NB, N_SEL, sm_scale,
                G, G_DOT, NB_PAD, BLOCK_K, BLOCK_D, IEEE)


def _next_pow2(n):
    return 1 << max(0, (int(n) - 1).bit_length())


# Launch settings, tuned on an H100 at S=16384, B=64 (`benchmarks/kernels_bench.py --tune`).
# select_max: largest selection chunk (a row is selected in chunks of min(next_pow2(S), select_max)
# positions); select_warps None: from the chunk size (16 positions per thread, 2 to 16 warps).
_LAUNCH = dict(block_s=1024, select_max=1024, step1_warps=4, select_warps=None, finish_warps=4)
_LAST = {}  # the last compiled kernels launched, by name (registers and spills for the benchmark)


def _select_warps(select_block):
    return max(2, min(16, select_block // 512))


def sparq_attention_triton(q, K, V, v_mean, k, r, l, *, K_t=None, return_scores=True, lengths=None,
                           block_s=None, select_block=None, row_chunk=None):
    """SparQ decode attention with Triton kernels; same arguments and result as the reference.

    K_t: optional [B, H_kv, d, S] S-contiguous copy of K (App. I). Step 1 then reads r contiguous
        rows instead of r strided components per position; values must equal ``K``.
    lengths: optional [B] ints, as for the reference (checking them synchronises with the host;
        without them nothing does).
    block_s: positions per program in step 1. select_block: positions per selection chunk
        (default: the whole row up to ``_LAUNCH['select_max']``). row_chunk: candidates per loop
        iteration when merging the chunks' candidates (default: all of them, up to 4096, in one
        register tile).
    Inputs may be float16, bfloat16 or float32; float64 is not supported. Scores, softmaxes and
    selection run in float32; with 16-bit inputs the two step-2 products use tensor cores (see
    _attend). Launches only Triton kernels (no host synchronisation), so a decode step can be
    graph-captured.
    """
    if not HAS_TRITON:  # pragma: no cover
        raise RuntimeError("triton is not installed")
    _check_params(k, r, l)
    B, H_q, H_kv, G, S, d = _shapes(q, K, V, v_mean)
    if q.dtype == torch.float64:
        raise TypeError("the Triton path computes in float32; use the reference for float64")
    if K.stride() != V.stride():
        raise ValueError("K and V must share strides")  # one set of strides for both gathers
    if S * d >= 2 ** 31:
        raise ValueError("one KV head must have fewer than 2^31 elements")
    if K_t is not None and K_t.shape != (B, H_kv, d, S):
        raise ValueError(f"K_t must be [B, H_kv, d, S], got {tuple(K_t.shape)}")
    dev = q.device
    f32 = torch.float32
    n_rows = B * H_kv
    r_eff = min(r, d)
    k_eff, l_eff, n_top = _budget(S, k, l)
    g_pad = _next_pow2(G)
    block_s = block_s or _LAUNCH["block_s"]
    select_block = select_block or min(_next_pow2(S), _LAUNCH["select_max"])
    nb = triton.cdiv(S, block_s)
    nch = triton.cdiv(S, select_block)
    n_cand = min(n_top, select_block)
    k1 = K_t.transpose(-1, -2) if K_t is not None else K  # [B, H_kv, S, d] view
    s_contig = k1.stride(2) == 1
    has_len = lengths is not None
    if has_len:
        lengths = _row_lengths(lengths, B, S, k_eff, dev).to(torch.int32)

    # prep: components, tau, q[i1] / tau.
    comps = torch.empty(B, H_kv, r_eff, dtype=torch.int64, device=dev)
    qhat = torch.empty(n_rows, G, r_eff, dtype=f32, device=dev)
    tau = torch.empty(B, H_q, dtype=f32, device=dev)
    _sparq_prep_kernel[(n_rows,)](
        q, *q.stride(), comps, qhat, tau, H_kv, d, r_eff,
        G=G, G_PAD=g_pad, D_PAD=_next_pow2(d), num_warps=1,
    )

    logits = torch.empty(B * H_q, S, dtype=f32, device=dev)
    bmax = torch.empty(B * H_q, nb, dtype=f32, device=dev)
    bsum = torch.empty(B * H_q, nb, dtype=f32, device=dev)
    scores = torch.empty(B * H_q, S, dtype=f32, device=dev) if return_scores else logits
    cbits = torch.empty(n_rows, nch, max(n_cand, 1), dtype=torch.int32, device=dev)
    cpos = torch.empty_like(cbits)
    positions = torch.empty(B, H_kv, k_eff, dtype=torch.int64, device=dev)
    out = torch.empty(B, H_q, d, dtype=q.dtype, device=dev)
    alpha = torch.empty(B, H_q, dtype=f32, device=dev)
    block_d = max(16, _next_pow2(d))
    n_cands = nch * n_cand
    row_chunk = row_chunk or min(4096, _next_pow2(max(n_cands, 16)))
    attend = dict(G_DOT=max(16, g_pad), NB_PAD=_next_pow2(nb), CHUNK=row_chunk,
                  ONE_TILE=n_cands <= row_chunk,
                  BLOCK_K=128 if block_d <= 64 else 64, BLOCK_D=block_d,
                  IEEE=(q.dtype == torch.float32))
    sel_warps = _LAUNCH["select_warps"] or _select_warps(select_block)
    _LAST["step1"] = _sparq_step1_kernel[(n_rows, nb)](
        qhat, comps, k1, *k1.stride(), logits, bmax, bsum, lengths if has_len else comps, H_kv, S, nb,
        G=G, G_PAD=g_pad, R=r_eff, R_PAD=_next_pow2(r_eff), BLOCK_S=block_s,
        S_CONTIG=s_contig, HAS_LEN=has_len, num_warps=_LAUNCH["step1_warps"],
    )
    _LAST["select"] = _sparq_select_kernel[(n_rows, nch)](
        logits, bmax, bsum, scores, cbits, cpos, lengths if has_len else comps, H_kv, S, l_eff, nb, nch, n_cand,
        G=G, NB_PAD=attend["NB_PAD"], BLOCK=select_block, N_PAD=_next_pow2(max(n_cand, 1)),
        WRITE_SCORES=return_scores, HAS_LEN=has_len, num_warps=sel_warps,
    )
    _LAST["finish"] = _sparq_finish_kernel[(n_rows,)](
        q, *q.stride(), K, V, *K.stride(), v_mean, *v_mean.stride(),
        cbits, cpos, positions, logits, bmax, bsum, out, alpha, lengths if has_len else comps,
        H_kv, S, d, nb, n_cands, n_top, k_eff, 1.0 / math.sqrt(d),
        G=G, HAS_LEN=has_len, num_warps=_LAUNCH["finish_warps"], **attend,
    )
    return SparQResult(
        out=out,
        positions=positions,
        alpha=alpha,
        scores=scores.view(B, H_q, S) if return_scores else None,
        components=comps,
        tau=tau,
    )


# ----------------------------------------------------------------------------- dispatch


def triton_enabled(t: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, or anywhere under TRITON_INTERPRET=1 (the tests)."""
    return HAS_TRITON and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def sparq_attention(q, K, V, v_mean, k, r, l, *, K_t=None, return_scores=True, lengths=None):
    """SparQ decode attention: the Triton kernels where they can run, else the torch reference."""
    impl = sparq_attention_triton if triton_enabled(q) and q.dtype != torch.float64 else sparq_attention_reference
    return impl(q, K, V, v_mean, k, r, l, K_t=K_t, return_scores=return_scores, lengths=lengths)
