"""ReAttention (Liu et al., 2024, Sec. 2, App. A): position-agnostic top-k selection, then RoPE on
the selected cache renumbered 0..L-1, so the attention scope stays small however long the text."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kernels.reattention import reattention_select_reference
from kernels.reattention_triton import reattention_select

from .base import AttendingPolicy, BlockResult
from .registry import register


@register
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

    honours_layer_limits: ClassVar[bool] = True  # Block.window and Block.softcap

    name = "reattention"
    summary = 'global + top-k spans by position-agnostic scores + local, re-rotated to positions 0..L-1'
    paper = 'Liu et al., 2024, *ReAttention*, Sec. 2, App. A'
    color = "#882255"
    needs_prerope = True
    budget: int = 64
    global_size: int = 4
    span: int = 8
    topk: int = 2
    chunk: int = 16

    @classmethod
    def for_budget(cls, budget: int) -> "ReAttention":
        """Below 40 the default parts leave no local window: shrink them with the budget (the app's slider)."""
        if budget >= 40:
            return cls(budget=budget)
        return cls(budget=budget, global_size=min(4, budget // 8), span=max(1, budget // 8), chunk=max(1, budget // 4))

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

    def may_cut(self, end: int) -> bool:
        """Prompt blocks end where Algorithm 1's chunks do: after global + local tokens, then every ``chunk``."""
        opening = self.global_size + self.local
        return end == opening or (end > opening and (end - opening) % self.chunk == 0)

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
            middles = [torch.arange(lo, hi) if chosen is None else chosen.row(0, h).cpu() for h in range(n_kv_heads)]
            kept, valid = _padded([torch.cat([torch.arange(lo), m, torch.arange(hi, e)]) for m in middles])
            rows = slice(s - block.first, e - block.first)
            out[rows], cell_reads, cell_attn = _attend_rerotated(block, kept, valid, s, e, group)
            for h in range(n_kv_heads):
                cells = np.ix_(np.arange(rows.start, rows.stop), kept[h, valid[h]].numpy())
                reads[h][cells] = cell_reads[h][:, valid[h]]
                attn[h][cells] = cell_attn[h][:, valid[h]]
        return state, BlockResult(out=out, reads=reads, attn=attn)


def _padded(kept: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head kept positions (merged spans make the lists differ in length) as [H_kv, L] with a
    validity mask; padding repeats position 0 and is never read."""
    width = max(len(k) for k in kept)
    padded = torch.zeros(len(kept), width, dtype=torch.long)
    valid = torch.zeros(len(kept), width, dtype=torch.bool)
    for h, k in enumerate(kept):
        padded[h, :len(k)] = k
        valid[h, :len(k)] = True
    return padded, valid


def _attend_rerotated(block, kept: torch.Tensor, valid: torch.Tensor, s: int, e: int, group: int):
    """Queries s..e-1 attend, every KV head at once, to their head's kept keys in order, rotated to
    positions 0..L_h-1 (Eq. 3); each query sits at its own key's place in that list.

    Returns the output [e - s, H_q, d] and, per KV head, what each query read (bool) and its mean
    attention over the group's heads, both [H_kv, e - s, L] numpy.
    """
    n_kv_heads, width = kept.shape
    n_c, dim = e - s, block.q_pre.shape[-1]
    device = block.q.device
    heads, at = torch.arange(n_kv_heads, device=device)[:, None], kept.to(device)
    keys = block.rope(block.k_pre[heads, at],
                      torch.arange(width, device=device))  # [H_kv, L, d]: valid entries first, at 0..L_h-1
    positions = torch.arange(s, e)
    own = valid.sum(1)[:, None] - (e - positions)[None, :]  # [H_kv, n_c]: each query's own key
    q_pre = block.q_pre[:, s - block.first: e - block.first].reshape(n_kv_heads, group, n_c, dim)
    q = block.rope(q_pre.transpose(0, 1).reshape(group, n_kv_heads * n_c, dim), own.flatten().to(device))
    q = q.reshape(group, n_kv_heads, n_c, dim).transpose(0, 1)  # [H_kv, G, n_c, d]
    visible = valid[:, None, :] & (kept[:, None, :] <= positions[None, :, None])  # causal within the chunk
    if block.window is not None:  # a sliding-window layer: keys the model's window has passed are not read
        visible = visible & (kept[:, None, :] > positions[None, :, None] - block.window)
    logits = q @ keys[:, None].transpose(-1, -2) * block.scaling
    if block.softcap is not None:
        logits = torch.tanh(logits / block.softcap) * block.softcap
    scores = logits.masked_fill(~visible[:, None].to(device), float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [H_kv, G, n_c, L]
    values = block.v[heads, at]  # [H_kv, L, d]
    out = (weights @ values[:, None]).permute(2, 0, 1, 3).reshape(n_c, n_kv_heads * group, dim)
    return out, visible.numpy(), weights.mean(1).float().cpu().numpy()
