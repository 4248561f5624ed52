"""SimLayerKV (Zhang et al., 2024, *SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction*)."""
from dataclasses import dataclass

import numpy as np

from .base import CacheView, CompressionPolicy, latest
from .registry import register


@register
@dataclass(frozen=True)
class SimLayerKV(CompressionPolicy):
    """Find the lazy layers and keep only their first and latest tokens; other layers keep everything.

    A layer is lazy when the last ``last`` queries (the prompt's end) put more than ``threshold`` of their attention
    (mean over heads and queries) on the ``sinks`` first tokens and the ``budget - sinks`` before them (their
    attention to themselves left out, as kvpress's): it reads little else, so the rest can go (the paper's finding:
    such layers recur across prompts). A lazy layer then keeps its ``sinks`` first and ``budget - sinks`` latest
    tokens; a busy one the whole text. One decision per layer.

    As kvpress's ``SimLayerKVPress`` (1 last query, 4 sinks; ``n_recent`` = budget - sinks), with the paper's
    threshold for Llama 3 (0.9; kvpress's default 1.0 makes no layer lazy; the paper gives 0.65 for Llama 2, 0.8
    Mistral, 0.85 Qwen). kvpress keeps one token fewer in a lazy layer (``n_recent - n_last`` latest).

    budget: tokens a lazy layer keeps (sinks included). sinks: first tokens kept. last: queries that decide.
    threshold: share of attention on the kept tokens above which a layer is lazy.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "simlayerkv"
    summary = "once the prompt is read, layers that attend only to the first and latest tokens keep just those"
    paper = "Zhang et al., 2024, *SimLayerKV: A Simple Framework for Layer-Level KV Cache Reduction*"
    color = "#B2182B"
    allocation = "lazy layers only"
    within_budget = False  # a busy layer holds the whole text
    reads_every_key = True  # and its queries read every key, as a selection policy's do (limits.row_cost)
    sinks: int = 4
    last: int = 1
    threshold: float = 0.9

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget or self.last < 1 or not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"{self.name}: need 0 <= sinks < budget, last >= 1 and threshold in 0..1, got "
                             f"sinks={self.sinks}, last={self.last}, threshold={self.threshold}")

    @classmethod
    def for_budget(cls, budget: int) -> "SimLayerKV":
        return cls(budget=budget, sinks=min(4, budget // 2))

    @property
    def window_queries(self) -> int:
        return self.last

    def lazy(self, view: CacheView) -> bool:
        """Do the last queries put more than ``threshold`` of their attention on the first ``sinks`` tokens and the
        ``budget - sinks`` before them (their attention to themselves left out, as kvpress)?"""
        rows = view.attn_window  # [H, w, t+1]
        if rows.shape[1] == 0:
            return False
        order = np.cumsum(view.kept, axis=1)  # 1 = the first cached token
        before = np.cumsum(view.kept[:, ::-1], axis=1)[:, ::-1] - self.last  # 1 = the latest before the queries
        scored = view.kept & ((order <= self.sinks) | ((before >= 1) & (before <= self.budget - self.sinks)))
        return float((rows * scored[:, None, :]).sum(-1).mean()) > self.threshold

    def keep(self, view: CacheView) -> np.ndarray:
        if not self.lazy(view):
            return view.kept.copy()
        first = view.kept & (np.cumsum(view.kept, axis=1) <= self.sinks)
        return first | latest(view.kept, self.budget - self.sinks)
