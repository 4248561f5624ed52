"""What every policy shares.

A policy decides, at every step t (one query, prompt or generated alike), which cached tokens that
query reads. Its decision is a pure function, so the prompt path, the decode path and the tests all
call the same code. When it acts is its kind:

* an **eviction** policy acts every step: it sees the attention of query t over what it read and
  returns the token each KV head drops once the cache is full (``step``);
* a **compression** policy acts on a schedule (once when the prompt has been read, then optionally every
  N decoding steps; in prompt mode every ``interval`` tokens): it scores the whole cache from a
  ``CacheView`` (the attention of a window of recent queries, the keys and values, the step, the
  prompt length, the layer) and keeps any number of tokens per head (``keep``);
* a **selection** policy chooses, before query t reads, which positions it reads (``select``); one that
  ``attends`` computes a block of queries' attention output itself (``attend_block``).

Every hook the engine and the runner may ask a policy is declared on ``Policy``, with its default.

Arrays are numpy, one row per KV head; ``attn`` is the mean softmax row of the query heads that share
that KV head (GQA), over positions ``0..t`` (zero where a token is not read).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np
import torch

State = dict[str, np.ndarray]

HEAD_MODES = ("head", "layer")
# What a policy may do to the tokens it holds besides choosing them (``Policy.reforms``): nothing (""), read only
# some of their key channels (ThinK), fold evicted values into held ones (CaM), hold them at fewer bits (KIVI), or
# turn their keys to other positions (FINCH's re-rotation).
REFORMS = ("", "channels", "merge", "precision", "rotation")


UINT64_MASK, _C1, _C2 = 2**64 - 1, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def splitmix64(x):
    """splitmix64's finaliser, a bijection of 64-bit integers that scatters nearby inputs (a Python int, kept to 64
    bits, or a uint64 array, which wraps around): the counter-based hash of the seeded policies."""
    if isinstance(x, int):
        x = (x ^ x >> 30) * _C1 & UINT64_MASK
        x = (x ^ x >> 27) * _C2 & UINT64_MASK
        return x ^ x >> 31
    x = (x ^ x >> np.uint64(30)) * np.uint64(_C1)
    x = (x ^ x >> np.uint64(27)) * np.uint64(_C2)
    return x ^ x >> np.uint64(31)


def grow(a: np.ndarray, length: int) -> np.ndarray:
    """Pad the last axis with zeros up to ``length`` (per-token state grows by one token a step)."""
    if length <= a.shape[-1]:
        return a
    grown = np.zeros(a.shape[:-1] + (length,), a.dtype)  # filling a new array: concatenate is slower (structured)
    grown[..., : a.shape[-1]] = a
    return grown


def ratio_budget(ratio: float, context: int) -> int:
    """The budget a compression ratio leaves on ``context`` tokens (kvpress's meaning: the share of the context's KV
    pairs removed, so 0.75 keeps a quarter): int(context x (1 - ratio)), at least 1."""
    return max(1, int(context * (1.0 - ratio)))


@dataclass(frozen=True)
class Policy:
    """Base of all policies: a name for the registry, parameter checks, and every hook the engine and the
    runner may ask a policy, each with its default (a plugin reads this class to learn them all; each kind's
    class below adds the methods that kind must give)."""

    name: ClassVar[str]
    kind: ClassVar[str]
    allocation: ClassVar[str] = "uniform"  # how the budget is shared across layers and heads
    summary: ClassVar[str] = ""  # one line for the docs' policy table and the app
    paper: ClassVar[str] = ""  # the reference the policy implements
    color: ClassVar[str] = ""  # its colour in every figure ("" = the next free palette colour)
    # Bump when the policy's decisions change: its traces in the store are then recomputed, never replayed.
    version: ClassVar[int] = 1
    # Named sets of parameters a spec can take whole (``preset=kvpress``): another implementation's settings.
    presets: ClassVar[dict[str, dict]] = {}
    # Window and sinks never look at attention: the engine skips computing it for them.
    uses_attention: ClassVar[bool] = True
    # What a row costs (limits.row_cost): every key for every query (selection), and passes over the text
    # besides the model's own (KVzip's reconstruction re-reads the context once).
    reads_every_key: ClassVar[bool] = False
    extra_passes: ClassVar[int] = 0
    # Does every query read at most ``budget`` tokens (after each compression)? SimLayerKV's busy layers hold the
    # whole text: its budget is its lazy layers'.
    within_budget: ClassVar[bool] = True

    # The hooks the engine and the runner ask every policy, declared here so one class lists them all; each
    # kind's class below adds what that kind gives (``step``, ``keep``, ``select``).

    # Plain class attributes, not annotated: a policy with a budget or a choice of heads declares its own
    # dataclass field of that name, and a base field would move it to the front of the parameter order.
    # Tokens the policy holds or reads per KV head; None: it holds every token and takes no budget (Full, KIVI,
    # GEAR: a spec that gives it one is told so, with the parameters it takes).
    budget = None
    heads = "head"  # "head": one decision per KV head; "layer": one for the layer (the heads' mean score)

    # Computes its own attention output for a block of queries (``attend_block``) instead of the engine's.
    attends: ClassVar[bool] = False
    # Reads queries and keys before RoPE (``Block.q_pre``, ``Block.k_pre``): the engine then captures them.
    needs_prerope: ClassVar[bool] = False
    # Runs on sliding-window and soft-capped layers (Gemma): the engine applies both for every policy it attends
    # for; one that ``attends`` itself must honour ``Block.window`` and ``Block.softcap`` to say True.
    honours_layer_limits: ClassVar[bool] = True
    # A compression policy that scores its cache from an extra pass over the text, which the runner feeds it
    # before it compresses (backend/engine/reconstruction.py; KVzip); the pass asks CompressionPolicy's
    # ``rereads_from``, ``pieces``, ``prompt``, ``pass_sinks``, ``record``, ``would_drop``, ``plan`` and
    # ``NO_TEMPLATE``.
    rereads: ClassVar[bool] = False
    # Do the policy's decisions depend on where a generate-mode run's prompt ends (the context's end, in a
    # query-agnostic task run, or the question's)? A compression policy compresses there and a dense prefill
    # ends there; a per-step eviction policy decides alike wherever it is said to end.
    reads_prompt_end: ClassVar[bool] = True
    # Does the policy change the form of the keys and values it holds (one of REFORMS; "" holds them as the model
    # computed them)? A compression policy that does says how in ``reform``, each time it compresses; the engine
    # then reads its held tokens in their new form on every path, and the trace records what changed
    # (docs/trace-format.md, "Held forms").
    reforms: ClassVar[str] = ""

    def __post_init__(self) -> None:
        budget = self.budget
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{self.name}: budget must be an integer >= 1, got {budget!r}")
        heads = self.heads
        if heads not in HEAD_MODES:
            raise ValueError(f"{self.name}: heads must be one of {HEAD_MODES}, got {heads!r}")
        if self.reforms not in REFORMS or (self.reforms and self.kind != "compression"):
            raise ValueError(f"{self.name}: reforms must be one of {REFORMS[1:]} on a compression policy (it reforms "
                             f"what it holds when it compresses), got {self.reforms!r} on a {self.kind} policy")

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def whole(self) -> "Policy":
        """The policy holding every token it keeps in its whole form (no key channel pruned, nothing merged, the
        model's own precision): at a budget of the whole text it then equals Full (the registry's tests)."""
        return self

    def schedule(self, mode: str | None = None) -> str:
        """When the policy decides in ``mode`` (generate, prompt, or None for both), in words (the app's summary)."""
        return {"full": "never drops", "eviction": "every step", "selection": "before every query"}.get(self.kind, "")

    def spec(self) -> str:
        """The spec that parses back to this policy: ``name:budget=..`` plus every other non-default parameter."""
        items = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                 if (f.name == "budget" and self.budget is not None) or getattr(self, f.name) != f.default]
        return self.name + (":" + ",".join(items) if items else "")

    @classmethod
    def for_budget(cls, budget: int) -> "Policy":
        """The policy at ``budget`` with its other parameters at their defaults (the app's budget slider)."""
        return cls(budget=budget) if any(f.name == "budget" for f in fields(cls)) else cls()

    @classmethod
    def for_ratio(cls, ratio: float, context: int) -> "Policy":
        """The policy at compression ratio ``ratio`` (the share of the context's KV cache removed) on ``context``
        tokens: by default its budget (``ratio_budget``) with ``for_budget``'s parameters; a policy that
        compresses otherwise (KIVI's bits) says how."""
        return cls.for_budget(ratio_budget(ratio, context))

    def check_model(self, head_dim: int, n_layers: int) -> None:
        """Raise ValueError when the parameters do not fit the model (checked once the model is known)."""

    def init_state(self, n_heads: int) -> State:
        """The policy's state in one layer of one batch row before the first token (arrays [H, ...])."""
        return {}

    def layer_state(self, n_heads: int, layer: int) -> State:
        """The state in layer ``layer`` before the first token: what the engine starts each layer from. A
        policy whose decisions depend on the layer (Keyformer's noise) keeps it here, since ``step`` is not
        told; an array not shaped [H, tokens] stays as it is when the engine drops tokens."""
        return self.init_state(n_heads)

    def first_departure(self, n_prompt: int | None) -> int:
        """The first query that may read otherwise than Full's: every query before it reads every earlier token,
        and the engine computes it in Full's own arithmetic, so the row's keys, values and predictions until then
        are Full's to the bit. The runner then lets the row take Full's prefill instead of computing its own: it
        joins the batch at its first block past this query, the cache Full's (``PolicyCache.share``); before
        that the policy sees Full's queries, keys and values as its own (``RowLayerState.follow``). ``n_prompt``:
        the prompt's length in generate mode (where a query-agnostic run's context ends), None in prompt mode.
        0: it may depart from the first query (and attends its own way throughout)."""
        return 0

    def decides_alike_in_every_layer(self) -> bool:
        """Are the policy's decisions a function of the positions a row holds and the step alone (not of a layer's
        attention, keys, values or index), with no state of its own? Then every layer of a row decides alike, and the
        engine walks a block in the first layer that reaches it and replays those decisions in the others."""
        return False

    def may_cut(self, end: int) -> bool:
        """May a forward call on a prompt end before position ``end``? ReAttention says no inside one of its
        chunks, whose queries vote together; the runner moves its block ends to where every row says yes."""
        return True

    def cut_reach(self) -> int:
        """How many tokens past its start a prompt block may grow to end where every row may cut (0: no claim;
        the runner takes ``REACH`` times the largest of these and of its chunk)."""
        return 0

    def attend_block(self, state: State, block: "Block") -> "tuple[State, BlockResult]":
        """(state, a block of queries) -> (new state, its output and what it read), for a policy that ``attends``."""
        raise NotImplementedError(f"{self.name} does not compute its own attention")


@dataclass(frozen=True)
class FullPolicy(Policy):
    """Kind marker for the reference: every query reads every earlier token."""

    kind: ClassVar[str] = "full"
    uses_attention: ClassVar[bool] = False
    reads_prompt_end: ClassVar[bool] = False


@dataclass(frozen=True)
class GumbelSoftmax:
    """A running score's increment as Keyformer's: each step t adds softmax((log a + g) / tau_t) over the columns
    read, a their attention, g standard Gumbel noise that is a hash of (``seed``, layer, t, KV head, position)
    (``keyformer.gumbel``), tau_t going linearly from ``tau_init`` to ``tau_end`` over the first ``steps`` steps.
    The compiled walk hashes in 64-bit integers, as the policy's numpy does for a seed below 2**32."""

    seed: int
    tau_init: float
    tau_end: float
    steps: int


@dataclass(frozen=True)
class RunningScore:
    """An eviction policy's ``update``, ``score`` and ``protected`` in the form the compiled walk runs
    (kernels/eviction_walk.py): the score of each held token is ``decay * score + attention`` after every
    step (H2O: decay 1, its A2S; A2SF: alpha; TOVA: 0, the current attention) or, ``by_position``, the
    token's position (Window: the oldest goes); the first ``sinks`` positions and the latest ``recent``
    are never dropped; ``layer`` scores the layer from the score averaged over heads. ``state`` names the
    policy's state array that holds the running score (None when the policy keeps none). ``gumbel``: the
    step adds, in place of the attention, its Gumbel-softmax over the columns read (Keyformer's score)."""

    decay: float = 0.0
    by_position: bool = False
    sinks: int = 0
    recent: int = 0
    layer: bool = False
    state: str | None = None
    gumbel: GumbelSoftmax | None = None


@dataclass(frozen=True)
class EvictionPolicy(Policy):
    """Keeps at most ``budget`` tokens (the current one included); drops the lowest ``score``.

    Subclasses give ``score`` (higher = keep) and optionally ``update`` (state carried across
    steps) and ``protected`` (positions that are never dropped, e.g. sinks or a recent window).
    Ties drop the earliest position.
    """

    kind: ClassVar[str] = "eviction"
    reads_prompt_end: ClassVar[bool] = False
    budget: int = 64

    def first_departure(self, n_prompt: int | None) -> int:
        # The first drop comes after the query that fills the budget (``step``): the queries until then read
        # every earlier token, and the next is the first to read less.
        return self.budget

    def update(self, state: State, attn: np.ndarray | None, t: int) -> State:
        return state

    def score(self, state: State, attn: np.ndarray | None, t: int, positions: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def protected(self, t: int) -> slice | None:
        return None

    def running_score(self) -> RunningScore | None:
        """The policy as a running score, when it is one: the engine then walks it compiled. It must say
        what ``update``, ``score`` and ``protected`` do (tests/test_eviction_walk.py compares the two)."""
        return None

    def step(self, state: State, attn: np.ndarray | None, kept: np.ndarray, t: int,
             positions: np.ndarray | None = None) -> tuple[State, np.ndarray | None]:
        """(state, attention of query t, kept [H, m], t, positions [H, m]) -> (new state, column each head
        drops [H], or columns [H, k] when every head drops k at once (a batch, as Scissorhands), or None).

        The m columns are the tokens a head holds plus the ones that arrived since the engine last
        compacted, in position order (``positions``; default 0..m-1, every token since the start); ``kept``
        marks those still cached, ``attn`` is query t's attention over them. Per-token state arrays are
        [H, m] in the same columns: ``update`` grows them by one column a step (``grow``), and the engine
        removes the columns of dropped tokens, so a step costs O(budget), not O(t).
        """
        if positions is None:
            positions = np.broadcast_to(np.arange(kept.shape[-1]), kept.shape)
        state = self.update(state, attn, t)
        # (This runs once per token, layer and row: it is written to do few numpy calls.)
        if kept.shape[-1] < self.budget or kept.sum(-1).max() < self.budget:
            return state, None
        score = np.asarray(self.score(state, attn, t, positions), dtype=np.float64)
        if score.ndim == 2 and self.heads == "layer":
            # Layer-wise: one decision for the layer, from the score averaged over heads (= score.mean(0)).
            score = np.add.reduce(score, axis=0) / len(score)
        droppable = kept
        guard = self.protected(t)
        if guard is not None:  # positions lo..hi-1 are never dropped
            lo, hi = guard.start or 0, t + 1 if guard.stop is None else guard.stop
            if hi > t:
                droppable = kept & (positions < lo)
            elif lo <= 0:
                droppable = kept & (positions >= hi)
            else:
                droppable = kept & ((positions < lo) | (positions >= hi))
        score = np.where(droppable, score, np.inf)
        return state, score.argmin(-1)


@dataclass
class CacheView:
    """What a compression policy may read when it acts after query ``t`` (one layer, one batch row).

    attn_window: [H, w, t+1] attention rows of the last w queries (mean of each KV head's query heads;
    zero where a query did not read), oldest first; none (w = 0) for a policy that reads no attention. keys, values: [H, t+1, d] float64, the cached keys
    (after RoPE; RoPE keeps their norms) and values, converted from the engine's tensors the first time a
    policy reads them; kept: [H, t+1] what is cached now.
    n_prompt: the prompt's length in generate mode, None in prompt mode (no prompt/continuation split).
    state: the policy's own state (``init_state``), which it may update in place; a fork copies it.
    queries: [H, G, w, d] float64, the last ``window_queries`` queries (after RoPE; query head h*G + g uses KV head
    h), at positions ``query_positions`` [w], those of ``attn_window`` when it has rows; converted on first read.
    rope(x [H, L, d] tensor, positions [L] tensor): the model's RoPE (None in bare unit tests); RoPE is a
    rotation, so ``rope(x, -p)`` undoes it at position p.
    attn_window_heads: [H, G, w, t+1] the same rows per query head (head h*G + g), each its own softmax; given
    only to a policy whose ``window_by_query_head`` is true (None otherwise).
    output: [hidden, H*G*d] float64, the layer's output projection (query head j's output enters through columns
    j*d..(j+1)*d), converted on first read; None where the engine found none (and in bare unit tests).
    """

    t: int
    n_prompt: int | None
    layer: int
    n_layers: int
    attn_window: np.ndarray
    keys: "np.ndarray | torch.Tensor"
    values: "np.ndarray | torch.Tensor"
    kept: np.ndarray
    state: State = field(default_factory=dict)
    queries: "np.ndarray | torch.Tensor | None" = None
    query_positions: np.ndarray | None = None
    rope: Callable | None = None
    attn_window_heads: np.ndarray | None = None
    output: "np.ndarray | torch.Tensor | None" = None

    def __getattribute__(self, name):
        value = object.__getattribute__(self, name)
        if name in ("keys", "values", "queries", "output") and value is not None and not isinstance(value, np.ndarray):
            value = value.double().cpu().numpy()  # only policies that read them pay for the copy
            object.__setattr__(self, name, value)
        return value


@dataclass
class Reform:
    """How a compression changes the form of held tokens (one layer, one batch row, after query ``t``).

    positions: bool [H, t+1], the tokens whose form changes now; keys, values: [H, t+1, d] their new keys and
    values (read where ``positions`` is set; None: unchanged); channels: bool [H, d], the key channels the
    reformed tokens keep (a channel-pruning policy), and ``channel_error`` [H] what that cost the attention logits
    it was chosen for; merged_into: int [H, t+1], the held position each token dropped now gave its value to (-1:
    none; a merging policy), with ``merge_weight`` [H, t+1] its share."""

    positions: np.ndarray
    keys: np.ndarray | None = None
    values: np.ndarray | None = None
    channels: np.ndarray | None = None
    channel_error: np.ndarray | None = None
    merged_into: np.ndarray | None = None
    merge_weight: np.ndarray | None = None


@dataclass(frozen=True)
class CompressionPolicy(Policy):
    """Scores the cache on a schedule and keeps the ``budget`` best tokens per KV head, the ``recent`` latest
    always (e.g. SnapKV's observation window); ties keep the earlier position.

    When (``compresses_after``): in generate mode once the prompt has been read (kvpress's prefill
    compression), then every ``every`` decoding steps if ``every`` > 0 (kvpress's DecodingPress);
    generated tokens are otherwise appended with no eviction. In prompt mode (teacher-forced scoring of a
    text, with no prompt boundary) every ``interval`` tokens, as a chunked prefill would: between
    compressions a query reads up to ``budget + interval - 1`` tokens.

    Subclasses give ``score`` (higher = keep); ``layer_budget`` shares the budget across layers and
    ``keep`` across heads (PyramidKV and AdaKV override them).
    """

    kind: ClassVar[str] = "compression"
    budget: int = 64
    interval: int = 32
    every: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.interval < 1 or self.every < 0:
            raise ValueError(f"{self.name}: need interval >= 1 and every >= 0, got interval={self.interval}, "
                             f"every={self.every}")

    @property
    def recent(self) -> int:
        """The latest cached tokens always kept (inside the budget)."""
        return 0

    @property
    def window_queries(self) -> int:
        """How many recent queries' attention rows the scorer reads (``CacheView.attn_window``)."""
        return 0

    @property
    def window_by_query_head(self) -> bool:
        """Does the scorer read those rows per query head too (``CacheView.attn_window_heads``)?"""
        return False

    def schedule(self, mode: str | None = None) -> str:
        generate = "once after the prompt" + (f", then every {self.every} decoding steps" if self.every else "")
        prompt = f"every {self.interval} tokens"
        return {"generate": generate, "prompt": prompt}.get(mode, f"{generate} (prompt mode: {prompt})")

    def first_departure(self, n_prompt: int | None) -> int:
        # In generate mode nothing is compressed before the prompt's last query has read (``compresses_after``):
        # the queries after it are the first to read less. A policy that scores from a second pass over the text
        # (``rereads``) makes it there too, once the row has joined the batch (``reconstruction.reread``).
        return n_prompt if n_prompt is not None else 0

    def compresses_after(self, t: int, n_prompt: int | None) -> bool:
        if n_prompt is None:
            return (t + 1) % self.interval == 0
        decoded = t + 1 - n_prompt
        return decoded == 0 or (self.every > 0 and decoded > 0 and decoded % self.every == 0)

    def compression_steps(self, start: int, stop: int, n_prompt: int | None) -> list[int]:
        """The steps t in start..stop - 1 after which it compresses (``compresses_after``), in order. The engine asks
        this of every block and decoding step, layer and row: for the schedule above it is counted, not stepped
        through; a policy that decides otherwise (its own ``compresses_after``) is asked step by step."""
        if type(self).compresses_after is not CompressionPolicy.compresses_after:
            return [t for t in range(start, stop) if self.compresses_after(t, n_prompt)]
        if n_prompt is None:  # t + 1 a multiple of the interval
            return list(range(-(-(start + 1) // self.interval) * self.interval - 1, stop, self.interval))
        last = n_prompt - 1  # the prompt's last query, then every ``every`` decoding steps after it
        steps = [last] if start <= last < stop else []
        if self.every > 0:
            first = max(1, -(-(start - last) // self.every))
            steps += range(last + first * self.every, stop, self.every)
        return steps

    def score(self, view: CacheView) -> np.ndarray:
        raise NotImplementedError

    def layer_budget(self, view: CacheView) -> int:
        return self.budget

    def keep(self, view: CacheView) -> np.ndarray:
        """Bool [H, t+1]: the ``recent`` latest cached tokens, then the best others up to the layer's budget."""
        return keep_top(self.score(view), view.kept, self.layer_budget(view), self.recent)

    def reform(self, view: CacheView, keep: np.ndarray) -> Reform | None:
        """After ``keep`` chose what stays (bool [H, t+1]), how the held tokens' form changes (a policy that
        ``reforms``); ``view.keys`` and ``view.values`` are the tokens as held so far. None: unchanged."""
        return None

    # --- the extra pass of a policy that ``rereads`` (backend/engine/reconstruction.py; KVzip) -------------

    # The assistant turn after the pass's prompt for a model with no chat template.
    NO_TEMPLATE: ClassVar[str] = ""

    def rereads_from(self, state: State, prefix: int) -> int:
        """Where the context the pass has not scored yet starts: the pass re-reads positions from there on.
        ``prefix``: how many leading tokens are the chat template's header (its system prompt and the user
        turn's opening; 0 for a plain text)."""
        return 0

    def pieces(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The pieces [a, b) the pass re-reads positions lo..hi-1 in, one forward call each."""
        return [(lo, hi)]

    def prompt(self, ids: list[int], a: int, b: int, encode: Callable, suffix: list[int], prefix: int) -> list[int]:
        """The pass's tokens for piece [a, b) of ``ids`` (the row's tokens so far), ``suffix`` being the
        model's assistant turn and ``prefix`` the chat header's length; ``encode(text)`` gives token ids."""
        return list(suffix) + list(ids[a:b])

    def pass_sinks(self) -> int:
        """The first positions the pass's scores are normalised over besides the piece (KVzip: its sinks)."""
        return 0

    def record(self, state: State, a: int, b: int, score: np.ndarray) -> None:
        """Store the pass's scores [H, b - a] of positions a..b-1 in ``state``."""

    def would_drop(self, held: list[np.ndarray], prefix: int) -> bool:
        """Would a compression now drop anything, ``held`` being what each layer caches ([H, t+1] per layer) and
        ``prefix`` the chat header's length? If not, the pass is skipped: there is nothing to decide."""
        return any(int(h.sum(1).max()) > self.budget for h in held)

    def plan(self, states: list[State], held: list[np.ndarray], t: int, prefix: int) -> None:
        """After the pass, before every layer compresses after step t: see every layer's state and what each
        holds ([H, t+1] per layer), and note in each state what that layer keeps (a budget shared across
        layers, as KVzip's). ``keep`` then returns it."""


@dataclass(frozen=True)
class WindowedCompression(CompressionPolicy):
    """A compression policy with an observation window (SnapKV, R-KV): the ``window`` latest queries' attention
    scores the cache, and the ``window`` latest tokens are always kept."""

    window: int = 8

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.window < self.budget:
            raise ValueError(f"{self.name}: need 0 <= window < budget, got window={self.window}, budget={self.budget}")

    @classmethod
    def for_budget(cls, budget: int):
        return cls(budget=budget, window=min(8, budget // 2))  # small budgets: the window takes at most half

    @property
    def recent(self) -> int:
        return self.window

    @property
    def window_queries(self) -> int:
        return self.window


def latest(kept: np.ndarray, n: int) -> np.ndarray:
    """Bool [H, m]: each head's ``n`` latest cached tokens."""
    order = np.cumsum(kept[:, ::-1], axis=1)[:, ::-1]  # 1 = the latest cached token, 2 = the one before...
    return kept & (order <= n)


def keep_top(score: np.ndarray, kept: np.ndarray, budget: int, recent: int) -> np.ndarray:
    """Bool [H, n]: per head, its last ``recent`` cached tokens and the best-scored other cached tokens,
    ``budget`` in all (everything when fewer are cached); ties keep the earlier position."""
    score = np.where(kept, np.asarray(score, np.float64), -np.inf)
    score = np.where(latest(kept, recent), np.inf, score)
    out = np.zeros(kept.shape, bool)
    for h in range(kept.shape[0]):
        count = min(budget, int(kept[h].sum()))
        best = np.argsort(-score[h], kind="stable")[:count]
        out[h, best] = True
    return out & kept


@dataclass(frozen=True)
class SelectionPolicy(Policy):
    """Chooses, before query t reads, which positions ``0..t`` it reads (a mask per KV head)."""

    kind: ClassVar[str] = "selection"
    reads_every_key: ClassVar[bool] = True
    budget: int = 64

    def select(self, state: State, attn_full: np.ndarray, t: int) -> tuple[State, np.ndarray]:
        raise NotImplementedError

    def reads_prompt_densely(self) -> bool:
        """Does a generate-mode run read its prompt exactly, the policy selecting from the first answer token on
        (``prefill="dense"``)? The prompt's queries then read as Full's (``first_departure``)."""
        return False

    def reads_all_before(self) -> int:
        """Every query before this position reads every earlier token: its whole cache fits what the policy reads
        (its budget), so it reads Full's attention. The engine computes those queries as Full's, and a row may
        take Full's prefill until then (``first_departure``). 0: no query is promised to."""
        return 0

    def first_departure(self, n_prompt: int | None) -> int:
        until = self.reads_all_before()
        return max(until, n_prompt) if n_prompt is not None and self.reads_prompt_densely() else until

    def read_as_full(self, state: State, first: int, n: int, heads: tuple[int, int, int], in_prompt: bool
                     ) -> tuple[State, dict[str, np.ndarray]]:
        """Queries first..first+n-1, before ``first_departure``, were computed as Full's: the policy's state after
        them, and what an attending policy records for them (``BlockResult.stats``, each name -> [n, ...]).
        heads: (query heads, KV heads, head size); in_prompt: the block is a generate-mode run's prompt."""
        return state, {}

    def select_block(self, state: State, attn_full: np.ndarray, first: int) -> tuple[State, np.ndarray]:
        """``select`` for queries first..first+n-1 in turn: attn_full [H, n, M] -> reads bool [H, n, M]."""
        n_heads, n, total = attn_full.shape
        reads = np.zeros((n_heads, n, total), bool)
        for i in range(n):
            t = first + i
            state, reads[:, i, : t + 1] = self.select(state, attn_full[:, i, : t + 1], t)
        return state, reads


def top_positions(score: np.ndarray, k: int, heads: str) -> np.ndarray:
    """Bool mask [H, n] of the k highest scores per head (per layer if heads='layer'); ties keep the earlier."""
    if heads == "layer":
        score = np.broadcast_to(score.mean(0), score.shape)
    n = score.shape[-1]
    if k >= n:
        return np.ones(score.shape, bool)
    # Stable sort on -score: among equal scores the earlier position ranks first.
    order = np.argsort(-score, axis=-1, kind="stable")[:, :k]
    mask = np.zeros(score.shape, bool)
    np.put_along_axis(mask, order, True, axis=-1)
    return mask


def top_positions_block(score: np.ndarray, k: int, heads: str, first: int) -> np.ndarray:
    """``top_positions`` for every query of a block at once: score [H, n, M] (query first + i sees
    positions 0..first+i) -> bool [H, n, M]. The k-th largest score is the threshold; of the scores equal
    to it, the earliest positions fill what is left (the stable order ``top_positions`` uses)."""
    n_heads, n, total = score.shape
    if heads == "layer":
        score = np.broadcast_to(score.mean(0), score.shape)
    visible = np.arange(total)[None, :] <= np.arange(first, first + n)[:, None]  # [n, M]
    score = np.where(visible, score, -np.inf)
    whole = (np.arange(first, first + n) + 1 <= k)[None, :, None]  # rows with at most k candidates
    kth = -np.partition(-score, min(k, total) - 1, axis=-1)[..., min(k, total) - 1: min(k, total)]
    above = score > kth
    tied = (score == kth) & visible
    fill = np.cumsum(tied, axis=-1) <= (k - above.sum(-1, keepdims=True))
    return np.where(whole, visible, above | (tied & fill))


@dataclass
class Block:
    """What an attending policy sees in one layer for one batch row: a block of ``n`` new queries.

    q: [H_q, n, d] queries after RoPE; k, v: [H_kv, M, d] every cached key (after RoPE) and value,
    the block's own last; first = M - n is the position of the block's first query.
    q_pre, k_pre: the same queries and keys before RoPE (only for policies with ``needs_prerope``).
    rope(x, positions): applies the model's RoPE to x [H, L, d] at the given positions.
    decoding: each query is a decoding step, though they arrive together (teacher-forced decoding);
    otherwise they are a prompt. Only a policy that cuts prompts its own way (``may_cut``) cares.
    layer, n_layers: which layer of how many (Quest keeps its first layers dense).
    n_prompt: the prompt's length in generate mode, None in prompt mode (a text scored with no prompt).
    """

    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    first: int
    scaling: float
    q_pre: "torch.Tensor | None" = None
    k_pre: "torch.Tensor | None" = None
    rope: Callable | None = None
    decoding: bool = False
    layer: int = 0
    n_layers: int = 1
    n_prompt: int | None = None
    softcap: float | None = None  # the layer's logit soft-capping (attention_logits)
    window: int | None = None  # a sliding-window layer: query t reads keys t - window + 1..t only

    def logits(self, q: "torch.Tensor", k: "torch.Tensor") -> "torch.Tensor":
        """The layer's attention logits of queries ``q`` against keys ``k`` (scaled, soft-capped)."""
        return attention_logits(q, k, self.scaling, self.softcap)

    def visible(self) -> "torch.Tensor":
        """bool [n, M]: the keys each query of the block may read (causal, within the layer's window)."""
        return visible_keys(self.first, self.q.shape[1], self.k.shape[1], self.window, self.q.device)


@dataclass
class BlockResult:
    """out: [n, H_q, d]; reads, attn: [H_kv, n, M] (bool; mean attention of the group's query heads);
    stats: name -> array [n, ...] of per-step numbers the policy records (e.g. SparQ's alpha)."""

    out: "torch.Tensor"
    reads: np.ndarray
    attn: np.ndarray
    stats: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class AttendingPolicy(SelectionPolicy):
    """A selection policy that computes the attention output itself, a block of queries at a time
    (SparQ mixes in the mean value vector; ReAttention re-rotates the keys it selects)."""

    attends: ClassVar[bool] = True
    honours_layer_limits: ClassVar[bool] = False

    def cut_reach(self) -> int:
        # ReAttention's chunks start within its budget; the other attending policies claim theirs too.
        return self.budget


PREFILLS = ("select", "dense")  # an attending policy's ``prefill``: how the prompt of a generate-mode run is read


def check_prefill(name: str, prefill: str) -> None:
    if prefill not in PREFILLS:
        raise ValueError(f"{name}: prefill must be one of {PREFILLS}, got {prefill!r}")


def masked_attention(block: Block, read: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """The block's softmax attention over the keys ``read`` marks (bool, broadcast to [H_kv, G, n, M]):
    (out [n, H_q, d], weights [H_kv, G, n, M])."""
    n_q_heads, n, dim = block.q.shape
    n_kv_heads = block.k.shape[0]
    q = block.q.view(n_kv_heads, n_q_heads // n_kv_heads, n, dim)
    scores = block.logits(q, block.k[:, None])  # [H_kv, G, n, M]
    if block.window is not None:
        read = read & block.visible()
    weights = torch.softmax(scores.masked_fill(~read, float("-inf")), dim=-1)
    return over_group(weights, block.v[:, None]).permute(2, 0, 1, 3).reshape(n, n_q_heads, dim), weights


def dense_attention(block: Block) -> tuple["torch.Tensor", np.ndarray, np.ndarray]:
    """Exact causal attention of the block over everything cached (a prefill read densely):
    (out [n, H_q, d], reads [H_kv, n, M], attn [H_kv, n, M], the mean of each group's weights)."""
    n = block.q.shape[1]
    n_kv_heads, total, _ = block.k.shape
    causal = block.visible()
    out, weights = masked_attention(block, causal)
    reads = np.broadcast_to(causal.cpu().numpy(), (n_kv_heads, n, total)).copy()
    return out, reads, weights.mean(1).float().cpu().numpy()


def over_group(a: "torch.Tensor", b: "torch.Tensor") -> "torch.Tensor":
    """a [..., G, n, x] @ b [..., 1, x, y] -> [..., G, n, y]: a KV head's G query heads against its keys or values
    in one product, the group's rows stacked, so b is not copied G times as broadcasting it would be (at a
    decoding step that copy is most of a broadcast product's time). Any other shapes: ``a @ b``."""
    if a.dim() < 3 or b.dim() != a.dim() or b.shape[-3] != 1 or a.shape[-3] == 1:
        return a @ b
    *lead, group, n, width = a.shape
    return (a.reshape(*lead, group * n, width) @ b.squeeze(-3)).view(*lead, group, n, b.shape[-1])


def attention_logits(q: "torch.Tensor", k: "torch.Tensor", scaling: float, softcap: float | None = None
                     ) -> "torch.Tensor":
    """q . k scaled, then soft-capped (Gemma 2's ``attn_logit_softcapping``: cap * tanh(logit / cap)) where the
    layer caps; k is given transposable as [..., M, d], with a 1 for the query group's axis where q has one
    (``over_group``)."""
    scores = over_group(q, k.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return scores


def visible_keys(first: int, n: int, total: int, window: int | None, device=None) -> "torch.Tensor":
    """bool [n, total]: query first + i reads keys 0..first + i, and on a sliding-window layer only the latest
    ``window`` of them (transformers' sliding window: key j is visible to query t when t - window < j <= t)."""
    keys = torch.arange(total, device=device)[None]
    queries = torch.arange(first, first + n, device=device)[:, None]
    visible = keys <= queries
    return visible if window is None else visible & (keys > queries - window)
