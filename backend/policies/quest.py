"""Quest (Tang et al., 2024, Sec. 3.4, Alg. 1): query-aware page selection; nothing is evicted."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .base import AttendingPolicy, BlockResult, check_prefill, masked_attention, over_group
from .registry import register

GROUPS = ("sum", "each")


@register
@dataclass(frozen=True)
class Quest(AttendingPolicy):
    """Pages keep the per-channel min and max of their keys; each query reads the pages whose bound on q.k is highest.

    The cache is cut into pages of ``page_size`` tokens from position 0. A page's metadata is the
    channel-wise min m and max M of its keys after RoPE (the authors' code builds it from the rotated
    keys it caches). A query q bounds q.k over a page by sum_i max(q_i m_i, q_i M_i) (Alg. 1) and reads
    whole pages, ``budget // page_size`` of them, its own included:

    * the page holding the query (the last page, partial while it fills) is always read, and the other
      pages compete for the rest, as in the authors' kernels (``page_budget`` "including the last page";
      estimation and top-k skip the last page). Their accuracy script instead ranks every page, the
      query's own too, with at least 3 pages: not followed, since a query could then skip itself and
      small budgets would be exceeded. Only pages before the query's own compete, so every bound a
      query uses is of complete pages: a prompt block gives each query what decoding would.
    * the first ``dense_layers`` layers read everything (Sec. 4.1; ``_quest_skip_layer = 2`` in the code).
    * every query selects, prompt tokens too (``prefill="select"``, the default): the paper's PG19
      protocol feeds the text one token at a time. Quest's serving system and its passkey and LongBench
      runs read a prompt densely and select only while decoding: ``prefill="dense"`` does that in a
      generate-mode run (the first answer token is then Full's); prompt mode has no prompt to read densely.
    * ties go to the earlier page (``torch.topk`` leaves them unspecified).
    * GQA (the paper and code are multi-head only; their accuracy code repeats KV heads, so each query
      head would pick its own pages): ``group="sum"`` picks one page set per KV head from the sum of its
      query heads' bounds, itself a bound on the group's summed q.k, so a KV head reads ``budget`` tokens;
      ``group="each"`` lets every query head pick its own pages, and the KV head's record is their union
      (up to group size x budget tokens).
    Recorded per step and KV head: ``pages_read``, the pages the query read (its own included).

    budget: tokens a query reads in the selecting layers: ``budget // page_size`` whole pages.
    page_size: tokens per page (16 in the paper).
    dense_layers: the first layers attend to everything (2 in the paper).
    group: "sum" (one choice per KV head) or "each" (one per query head, union recorded).
    prefill: "select" (every prompt query selects) or "dense" (the prompt is read exactly; see above).
    """

    honours_layer_limits: ClassVar[bool] = True  # it reads through masked_attention

    name = "quest"
    summary = ('pages of `page_size` tokens; each query reads its own page and the pages whose min/max keys bound '
               'q.k highest; first `dense_layers` layers dense')
    paper = 'Tang et al., 2024, *Quest*, Sec. 3.4, Alg. 1'
    color = "#CC6677"
    budget: int = 64
    page_size: int = 16
    dense_layers: int = 2
    group: str = "sum"
    prefill: str = "select"

    @classmethod
    def for_budget(cls, budget: int) -> "Quest":
        """Below 64 tokens 16-token pages leave fewer than 4 pages: shrink the pages (the app's slider)."""
        return cls(budget=budget, page_size=min(16, max(1, budget // 4)))

    @property
    def pages(self) -> int:
        return self.budget // self.page_size

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.page_size <= self.budget:
            raise ValueError(f"quest: need 1 <= page_size <= budget, got page_size={self.page_size}, "
                             f"budget={self.budget}")
        if self.dense_layers < 0:
            raise ValueError(f"quest: dense_layers must be >= 0, got {self.dense_layers}")
        if self.group not in GROUPS:
            raise ValueError(f"quest: group must be one of {GROUPS}, got {self.group!r}")
        check_prefill(self.name, self.prefill)

    def reads_prompt_densely(self) -> bool:
        return self.prefill == "dense"

    def reads_all_before(self) -> int:
        # Query t reads its own page (t // page_size) and up to pages - 1 before it: every page while t's is
        # among the first ``pages``.
        return self.pages * self.page_size

    def read_as_full(self, state, first, n, heads, in_prompt):
        pages = np.arange(first, first + n) // self.page_size + 1  # its own and every page before
        return state, {"pages_read": np.repeat(pages[:, None], heads[1], axis=1).astype(np.float32)}

    def choose_pages(self, q: torch.Tensor, k: torch.Tensor, first: int) -> torch.Tensor:
        """q [H_kv, G, n, d] (queries first..first+n-1), k [H_kv, M, d] -> bool [H_kv, 1 or G, n, P]: the pages
        each query reads (P pages of ``page_size``; "sum" gives one row per KV head)."""
        n_kv_heads, total, dim = k.shape
        size = self.page_size
        n_pages = -(-total // size)
        padding = (0, 0, 0, n_pages * size - total)  # the last page's padding never sets its min or max
        hi = torch.nn.functional.pad(k, padding, value=float("-inf")).view(n_kv_heads, n_pages, size, dim).amax(2)
        lo = torch.nn.functional.pad(k, padding, value=float("inf")).view(n_kv_heads, n_pages, size, dim).amin(2)
        # sum_i max(q_i m_i, q_i M_i) = q+ . M + q- . m, for every query and page at once.
        bound = (over_group(q.clamp(min=0), hi.transpose(-1, -2)[:, None])
                 + over_group(q.clamp(max=0), lo.transpose(-1, -2)[:, None]))
        if self.group == "sum":
            bound = bound.sum(1, keepdim=True)
        own = torch.arange(first, first + q.shape[2], device=k.device) // size  # [n]: the query's own page
        page = torch.arange(n_pages, device=k.device)
        competes = page[None, :] < own[:, None]  # [n, P]: complete pages before the query's own
        bound = bound.masked_fill(~competes, float("-inf"))
        chosen = torch.zeros(bound.shape, dtype=torch.bool, device=k.device)
        others = min(self.pages - 1, n_pages)
        if others > 0:
            order = torch.argsort(-bound, dim=-1, stable=True)[..., :others]  # stable: the earlier page wins ties
            chosen.scatter_(-1, order, True)
        return (chosen & competes) | (page[None, :] == own[:, None])

    def attend_block(self, state, block):
        n_q_heads, n, dim = block.q.shape
        n_kv_heads, total, _ = block.k.shape
        group = n_q_heads // n_kv_heads
        device = block.q.device
        q = block.q.view(n_kv_heads, group, n, dim)
        steps = torch.arange(block.first, block.first + n, device=device)
        causal = block.visible()  # [n, M]: causal, and within a sliding-window layer's window
        if block.layer < self.dense_layers:
            read = causal.expand(n_kv_heads, 1, n, total)
            pages_read = ((steps // self.page_size + 1).float().cpu()[:, None]).expand(n, n_kv_heads)
        else:
            precise = torch.promote_types(block.q.dtype, torch.float32)
            chosen = self.choose_pages(q.to(precise), block.k.to(precise), block.first)  # [H_kv, 1|G, n, P]
            read = chosen.repeat_interleave(self.page_size, dim=-1)[..., :total] & causal
            pages_read = chosen.any(1).sum(-1).T.float().cpu()  # [n, H_kv]
        out, weights = masked_attention(block, read)
        reads = read.any(1).cpu().numpy()
        attn = weights.mean(1).float().cpu().numpy()
        stats = {"pages_read": np.ascontiguousarray(pages_read.numpy(), dtype=np.float32)}
        return state, BlockResult(out=out, reads=reads, attn=attn, stats=stats)
