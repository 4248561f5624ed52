"""KVzip (Kim et al., 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*, Sec. 3)."""
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .base import CacheView, CompressionPolicy, grow
from .registry import register

SCOPES = ("model", "layer", "head")
PREFIXES = ("keep", "zero", "reread")


@register
@dataclass(frozen=True)
class KVzip(CompressionPolicy):
    """Keep the tokens the model attends to most while it re-reads its context after a repeat prompt.

    A second pass (``backend/engine/reconstruction.py``, run by the runner): the model reads "Repeat the previous
    context exactly." + its chat template's assistant turn + the context again, teacher-forced, over the
    row's cache. A token's score is the highest attention any query of that pass, from any query head of
    the KV head's group, gives it (the authors' ``amax`` over group and queries). The pass is the method's
    cost: traces report its tokens (``extra_pass_tokens``).

    Which scores stay (``scope``): the paper ranks every layer's and head's scores together and keeps the
    best budget x heads x layers (``model``, the default: the paper's and kvpress's default, the one that
    answers the needle at small budgets, docs/faithfulness.md); ``layer`` ranks a layer's heads together
    (budget x heads per layer, kvpress's ``layerwise=True``); ``head`` keeps ``budget`` per KV head (the
    authors' ``pair-uniform``).

    The context the pass re-reads: the authors re-read the context only, never their system prompt, which
    they always keep; kvpress skips the chat template's header (``prefix_length``). Here the first
    ``sinks`` tokens are always kept and never re-read (they stand for the system prompt of a plain text),
    and ``prefix`` says what becomes of the rest of the chat template's header (its system prompt and the
    user turn's opening, in generate mode with a template): ``keep`` (the authors: not re-read, kept
    besides the budget, which counts the context),
    ``zero`` (kvpress: not re-read, scored 0, so it goes first) or ``reread`` (scored like the context).

    Choices from the authors' code (github:snu-mllab/KVzip, ``model/wrapper.py``, ``attention/score.py``):
    the context is re-read in pieces of at most ``chunk`` tokens; a piece after the first is prompted
    "Repeat the part of the previous context exactly, starting with " + the 8 tokens before it (kvpress
    drops the trailing space: ``quote_space=False``); a piece's scores are the softmax over the sinks, the
    piece and the pass's own tokens (not the rest of the cache); a model without a chat template gets
    "\\n\\nAnswer: ".

    ``preset=kvpress`` is kvpress's ``KVzipPress`` with its defaults: it sets ``scope=model`` (``layerwise=False``;
    ``scope=layer`` beside it is ``layerwise=True``), ``prefix=zero``, ``quote_space=false`` and ``chunk=2048`` (its
    ``chunk_size``); ``sinks`` stays 4 (its ``n_sink``). On a chat prompt its kept sets are then kvpress's in every
    layer and KV head (tests/test_kvpress_reference.py).

    When: in generate mode once the prompt is read (the paper), then every ``every`` decoding steps; in
    prompt mode every ``interval`` tokens. Each pass re-reads only the tokens not scored yet (its pieces
    continue the authors' chunking), so every token is re-read once and the cost is linear in the text; a
    compression that would drop nothing skips its pass.

    budget: tokens kept per KV head at each compression (the mean over heads and layers unless scope=head),
        the sinks included, a kept chat header besides.
    scope: model, layer or head: over what the scores are ranked together.
    prefix: keep, zero or reread: the chat template's header. sinks: first tokens always kept.
    chunk: most context tokens one reconstruction piece re-reads. quote_space: the later pieces' prompt ends
        in a space (the authors) or not (kvpress).
    interval, every: when it compresses (see CompressionPolicy).
    """

    name = "kvzip"
    summary = "keep the tokens drawing the most attention while the model re-reads its context (a second pass)"
    paper = "Kim et al., 2025, *KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction*, Sec. 3"
    color = "#44AA99"
    version = 2
    uses_attention = False  # its scores come from its own pass, not from the text's attention
    rereads: ClassVar[bool] = True  # the runner feeds it a reconstruction pass before it compresses
    extra_passes: ClassVar[int] = 1  # that pass: the row costs twice its length (limits.row_cost)
    presets = {"kvpress": {"scope": "model", "prefix": "zero", "quote_space": False, "chunk": 2048}}

    FIRST: ClassVar[str] = "\n\nRepeat the previous context exactly."
    LATER: ClassVar[str] = "\n\nRepeat the part of the previous context exactly, starting with"
    NO_TEMPLATE: ClassVar[str] = "\n\nAnswer: "
    OVERLAP: ClassVar[int] = 8  # tokens before a later piece that its prompt quotes

    sinks: int = 4
    chunk: int = 2000
    scope: str = "model"
    prefix: str = "keep"
    quote_space: bool = True

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.sinks < self.budget:
            raise ValueError(f"kvzip: need 0 <= sinks < budget, got sinks={self.sinks}, budget={self.budget}")
        if self.chunk < 1:
            raise ValueError(f"kvzip: chunk must be >= 1, got {self.chunk}")
        if self.scope not in SCOPES or self.prefix not in PREFIXES:
            raise ValueError(f"kvzip: scope must be one of {', '.join(SCOPES)} and prefix one of "
                             f"{', '.join(PREFIXES)}, got scope={self.scope!r}, prefix={self.prefix!r}")

    @classmethod
    def for_budget(cls, budget: int) -> "KVzip":
        return cls(budget=budget, sinks=min(4, budget - 1))

    @property
    def allocation(self) -> str:
        return {"model": "across layers and heads", "layer": "across a layer's heads", "head": "uniform"}[self.scope]

    def schedule(self, mode: str | None = None) -> str:
        return super().schedule(mode) + ", after a reconstruction pass"

    def init_state(self, n_heads: int):
        # score: [H, positions] the max attention of the pass that re-read each position; scored: how many
        # positions (0..scored-1) have one (or are never re-read); plan: what the layer keeps after the
        # step ``planned`` (``plan``).
        return {"score": np.zeros((n_heads, 0)), "scored": np.zeros(1, np.int64),
                "plan": np.zeros((n_heads, 0), bool), "planned": np.full(1, -1, np.int64)}

    def context_start(self, prefix: int) -> int:
        """The first position the pass re-reads: after the sinks, and after the chat header unless re-read."""
        return self.sinks if self.prefix == "reread" else max(self.sinks, prefix)

    def rereads_from(self, state, prefix: int) -> int:
        return max(int(state["scored"][0]), self.context_start(prefix))

    def pass_sinks(self) -> int:
        return self.sinks

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The pieces [a, b) that re-read positions lo..hi-1."""
        return [(a, min(a + self.chunk, hi)) for a in range(lo, hi, self.chunk)]

    def prompt(self, ids: list[int], a: int, b: int, encode, suffix: list[int], prefix: int) -> list[int]:
        """The pass's tokens for piece [a, b) of ``ids`` (the row's tokens so far): the repeat prompt, the
        assistant turn ``suffix``, then the piece. ``encode(text)`` gives token ids."""
        if a == self.context_start(prefix):
            head = encode(self.FIRST)
        else:
            head = encode(self.LATER + (" " if self.quote_space else "")) + list(ids[max(0, a - self.OVERLAP):a])
        return head + list(suffix) + list(ids[a:b])

    def record(self, state, a: int, b: int, score: np.ndarray) -> None:
        """Store the pass's max attention [H, b - a] for positions a..b-1."""
        state["score"] = grow(state["score"], b)
        state["score"][:, a:b] = score
        state["scored"][0] = max(int(state["scored"][0]), b)

    def scores(self, state, t: int, prefix: int) -> np.ndarray:
        """[H, t+1]: the pass's scores, +inf for the sinks (and the kept header), 0 for a header scored zero."""
        score = grow(state["score"], t + 1)[:, : t + 1].copy()
        score[:, : self.sinks] = np.inf
        if self.prefix != "reread":
            score[:, self.sinks: prefix] = np.inf if self.prefix == "keep" else 0.0
        return score

    def header(self, prefix: int) -> slice:
        """The chat header's positions kept besides the budget (the authors' system prompt): none unless kept."""
        return slice(self.sinks, prefix if self.prefix == "keep" else self.sinks)

    def would_drop(self, held: list[np.ndarray], prefix: int) -> bool:
        counts = np.stack([h.sum(1) - h[:, self.header(prefix)].sum(1) for h in held])  # [L, H], the header aside
        if self.scope == "model":
            return int(counts.sum()) > self.budget * counts.size
        if self.scope == "layer":
            return bool((counts.sum(1) > self.budget * counts.shape[1]).any())
        return bool((counts > self.budget).any())

    def plan(self, states, held, t: int, prefix: int) -> None:
        """Keep the best budget x (heads x layers | heads | 1) scores of what is held, ranked together over the
        scope, and a kept chat header besides; ties keep the earlier layer, head and position."""
        score = np.stack([np.where(h, self.scores(s, t, prefix), -np.inf) for s, h in zip(states, held)])  # [L, H, n]
        alive, header = np.stack(held), self.header(prefix)
        rows = {"model": 1, "layer": score.shape[0], "head": score.shape[0] * score.shape[1]}[self.scope]
        groups, headers = score.reshape(rows, -1, score.shape[-1]), alive[..., header].reshape(rows, -1)
        keep = np.zeros(groups.shape, bool)
        for g, table in enumerate(groups):
            count = min(self.budget * table.shape[0] + int(headers[g].sum()), int((table > -np.inf).sum()))
            keep[g].flat[np.argsort(-table, axis=None, kind="stable")[:count]] = True
        keep = keep.reshape(score.shape) & alive
        for layer, state in enumerate(states):
            state["plan"], state["planned"][0] = keep[layer], t

    def keep(self, view: CacheView) -> np.ndarray:
        if view.state["planned"][0] != view.t:
            # Not re-read yet: the engine's walk asks at the scheduled step, the runner's pass comes after
            # the forward call; KVzip compresses then (reconstruction.reread, RowLayerState.compress_now).
            return view.kept.copy()
        return view.state["plan"] & view.kept
