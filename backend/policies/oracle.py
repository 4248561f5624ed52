"""Oracle ("Ideal" in the A2SF paper, Sec. 4.3): a reference, not a deployable policy."""
from dataclasses import dataclass

from .base import SelectionPolicy, check_prefill, top_positions, top_positions_block
from .registry import register


@register
@dataclass(frozen=True)
class Oracle(SelectionPolicy):
    """Query t reads the ``budget`` tokens with the highest exact attention over the whole cache.

    Nothing is ever dropped: the next query chooses again from every earlier token. The scores are
    the query's full softmax row (mean over the query heads of a KV head).

    budget: tokens each query reads, its own included.
    heads: 'head' (each KV head picks its own) or 'layer' (the mean row decides for all heads).
    prefill: how a generate-mode run reads its prompt. "select" (default): every query selects, the prompt's
        too, as the paper's masks show it (one per query row). "dense": the prompt is read exactly and the
        oracle selects from the first answer token on, a ceiling for selection at decoding time (Quest's and
        SparQ's ``prefill="dense"``). In prompt mode there is no prompt, and it changes nothing.
    """

    name = "oracle"
    summary = 'each query reads the top-`budget` tokens of its exact attention ("Ideal")'
    paper = 'A2SF Sec. 4.3'
    color = "#CC79A7"
    heads: str = "head"
    prefill: str = "select"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_prefill(self.name, self.prefill)

    def reads_prompt_densely(self) -> bool:
        return self.prefill == "dense"

    def reads_all_before(self) -> int:
        return self.budget  # query t has t + 1 tokens to choose from

    def select(self, state, attn_full, t):
        return state, top_positions(attn_full, self.budget, self.heads)

    def select_block(self, state, attn_full, first):
        return state, top_positions_block(attn_full, self.budget, self.heads, first)
