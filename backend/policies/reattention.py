"""ReAttention (Liu et al., 2024, Sec. 2, App. A): position-agnostic top-k selection, then RoPE on
the selected cache renumbered 0..L-1, so the attention scope stays small however long the text."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from kernels.reattention import chunk_groups, middle_segment, reattention_select_chunks
from kernels.reattention_triton import reattention_select

from .base import AttendingPolicy, BlockResult
from .registry import register


# Elements of a group of chunks' attention (its logits, and its read maps over the cache) computed at once: on
# a CPU a block's 16-query chunks in one to three batches at 4k tokens on the default model, on a GPU in
# few launches.
ATTEND_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 26}


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

    def reads_all_before(self) -> int:
        """A chunk ending at e reads its whole middle while it fits the spans (e <= budget); a prompt's chunks end
        on the grid global + local + j * chunk or sooner (a block end cuts them), a decoding step's at t + 1."""
        return self.global_size + self.local + self.topk * self.span // self.chunk * self.chunk

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
        chunks = self.chunks(block.first, block.q.shape[1], block.decoding)
        return state, _attend_rerotated(block, self.chunk_reads(block, chunks), chunks)

    def chunk_reads(self, block, chunks: list[tuple[int, int]]) -> torch.Tensor:
        """bool [C, H_kv, M]: the keys each chunk's queries read: the first ``global_size``, the last ``local``
        before the chunk's end and the chunk's own, and in the middle the voted spans, or the whole middle where
        it fits in them. Every chunk of the block is selected in one batched call (kernels/reattention.py); a
        block of one chunk on a GPU takes the Triton kernel (kernels/reattention_triton.py)."""
        n_kv_heads, total, _ = block.k.shape
        device = block.k.device
        bounds = [(e, *middle_segment(e, self.global_size, self.local)) for _, e in chunks]
        position = torch.arange(total, device=device)
        end, lo, hi = (torch.tensor(column, device=device)[:, None] for column in zip(*bounds))
        fits = [h - l <= self.topk * self.span for _, l, h in bounds]  # a middle the spans would cover is read whole
        whole = torch.tensor(fits, device=device)[:, None]
        keep = (position < lo) | ((position >= hi) & (position < end)) | ((position >= lo) & (position < hi) & whole)
        keep = keep[:, None].expand(-1, n_kv_heads, -1).clone()
        voting = [c for c, fit in enumerate(fits) if not fit]
        if len(voting) == 1 and block.k.is_cuda:  # a decoding step on a GPU: the kernel, without the [H_q, M] scores
            (s, e), = [chunks[c] for c in voting]
            voters = block.q_pre[:, s - block.first: e - block.first].reshape(1, -1, block.q_pre.shape[-1])
            keep[voting[0]] |= reattention_select(voters, block.k_pre[None, :, :e], self.global_size, self.local,
                                                  self.span, self.topk).mask(0, total)
        elif voting:
            keep[voting] |= reattention_select_chunks(block.q_pre, block.k_pre, [chunks[c] for c in voting],
                                                      block.first, self.global_size, self.local, self.span, self.topk)
        return keep


def _attend_rerotated(block, keep: torch.Tensor, chunks: list[tuple[int, int]]) -> BlockResult:
    """Each chunk's queries attend to their head's kept keys in order, rotated to positions 0..L-1 (Eq. 3);
    each query sits at its own key's place in that list. The chunks go in groups (``chunk_groups``), every
    chunk and KV head of a group at once: a group's logits and read maps stay within ``ATTEND_ELEMENTS``.

    keep: bool [C, H_kv, M] on the block's device. Returns the output [n, H_q, d] and, per KV head, what each
    query read (bool) and its mean attention over the group's heads, both [H_kv, n, M] numpy.
    """
    n_kv_heads, total = keep.shape[1:]
    n_q_heads, n, dim = block.q_pre.shape
    widths = keep.sum(-1).amax(-1).tolist()
    costs = [(e - s, n_q_heads * width + n_kv_heads * total) for (s, e), width in zip(chunks, widths)]
    limit = ATTEND_ELEMENTS["cuda" if keep.is_cuda else "cpu"]
    out = torch.empty(n, n_q_heads, dim, dtype=block.q.dtype, device=keep.device)
    parts = [_attend_group(block, keep[a:b], chunks[a:b], out) for a, b in chunk_groups(costs, limit)]
    return BlockResult(out=out, reads=np.concatenate([r for r, _ in parts], axis=1),
                       attn=np.concatenate([a for _, a in parts], axis=1))


def _attend_group(block, keep: torch.Tensor, chunks: list[tuple[int, int]], out: torch.Tensor):
    """``_attend_rerotated`` for one group of consecutive chunks: their queries' rows of ``out`` written, and
    their (reads, attn), [H_kv, n_group, M] numpy, returned."""
    n_chunks, n_kv_heads, total = keep.shape
    n_q_heads, _, dim = block.q_pre.shape
    group, device = n_q_heads // n_kv_heads, keep.device
    width = int(keep.sum(-1).max())
    position = torch.arange(total, device=device)
    # A head's kept positions ascending, padded with `total`; the padding is never read.
    at = torch.sort(torch.where(keep, position, total), dim=-1).values[..., :width]  # [C, H_kv, L]
    valid, at = at < total, at.clamp(max=total - 1)
    heads = torch.arange(n_kv_heads, device=device)[None, :, None]
    keys = block.rope(block.k_pre[heads, at].reshape(n_chunks * n_kv_heads, width, dim),
                      torch.arange(width, device=device)).view(n_chunks, n_kv_heads, width, dim)
    values = block.v[heads, at]  # [C, H_kv, L, d]
    # Each chunk's queries; a shorter chunk's padding rows repeat its last query and are dropped at the end.
    rows = max(e - s for s, e in chunks)
    t = torch.tensor([[min(s + j, e - 1) for j in range(rows)] for s, e in chunks], device=device)  # [C, n_c]
    real = torch.tensor([[j < e - s for j in range(rows)] for s, e in chunks], device=device)
    own = (keep.cumsum(-1) - 1).gather(-1, t[:, None, :].expand(-1, n_kv_heads, -1))  # [C, H_kv, n_c]
    q_pre = block.q_pre[:, t - block.first].view(n_kv_heads, group, n_chunks, rows, dim)
    q = block.rope(q_pre.permute(1, 2, 0, 3, 4).reshape(group, -1, dim), own.flatten())
    # [C, H_kv, G * n_c, d]: a chunk's group of query heads against its KV head's keys, one matrix product each.
    q = q.view(group, n_chunks, n_kv_heads, rows, dim).permute(1, 2, 0, 3, 4).reshape(n_chunks, n_kv_heads, -1, dim)
    visible = valid[:, :, None, :] & (at[:, :, None, :] <= t[:, None, :, None])  # [C, H_kv, n_c, L]: causal
    if block.window is not None:  # a sliding-window layer: keys the model's window has passed are not read
        visible = visible & (at[:, :, None, :] > t[:, None, :, None] - block.window)
    logits = (q @ keys.transpose(-1, -2) * block.scaling).view(n_chunks, n_kv_heads, group, rows, width)
    if block.softcap is not None:
        logits = torch.tanh(logits / block.softcap) * block.softcap
    weights = torch.softmax(logits.masked_fill(~visible[:, :, None], float("-inf")), dim=-1)  # [C, H_kv, G, n_c, L]
    mixed = (weights.view(n_chunks, n_kv_heads, -1, width) @ values).view(n_chunks, n_kv_heads, group, rows, dim)
    out[(t - block.first)[real]] = mixed.permute(0, 3, 1, 2, 4)[real].reshape(-1, n_q_heads, dim).to(out.dtype)
    # What each query read and its group's mean attention, scattered back to positions: [H_kv, n, M].
    # The padding goes to an extra last column, so it never overwrites a real key's entry.
    spread = torch.where(valid, at, total)[:, :, None, :].expand(-1, -1, rows, -1)
    reads = torch.zeros(n_chunks, n_kv_heads, rows, total + 1, dtype=torch.bool, device=device)
    reads.scatter_(-1, spread, visible)
    attn = torch.zeros(n_chunks, n_kv_heads, rows, total + 1, dtype=torch.float32, device=device)
    attn.scatter_(-1, spread, weights.mean(2).float().masked_fill(~visible, 0))
    return tuple(x[..., :total].permute(1, 0, 2, 3)[:, real].cpu().numpy() for x in (reads, attn))
