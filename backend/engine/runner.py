"""Run several policies on one text, sharing the work: one batched forward with a policy per row.

Row 0 is always Full (the reference for KL and top-1 agreement); the requested policies follow.
Two modes (docs/trace-format.md):

* ``prompt``: teacher-forced. The whole text goes through the model in chunks of ``chunk`` tokens;
  inside each chunk the policy still decides token by token (attention.py), so the result equals
  feeding the text one token at a time, but the heavy matmuls run once per chunk and layer.
* ``generate``: every row greedily continues the prompt under its own policy (the prompt itself is
  processed the same way as above). Then every policy is scored teacher-forced on Full's continuation, so
  divergence from Full is measured token for token; the prompt's positions but its last are not scored.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from . import DEFAULT_CHUNK, LM_HEAD_CHUNK
from .allocator import give_back
from .attention import FEWEST_PRODUCT_ROWS, PolicyCache
from .cache_layer import rows_up_to
from .features import key_rope
from .models import LoadedModel, check_fits, default_record_layers
from ..policies import Full, Policy
from .reconstruction import cuts, reread
from ..traces.recorded import choose_top_k, key_positions
from ..traces.trace import FORMAT_VERSION, Trace

REACH = 4  # a prompt block may grow to this many chunks (or budgets) to end where every row may cut

Progress = Callable[[float, str], None]


def _rows(policies: Sequence[Policy], reference: bool = True, n_prompt: int | None = None
          ) -> tuple[list[Policy], list[int]]:
    """Row 0 = Full; each requested policy gets a row (a requested Full reuses row 0), the rows that read as
    Full longest last (``Policy.first_departure`` with ``n_prompt``): they take Full's prefill, and join the
    batch as they depart (``PolicyCache.batch_for``).

    ``reference=False`` (benchmarks only) runs just the requested policies, without the Full row.
    """
    if not reference:
        return list(policies), list(range(len(policies)))
    rows: list[Policy] = [Full()]
    index = []
    for policy in policies:
        if isinstance(policy, Full):
            index.append(0)
        else:
            index.append(len(rows))
            rows.append(policy)
    order = [0] + sorted(range(1, len(rows)), key=lambda r: rows[r].first_departure(n_prompt))  # stable
    moved_to = {old: new for new, old in enumerate(order)}
    return [rows[r] for r in order], [moved_to[r] for r in index]


def rope_function(lm: LoadedModel, layer: int = 0) -> Callable:
    """rope(x [H, L, d], positions [L]) -> x rotated as the model rotates keys at those positions in ``layer``."""
    return lm.features.layers[layer].rope


def new_cache(lm: LoadedModel, rows: Sequence[Policy], record_layers: Sequence[int], length: int) -> PolicyCache:
    """A cache for ``rows`` on a text of up to ``length`` tokens (which sizes the recorded attention)."""
    for policy in rows:
        check_fits(lm, policy)
    top_k = choose_top_k(length, len(record_layers), lm.n_kv_heads)
    return PolicyCache(list(rows), lm.n_layers, lm.n_kv_heads, tuple(record_layers),
                       [layer.rope for layer in lm.features.layers], top_k, features=lm.features)


def block_ends(chunk: int, n: int, rows: Sequence[Policy], stops: Sequence[int] = ()) -> list[int]:
    """Where the forward calls on a prompt of ``n`` tokens end: every ``chunk`` tokens, moved back (or, if
    there is none in reach, forward up to ``REACH`` chunks or budgets) to a place where every row may cut
    (ReAttention's Algorithm 1 needs all of one of its chunks' queries in one call to vote together), and at
    every one of ``stops`` (a query-agnostic run's context end: no block straddles it, as none straddles the
    prompt's end).

    Two ReAttention rows whose chunk grids never meet (e.g. budgets 64 and 72 in one sweep) have no common
    place: the block then ends at the reach, past both rows' first global + local tokens, and their later
    chunks are cut there, as any block end cuts them, rather than growing the block to the whole
    prompt (O(T^2) memory for every other row)."""
    # A ReAttention row may cut every `chunk` of its own after its first global + local tokens (< budget).
    reach = REACH * max([chunk] + [p.cut_reach() for p in rows])
    ends, lo = [], 0
    for stop in sorted({int(s) for s in stops if 0 < s < n} | {n}):
        def ok(end: int) -> bool:
            return end == stop or all(p.may_cut(end) for p in rows)

        while lo < stop:
            aim = min(lo + chunk, stop)
            end = next((e for e in range(aim, lo, -1) if ok(e)), None)
            if end is None:
                end = next((e for e in range(aim + 1, min(lo + reach, stop) + 1) if ok(e)), min(lo + reach, stop))
            ends.append(end)
            lo = end
    return ends


def _forward(lm: LoadedModel, cache: PolicyCache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Feed ids [B, n] at positions start..start+n-1; return the last hidden states [B, n, D]."""
    positions = torch.arange(start, start + ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
    cache.feed(ids, start)
    out = lm.model.model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                         kv_lens=cache)
    give_back()  # the block's freed arrays: without it the heap fragments and RSS creeps up (allocator.py)
    return out.last_hidden_state


def _log_softmax(lm: LoadedModel, hidden: torch.Tensor) -> torch.Tensor:
    """Log-probabilities from hidden states [B, m, D]. A product of fewer than ``FEWEST_PRODUCT_ROWS`` rows rounds
    otherwise than a larger one on some processors (attention.py): zero rows make up the rest, so a row's numbers are
    the same in any batch."""
    missing = -(-FEWEST_PRODUCT_ROWS // hidden.shape[1]) - hidden.shape[0]
    padded = hidden if missing <= 0 else torch.cat([hidden, hidden.new_zeros(missing, *hidden.shape[1:])])
    return torch.log_softmax(lm.features.logits(lm.model.lm_head(padded)).float(), dim=-1)[: len(hidden)]


def _predictions(lm: LoadedModel, hidden: torch.Tensor, next_ids: torch.Tensor) -> dict[str, np.ndarray]:
    """What each row predicts at positions with hidden states [B, m, D] for their next tokens [m'] (m' <= m):
    ``logprobs`` of those tokens, ``top1_ids`` and ``kl_to_full`` (KL(Full || row), row 0 being Full)."""
    pieces = []
    for lo in range(0, len(next_ids), LM_HEAD_CHUNK):
        targets = next_ids[lo:lo + LM_HEAD_CHUNK]
        logp = _log_softmax(lm, hidden[:, lo:lo + len(targets)])
        # KL(Full || row) = sum p_full logp_full - sum p_full logp_row: one product and one sum over the rows'
        # [m, vocab] log-probabilities instead of three passes (a quarter faster; a batched matmul would be
        # faster still, but its rounding would depend on which rows share the batch).
        cross = (logp[0].exp() * logp).sum(-1)
        chosen = logp.gather(-1, targets.expand(len(logp), -1)[..., None])[..., 0]
        # One device-to-host copy for the three (float64 holds each exactly): a GPU waits once per chunk.
        outcome = torch.stack([chosen.double(), logp.argmax(-1).double(), (cross[0:1] - cross).double()])
        logprobs, top1, kl = outcome.cpu().numpy()
        pieces.append({"logprobs": logprobs.astype(np.float32), "top1_ids": top1.astype(np.int64),
                       "kl_to_full": kl.astype(np.float32)})
    return _joined(pieces, len(hidden))


def _joined(pieces: Sequence[dict[str, np.ndarray]], n_rows: int) -> dict[str, np.ndarray]:
    """Per-position arrays of consecutive stretches of the text, joined along the position axis."""
    empty = {"logprobs": np.zeros((n_rows, 0), np.float32), "top1_ids": np.zeros((n_rows, 0), np.int32),
             "kl_to_full": np.zeros((n_rows, 0), np.float32)}
    return {name: np.concatenate([zero, *(p[name] for p in pieces)], axis=1).astype(zero.dtype)
            for name, zero in empty.items()}


def _unscored(n_rows: int, m: int) -> dict[str, np.ndarray]:
    """Per-position arrays for ``m`` positions that are not scored (a generate-mode prompt's but its last): NaN
    log-probabilities and KL, top-1 id -1."""
    return {"logprobs": np.full((n_rows, m), np.nan, np.float32), "top1_ids": np.full((n_rows, m), -1, np.int64),
            "kl_to_full": np.full((n_rows, m), np.nan, np.float32)}


def _teacher_force(lm: LoadedModel, cache: PolicyCache, ids: Sequence[int], start: int, ends: Sequence[int],
                   next_ids: Sequence[int] | None = None, progress: Progress | None = None, label: str = "scoring"
                   ) -> tuple[torch.Tensor | None, dict[str, np.ndarray]]:
    """Feed ``ids`` to every row at positions start.. in blocks ending at ``ends`` (offsets into ``ids``).

    Returns the last position's hidden states [B, D] (None if ``ids`` is empty) and what each position
    predicts for its next token: ``next_ids`` (default ``ids[1:]``, so the last position predicts nothing).
    A block also ends where a row compresses after a reconstruction pass (KVzip), which runs between blocks.
    """
    device = lm.model.device
    n_rows = len(cache.policies)
    batch = torch.tensor(ids, dtype=torch.long, device=device).expand(n_rows, -1)
    targets = torch.tensor(list(ids[1:] if next_ids is None else next_ids), dtype=torch.long, device=device)
    pieces, hidden, lo = [], None, 0
    ends = sorted(set(ends) | {e for e in cuts(cache, start, len(ids)) if ends and e < max(ends)})
    for hi in ends:
        # The rows that still read as Full are left out: theirs are Full's hidden states and predictions.
        size = cache.batch_for(start + hi, hi - lo)
        cache.grow_batch(size)
        hidden = _forward(lm, cache, batch[:size, lo:hi], start + lo)
        reread(lm, cache, start + hi - 1)
        predicted = _predictions(lm, hidden, targets[lo:hi])
        pieces.append({name: np.concatenate([a, np.repeat(a[:1], n_rows - size, 0)]) for name, a in predicted.items()})
        if progress:
            progress(hi / len(ids), f"{label}: token {start + hi} of {start + len(ids)}")
        lo = hi
    return (None if hidden is None else rows_up_to(hidden[:, -1], n_rows)), _joined(pieces, n_rows)


def _decode(lm: LoadedModel, cache: PolicyCache, hidden: torch.Tensor, position: int, max_new_tokens: int,
            progress: Progress | None = None) -> list[list[int]]:
    """Greedy tokens from each row's last hidden state [B, D], each row under its own policy, until EOS."""
    eos = lm.tokenizer.eos_token_id
    cache.grow_batch(len(cache.policies))  # every row answers from its own cache
    outputs: list[list[int]] = [[] for _ in cache.policies]
    done = np.zeros(len(outputs), bool)
    next_ids = torch.full((len(outputs),), eos if eos is not None else 0, dtype=torch.long, device=hidden.device)
    # Each row's last hidden state, written in place as its row steps: a copy, since the caller scores the prompt's
    # last hidden states after decoding.
    hidden = hidden.clone()
    try:
        for step in range(max_new_tokens):
            # Only the rows still answering go through the LM head and the model: a row that has read its EOS
            # is idle (``PolicyCache.members``), so a row that rambles on costs the others nothing.
            answering = np.flatnonzero(~done)
            active = torch.from_numpy(answering).to(hidden.device)
            next_ids[active] = lm.features.logits(lm.model.lm_head(hidden[active])).argmax(-1)
            tokens = next_ids.tolist()  # one read from the device a step
            for row in answering:
                outputs[row].append(tokens[row])
            done |= np.array([out[-1] == eos for out in outputs])  # every row has a token from the first step on
            # Feed every generated token, the last one too, so each has its own step in the trace.
            cache.members = None if len(answering) == len(outputs) else tuple(answering.tolist())
            hidden[active] = _forward(lm, cache, next_ids[active][:, None], position)[:, -1]
            reread(lm, cache, position)
            position += 1
            if done.all():
                break
            if progress:
                progress((step + 1) / max_new_tokens, f"generating: token {step + 1} of at most {max_new_tokens}")
    finally:
        cache.members = None
    return outputs


def score_text(lm: LoadedModel, ids: Sequence[int], policies: Sequence[Policy], chunk: int = DEFAULT_CHUNK,
               progress: Progress | None = None, reference: bool = True, record_layers: Sequence[int] = ()
               ) -> tuple[PolicyCache, dict[str, np.ndarray], list[int]]:
    """Teacher-force ``ids`` under every policy at once.

    Returns the cache (what each row read), per-row arrays ``logprobs``, ``top1_ids``, ``kl_to_full``
    (each [rows, T-1], position i predicting ids[i+1]) and the row index of each policy.
    """
    rows, index = _rows(policies, reference)
    cache = new_cache(lm, rows, record_layers, len(ids))
    with torch.inference_mode(), cache.capture_prerope(lm.model):
        _, stats = _teacher_force(lm, cache, ids, 0, block_ends(chunk, len(ids), rows), progress=progress)
    return cache, stats, index


def generate(lm: LoadedModel, prompt_ids: Sequence[int], policies: Sequence[Policy], max_new_tokens: int,
             chunk: int = DEFAULT_CHUNK, progress: Progress | None = None, reference: bool = True,
             record_layers: Sequence[int] = (), context_end: int | None = None
             ) -> tuple[PolicyCache, list[list[int]], list[int]]:
    """Greedy continuation of the prompt under each policy; returns (cache, continuation per row, row index).
    ``context_end``: see ``_generate_and_score``."""
    cache, outputs, index, _ = _generate_and_score(lm, prompt_ids, policies, max_new_tokens, chunk, progress,
                                                   reference=reference, record_layers=record_layers, score=False,
                                                   context_end=context_end)
    return cache, outputs, index


def _generate_and_score(lm: LoadedModel, prompt_ids: Sequence[int], policies: Sequence[Policy], max_new_tokens: int,
                        chunk: int, progress: Progress | None, reference: bool, record_layers: Sequence[int],
                        score: bool = True, context_end: int | None = None):
    """Generate under every policy; with ``score``, also every policy's predictions on Full's continuation, from the
    prompt's last position on (the positions before it hold NaN and -1: ``_unscored``).

    ``context_end`` (query-agnostic): the policies take the prompt to end there, before the question, so a
    compression policy compresses the context alone and the question's tokens are read under the compressed
    cache (then kept, like generated ones, until the policy's next compression); a dense prefill ends there
    too. None: the whole prompt, the question included, is what they decide over (query-aware).

    The prompt is read once. Before generating, the cache is forked: the fork then reads Full's continuation
    teacher-forced, in one call but as decoding steps, so every policy's scores come from the same prompt
    state as its generation and each continuation token is read as decoding reads it.
    """
    n = len(prompt_ids)
    if context_end is not None and not 1 <= context_end <= n:
        raise ValueError(f"context_end must be within 1..{n} (the prompt's tokens), got {context_end}")
    n_prompt = n if context_end is None else context_end  # compression policies act once it is read
    rows, index = _rows(policies, reference, n_prompt)
    cache = new_cache(lm, rows, record_layers, n + max_new_tokens)
    cache.n_prompt = n_prompt
    ends = block_ends(chunk, n, rows, stops=() if context_end is None else (context_end,))
    with torch.inference_mode():
        with cache.capture_prerope(lm.model):
            # No predictions over the prompt ([]): what metrics count in generate mode starts at its last position
            # (``score_start``), and the LM head over every prompt position of every row was a quarter of a SmolLM2
            # row's prefill and two thirds of a Gemma 3 row's (a 262k-word vocabulary).
            hidden, _ = _teacher_force(lm, cache, prompt_ids, 0, ends, next_ids=[], progress=progress,
                                       label="reading the prompt")
            scoring = cache.fork() if score else None
            outputs = _decode(lm, cache, hidden, n, max_new_tokens, progress)
        if not score:
            return cache, outputs, index, None
        full = outputs[0]
        first = _predictions(lm, hidden[:, None], torch.tensor(full[:1], device=hidden.device))
        scoring.decoding = True
        with scoring.capture_prerope(lm.model):
            _, rest = _teacher_force(lm, scoring, full[:-1], n, [len(full) - 1] if len(full) > 1 else [], next_ids=full[1:],
                                     progress=progress)
    return cache, outputs, index, _joined([_unscored(len(rows), n - 1), first, rest], len(rows))


def _recorded(cache: PolicyCache, row: int, length: int, ropes: dict[str, np.ndarray]) -> dict:
    """Attention rows (top-k entries) and sampled keys before RoPE of the recorded layers, over the row's
    own length, and how each recorded layer rotates its keys (``ropes``, from ``_recorded_ropes``)."""
    if not cache.record_layers:
        return {}
    where = key_positions(length)
    return {"attention": cache.recorded_attention(row, length), "keys": cache.recorded_keys(row, where),
            "key_positions": where, **ropes}


def _recorded_ropes(lm: LoadedModel, record_layers: Sequence[int]) -> dict[str, np.ndarray]:
    """Each recorded layer's own RoPE (Gemma 3's local and global bases differ; a NoPE layer has none), so the
    keys after RoPE can be drawn from the keys a trace keeps."""
    if not record_layers:
        return {}
    ropes = [key_rope(lm.features.layers[layer].rope, lm.head_dim, lm.model.device) for layer in record_layers]
    return {"rope_freq": np.stack([r.freq for r in ropes]).astype(np.float32),
            "rope_partner": np.stack([r.partner for r in ropes]).astype(np.int16),
            "rope_scaling": np.array([r.scaling for r in ropes], np.float32)}


def _meta(lm: LoadedModel, spec: str, policy: Policy, mode: str, tokens: Sequence[int], n_prompt: int,
          record_layers: Sequence[int]) -> dict:
    return {
        "format_version": FORMAT_VERSION, "spec": spec, "policy": policy.name, "params": policy.params(),
        "kind": policy.kind, "mode": mode, "model": lm.name, "model_fingerprint": lm.fingerprint,
        "n_layers": lm.n_layers, "n_kv_heads": lm.n_kv_heads, "n_heads": lm.n_heads,
        "n_prompt": n_prompt, "score_start": 0 if mode == "prompt" else n_prompt - 1,
        "token_texts": [lm.tokenizer.decode([t]) for t in tokens],
        "recorded_layers": list(record_layers),
        **({"layer_windows": lm.features.windows} if any(lm.features.windows) else {}),
    }


def _masks(cache: PolicyCache, row: int, policy: Policy, length: int) -> dict[str, np.ndarray]:
    """What row ``row`` read over its first ``length`` tokens (rows may stop early at EOS)."""
    if policy.kind in ("eviction", "compression"):
        evicted = cache.evicted_at(row)[..., :length]
        forms = cache.forms(row, length) if policy.reforms else {}
        return {"evicted_at": np.where(evicted > length, -1, evicted).astype(np.int32), **forms}
    if policy.kind == "selection":
        stats = {f"stat_{name}": values[:, :length] for name, values in cache.stats(row).items()}
        return {"spans": cache.spans(row, length), **stats}
    return {}


def compute_traces(lm: LoadedModel, specs: Sequence[str], policies: Sequence[Policy], ids: Sequence[int], mode: str = "prompt",
        max_new_tokens: int = 64, chunk: int = DEFAULT_CHUNK, progress: Progress | None = None,
        record_layers: Sequence[int] | None = None, context_end: int | None = None) -> tuple[list[Trace], Trace]:
    """Run every policy on ``ids`` (the text, or the prompt in generate mode).

    Returns one trace per policy, and Full's trace (the reference row, whether asked for or not).
    ``record_layers`` (default: first, middle, last) keep attention rows and keys for those layers.
    ``context_end`` (generate mode): the policies decide over ``ids[:context_end]`` before reading the rest, the
    question (query-agnostic; ``_generate_and_score``).
    """
    record = default_record_layers(lm) if record_layers is None else tuple(record_layers)
    if any(not 0 <= layer < lm.n_layers for layer in record):
        raise ValueError(f"record_layers must be within 0..{lm.n_layers - 1}, got {list(record)}")
    if mode not in ("prompt", "generate"):
        raise ValueError(f"mode must be 'prompt' or 'generate', got {mode!r}")
    ids = [int(i) for i in ids]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    if context_end is not None and mode != "generate":
        raise ValueError("context_end (a query-agnostic run) needs generate mode")
    if mode == "prompt":
        cache, stats, index = score_text(lm, ids, policies, chunk, progress, record_layers=record)
        continuations = None
    else:
        cache, continuations, index, stats = _generate_and_score(lm, ids, policies, max_new_tokens, chunk, progress,
                                                                 reference=True, record_layers=record,
                                                                 context_end=context_end)

    ropes = _recorded_ropes(lm, record)

    def trace(spec: str, policy: Policy, row: int) -> Trace:
        own = ids if continuations is None else ids + continuations[row]
        generated = {} if continuations is None else {"generated_ids": np.array(continuations[row], np.int32)}
        scored = ids if continuations is None else ids + continuations[0]
        meta = {**_meta(lm, spec, policy, mode, own, len(ids), record), "attention_top_k": cache.record_top_k if record else 0}
        if context_end is not None and policy.reads_prompt_end:  # where it took the prompt to end (query-agnostic)
            meta["context_end"] = int(context_end)
        if policy.rereads:  # a second pass through the model (KVzip's): its cost
            meta["extra_pass_tokens"] = cache.extra_pass_tokens[row] if cache.extra_pass_tokens else 0
        return Trace(meta=meta, tokens=np.array(own, np.int32),
                     scored_ids=np.array(scored, np.int32), **{k: v[row] for k, v in stats.items()},
                     **_masks(cache, row, policy, len(own)), **_recorded(cache, row, len(own), ropes), **generated)

    return [trace(s, p, row) for s, p, row in zip(specs, policies, index)], trace("full", Full(), 0)
