"""StreamingLLM as its paper runs it (Xiao et al., 2023, Sec. 3.2): attention sinks plus a recent window, the keys
rotated by their place in the cache rather than in the text."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import AttendingPolicy, BlockResult, over_group
from .registry import register


@register
@dataclass(frozen=True)
class StreamingLLM(AttendingPolicy):
    """Sinks + recent window with positions within the cache: keys are cached before RoPE and rotated at 0..L-1.

    Query t reads what ``sinks`` reads: the first ``sinks`` tokens and the latest ``budget - sinks``, itself
    included. Unlike ``sinks``, which keeps every key at its position in the text, the cache is renumbered
    (Sec. 3.2: a cache holding tokens [0, 1, 2, 3, 6, 7, 8] that decodes token 9 gives them positions
    0..7): sink i sits at position i, the window follows, and the query sits at its own place in the
    cache, min(t, budget - 1). The authors' code (``pos_shift``) rotates the cached pre-RoPE keys by
    ``arange(cache length)`` and the query at the cache length; this policy computes the same attention
    (each query's cache is its own) from the model's RoPE, using that RoPE scores depend only on distances
    (``attend_block``).

    What changes: inside the window the distance from query to key is the same either way (both are
    shifted by t - budget + 1), so only the sinks move: query t sees sink i budget - 1 - i positions back
    instead of t - i. Positions never exceed budget - 1, however long the text, which is what lets the
    paper's models run past their training length.

    budget: tokens each query reads, its own included (the cache size).
    sinks: how many initial tokens (attention sinks) stay; must be < budget.
    """

    honours_layer_limits: ClassVar[bool] = True  # Block.window and Block.softcap

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

    def reads_all_before(self) -> int:
        return self.budget  # query t < budget holds every token, at its own position (nothing has slid)

    def cache_of(self, steps: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each query's cache, in cache order: positions in the text [n, L] (L = min(budget, length)) and which
        exist yet [n, L] (a query before position L - 1 holds fewer). Entry j sits at RoPE position j."""
        j = torch.arange(min(self.budget, length), device=steps.device)
        slid = (steps - (self.budget - 1)).clamp(min=0)  # how far the window has moved past the text's start
        where = j[None, :] + (j[None, :] >= self.sinks) * slid[:, None]
        return where, where <= steps[:, None]

    def attend_block(self, state, block):
        """Each query's re-rotated cache, computed without rotating it per query: RoPE scores depend only on
        the distance between query and key, and inside the window both are shifted by the same ``slid``, so
        the window's scores are the model's own (keys and queries at their positions in the text); only the
        sinks, which stay at 0..sinks-1 while the query sits at its place in the cache, ``t - slid``, take a
        query rotated there. A block then costs O(n x (n + budget)), not a rotation of ``budget`` keys per
        query; tests/test_quest_streamingllm.py holds it equal to rotating each query's cache."""
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        group = n_q_heads // n_kv_heads
        device, first = block.q.device, block.first
        steps = torch.arange(first, first + n, device=device)
        slid = (steps - (self.budget - 1)).clamp(min=0)
        sinks, window = min(self.sinks, total), self.budget - self.sinks
        lo = max(0, first - window + 1)  # the earliest window key of the block's queries
        near = torch.arange(lo, first + n, device=device)
        sink_ok = torch.arange(sinks, device=device)[None, :] <= steps[:, None]  # [n, sinks]
        earliest = torch.clamp(steps - window + 1, min=sinks)  # [n]: each query's first window position
        near_ok = (near[None, :] >= earliest[:, None]) & (near[None, :] <= steps[:, None])
        if block.window is not None:  # a sliding-window layer: keys the model's window has passed are not read
            sink_ok = sink_ok & (torch.arange(sinks, device=device)[None, :] > steps[:, None] - block.window)
            near_ok = near_ok & (near[None, :] > steps[:, None] - block.window)
        q_text = block.q.view(n_kv_heads, group, n, dim)  # at its position in the text
        q_cache = block.rope(block.q_pre, steps - slid).view(n_kv_heads, group, n, dim)  # at its place in the cache
        if block.softcap is None:
            sink_scores = over_group(q_cache, block.k[:, None, :sinks].transpose(-1, -2))
            near_scores = over_group(q_text, block.k[:, None, lo:].transpose(-1, -2))
            scores = torch.cat([sink_scores.masked_fill(~sink_ok, float("-inf")),
                                near_scores.masked_fill(~near_ok, float("-inf"))], -1) * block.scaling
        else:  # capped first: a capped -inf would be finite
            scores = torch.cat([block.logits(q_cache, block.k[:, None, :sinks]), block.logits(q_text, block.k[:, None, lo:])],
                               -1).masked_fill(~torch.cat([sink_ok, near_ok], -1), float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # [H_kv, G, n, sinks + near]
        values = torch.cat([block.v[:, :sinks], block.v[:, lo:]], 1)
        out = over_group(weights, values[:, None]).permute(2, 0, 1, 3).reshape(n, n_q_heads, dim)
        mean = weights.mean(1).float().cpu().numpy()
        reads = np.zeros((n_kv_heads, n, total), bool)
        attn = np.zeros((n_kv_heads, n, total), np.float32)
        reads[..., lo:] = near_ok.cpu().numpy()
        attn[..., lo:] = mean[..., sinks:]
        reads[..., :sinks] |= sink_ok.cpu().numpy()
        attn[..., :sinks] += mean[..., :sinks]
        return state, BlockResult(out=out.to(block.q.dtype), reads=reads, attn=attn)
