"""Keyformer: key tokens by accumulated Gumbel-softmax scores, plus a recent window (Adnan et al., 2024)."""
import functools
from dataclasses import dataclass

import numpy as np

from .base import EvictionPolicy, GumbelSoftmax, RunningScore, grow, splitmix64
from .registry import register


@functools.lru_cache(maxsize=None)
def _layer_hash(layer: int) -> int:
    return splitmix64(layer)  # once per layer, not once per step


def gumbel(seed: int, layer: int, t: int, positions: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise [H, m], a function of (seed, layer, step t, KV head, token position) only: every
    layer draws its own, and the same token gets the same draw whichever column it sits in (the prompt and
    decode paths order them alike but compact them at different times)."""
    step = splitmix64(splitmix64(seed << 32 | t) ^ _layer_hash(layer))
    # The heads' hashes in one call on uint64, which wraps as the Python ints are masked: the same numbers.
    heads = splitmix64(np.uint64(step) ^ np.arange(len(positions), dtype=np.uint64))
    x = splitmix64(positions.astype(np.uint64) ^ heads[:, None])
    u = (x >> np.uint64(11)) * 2.0**-53 + 2.0**-54  # in (0, 1)
    return -np.log(-np.log(u))


@register
@dataclass(frozen=True)
class Keyformer(EvictionPolicy):
    """Score = sum over the steps of softmax((logit + g) / tau) over the cached tokens, g Gumbel noise drawn
    afresh each step and in each layer (the paper's Keyformer score function); keep the ``recent`` latest
    tokens and drop the lowest score, one token a step, as H2O with this score.

    Temperature: tau rises linearly from ``tau_init`` to ``tau_end``. The authors' code adds
    (tau_end - tau_init) / max_new_tokens per decoding step (128 new tokens in their summarisation runs)
    and keeps tau_init for the whole prompt; an eviction step here knows only its position t (prompt mode
    has no prompt/continuation split), so tau_t = tau_init + (tau_end - tau_init) * min(t, steps) / steps.
    Other choices are the authors' code's: standard Gumbel(0, 1) noise (torch's gumbel_softmax, soft),
    head-wise scores, recent window 30% of the cache (``--recent 30``), tau from 1 to 2.

    Logits: the engine gives attention probabilities; log(attn) is the logit up to a per-query constant,
    which the softmax cancels, so for one query head per KV head this is exact. GQA: the mean attention of
    the KV head's query heads stands for the head's distribution (its log for the logit) with one noise draw
    per KV head (the authors' models, GPT-J, MPT and Cerebras-GPT, have no GQA).

    Seeded: g is a hash of (seed, layer, step, KV head, position), so a seed gives the same trace every time,
    and each layer draws its own noise, as the authors' per-layer gumbel_softmax calls do. A step is not
    told its layer: the state carries it (``layer_state``).

    budget: tokens each query reads, its own included.
    recent: latest tokens never dropped; -1 means int(0.3 x budget) (the authors' default); must be < budget.
    tau_init, tau_end: temperature at step 0 and from step ``steps`` on (> 0).
    steps: steps over which tau goes from tau_init to tau_end.
    seed: seed of the Gumbel noise (>= 0).
    """

    name = "keyformer"
    summary = "accumulated Gumbel-softmax attention (temperature `tau_init` to `tau_end`, seeded) + recent window"
    paper = "Adnan et al., 2024, *Keyformer* (MLSys)"
    color = "#DDCC77"
    version = 2
    recent: int = -1
    tau_init: float = 1.0
    tau_end: float = 2.0
    steps: int = 128
    seed: int = 0

    @property
    def window(self) -> int:
        return int(0.3 * self.budget) if self.recent < 0 else self.recent

    def __post_init__(self):
        super().__post_init__()
        if self.recent < -1 or self.window >= self.budget:
            raise ValueError(f"keyformer: need 0 <= recent < budget (or -1), got recent={self.recent}, "
                             f"budget={self.budget}")
        if self.tau_init <= 0 or self.tau_end <= 0 or self.steps < 1 or self.seed < 0:
            raise ValueError(f"keyformer: need tau_init, tau_end > 0, steps >= 1 and seed >= 0, got "
                             f"tau_init={self.tau_init}, tau_end={self.tau_end}, steps={self.steps}, seed={self.seed}")

    def tau(self, t: int) -> float:
        return self.tau_init + (self.tau_end - self.tau_init) * min(t, self.steps) / self.steps

    def init_state(self, n_heads):
        return self.layer_state(n_heads, 0)

    def layer_state(self, n_heads, layer):
        return {"score": np.zeros((n_heads, 0)), "layer": np.array([layer])}

    def step(self, state, attn, kept, t, positions=None):
        if positions is None:
            positions = np.broadcast_to(np.arange(kept.shape[-1]), kept.shape)
        logit = np.log(attn, out=np.full(attn.shape, -np.inf), where=kept & (attn > 0))  # -inf: not read
        z = (logit + gumbel(self.seed, int(state["layer"][0]), t, positions)) / self.tau(t)
        p = np.exp(z - z.max(-1, keepdims=True))
        state = {**state, "score": grow(state["score"], kept.shape[-1]) + p / p.sum(-1, keepdims=True)}
        return super().step(state, attn, kept, t, positions)

    def score(self, state, attn, t, positions):
        return state["score"]

    def protected(self, t):
        return slice(t + 1 - self.window, t + 1) if self.window else None

    def running_score(self):
        # The compiled walk hashes the noise in 64-bit integers; numpy's Python ints carry a larger seed's high bits.
        if self.seed >= 2**32:
            return None
        return RunningScore(decay=1.0, recent=self.window, layer=self.heads == "layer", state="score",
                            gumbel=GumbelSoftmax(self.seed, self.tau_init, self.tau_end, self.steps))
