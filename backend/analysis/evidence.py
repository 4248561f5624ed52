"""Where a sample's answer lives in its prompt, and what each policy's cache did with it.

**Evidence** is the tokens of the prompt that hold the answer: each reference string of a task sample (a needle's
number, the variables of a VT chain, the CWE and FWE words), every occurrence of it in the context, or a span a
user names. It is found in the text, not in the tokens: the prompt's tokens are mapped to characters once
(``token_offsets``), each occurrence of a reference (case-insensitive, as RULER scores, and as a whole word or
number) is located there, and the tokens it overlaps are its span. So a string the tokenizer splits differently
in context than alone is still found, and a reference absent from the prompt is reported, not an error.

**Following it** (``follow``) reads the stored trace only: per layer and KV head, whether each evidence token was
read by the query that produced the answer's first token (the prompt's last position), the step it stopped being
read, and, in the recorded layers, the share of that query's attention the evidence received. ``verdict`` says it
in one line; the same for Full gives the reference numbers.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..traces.trace import Trace
from .reads import intervals


@dataclass(frozen=True)
class Span:
    """Tokens ``start .. end - 1`` of the prompt hold an occurrence of ``label``."""

    label: str
    start: int
    end: int


@dataclass(frozen=True)
class Evidence:
    """The spans of every reference found before ``end`` (the context's end), and the references not found."""

    spans: tuple[Span, ...]
    missing: tuple[str, ...]
    end: int

    @property
    def positions(self) -> np.ndarray:
        """int64: every evidence token's position, sorted, each once."""
        if not self.spans:
            return np.zeros(0, np.int64)
        return np.unique(np.concatenate([np.arange(s.start, s.end) for s in self.spans])).astype(np.int64)

    def describe(self) -> str:
        found = sorted({s.label for s in self.spans})
        n = len(self.spans)
        text = (f"{len(self.positions)} tokens in {n} occurrence{'' if n == 1 else 's'} of "
                f"{', '.join(found) or 'nothing'}")
        if self.missing:
            text += f"; not in the prompt: {', '.join(self.missing)}"
        return text


def token_offsets(tokenizer, ids: Sequence[int]) -> tuple[str, np.ndarray, np.ndarray]:
    """The text of ``ids`` and each token's [start, end) characters in it.

    The tokens' own decoding gives the text; re-encoding it with offsets gives each token's characters when that
    round-trips to the same ids (so every tokenizer's merges and normalisation are its own). Otherwise each token
    is decoded alone and the pieces are joined (exact for ASCII; a character split across byte tokens is shared
    by them)."""
    ids = [int(i) for i in ids]
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded["input_ids"]) == ids:
            offsets = np.asarray(encoded["offset_mapping"], np.int64).reshape(-1, 2)
            return text, offsets[:, 0], offsets[:, 1]
    except (NotImplementedError, TypeError, ValueError, KeyError):  # a slow tokenizer has no offsets
        pass
    pieces = [tokenizer.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False) for i in ids]
    ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
    return "".join(pieces), ends - np.asarray([len(p) for p in pieces], np.int64), ends


def _pattern(reference: str) -> re.Pattern:
    """The reference as a whole word or number: not inside a longer run of letters or digits."""
    before = r"(?<![0-9A-Za-z])" if reference[:1].isalnum() else ""
    after = r"(?![0-9A-Za-z])" if reference[-1:].isalnum() else ""
    return re.compile(before + re.escape(reference) + after, re.IGNORECASE)


def locate(tokenizer, ids: Sequence[int], references: Sequence[str], end: int | None = None) -> Evidence:
    """Every occurrence of each reference among the first ``end`` tokens of ``ids`` (all of them by default: pass
    the context's end so that a question repeating the answer's words is not taken for evidence)."""
    return _locate(*token_offsets(tokenizer, ids), references, len(ids) if end is None else int(end))


def locate_texts(token_texts: Sequence[str], references: Sequence[str], end: int | None = None) -> Evidence:
    """``locate`` from a trace's own token texts (each token decoded alone, ``meta["token_texts"]``), where no
    tokenizer is at hand: the same for ASCII text."""
    lengths = np.asarray([len(t) for t in token_texts], np.int64)
    ends = np.cumsum(lengths)
    end = len(token_texts) if end is None else min(int(end), len(token_texts))
    return _locate("".join(token_texts), ends - lengths, ends, references, end)


def run_evidence(full: Trace, names: Sequence[str], end: int | None = None) -> Evidence | None:
    """A run's evidence strings (``api.RunRequest.evidence``) located in its prompt from Full's token texts, before
    ``end`` when given; None when it names none."""
    if not names:
        return None
    n_prompt = int(full.meta.get("n_prompt") or len(full.tokens))
    return locate_texts(full.meta["token_texts"][:n_prompt], names, n_prompt if not end else min(int(end), n_prompt))


def _locate(text: str, starts: np.ndarray, ends: np.ndarray, references: Sequence[str], end: int) -> Evidence:
    limit = int(ends[end - 1]) if end > 0 else 0
    spans, missing = [], []
    for reference in dict.fromkeys(r.strip() for r in references if r and r.strip()):
        found = [m for m in _pattern(reference).finditer(text, 0, limit)]
        if not found:
            missing.append(reference)
        for m in found:
            first = int(np.searchsorted(ends, m.start(), side="right"))  # the first token ending after the start
            last = int(np.searchsorted(starts, m.end(), side="left"))  # one past the last token starting before
            if first < last:
                spans.append(Span(reference, first, min(last, end)))
    spans.sort(key=lambda s: (s.start, s.label))
    return Evidence(tuple(spans), tuple(missing), end)


def spans_of(positions: Sequence[tuple[int, int]], label: str = "span", end: int | None = None) -> Evidence:
    """Evidence a user names by token ranges [start, end) rather than by strings."""
    spans = tuple(Span(label, int(a), int(b)) for a, b in positions if int(b) > int(a))
    return Evidence(spans, (), int(end if end is not None else max((s.end for s in spans), default=0)))


@dataclass(frozen=True)
class Followed:
    """What one trace did with the evidence, read at ``step`` (the query that produced the answer's first token).

    ``held`` bool [L, H, E]: evidence token e was read by that query in layer l, KV head h; ``left`` int [L, H, E]:
    the step from which it was no longer read (-1 where it was read at ``step``); ``attention`` float [R]: per
    recorded layer, the share of that query's attention (mean over KV heads, each the mean of its query heads)
    on the evidence, or None where nothing was recorded; ``attention_top_k``: where the recorded rows are cut to
    their k largest weights (``TopAttention``, k = 7 at 8k tokens), that k, for the share is then a lower bound
    (evidence outside a row's top k counts 0); None where the rows are whole."""

    spec: str
    step: int
    positions: np.ndarray
    held: np.ndarray
    left: np.ndarray
    attention: np.ndarray | None
    attention_top_k: int | None = None

    def held_share(self, full: "Followed | None" = None) -> float:
        """The share of the (layer, KV head, evidence token) triples held at the step: of those Full held there
        when ``full`` is given (nan when Full held none), else of all."""
        held, reference = (self.held, np.ones_like(self.held)) if full is None else (self.held & full.held, full.held)
        return float(held.sum() / reference.sum()) if reference.sum() else float("nan")

    def lost_layers(self, full: "Followed | None" = None) -> np.ndarray:
        """bool [L]: layers in which no KV head held any evidence token at the step (of those Full held there)."""
        if not self.held.size:
            return np.zeros(self.held.shape[0], bool)
        lost = ~self.held.any(axis=(1, 2))
        return lost & full.held.any(axis=(1, 2)) if full is not None else lost

    @property
    def mean_attention(self) -> float | None:
        return None if self.attention is None else float(np.mean(self.attention))


def answer_step(trace: Trace) -> int:
    """The query that produced the answer's first token that is not blank (a chat model often writes a space or a
    newline first, and the digits of a number after it): in generate mode, the prompt's last position plus the
    blank tokens before it; the text's last token otherwise."""
    n_prompt = int(trace.meta.get("n_prompt") or len(trace.tokens))
    texts = trace.meta.get("token_texts") or []
    blank = 0
    while n_prompt + blank < min(len(trace.tokens), len(texts)) and not texts[n_prompt + blank].strip():
        blank += 1
    if n_prompt + blank >= min(len(trace.tokens), len(texts)):  # no answer, or an answer of blanks only
        blank = 0
    return n_prompt - 1 + blank


def follow(trace: Trace, evidence: Evidence, step: int | None = None) -> Followed:
    """Follow the evidence through ``trace`` (stored arrays only) up to ``step`` (default ``answer_step``)."""
    step = answer_step(trace) if step is None else int(step)
    positions = evidence.positions
    n_layers, n_heads = trace.meta["n_layers"], trace.meta["n_kv_heads"]
    held = np.zeros((n_layers, n_heads, len(positions)), bool)
    left = np.full(held.shape, -1, np.int64)
    if len(positions):
        for layer in range(n_layers):
            for head in range(n_heads):
                pos, start, end = intervals(trace, layer, [head])
                mine = np.isin(pos, positions) & (start <= step)
                pos, start, end = pos[mine], start[mine], end[mine]
                index = np.searchsorted(positions, pos)
                reading = (start <= step) & (step < end)
                held[layer, head, index[reading]] = True
                # The last step each token was read, for the tokens not read at ``step``: the end of its last
                # interval; a token never read left on arrival.
                last = np.asarray(positions, np.int64).copy()
                np.maximum.at(last, index, np.minimum(end, step))
                left[layer, head] = np.where(held[layer, head], -1, last)
    attention, top_k = None, None
    if trace.attention is not None and len(positions):
        pos = trace.attention.pos[:, :, step]  # [R, H, k]
        val = trace.attention.val[:, :, step].astype(np.float64)
        attention = (val * np.isin(pos, positions)).sum(-1).mean(-1)
        top_k = None if trace.attention.top_k > step else trace.attention.top_k  # query t has t + 1 weights
    return Followed(trace.spec, step, positions, held, left, attention, top_k)


def _percent(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if 100 * x < 10 else f"{100 * x:.0f}%"


def verdict(name: str, mine: Followed, full: Followed | None, evidence: Evidence, score: float | None = None,
            context_end: int | None = None) -> str:
    """One line: what ``name``'s cache did with the evidence and what its answer's first token attended to, beside
    Full's. ``score`` (0-1) says whether the answer was right; ``context_end`` where the question began."""
    n_layers, _, n_evidence = mine.held.shape
    outcome = "" if score is None else (" (answered right)" if score >= 0.5 else " (answered wrong)")
    if not n_evidence:
        return f"{name}: the references were not found in the prompt, so there is no evidence to follow{outcome}."
    attention = ""
    if mine.mean_attention is not None:
        at_least = "at least " if mine.attention_top_k else ""
        attention = f"; the answer's first token put {at_least}{_percent(mine.mean_attention)} of its attention on it"
        if full is not None and full.mean_attention is not None:
            attention += f", Full {_percent(full.mean_attention)}"
        if mine.attention_top_k:
            attention += f" (of the {mine.attention_top_k} largest weights a head's row keeps)"
    gone = ~mine.held.any(axis=1)  # [L, E]: no KV head read the token at the step
    readable = full.held.any(axis=1) if full is not None else np.ones_like(gone)
    gone &= readable  # only where Full read it (a sliding-window layer reads no token beyond its window)
    all_gone = gone.any(axis=1) & (gone == readable).all(axis=1)  # every token Full read there is gone
    some_gone = gone.any(axis=1) & ~all_gone
    if not gone.any():
        return (f"{name} held all {n_evidence} evidence tokens in every layer when the answer began"
                f"{attention}{outcome}.")
    parts = []
    if all_gone.any():
        parts.append(f"all {n_evidence} evidence tokens in {int(all_gone.sum())} of {n_layers} layers")
    if some_gone.any():
        most = int(gone[some_gone].sum(axis=1).max())
        parts.append(f"up to {most} of {n_evidence} in {int(some_gone.sum())}"
                     f"{' more' if all_gone.any() else f' of {n_layers} layers'}")
    # When they went: the latest step at which a lost token's last KV head stopped reading it.
    left = int(np.where(gone[:, None, :], mine.left, -1).max())
    when = ""
    if left >= 0:
        when = f", the last by token {left:,}"
        if context_end is not None:
            when += (f", {context_end - left:,} tokens before the question" if left < context_end
                     else " (at the question)" if left == context_end else ", as the question was read")
    return (f"{name} had lost {' and '.join(parts)}{when}: no KV head read them when the answer began{attention}"
            f"{outcome}.")
