"""Numbers computed from traces alone: a metric never re-runs the model."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .trace import Trace


def _counted(trace: Trace, values: np.ndarray) -> np.ndarray:
    """The positions metrics count: all of a scored text, or only Full's continuation in generate mode."""
    return values[trace.meta["score_start"]:]


def perplexity(trace: Trace) -> float:
    """exp of the mean negative log-prob of the counted tokens."""
    return float(np.exp(-_counted(trace, trace.logprobs).astype(np.float64).mean()))


def mean_kl_to_full(trace: Trace) -> float:
    """Mean KL(Full || policy) of the next-token distributions over the counted positions (nats)."""
    return float(_counted(trace, trace.kl_to_full).astype(np.float64).mean())


def top1_agreement(trace: Trace, full: Trace) -> float:
    """Share of counted positions where the policy's most likely next token is Full's."""
    if not np.array_equal(trace.scored_ids, full.scored_ids):
        raise ValueError("top-1 agreement needs both traces scored on the same text")
    return float((_counted(trace, trace.top1_ids) == _counted(full, full.top1_ids)).mean())


def summary_row(trace: Trace, full: Trace) -> dict:
    return {"ppl": perplexity(trace), "kl_to_full": mean_kl_to_full(trace), "top1_agreement": top1_agreement(trace, full)}


# --- Per-step divergence from Full -------------------------------------------------------------------

def kl_per_step(trace: Trace) -> np.ndarray:
    """float64 [N]: KL(Full || policy) in nats at each counted position.

    Element ``i`` is position ``score_start + i`` of ``scored_ids``, i.e. the distribution that
    predicts ``scored_ids[score_start + i + 1]``. Its mean is ``mean_kl_to_full``.
    """
    return _counted(trace, trace.kl_to_full).astype(np.float64)


def top1_match_per_step(trace: Trace, full: Trace) -> np.ndarray:
    """bool [N]: at each counted position (as in ``kl_per_step``), is the policy's top-1 token Full's?

    Its mean is ``top1_agreement``.
    """
    if not np.array_equal(trace.scored_ids, full.scored_ids):
        raise ValueError("top-1 match needs both traces scored on the same text")
    return _counted(trace, trace.top1_ids) == _counted(full, full.top1_ids)


def first_divergence(trace: Trace, full: Trace) -> int | None:
    """Index ``i`` into the generated tokens (0 = the first token after the prompt, at text position
    ``n_prompt + i``) of the first greedy token where the policy's continuation differs from Full's;
    ``None`` when both continuations are identical. Generate mode only.

    If one continuation is a strict prefix of the other (only possible when runs stopped at different
    lengths), the divergence is at the length of the shorter one.
    """
    for t in (trace, full):
        if t.meta.get("mode") != "generate" or t.generated_ids is None:
            raise ValueError("first_divergence needs generate-mode traces (with generated_ids)")
    n_prompt = trace.meta["n_prompt"]
    if n_prompt != full.meta["n_prompt"] or not np.array_equal(trace.tokens[:n_prompt], full.tokens[:n_prompt]):
        raise ValueError("first_divergence needs both traces to continue the same prompt")
    a, b = np.asarray(trace.generated_ids), np.asarray(full.generated_ids)
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    if differ.size:
        return int(differ[0])
    return None if len(a) == len(b) else n


# --- Similarity to the oracle ("Ideal", A2SF Sec. 4.3, Table 2) ---------------------------------------

def _check_same_tokens(trace: Trace, other: Trace, what: str) -> None:
    if not np.array_equal(trace.tokens, other.tokens):
        raise ValueError(f"{what} needs both traces on the same tokens")
    for key in ("n_layers", "n_kv_heads"):
        if trace.meta[key] != other.meta[key]:
            raise ValueError(f"{what} needs traces of the same model ({key} {trace.meta[key]} != {other.meta[key]})")


def _row_cosine(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Cosine similarity of matching rows (last axis) of two float arrays."""
    num = (x * y).sum(-1)
    return num / np.sqrt((x * x).sum(-1) * (y * y).sum(-1))


def mask_similarity(trace: Trace, oracle_trace: Trace, from_step: int = 0) -> dict:
    """Cosine similarity of the read masks of two traces on the same tokens, A2SF Table 2 on masks.

    For each layer ``l``, KV head ``h`` and step ``t >= from_step``, the rows ``a = reads[h, t, :]``
    of ``trace`` and ``b`` of ``oracle_trace`` (bool, 1 where query ``t`` read token ``j``) give
    ``cos = |a and b| / sqrt(|a| * |b|)`` (1 = same set of tokens read, 0 = disjoint; every row reads
    at least its own token, so it is defined). ``per_layer[l]`` is the mean over heads and steps;
    ``overall`` is the mean of ``per_layer``. Steps before the cache fills read every token under both
    traces and score 1; pass ``from_step=budget`` to leave them out.

    Returns ``{"layers": [0..L-1], "per_layer": float64 [L], "overall": float}``.
    """
    _check_same_tokens(trace, oracle_trace, "mask_similarity")
    n_layers = trace.meta["n_layers"]
    if not 0 <= from_step < len(trace.tokens):
        raise ValueError(f"from_step must be within 0..{len(trace.tokens) - 1}, got {from_step}")
    per_layer = np.empty(n_layers)
    for layer in range(n_layers):
        a = trace.reads(layer)[:, from_step:]
        b = oracle_trace.reads(layer)[:, from_step:]
        both = (a & b).sum(-1, dtype=np.float64)
        per_layer[layer] = (both / np.sqrt(a.sum(-1, dtype=np.float64) * b.sum(-1, dtype=np.float64))).mean()
    return {"layers": list(range(n_layers)), "per_layer": per_layer, "overall": float(per_layer.mean())}


def attention_similarity(trace: Trace, oracle_trace: Trace, from_step: int = 0) -> dict:
    """Cosine similarity of the recorded attention rows of two traces, A2SF Table 2 on scores.

    For each layer recorded in both traces, KV head ``h`` and step ``t >= from_step``, the cosine
    similarity of the attention row of query ``t`` under ``trace`` and under ``oracle_trace`` (each the
    softmax over what that query read, mean over the KV head's query heads, zero where not read: the
    "attention score after applying the method" of A2SF Table 2). ``per_layer`` is the mean over heads
    and steps, in the order of ``layers``; ``overall`` is the mean of ``per_layer``.

    Returns ``{"layers": [...], "per_layer": float64 [R], "overall": float}``; ValueError when the
    traces have no recorded layer in common.
    """
    _check_same_tokens(trace, oracle_trace, "attention_similarity")
    if trace.attention is None or oracle_trace.attention is None:
        raise ValueError("attention_similarity needs both traces to have recorded attention")
    mine, theirs = trace.meta["recorded_layers"], oracle_trace.meta["recorded_layers"]
    layers = [layer for layer in mine if layer in theirs]
    if not layers:
        raise ValueError(f"no recorded layer in common: {mine} vs {theirs}")
    if not 0 <= from_step < len(trace.tokens):
        raise ValueError(f"from_step must be within 0..{len(trace.tokens) - 1}, got {from_step}")
    per_layer = np.array([
        _row_cosine(trace.attention[mine.index(layer), :, from_step:].astype(np.float64),
                    oracle_trace.attention[theirs.index(layer), :, from_step:].astype(np.float64)).mean()
        for layer in layers])
    return {"layers": layers, "per_layer": per_layer, "overall": float(per_layer.mean())}


# --- Retention (TOVA Sec. 6.1) -------------------------------------------------------------------------

def lifetimes(trace: Trace) -> np.ndarray:
    """int64 [L, H_kv, T]: the number of steps each token was read, its arrival step included.

    Eviction traces: ``evicted_at - j`` (steps ``j .. evicted_at - 1``), or ``T - j`` when never
    dropped. Full: ``T - j``. Selection traces (oracle, ...), where a token can be skipped and read
    again: the number of queries that read it. For eviction and Full the two definitions agree.
    Tokens near the end of the text are censored: they cannot live more than ``T - j`` steps.
    """
    n_layers, n_heads, n = trace.meta["n_layers"], trace.meta["n_kv_heads"], len(trace.tokens)
    j = np.arange(n)
    if trace.selected is not None:
        return trace.selected.sum(axis=2, dtype=np.int64)
    if trace.evicted_at is None:
        return np.broadcast_to(n - j, (n_layers, n_heads, n)).astype(np.int64)
    gone = trace.evicted_at.astype(np.int64)
    return np.where(gone < 0, n, gone) - j


def mean_lifetime_by_position(trace: Trace) -> np.ndarray:
    """float64 [T]: ``lifetimes`` averaged over layers and KV heads (TOVA Fig. 8, one line)."""
    return lifetimes(trace).mean(axis=(0, 1))


def first_token_retention(trace: Trace, i: int = 1) -> np.ndarray:
    """float64 [L, i]: for each of the first ``i`` tokens, the share of the steps from its arrival on
    (steps ``j .. T-1``, arrival included) on which it was read, averaged over KV heads, per layer.

    1.0 = never dropped. Equals ``lifetimes / (T - j)`` (TOVA Fig. 8 as a share of the steps).
    """
    n = len(trace.tokens)
    if not 1 <= i <= n:
        raise ValueError(f"i must be within 1..{n}, got {i}")
    return lifetimes(trace)[:, :, :i].mean(axis=1) / (n - np.arange(i))


def _budget(trace: Trace, budget: int | None) -> int:
    if budget is None:
        budget = trace.meta.get("params", {}).get("budget")
    if budget is None:
        raise ValueError(f"{trace.meta.get('policy')} has no budget: pass budget=")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    return int(budget)


def non_recent_share(trace: Trace, budget: int | None = None) -> dict:
    """Share of the tokens a query read that are not among the ``budget`` most recent positions.

    At step ``t`` the recent positions are ``t - budget + 1 .. t`` (``budget`` = the policy's, its
    own token included; pass ``budget=`` for Full). For each layer, KV head and step ``t >= budget``
    (earlier steps cannot read an older token), ``share = #{j read by t : j <= t - budget} / #{j read
    by t}``; ``per_layer`` is the mean over heads and those steps, ``overall`` the mean over layers.
    TOVA Sec. 6.1 reports 1 - share ("only 73-76% of the tokens are recent"). Window scores 0.

    Returns ``{"budget": b, "per_layer": float64 [L], "overall": float}``.
    """
    b = _budget(trace, budget)
    n = len(trace.tokens)
    if n <= b:
        raise ValueError(f"the text ({n} tokens) must be longer than the budget ({b})")
    old = np.tri(n, n, -b, dtype=bool)[b:]  # row t (from b on): j <= t - b
    per_layer = np.empty(trace.meta["n_layers"])
    for layer in range(len(per_layer)):
        reads = trace.reads(layer)[:, b:]
        per_layer[layer] = ((reads & old).sum(-1) / reads.sum(-1)).mean()
    return {"budget": b, "per_layer": per_layer, "overall": float(per_layer.mean())}


# --- A2S vs A2SF score curves (A2SF Eq. 4-5, Fig. 1 and 6) ---------------------------------------------

@dataclass
class ScoreCurves:
    """Accumulated attention scores of one head of one recorded layer, float64 ``[T, T]`` (row = step
    ``t``, column = token ``j``; zero for ``j > t``), and the tokens each score would keep."""

    attention: np.ndarray  # S[t, j]: the recorded attention row of query t
    a2s: np.ndarray  # alpha = 1 (Eq. 4): sum_{q <= t} S[q, j]
    a2sf: np.ndarray  # Eq. 5: sum_{q <= t} alpha^(t - q) S[q, j]
    keep_a2s: np.ndarray  # bool [T, T]: the top-`budget` tokens j <= t by a2s at step t
    keep_a2sf: np.ndarray  # bool [T, T]: the same by a2sf
    alpha: float
    budget: int


def _top_by_row(score: np.ndarray, k: int) -> np.ndarray:
    """bool [T, T]: per row t, the k highest scores among j <= t (ties: the earlier position)."""
    n = score.shape[0]
    causal = np.tri(n, n, dtype=bool)
    masked = np.where(causal, score, -np.inf)
    order = np.argsort(-masked, axis=-1, kind="stable")[:, :k]
    keep = np.zeros((n, n), bool)
    np.put_along_axis(keep, order, True, axis=-1)
    return keep & causal  # rows t < k - 1 have fewer than k candidates


def score_curves(trace: Trace, layer: int, head: int, alpha: float, budget: int) -> ScoreCurves:
    """A2S (alpha = 1) and A2SF (forgetting factor ``alpha``) scores from the recorded attention of
    ``layer`` (a model layer index, one of ``meta["recorded_layers"]``) and KV ``head``.

    ``S[q, j]`` is the trace's own recorded attention (what query q read; Full's trace gives the
    unpruned scores of the papers' figures). ``A[t, j] = sum_{q=j..t} alpha^(t-q) S[q, j]``, computed as
    one matrix product with the decay matrix ``W[t, q] = alpha^(t-q)`` (q <= t). ``keep_*[t]`` are the
    ``budget`` tokens among ``0..t`` with the highest score at step t (all of them while t < budget),
    as a selection from the whole past, not a replay of the eviction policy.
    """
    recorded = trace.meta.get("recorded_layers") or []
    if trace.attention is None or layer not in recorded:
        raise ValueError(f"layer {layer} has no recorded attention in this trace (recorded layers: {recorded})")
    if not 0 <= head < trace.attention.shape[1]:
        raise ValueError(f"head must be within 0..{trace.attention.shape[1] - 1}, got {head}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    s = trace.attention[recorded.index(layer), head].astype(np.float64)
    n = s.shape[0]
    lag = np.arange(n)[:, None] - np.arange(n)[None, :]
    causal = lag >= 0

    def accumulate(a: float) -> np.ndarray:
        decay = np.where(causal, np.float64(a) ** np.where(causal, lag, 0), 0.0)  # 0 ** 0 = 1
        return decay @ s

    a2s, a2sf = accumulate(1.0), accumulate(alpha)
    return ScoreCurves(attention=s, a2s=a2s, a2sf=a2sf, keep_a2s=_top_by_row(a2s, budget),
                       keep_a2sf=_top_by_row(a2sf, budget), alpha=float(alpha), budget=int(budget))


# --- K cache before and after RoPE, for t-SNE (ReAttention Fig. 8-9) ----------------------------------

def rotate_half(x: np.ndarray) -> np.ndarray:
    """transformers' rotate_half: (x1, x2) -> (-x2, x1) over the two halves of the last axis."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def unrotate_keys(keys: np.ndarray, inv_freq: np.ndarray, scaling: float = 1.0,
                  positions: np.ndarray | None = None) -> np.ndarray:
    """Undo RoPE on keys ``[..., T, d]`` (position ``j`` = ``positions[j]``, default ``j``).

    RoPE gave ``k_rot = (k * cos + rotate_half(k) * sin) * s`` with angles ``j * inv_freq`` repeated
    over both halves of the head dim; a rotation by ``-angle`` and a division by ``s`` gives
    ``k = (k_rot * cos - rotate_half(k_rot) * sin) / s``.
    """
    keys = np.asarray(keys, np.float64)
    n = keys.shape[-2]
    pos = np.arange(n) if positions is None else np.asarray(positions)
    angle = pos[:, None].astype(np.float64) * np.asarray(inv_freq, np.float64)[None, :]
    angle = np.concatenate([angle, angle], axis=-1)
    return (keys * np.cos(angle) - rotate_half(keys) * np.sin(angle)) / scaling


@dataclass
class KeySamples:
    """The cached keys of one KV head of one recorded layer, one row per token (position)."""

    after_rope: np.ndarray  # float32 [T, d], as cached
    before_rope: np.ndarray  # float32 [T, d], rotated back
    kept: np.ndarray  # bool [T]: read by the last query (step T - 1)


def key_samples(trace: Trace, layer: int, head: int) -> KeySamples:
    """Keys of model ``layer`` (one of ``meta["recorded_layers"]``) and KV ``head`` after RoPE, before
    RoPE (rotated back with ``rope_inv_freq`` and ``rope_attention_scaling``, see ``unrotate_keys``),
    and whether each token is in the cache the last query read (``kept``; False = evicted by then, or
    not selected at the last step for selection policies)."""
    recorded = trace.meta.get("recorded_layers") or []
    if trace.keys is None or trace.rope_inv_freq is None or layer not in recorded:
        raise ValueError(f"layer {layer} has no recorded keys in this trace (recorded layers: {recorded})")
    if not 0 <= head < trace.keys.shape[1]:
        raise ValueError(f"head must be within 0..{trace.keys.shape[1] - 1}, got {head}")
    after = trace.keys[recorded.index(layer), head].astype(np.float32)
    before = unrotate_keys(after, trace.rope_inv_freq, trace.meta.get("rope_attention_scaling", 1.0))
    kept = np.array(trace.reads(layer)[head, -1], bool)
    return KeySamples(after_rope=after, before_rope=before.astype(np.float32), kept=kept)
