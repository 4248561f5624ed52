"""Scissorhands: drop the tokens that were unimportant most often (Liu et al., 2023, Alg. 1-2)."""
from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, grow
from .registry import register

AVERAGES = ("read", "seen")  # a step's average attention: 1/n over the n tokens read, 1/(t+1) over all seen


@register
@dataclass(frozen=True)
class Scissorhands(EvictionPolicy):
    """When the cache is full, drop at once the ``m`` tokens whose attention fell below the step's average
    most often in the last ``window`` steps (the persistence of importance: a token that was unimportant
    keeps being so); the ``recent`` latest tokens are never dropped. Then no token leaves until the cache
    is full again, ``m`` steps later (Alg. 1: compress only when the buffer is full; Alg. 2: the counter).

    Defaults: the paper's w = 400, r = 10 and m = 0.5 x budget (Alg. 1-2); ``drop=0.4`` is the value
    cold-compress's first Scissorhands version (AnswerDotAI; the paper has no official code) names as the
    paper's. "Below the average" is attention < 1/n, n the tokens the query read (the average of a softmax
    row over them; ``average="read"``), and the counter is the raw count over the window, the ``m`` highest
    counts go, ties the earliest position: cold-compress's reading of Alg. 2. Alg. 2 writes the threshold
    1/t, t the tokens so far, which under a budget is below the average of what a query reads:
    ``average="seen"`` takes it (1/(t+1), t counted from 0). Head-wise: every KV head counts and drops its
    own tokens. GQA: the counter reads the mean attention of the head's query heads (what the engine gives;
    its average is still 1/n).

    budget: tokens each query reads, its own included.
    window: history window w, in steps (each token keeps one bit per step, a ring of w bits).
    recent: recent window r, the latest tokens never dropped; must be < budget.
    drop: drop amount m as a fraction of the budget; m = round(drop x budget), at least 1 and at most
        budget - recent (what is not protected). 0.5 in the paper; 0.4 as cold-compress names it.
    average: "read" (1/n, the tokens the query read) or "seen" (1/(t+1), Alg. 2's 1/t): the threshold below
        which a token counts as unimportant at a step.
    """

    name = "scissorhands"
    summary = "when full, drop at once the `m` tokens most often below average attention in a history window; recent kept"
    paper = "Liu et al., 2023, *Scissorhands*, Alg. 1-2"
    color = "#CC3311"
    version = 2
    window: int = 400
    recent: int = 10
    drop: float = 0.5
    average: str = "read"

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1 or not 0 <= self.recent < self.budget or not 0.0 < self.drop <= 1.0:
            raise ValueError(f"scissorhands: need window >= 1, 0 <= recent < budget and 0 < drop <= 1, got "
                             f"window={self.window}, recent={self.recent}, budget={self.budget}, drop={self.drop}")
        if self.average not in AVERAGES:
            raise ValueError(f"scissorhands: average must be one of {AVERAGES}, got {self.average!r}")

    @classmethod
    def for_budget(cls, budget: int) -> "Scissorhands":
        return cls(budget=budget, recent=min(10, budget // 2))

    @property
    def m(self) -> int:
        return max(1, min(round(self.drop * self.budget), self.budget - self.recent))

    def init_state(self, n_heads):
        # Per token, a ring of `window` bits packed in uint64 words: bit t % window is "below average at step t".
        return {"low": np.zeros((n_heads, 0), [("bits", np.uint64, (-(-self.window // 64),))])}

    def step(self, state, attn, kept, t, positions=None):
        n = np.add.reduce(kept, axis=-1)  # tokens each head holds (count_nonzero with an axis is slower)
        ring = grow(state["low"], kept.shape[-1])
        ring = ring.copy() if ring is state["low"] else ring
        word, bit = divmod(t % self.window, 64)
        mean = 1.0 / n[:, None] if self.average == "read" else 1.0 / (t + 1)
        low = (kept & (attn < mean)).astype(np.uint64) << np.uint64(bit)
        bits = ring["bits"]
        bits[..., word] = bits[..., word] & ~(np.uint64(1) << np.uint64(bit)) | low
        if n.max() < self.budget:
            return {"low": ring}, None
        if positions is None:
            positions = np.broadcast_to(np.arange(kept.shape[-1]), kept.shape)
        count = np.bitwise_count(bits).sum(-1).astype(np.float64)
        count = np.where(kept & (positions <= t - self.recent), count, -np.inf)
        return {"low": ring}, np.argsort(-count, axis=-1, kind="stable")[:, : self.m]
