"""What every policy shares.

A policy decides, at every step t (one query, prompt or generated alike), which cached tokens that
query reads. Its decision is a pure function, so the prompt path, the decode path and the tests all
call the same code:

* an **eviction** policy sees the attention of query t over what it read and returns the token each
  KV head drops once the cache is full (``step``);
* a **selection** policy chooses, before query t reads, which positions it reads (``select``).

Arrays are numpy, one row per KV head; ``attn`` is the mean softmax row of the query heads that share
that KV head (GQA), over positions ``0..t`` (zero where a token is not read).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import ClassVar

import numpy as np

State = dict[str, np.ndarray]

HEAD_MODES = ("head", "layer")


def grow(a: np.ndarray, length: int) -> np.ndarray:
    """Pad the last axis with zeros up to ``length`` (per-token state grows by one token a step)."""
    missing = length - a.shape[-1]
    if missing <= 0:
        return a
    return np.concatenate([a, np.zeros(a.shape[:-1] + (missing,), a.dtype)], axis=-1)


@dataclass(frozen=True)
class Policy:
    """Base of all policies: a name for the registry and parameter checks."""

    name: ClassVar[str]
    kind: ClassVar[str]
    # Window and sinks never look at attention: the engine skips computing it for them.
    uses_attention: ClassVar[bool] = True

    def __post_init__(self) -> None:
        budget = getattr(self, "budget", None)
        if budget is not None and (not isinstance(budget, int) or budget < 1):
            raise ValueError(f"{self.name}: budget must be an integer >= 1, got {budget!r}")
        heads = getattr(self, "heads", "head")
        if heads not in HEAD_MODES:
            raise ValueError(f"{self.name}: heads must be one of {HEAD_MODES}, got {heads!r}")

    def params(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_model(self, head_dim: int, n_layers: int) -> None:
        """Raise ValueError when the parameters do not fit the model (checked once the model is known)."""

    def init_state(self, n_heads: int) -> State:
        return {}


@dataclass(frozen=True)
class FullPolicy(Policy):
    """Kind marker for the reference: every query reads every earlier token."""

    kind: ClassVar[str] = "full"
    uses_attention: ClassVar[bool] = False


@dataclass(frozen=True)
class EvictionPolicy(Policy):
    """Keeps at most ``budget`` tokens (the current one included); drops the lowest ``score``.

    Subclasses give ``score`` (higher = keep) and optionally ``update`` (state carried across
    steps) and ``protected`` (positions that are never dropped, e.g. sinks or a recent window).
    Ties drop the earliest position.
    """

    kind: ClassVar[str] = "eviction"
    budget: int = 64

    def update(self, state: State, attn: np.ndarray | None, t: int) -> State:
        return state

    def score(self, state: State, attn: np.ndarray | None, t: int) -> np.ndarray:
        raise NotImplementedError

    def protected(self, t: int) -> slice | None:
        return None

    def step(self, state: State, attn: np.ndarray | None, kept: np.ndarray, t: int
             ) -> tuple[State, np.ndarray | None]:
        """(state, attention of query t, kept [H, t+1]) -> (new state, position each head drops or None)."""
        state = self.update(state, attn, t)
        if kept.sum(-1).max() < self.budget:
            return state, None
        score = np.array(self.score(state, attn, t), dtype=np.float64)
        if score.ndim == 1:
            score = np.broadcast_to(score, kept.shape).copy()
        if getattr(self, "heads", "head") == "layer":
            # Layer-wise: one decision for the layer, from the score averaged over heads.
            score[:] = score.mean(0)
        score[~kept] = np.inf
        guard = self.protected(t)
        if guard is not None:
            score[:, guard] = np.inf
        return state, score.argmin(-1)


@dataclass(frozen=True)
class SelectionPolicy(Policy):
    """Chooses, before query t reads, which positions ``0..t`` it reads (a mask per KV head)."""

    kind: ClassVar[str] = "selection"
    budget: int = 64

    def select(self, state: State, attn_full: np.ndarray, t: int) -> tuple[State, np.ndarray]:
        raise NotImplementedError


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


@dataclass
class Block:
    """What an attending policy sees in one layer for one batch row: a block of ``n`` new queries.

    q: [H_q, n, d] queries after RoPE; k, v: [H_kv, M, d] every cached key (after RoPE) and value,
    the block's own last; first = M - n is the position of the block's first query.
    q_pre, k_pre: the same queries and keys before RoPE (only for policies with ``needs_prerope``).
    rope(x, positions): applies the model's RoPE to x [H, L, d] at the given positions.
    decoding: each query is a decoding step, though they arrive together (teacher-forced decoding);
    otherwise they are a prompt. Only a policy that treats prompts differently (``chunks_prompt``) cares.
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

    needs_prerope: ClassVar[bool] = False
    chunks_prompt: ClassVar[bool] = False  # True: give it the whole prompt in one block

    def attend_block(self, state: State, block: Block) -> tuple[State, BlockResult]:
        raise NotImplementedError
