"""Numbers computed from traces alone: a metric never re-runs the model."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import reads
from ..traces.rope import KeyRope
from ..traces.trace import Trace


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


def mask_similarity(trace: Trace, oracle_trace: Trace, from_step: int = 0) -> dict:
    """Cosine similarity of the read masks of two traces on the same tokens, A2SF Table 2 on masks.

    For each layer ``l``, KV head ``h`` and step ``t >= from_step``, the rows ``a = reads[h, t, :]``
    of ``trace`` and ``b`` of ``oracle_trace`` (bool, 1 where query ``t`` read token ``j``) give
    ``cos = |a and b| / sqrt(|a| * |b|)`` (1 = same set of tokens read, 0 = disjoint; every row reads
    at least its own token, so it is defined). ``per_layer[l]`` is the mean over heads and steps;
    ``overall`` is the mean of ``per_layer``. Steps before the cache fills read every token under both
    traces and score 1; pass ``from_step=budget`` to leave them out. The three counts of every row come
    from read intervals (``backend/analysis/reads.py``), so no mask is built.

    Returns ``{"layers": [0..L-1], "per_layer": float64 [L], "overall": float}``.
    """
    _check_same_tokens(trace, oracle_trace, "mask_similarity")
    n_layers, n = trace.meta["n_layers"], len(trace.tokens)
    if not 0 <= from_step < n:
        raise ValueError(f"from_step must be within 0..{n - 1}, got {from_step}")
    per_layer = np.empty(n_layers)
    for layer in range(n_layers):
        cosines = []
        for head in range(trace.meta["n_kv_heads"]):
            a, b = reads.intervals(trace, layer, [head]), reads.intervals(oracle_trace, layer, [head])
            both = reads.per_step(*reads.overlaps(a, b), n)
            size_a, size_b = reads.per_step(a[1], a[2], n), reads.per_step(b[1], b[2], n)
            cosines.append(both[from_step:] / np.sqrt(size_a[from_step:] * size_b[from_step:], dtype=np.float64))
        per_layer[layer] = np.mean(cosines)
    return {"layers": list(range(n_layers)), "per_layer": per_layer, "overall": float(per_layer.mean())}


def _sparse_row_cosine(pos_a: np.ndarray, val_a: np.ndarray, pos_b: np.ndarray, val_b: np.ndarray) -> np.ndarray:
    """float64 [T]: cosine of matching rows of two sparse row sets ([T, k] positions, -1 = empty, and values)."""
    n = pos_a.shape[0]

    def keyed(pos, val):
        rows = np.broadcast_to(np.arange(n)[:, None], pos.shape)
        hit = pos >= 0
        return rows[hit] * n + pos[hit], val[hit].astype(np.float64)

    (ka, va), (kb, vb) = keyed(pos_a, val_a), keyed(pos_b, val_b)
    _, ia, ib = np.intersect1d(ka, kb, assume_unique=True, return_indices=True)  # a row holds a position once
    dot = np.bincount(ka[ia] // n, weights=va[ia] * vb[ib], minlength=n)
    norm_a = np.bincount(ka // n, weights=va * va, minlength=n)
    norm_b = np.bincount(kb // n, weights=vb * vb, minlength=n)
    return dot / np.sqrt(norm_a * norm_b)


def attention_similarity(trace: Trace, oracle_trace: Trace, from_step: int = 0) -> dict:
    """Cosine similarity of the recorded attention rows of two traces, A2SF Table 2 on scores.

    For each layer recorded in both traces, KV head ``h`` and step ``t >= from_step``, the cosine
    similarity of the attention row of query ``t`` under ``trace`` and under ``oracle_trace`` (each the
    softmax over what that query read, mean over the KV head's query heads, zero where not read: the
    "attention score after applying the method" of A2SF Table 2). ``per_layer`` is the mean over heads
    and steps, in the order of ``layers``; ``overall`` is the mean of ``per_layer``. Long texts keep each
    row's top-k entries only (``backend/traces/recorded.py``): the cosine is then that of the stored entries.

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
    a, b = trace.attention, oracle_trace.attention
    per_layer = np.array([
        np.mean([_sparse_row_cosine(a.pos[mine.index(layer), h], a.val[mine.index(layer), h],
                                    b.pos[theirs.index(layer), h], b.val[theirs.index(layer), h])[from_step:]
                 for h in range(a.pos.shape[1])])
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
    if trace.spans is not None:
        return trace.spans.counts()
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
    A read of token ``j`` is old from step ``j + budget`` on, so each read interval is cut there.

    Returns ``{"budget": b, "per_layer": float64 [L], "overall": float}``.
    """
    b = _budget(trace, budget)
    n = len(trace.tokens)
    if n <= b:
        raise ValueError(f"the text ({n} tokens) must be longer than the budget ({b})")
    per_layer = np.empty(trace.meta["n_layers"])
    for layer in range(len(per_layer)):
        pos, start, end = reads.intervals(trace, layer)
        shares = []
        for head, rows in enumerate(np.split(np.arange(len(pos)), _head_offsets(trace, layer))):
            p, s, e = pos[rows], start[rows], end[rows]
            old_from = np.minimum(np.maximum(s, p + b), e)
            shares.append(reads.per_step(old_from, e, n)[b:] / reads.per_step(s, e, n)[b:])
        per_layer[layer] = np.mean(shares)
    return {"budget": b, "per_layer": per_layer, "overall": float(per_layer.mean())}


def _head_offsets(trace: Trace, layer: int) -> list[int]:
    """Where each KV head's intervals begin in ``reads.intervals(trace, layer)`` (the first head left out)."""
    if trace.spans is None:
        return [len(trace.tokens) * h for h in range(1, trace.meta["n_kv_heads"])]
    first = trace.spans.offsets[layer * trace.spans.n_heads]
    return [int(trace.spans.offsets[layer * trace.spans.n_heads + h] - first) for h in range(1, trace.spans.n_heads)]


# --- A2S vs A2SF score curves (A2SF Eq. 4-5, Fig. 1 and 6) ---------------------------------------------

FOLLOWED_TOKENS = 6  # tokens whose scores the over-the-steps figure follows
_BLOCK = 32  # steps ranked at a time while following tokens: their candidates are ~budget + 17 per step


@dataclass
class ScoreCurves:
    """A2S and A2SF of one head of one recorded layer: every token's score at one ``step`` (A2SF Fig. 1)
    and a few tokens' scores over all the steps (Fig. 6), with the tokens each score would keep."""

    step: int
    a2s: np.ndarray  # float64 [step + 1]: alpha = 1 (Eq. 4), sum_{q <= step} S[q, j]
    a2sf: np.ndarray  # float64 [step + 1]: Eq. 5, sum_{q <= step} alpha^(step - q) S[q, j]
    keep_a2s: np.ndarray  # bool [step + 1]: the top-`budget` tokens by a2s at `step`
    keep_a2sf: np.ndarray  # bool [step + 1]: the same by a2sf
    tokens: np.ndarray  # int64 [m]: the followed tokens
    a2s_over_steps: np.ndarray  # float64 [m, T]: row i = token tokens[i]'s A2S at every step (0 before it arrived)
    a2sf_over_steps: np.ndarray  # float64 [m, T]
    kept_a2s_over_steps: np.ndarray  # bool [m, T]: is the token in the top `budget` at that step
    kept_a2sf_over_steps: np.ndarray  # bool [m, T]
    alpha: float
    budget: int


def _top(score: np.ndarray, k: int) -> np.ndarray:
    """bool [n]: the k highest scores (ties: the earlier position), all of them when n <= k."""
    keep = np.zeros(len(score), bool)
    keep[np.argsort(-score, kind="stable")[:k]] = True
    return keep


def _score_at(pos: np.ndarray, val: np.ndarray, alpha: float, step: int) -> np.ndarray:
    """float64 [step + 1]: sum_{q <= step} alpha^(step - q) S[q, j] from sparse rows (O(step * k))."""
    pos, val = pos[: step + 1], val[: step + 1]
    weight = np.power(np.float64(alpha), np.arange(step, -1, -1, dtype=np.float64))[:, None]  # 0 ** 0 = 1
    hit = pos >= 0
    return np.bincount(pos[hit], weights=(val * weight)[hit], minlength=step + 1)


def _forgetting_sums(rows: np.ndarray, alpha: float) -> np.ndarray:
    """Row i -> sum_{q <= i} alpha^(i - q) rows[q]: a block's own part of the recurrence, as a running sum of
    the rows scaled by alpha^-q (no matrix product: BLAS threads stall on a busy machine), or step by step
    where alpha^-q would overflow."""
    if alpha == 1:
        return np.cumsum(rows, axis=0)
    scale = np.power(np.float64(alpha), np.arange(len(rows), dtype=np.float64))[:, None]
    if alpha > 0 and scale[-1, 0] > 1e-250:
        return np.cumsum(rows / scale, axis=0) * scale
    out = rows.copy()
    for i in range(1, len(out)):
        out[i] += alpha * out[i - 1]
    return out


def _follow(pos: np.ndarray, val: np.ndarray, alpha: float, budget: int, tokens: np.ndarray) -> tuple:
    """The recurrence A_t = alpha * A_(t-1) + S_t over all steps, keeping only what the figure needs: the
    followed tokens' scores [m, T] and whether each is in the top ``budget`` at every step [m, T].

    Exact without ranking every token at every step (T x T work: 20 s at 32k). Every score is multiplied by
    the same alpha at each step, so scores keep their order except where a query adds weight: a token
    outside the top ``budget`` stays outside until a query reads it. So ``_BLOCK`` steps at a time only the
    candidates are ranked (ties: the earlier position, as a stable sort ranks them): the top ``budget``
    before the block, the tokens its rows read or bring, the followed tokens, and the tokens whose order
    multiplying may break: those that may sink below the smallest normal float within the block (they can
    round to ties), and the earliest ``budget`` tokens at 0 (zeros rank by position). Every token's score is
    ``alpha ** lag * (its score before the block) + (what the block added)``, one product for all, so
    tokens that tie keep tying."""
    n, tokens = pos.shape[0], np.asarray(tokens, np.int64)
    scores, kept = np.zeros((len(tokens), n)), np.zeros((len(tokens), n), bool)
    if not len(tokens):  # a snapshot only (Play's frames): no pass over the steps
        return scores, kept
    before = np.zeros(n)  # every token's score after the previous block
    top = np.zeros(0, np.int64)  # the top `budget` tokens after the previous block
    column, chosen = np.zeros(n, np.int64), np.zeros(n, bool)
    tiny = np.finfo(np.float64).tiny
    for first in range(0, n, _BLOCK):
        last = min(n, first + _BLOCK)
        decay = np.power(np.float64(alpha), np.arange(1, last - first + 1, dtype=np.float64))[:, None]
        rows, slots = np.nonzero(pos[first:last] >= 0)
        read = pos[first:last][rows, slots].astype(np.int64)
        chosen[:] = False
        chosen[top], chosen[read], chosen[first:last], chosen[tokens] = True, True, True, True
        chosen[np.flatnonzero(before[:first] == 0)[:budget]] = True
        if alpha < 1:
            chosen |= (before > 0) & (before * decay[-1, 0] < tiny)
        candidates = np.flatnonzero(chosen)
        column[candidates] = np.arange(len(candidates))
        block = decay * before[candidates]  # [b, candidates]: every candidate's score at each step
        touched = np.flatnonzero(np.bincount(column[read], minlength=len(candidates)))  # the columns read
        where = np.zeros(len(candidates), np.int64)
        where[touched] = np.arange(len(touched))
        added = np.zeros((last - first, len(touched)))
        added[rows, where[column[read]]] = val[first:last][rows, slots]  # a row holds a position once
        block[:, touched] += _forgetting_sums(added, alpha)
        steps = np.arange(first, last)
        arrived = tokens[None, :] <= steps[:, None]  # [b, m]
        own = block[:, column[tokens]]
        scores[:, first:last] = np.where(arrived, own, 0.0).T
        in_top = arrived.copy()  # while t < budget every token that arrived is kept
        full = np.flatnonzero(arrived.any(1) & (steps >= budget))
        if len(full):
            # Tokens yet to arrive score 0 and come later: they never rank above one that arrived.
            threshold = np.partition(block[full], len(candidates) - budget, axis=1)[:, len(candidates) - budget]
            mine = own[full]
            in_top[full] = (mine > threshold[:, None]) & arrived[full]
            ties = (mine == threshold[:, None]) & arrived[full]
            for k in np.flatnonzero(ties.any(0)):  # rank exactly
                i, j = full[ties[:, k]], tokens[k]
                row, score = block[i], mine[ties[:, k], k][:, None]
                in_top[i, k] = (row > score).sum(1) + (row[:, candidates < j] == score).sum(1) < budget
        kept[:, first:last] = in_top.T
        before *= decay[-1, 0]
        before[candidates] = block[-1]
        top = candidates[np.lexsort((candidates, -block[-1]))[:budget]]
    return scores, kept


def score_curves(trace: Trace, layer: int, head: int, alpha: float, budget: int, step: int | None = None,
                 tokens=None) -> ScoreCurves:
    """A2S (alpha = 1) and A2SF (forgetting factor ``alpha``) scores from the recorded attention of
    ``layer`` (a model layer index, one of ``meta["recorded_layers"]``) and KV ``head``.

    ``S[q, j]`` is the trace's own recorded attention (what query q read; Full's trace gives the
    unpruned scores of the papers' figures; long texts store each row's top-k entries, and the rest of a
    row's weight is not counted). ``A[t, j] = sum_{q=j..t} alpha^(t-q) S[q, j]``, i.e. the recurrence
    ``A_t = alpha * A_(t-1) + S_t``: at ``step`` (default the last) for every token, and over the steps for
    ``tokens`` (default: the ``FOLLOWED_TOKENS`` that A2SF ranks highest at ``step``; none skips the pass over
    the steps, for the snapshot alone). A token is kept at step
    t when it is among the ``budget`` highest scores of tokens ``0..t`` (all of them while t < budget), as a
    selection from the whole past, not a replay of the eviction policy.
    """
    recorded = trace.meta.get("recorded_layers") or []
    if trace.attention is None or layer not in recorded:
        raise ValueError(f"layer {layer} has no recorded attention in this trace (recorded layers: {recorded})")
    if not 0 <= head < trace.attention.pos.shape[1]:
        raise ValueError(f"head must be within 0..{trace.attention.pos.shape[1] - 1}, got {head}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    n = len(trace.tokens)
    step = n - 1 if step is None else int(step)
    if not 0 <= step < n:
        raise ValueError(f"step must be within 0..{n - 1}, got {step}")
    r = recorded.index(layer)
    pos, val = trace.attention.pos[r, head], trace.attention.val[r, head].astype(np.float64)
    a2s, a2sf = _score_at(pos, val, 1.0, step), _score_at(pos, val, alpha, step)
    keep_a2sf = _top(a2sf, budget)
    if tokens is None:
        tokens = np.sort(np.argsort(-a2sf, kind="stable")[:FOLLOWED_TOKENS])
    tokens = np.asarray(tokens, np.int64)
    if tokens.size and not (0 <= tokens.min() and tokens.max() < n):
        raise ValueError(f"followed tokens must be within 0..{n - 1}")
    a2s_steps, kept_a2s = _follow(pos, val, 1.0, budget, tokens)
    a2sf_steps, kept_a2sf = _follow(pos, val, float(alpha), budget, tokens)
    return ScoreCurves(step=step, a2s=a2s, a2sf=a2sf, keep_a2s=_top(a2s, budget), keep_a2sf=keep_a2sf,
                       tokens=tokens, a2s_over_steps=a2s_steps, a2sf_over_steps=a2sf_steps,
                       kept_a2s_over_steps=kept_a2s, kept_a2sf_over_steps=kept_a2sf, alpha=float(alpha),
                       budget=int(budget))


# --- K cache before and after RoPE, for t-SNE (ReAttention Fig. 8-9) ----------------------------------

def unrotate_keys(keys: np.ndarray, inv_freq: np.ndarray, scaling: float = 1.0,
                  positions: np.ndarray | None = None) -> np.ndarray:
    """Undo RoPE in transformers' ``rotate_half`` layout on keys ``[..., S, d]`` at ``positions`` (default
    ``0..S-1``): a rotation by ``-position * inv_freq`` and a division by ``scaling``."""
    return KeyRope.halves(inv_freq, scaling).rotate(keys, positions, inverse=True)


@dataclass
class KeySamples:
    """The keys of one KV head of one recorded layer at the trace's sampled positions, one row per position."""

    positions: np.ndarray  # int32 [S]: the token positions of the rows (all of them up to 512 tokens)
    before_rope: np.ndarray  # float32 [S, d], as the trace stores them
    after_rope: np.ndarray  # float32 [S, d], rotated to their positions as the cache held them
    kept: np.ndarray  # bool [S]: read by the last query (step T - 1)


def key_samples(trace: Trace, layer: int, head: int) -> KeySamples:
    """Keys of model ``layer`` (one of ``meta["recorded_layers"]``) and KV ``head`` before RoPE (as stored,
    at ``Trace.key_positions``), after RoPE (rotated forward as that layer rotates them, ``Trace.rope``), and
    whether each is in the cache the last query read (``kept``; False = evicted by then, or not selected at the
    last step for selection policies)."""
    recorded = trace.meta.get("recorded_layers") or []
    rope = trace.rope(layer)
    if trace.keys is None or rope is None:
        raise ValueError(f"layer {layer} has no recorded keys in this trace (recorded layers: {recorded})")
    if not 0 <= head < trace.keys.shape[1]:
        raise ValueError(f"head must be within 0..{trace.keys.shape[1] - 1}, got {head}")
    positions = np.asarray(trace.key_positions)
    before = trace.keys[recorded.index(layer), head].astype(np.float32)
    after = rope.rotate(before, positions)
    kept = trace.reads_at(layer, len(trace.tokens) - 1)[head][positions]
    return KeySamples(positions=positions, before_rope=before, after_rope=after.astype(np.float32),
                      kept=np.asarray(kept, bool))
