"""Side passes through the model, outside the text: KVzip's context reconstruction.

A policy with ``rereads`` (KVzip) scores its cache by what the model attends to while it re-reads its
context after a repeat prompt. The runner cuts its forward calls at every step where such a row compresses
(``cuts``) and, after each, calls ``reread``: for each row due, the row's unscored context goes through the
model again, piece by piece (``pieces``, ``prompt``, from ``rereads_from``), over a one-row cache
(``RereadCache``) that starts from the row's keys and values, inside ``PolicyCache.side_pass`` so the text's
captured pre-RoPE vectors stay as they were; the policy stores each position's score (``record``), decides
what every layer keeps (``plan``: a budget may be shared across layers) and every layer compresses
(``RowLayerState.compress_now``). The chat template's header (``template_header``) is the policy's to skip. The tokens of the pass are the method's cost: the
cache counts them per row (``PolicyCache.extra_pass_tokens``) and traces report them. Rows with the same history
(KVzip at several budgets, compressing a context for the first time) make each pass once, together.
"""
from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from ..policies.base import attention_logits, visible_keys
from .attention import PolicyCache
from .models import LoadedModel

QUERY_BLOCK = 256  # pass queries per attention matmul: bounds the [H, G, block, keys] scores


class RereadCache(DynamicCache):
    """One row's cache for a reconstruction piece: layer l starts as the row's keys and values 0..t.

    A query of the pass reads what the row holds (``alive[l]`` [H, t+1], by position) and the pass's tokens up
    to its own. Per layer it records, for positions a..b-1, the most attention any pass query from any query
    head of the KV head's group gives them, the softmax taken over the sinks, a..b-1 and the pass's tokens
    (the authors' ``KVScore._get_score``): ``scores[l]`` [H, b - a].
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], alive: list[np.ndarray],
                 a: int, b: int, sinks: int):
        super().__init__()
        for layer, (k, v) in enumerate(zip(keys, values)):
            self.update(k, v, layer)
        self.alive, self.a, self.b, self.sinks = alive, a, b, sinks
        self.scores: list[np.ndarray | None] = [None] * len(keys)

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float, softcap: float | None = None, window: int | None = None) -> torch.Tensor:
        """query [1, H_q, L, d], key/value [1, H, M, d] (the row's M - L tokens, then the pass's) -> [1, L, H_q, d].
        The layer's soft-capping and sliding window apply as in the engine (``PolicyCache.attend``)."""
        _, n_q_heads, n, dim = query.shape
        n_heads, total = key.shape[1], key.shape[2]
        held = total - n
        q = query[0].view(n_heads, n_q_heads // n_heads, n, dim)
        k, v = key[0], value[0]
        alive = torch.from_numpy(self.alive[layer]).to(k.device)  # [H, held]
        scored = torch.zeros(held, dtype=torch.bool, device=k.device)
        scored[: self.sinks] = True
        scored[self.a: self.b] = True
        scored = scored & alive  # [H, held]: the columns the score's softmax spans, with the pass's tokens
        best = torch.zeros(n_heads, self.b - self.a, dtype=query.dtype, device=k.device)
        out = []
        for lo in range(0, n, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, n)
            own = torch.arange(n, device=k.device)[None] <= torch.arange(lo, hi, device=k.device)[:, None]  # [m, n]
            s = attention_logits(q[:, :, lo:hi], k[:, None], scaling, softcap)  # [H, G, m, M]
            if window is not None:  # the pass's queries stand at positions held + lo.. in this layer's window
                s = s.masked_fill(~visible_keys(held + lo, hi - lo, total, window, k.device), float("-inf"))
            reads = torch.cat([alive[:, None, :].expand(-1, hi - lo, -1), own.expand(n_heads, -1, -1)], -1)
            out.append(torch.softmax(s.masked_fill(~reads[:, None], float("-inf")), -1) @ v[:, None])
            spans = torch.cat([scored[:, None, :].expand(-1, hi - lo, -1), own.expand(n_heads, -1, -1)], -1)
            p = torch.softmax(s.masked_fill(~spans[:, None], float("-inf")), -1)[..., self.a: self.b]
            best = torch.maximum(best, p.amax(dim=(1, 2)))
        self.scores[layer] = best.double().cpu().numpy()
        return torch.cat(out, 2).reshape(n_q_heads, n, dim).transpose(0, 1)[None].contiguous()


def _encode(lm: LoadedModel, text: str) -> list[int]:
    """Token ids of ``text`` without special tokens (a BOS in the middle of a pass would be a new text)."""
    encode = getattr(lm.tokenizer, "encode", None)
    return list(encode(text, add_special_tokens=False) if encode else lm.tokenizer(text).input_ids)


def assistant_turn(lm: LoadedModel, fallback: str) -> list[int]:
    """What the model's chat template puts between a user's text and the assistant's answer (kvpress reads it
    the same way); ``fallback`` when the model has none (the authors' template for unknown models)."""
    tokenizer = lm.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        return _encode(lm, fallback)
    mark = "\x00KVLENS\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    return _encode(lm, text.split(mark, 1)[1])


def template_header(lm: LoadedModel, ids: list[int]) -> int:
    """How many of ``ids``' first tokens are the chat template's header before the user's text (its system
    prompt and the user turn's opening, kvpress's ``prefix_length``); 0 when the text is not wrapped in it."""
    tokenizer = lm.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        return 0
    mark = "\x00KVLENS\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], add_generation_prompt=True,
                                         tokenize=False)
    header = _encode(lm, text.split(mark, 1)[0])
    # The header's last token may merge with the text's first one: a header matched up to it still counts.
    same = next((i for i, (x, y) in enumerate(zip(header, ids)) if x != y), min(len(header), len(ids)))
    return same if header and same >= len(header) - 1 else 0


def _rereading(cache: PolicyCache) -> list[int]:
    return [row for row, p in enumerate(cache.policies) if p.rereads and row not in cache.idle]


def cuts(cache: PolicyCache, start: int, n: int) -> set[int]:
    """Offsets e in 1..n where a forward call over positions start.. must end: a rereading row compresses
    after step start + e - 1."""
    rows = _rereading(cache)
    return {t - start + 1 for r in rows
            for t in cache.policies[r].compression_steps(start, start + n, cache.n_prompt)}


class _Pass:
    """A reconstruction piece made after this step: the history of the row that made it, and the scores it gave."""

    def __init__(self, piece: tuple, history: tuple, scores: list[np.ndarray]):
        self.piece, self.history, self.scores = piece, history, scores

    def reads_as(self, piece: tuple, history: tuple) -> bool:
        """Would a row with ``history`` make this pass over ``piece``: the same tokens over the same cache?"""
        return piece == self.piece and len(history) == len(self.history) and all(
            np.array_equal(x, y) for x, y in zip(history, self.history))


def _history(cache: PolicyCache, row: int, t: int) -> tuple:
    """What makes ``row``'s cache after step t what it is: the tokens it was fed, and in every layer when each held
    token left (``evicted_at``, -1: still held), so what every query read. Rows with the same history hold the
    same keys and values, up to the rounding of where they sit in the batch. A row that reforms what it holds
    (``Policy.reforms``) read forms of its own: its history is its own (the row's index)."""
    own = (np.array([row]),) if cache.policies[row].reforms else ()
    return (*own, cache.fed[row, : t + 1].numpy().copy(),
            *(layer[row].evicted_at[:, : t + 1].copy() for layer in cache.rows))


def reread(lm: LoadedModel, cache: PolicyCache, t: int) -> None:
    """After step t: every rereading row due to compress re-reads its unscored context, then compresses (a
    compression that would drop nothing makes no pass: there is nothing to decide).

    Rows that would make the same pass share it: KVzip at several budgets over one context holds the same cache
    when it first compresses, and its scores do not depend on the budget. Each row still counts the pass's tokens,
    the method's cost."""
    made: list[_Pass] = []
    for row in _rereading(cache):
        policy = cache.policies[row]
        states = [layer[row] for layer in cache.rows]
        if not policy.compresses_after(t, cache.n_prompt):
            continue
        # A row that took Full's prefill departs here: it joins the batch with Full's cache, its own to the bit.
        cache.grow_batch(max(row + 1, cache.batch_for(t + 2)))
        held = [s.alive[:, : t + 1] for s in states]
        ids = cache.fed[row, : t + 1].tolist()
        prefix = template_header(lm, ids)
        if not policy.would_drop(held, prefix):
            continue
        lo = policy.rereads_from(states[0].state, prefix)
        suffix = assistant_turn(lm, policy.NO_TEMPLATE)
        history, sinks = _history(cache, row, t), policy.pass_sinks()
        for a, b in policy.pieces(lo, t + 1):
            tokens = policy.prompt(ids, a, b, lambda text: _encode(lm, text), suffix, prefix)
            piece = (a, b, tuple(tokens), sinks)
            piece_pass = next((p for p in made if p.reads_as(piece, history)), None)
            if piece_pass is None:
                piece_pass = _Pass(piece, history, _pass(lm, cache, row, held, t, tokens, a, b, sinks))
                made.append(piece_pass)
            for state, score in zip(states, piece_pass.scores):
                policy.record(state.state, a, b, score)
            cache.add_extra_pass(row, len(tokens))
        policy.plan([s.state for s in states], held, t, prefix)
        for state, layer in zip(states, cache.layers):
            state.compress_now(t, layer.keys[row], layer.values[row], cache.n_prompt)


def _pass(lm: LoadedModel, cache: PolicyCache, row: int, held: list[np.ndarray], t: int, tokens: list[int], a: int,
          b: int, sinks: int) -> list[np.ndarray]:
    """One reconstruction piece of ``row``: ``tokens`` through the model over the row's cache; per layer the scores
    [H, b - a] of positions a..b-1 (``RereadCache``)."""
    side = RereadCache([layer.keys[row: row + 1, :, : t + 1] for layer in cache.layers],
                       [layer.values[row: row + 1, :, : t + 1] for layer in cache.layers], held, a, b, sinks)
    device = lm.model.device
    positions = torch.arange(t + 1, t + 1 + len(tokens), device=device)[None]
    with cache.side_pass():
        lm.model.model(input_ids=torch.tensor([tokens], device=device), position_ids=positions,
                       past_key_values=side, use_cache=True, kv_lens=side)
    return side.scores
