"""StreamingLLM as its paper runs it (Xiao et al., 2023, Sec. 3.2): attention sinks plus a recent window, the keys
rotated by their place in the cache rather than in the text."""
from dataclasses import dataclass

import numpy as np
import torch

from .base import AttendingPolicy, BlockResult
from .registry import register

ROW_ELEMENTS = 1 << 22  # gathered key entries per slice of queries (memory stays bounded on long blocks)


@register
@dataclass(frozen=True)
class StreamingLLM(AttendingPolicy):
    """Sinks + recent window with positions within the cache: keys are cached before RoPE and rotated at 0..L-1.

    Query t reads what ``sinks`` reads: the first ``sinks`` tokens and the latest ``budget - sinks``, itself
    included. Unlike ``sinks``, which keeps every key at its position in the text, the cache is renumbered
    (Sec. 3.2: a cache holding tokens [0, 1, 2, 3, 6, 7, 8] that decodes token 9 gives them positions
    0..7): sink i sits at position i, the window follows, and the query sits at its own place in the
    cache, min(t, budget - 1). The authors' code (``pos_shift``) rotates the cached pre-RoPE keys by
    ``arange(cache length)`` and the query at the cache length; so does this policy, one query at a time
    (each query's cache is its own), with the model's RoPE.

    What changes: inside the window the distance from query to key is the same either way (both are
    shifted by t - budget + 1), so only the sinks move: query t sees sink i budget - 1 - i positions back
    instead of t - i. Positions never exceed budget - 1, however long the text, which is what lets the
    paper's models run past their training length.

    budget: tokens each query reads, its own included (the cache size).
    sinks: how many initial tokens (attention sinks) stay; must be < budget.
    """

    name = "streamingllm"
    summary = 'first `sinks` tokens + recent window, keys re-rotated to their place in the cache (0..budget-1)'
    paper = 'Xiao et al., 2023, *Efficient Streaming Language Models with Attention Sinks*, Sec. 3.2'
    color = "#EE3377"
    needs_prerope = True
    reads_every_key = False  # a query reads its cache, ``budget`` keys, re-rotated
    budget: int = 64
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"streamingllm: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")

    @classmethod
    def for_budget(cls, budget: int) -> "StreamingLLM":
        return cls(budget=budget, sinks=min(4, budget - 1))

    def cache_of(self, steps: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's cache, in cache order: positions in the text [n, L] (L = min(budget, length)) and which
        exist yet [n, L] (a query before position L - 1 holds fewer). Entry j sits at RoPE position j."""
        j = torch.arange(min(self.budget, length), device=steps.device)
        slid = (steps - (self.budget - 1)).clamp(min=0)  # how far the window has moved past the text's start
        where = j[None, :] + (j[None, :] >= self.sinks) * slid[:, None]
        return where, where <= steps[:, None]

    def attend_block(self, state, block):
        n_q_heads, n, dim = block.q_pre.shape
        n_kv_heads, total, _ = block.k_pre.shape
        group = n_q_heads // n_kv_heads
        device = block.q_pre.device
        steps = torch.arange(block.first, block.first + n, device=device)
        where, exists = self.cache_of(steps, total)
        width = where.shape[1]
        slots = torch.arange(width, device=device)
        out = torch.empty(n, n_q_heads, dim, dtype=block.q.dtype, device=device)
        reads = np.zeros((n_kv_heads, n, total), bool)
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        rows_per_slice = max(1, ROW_ELEMENTS // (n_kv_heads * width * dim))
        for s in range(0, n, rows_per_slice):
            rows = slice(s, min(s + rows_per_slice, n))
            at, ok = where[rows], exists[rows]  # [r, L]
            keys = block.rope(block.k_pre[:, at], slots)  # [H_kv, r, L, d]: entry j rotated at position j
            place = ok.sum(1) - 1  # the query's own place in its cache: min(t, budget - 1)
            q = block.rope(block.q_pre[:, rows], place).view(n_kv_heads, group, -1, dim)
            scores = torch.einsum("hgrd,hrld->hgrl", q, keys) * block.scaling
            weights = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)
            values = block.v[:, at]  # [H_kv, r, L, d]
            out[rows] = torch.einsum("hgrl,hrld->rhgd", weights, values).reshape(-1, n_q_heads, dim).to(out.dtype)
            index = np.broadcast_to(at.cpu().numpy(), (n_kv_heads, *at.shape))
            np.put_along_axis(reads[:, rows], index, np.broadcast_to(ok.cpu().numpy(), index.shape), axis=-1)
            np.put_along_axis(attn[:, rows], index, weights.mean(1).float().cpu().numpy(), axis=-1)
        return state, BlockResult(out=out, reads=reads, attn=attn)
