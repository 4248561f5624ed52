"""ReAttention (Liu et al., 2024, Sec. 2, App. A): position-agnostic top-k selection, then RoPE on
the selected cache renumbered 0..L-1, so the attention scope stays small however long the text."""
from dataclasses import dataclass

import numpy as np
import torch

from kernels.reattention import reattention_select, reattention_select_reference

from .base import AttendingPolicy, BlockResult


@dataclass(frozen=True)
class ReAttention(AttendingPolicy):
    """Global + selected spans + local, re-rotated to contiguous positions (Eq. 1-3).

    Per chunk of queries (the prompt in chunks as Algorithm 1; one token per step when decoding,
    Algorithm 2) and KV head: the first ``global_size`` and the last ``local`` tokens always; in the
    middle, scores q.k *without RoPE* (float64, the earlier position wins ties) nominate positions,
    the group's query heads and the chunk's queries vote for ``topk`` centres, each widened to
    ``span`` neighbours, overlaps merged (kernels/reattention.py). The kept keys, in their original
    order, get RoPE positions 0..L-1 and each query the position of its own key in that list.

    budget: the attention scope, global_size + topk * span + local (local is what is left).
    global_size: first tokens always read.
    span: m, neighbours read around each voted centre.
    topk: k', centres per KV head.
    chunk: prompt tokens per selection (must not exceed local, Sec. 4.1).
    """

    name = "reattention"
    needs_prerope = True
    chunks_prompt = True  # the runner hands it the whole prompt; it cuts its own chunks
    budget: int = 64
    global_size: int = 4
    span: int = 8
    topk: int = 2
    chunk: int = 16

    @property
    def local(self) -> int:
        return self.budget - self.global_size - self.topk * self.span

    def __post_init__(self):
        super().__post_init__()
        if min(self.global_size, self.span - 1, self.topk - 1, self.chunk - 1) < 0:
            raise ValueError("reattention: need global_size >= 0 and span, topk, chunk >= 1")
        if not 1 <= self.chunk <= self.local:
            raise ValueError(f"reattention: budget {self.budget} leaves local = {self.local} tokens; it must be "
                             f">= chunk ({self.chunk}): raise budget or lower topk, span, chunk")

    def chunks(self, first: int, n: int, decoding: bool = False) -> list[tuple[int, int]]:
        """Query ranges [s, e) of this block: Algorithm 1's chunks, cut at the block's ends, or one query
        each when the block's queries are decoding steps (Algorithm 2)."""
        if decoding:
            return [(s, s + 1) for s in range(first, first + n)]
        out, s, end = [], first, first + n
        while s < end:
            opening = self.global_size + self.local
            e = opening if s < opening else opening + ((s - opening) // self.chunk + 1) * self.chunk
            out.append((s, min(e, end)))
            s = min(e, end)
        return out

    def attend_block(self, state, block):
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        group = n_q_heads // n_kv_heads
        out = torch.empty(n, n_q_heads, dim, dtype=block.q.dtype, device=block.q.device)
        reads = np.zeros((n_kv_heads, n, total), bool)
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        for s, e in self.chunks(block.first, n, block.decoding):
            lo, hi = min(self.global_size, e), max(e - self.local, min(self.global_size, e))
            chosen = None
            if hi - lo > self.topk * self.span:  # a middle that fits in the scope is read whole
                queries = block.q_pre[:, s - block.first: e - block.first]  # [H_q, n_c, d], no RoPE
                voters = queries.reshape(1, n_kv_heads * group * (e - s), dim)  # the group's heads x queries vote
                select = reattention_select if voters.is_cuda else reattention_select_reference
                chosen = select(voters, block.k_pre[None, :, :e], self.global_size, self.local, self.span, self.topk)
            for h in range(n_kv_heads):
                middle = torch.arange(lo, hi) if chosen is None else chosen.row(0, h).cpu()
                kept = torch.cat([torch.arange(lo), middle, torch.arange(hi, e)])  # original positions
                at = torch.arange(len(kept), device=block.q.device)  # Eq. 3: renumbered 0..L-1
                keys = block.rope(block.k_pre[h, kept][None], at)[0]
                positions = torch.arange(s, e)
                own = (len(kept) - (e - positions)).to(block.q.device)  # each query's own key: the local tail
                q = block.rope(block.q_pre[h * group:(h + 1) * group, s - block.first: e - block.first], own)
                visible = kept[None, :] <= positions[:, None]  # causal within the chunk
                scores = (q @ keys.T * block.scaling).masked_fill(~visible.to(q.device), float("-inf"))
                weights = torch.softmax(scores, dim=-1)  # [G, n_c, L]
                rows = slice(s - block.first, e - block.first)
                out[rows, h * group:(h + 1) * group] = (weights @ block.v[h, kept]).transpose(0, 1)
                cells = np.ix_(np.arange(s - block.first, e - block.first), kept.numpy())
                reads[h][cells] = visible.numpy()
                attn[h][cells] = weights.mean(0).float().cpu().numpy()
        return state, BlockResult(out=out, reads=reads, attn=attn)
