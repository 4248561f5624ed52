"""Oracle ("Ideal" in the A2SF paper, Sec. 4.3): a reference, not a deployable policy."""
from dataclasses import dataclass

from .base import SelectionPolicy, top_positions, top_positions_block
from .registry import register


@register
@dataclass(frozen=True)
class Oracle(SelectionPolicy):
    """Query t reads the ``budget`` tokens with the highest exact attention over the whole cache.

    Nothing is ever dropped: the next query chooses again from every earlier token. The scores are
    the query's full softmax row (mean over the query heads of a KV head).

    budget: tokens each query reads, its own included.
    heads: 'head' (each KV head picks its own) or 'layer' (the mean row decides for all heads).
    """

    name = "oracle"
    summary = 'each query reads the top-`budget` tokens of its exact attention ("Ideal")'
    paper = 'A2SF Sec. 4.3'
    color = "#CC79A7"
    heads: str = "head"

    def select(self, state, attn_full, t):
        return state, top_positions(attn_full, self.budget, self.heads)

    def select_block(self, state, attn_full, first):
        return state, top_positions_block(attn_full, self.budget, self.heads, first)
