"""KVzip (Kim et al., 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*, Sec. 3)."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import CacheView, CompressionPolicy, grow, keep_top
from .registry import register


@register
@dataclass(frozen=True)
class KVzip(CompressionPolicy):
    """Keep the tokens the model attends to most while it re-reads its context after a repeat prompt.

    A second pass (``backend/engine/reconstruction.py``, run by the runner): the model reads "Repeat the previous
    context exactly." + its chat template's assistant turn + the context again, teacher-forced, over the
    row's cache. A token's score is the highest attention any query of that pass, from any query head of
    the KV head's group, gives it (the authors' ``amax`` over group and queries); per KV head the ``budget``
    best stay. The pass is the method's cost: traces report its tokens (``extra_pass_tokens``).

    Choices from the authors' code (github:snu-mllab/KVzip, ``model/wrapper.py``, ``attention/score.py``):
    the context is re-read in pieces of at most ``chunk`` tokens; a piece after the first is prompted
    "Repeat the part of the previous context exactly, starting with " + the 8 tokens before it; a piece's
    scores are the softmax over the sinks, the piece and the pass's own tokens (not the rest of the cache);
    a model without a chat template gets "\\n\\nAnswer: ". The authors never evict the system prompt; KV
    Lens texts have none, so, as kvpress, the first ``sinks`` tokens stand for it and are always kept.
    Budgets are uniform over heads (the authors' ``pair-uniform``; their default shares one budget across
    layers and heads).

    When: in generate mode once the prompt is read (the paper), then every ``every`` decoding steps; in
    prompt mode every ``interval`` tokens. Each pass re-reads only the tokens not scored yet (its pieces
    continue the authors' chunking), so every token is re-read once and the cost is linear in the text; a
    compression that would drop nothing skips its pass.

    budget: tokens kept per KV head at each compression, the sinks included.
    sinks: first tokens always kept. chunk: most context tokens one reconstruction piece re-reads.
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "kvzip"
    summary = "keep the tokens drawing the most attention while the model re-reads its context (a second pass)"
    paper = "Kim et al., 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*, Sec. 3"
    color = "#44AA99"
    uses_attention = False  # its scores come from its own pass, not from the text's attention
    rereads: ClassVar[bool] = True  # the runner feeds it a reconstruction pass before it compresses
    extra_passes: ClassVar[int] = 1  # that pass: the row costs twice its length (limits.row_cost)

    FIRST: ClassVar[str] = "\n\nRepeat the previous context exactly."
    LATER: ClassVar[str] = "\n\nRepeat the part of the previous context exactly, starting with "
    NO_TEMPLATE: ClassVar[str] = "\n\nAnswer: "
    OVERLAP: ClassVar[int] = 8  # tokens before a later piece that its prompt quotes

    sinks: int = 4
    chunk: int = 2000

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"kvzip: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")
        if self.chunk < 1:
            raise ValueError(f"kvzip: chunk must be >= 1, got {self.chunk}")

    @classmethod
    def for_budget(cls, budget: int) -> "KVzip":
        return cls(budget=budget, sinks=min(4, budget - 1))

    def schedule(self, mode: str | None = None) -> str:
        return super().schedule(mode) + ", after a reconstruction pass"

    def init_state(self, n_heads: int):
        # score: [H, positions] the max attention of the pass that re-read each position; scored: how many
        # positions (0..scored-1) have one.
        return {"score": np.zeros((n_heads, 0)), "scored": np.zeros(1, np.int64)}

    def rereads_from(self, state) -> int:
        return int(state["scored"][0])

    def pass_sinks(self) -> int:
        return self.sinks

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The pieces [a, b) that re-read positions lo..hi-1."""
        return [(a, min(a + self.chunk, hi)) for a in range(lo, hi, self.chunk)]

    def prompt(self, ids: list[int], a: int, b: int, encode, suffix: list[int]) -> list[int]:
        """The pass's tokens for piece [a, b) of ``ids`` (the row's tokens so far): the repeat prompt, the
        assistant turn ``suffix``, then the piece. ``encode(text)`` gives token ids."""
        if a == 0:
            head = encode(self.FIRST)
        else:
            head = encode(self.LATER) + list(ids[max(0, a - self.OVERLAP):a])
        return head + list(suffix) + list(ids[a:b])

    def record(self, state, a: int, b: int, score: np.ndarray) -> None:
        """Store the pass's max attention [H, b - a] for positions a..b-1."""
        state["score"] = grow(state["score"], b)
        state["score"][:, a:b] = score
        state["scored"][0] = max(int(state["scored"][0]), b)

    def keep(self, view: CacheView) -> np.ndarray:
        if view.state["scored"][0] < view.t + 1:
            # Not re-read yet: the engine's walk asks at the scheduled step, the runner's pass comes after
            # the forward call; KVzip compresses then (RowLayerState.compress_now).
            return view.kept.copy()
        score = view.state["score"][:, : view.t + 1].copy()
        score[:, : self.sinks] = np.inf
        return keep_top(score, view.kept, self.budget, 0)
