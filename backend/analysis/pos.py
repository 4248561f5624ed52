"""Which kinds of words a policy keeps: mean lifetime per part-of-speech tag (TOVA Sec. 6.1, Tables 1, 4).

The text (the trace's ``token_texts`` joined) is split into sentences and words with NLTK's tokenizers
(Punkt without trained parameters, and the Treebank-style word tokenizer: neither needs data files),
the words are tagged with NLTK's averaged perceptron tagger, and each model token takes the tag of the
word it overlaps most, by character offsets. A token that overlaps no word (whitespace) is tagged
``\\n`` when it holds a line break, as in TOVA's table, and left out otherwise.

The tagger's data (``taggers/averaged_perceptron_tagger_eng``, zipped or not) ships in
``assets/nltk_data`` and is looked up there first, then in the directories of ``NLTK_DATA`` (read at call
time) and ``nltk.data.path``; when it is missing everywhere, one download is tried, and if that fails too
``TaggerUnavailable`` says what to do.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from .metrics import lifetimes
from ..texts import NLTK_DATA as SHIPPED_NLTK_DATA
from ..traces.trace import Trace

TAGGER = "averaged_perceptron_tagger_eng"
NEWLINE_TAG = "\n"

_tagger = None  # loaded once per process, only after a successful load
_download_failed = ""  # why the one download attempt of this process failed (offline machines)


class TaggerUnavailable(RuntimeError):
    """NLTK's POS tagger cannot be loaded; the message says how to install it (shown to the user)."""


def _use_nltk_data_env() -> None:
    """Put the shipped data, then the directories of ``NLTK_DATA``, first on nltk's search path (nltk
    reads ``NLTK_DATA`` only at import)."""
    import nltk

    env = [d for d in os.environ.get("NLTK_DATA", "").split(os.pathsep) if d]
    for directory in reversed([str(SHIPPED_NLTK_DATA), *env]):
        if directory in nltk.data.path:
            nltk.data.path.remove(directory)
        nltk.data.path.insert(0, directory)


def _find_tagger() -> bool:
    import nltk

    try:
        nltk.data.find(f"taggers/{TAGGER}/")
        return True
    except LookupError:
        return False


def load_tagger(download: bool = True):
    """NLTK's English averaged perceptron tagger, or TaggerUnavailable with a one-line reason."""
    global _tagger, _download_failed
    if _tagger is not None:
        return _tagger
    try:
        import nltk
        from nltk.tag.perceptron import PerceptronTagger
    except ImportError as err:
        raise TaggerUnavailable(f"POS tags need the nltk package ({err})") from None
    _use_nltk_data_env()
    if not _find_tagger():
        why = "downloads disabled"
        if download and _download_failed:
            why = _download_failed  # tried once already in this process: don't wait on the network again
        elif download:
            try:
                ok = nltk.download(TAGGER, quiet=True, raise_on_error=True)
                why = "download failed" if not ok else why
            except Exception as err:  # offline, blocked host, read-only directory...
                why = f"download failed: {str(err).splitlines()[0]}"
            _download_failed = "" if _find_tagger() else why
        if not _find_tagger():
            raise TaggerUnavailable(
                f"NLTK's POS tagger {TAGGER!r} is not installed ({why}); put "
                f"taggers/{TAGGER}.zip in a directory named by NLTK_DATA, or run "
                f"`python -m nltk.downloader {TAGGER}` (searched: {', '.join(map(str, nltk.data.path))})")
    try:
        _tagger = PerceptronTagger(lang="eng")
    except Exception as err:  # a corrupt or partial download
        raise TaggerUnavailable(f"NLTK's POS tagger {TAGGER!r} could not be loaded: {err}") from None
    return _tagger


def _sentence_words(text: str) -> list[list[tuple[int, int, str]]]:
    """Per sentence, its words as (start, end, form the tagger should see), by character offsets."""
    from nltk.tokenize import NLTKWordTokenizer
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    words = NLTKWordTokenizer()
    out = []
    for s_start, s_end in PunktSentenceTokenizer().span_tokenize(text):
        sentence = text[s_start:s_end]
        spans = list(words.span_tokenize(sentence))
        forms = words.tokenize(sentence)  # '"' comes out as `` or '', the forms the tagger knows
        if len(forms) != len(spans):
            forms = [sentence[a:b] for a, b in spans]
        out.append([(s_start + a, s_start + b, form) for (a, b), form in zip(spans, forms)])
    return out


def tag_words(text: str, tagger=None) -> list[tuple[int, int, str]]:
    """(start, end, POS tag) of each word of ``text``, tagged sentence by sentence."""
    tagger = tagger or load_tagger()
    out = []
    for sentence in _sentence_words(text):
        if sentence:
            tags = tagger.tag([form for _, _, form in sentence])
            out.extend((a, b, tag) for (a, b, _), (_, tag) in zip(sentence, tags))
    return out


def tag_tokens(token_texts: list[str], tagger=None) -> list[str | None]:
    """One POS tag per token: the tag of the word it overlaps most (ties: the first such word),
    ``"\\n"`` for a token with no word but a line break, ``None`` for other word-less tokens."""
    text = "".join(token_texts)
    words = tag_words(text, tagger)
    tags: list[str | None] = []
    pos, w = 0, 0
    for piece in token_texts:
        start, end = pos, pos + len(piece)
        pos = end
        while w < len(words) and words[w][1] <= start:  # words that end before this token
            w += 1
        best, best_overlap, k = None, 0, w
        while k < len(words) and words[k][0] < end:
            overlap = min(end, words[k][1]) - max(start, words[k][0])
            if overlap > best_overlap:
                best, best_overlap = words[k][2], overlap
            k += 1
        if best is None and "\n" in piece:
            best = NEWLINE_TAG
        tags.append(best)
    return tags


def pos_lifetimes(trace: Trace, tagger=None, tags: list[str | None] | None = None) -> pd.DataFrame:
    """Mean lifetime per POS tag (TOVA Tables 1 and 4) for one trace.

    A token's lifetime is ``metrics.lifetimes`` (steps it was read, arrival included) averaged over
    layers and KV heads; a tag's ``mean_lifetime`` is the mean over its tokens, ``count`` their number.
    Sorted by ``mean_lifetime``, longest first. ``df.attrs["mean_lifetime_all"]`` is the mean over all
    tagged tokens (TOVA's "Avg." row). Tokens near the end of the text are censored (at most ``T - j``).
    Raises TaggerUnavailable when the tagger cannot be loaded. ``tags``: the text's ``tag_tokens``, when
    another trace of the same text has them already (tagging 32k tokens takes seconds).
    """
    texts = trace.meta["token_texts"]
    if len(texts) != len(trace.tokens):
        raise ValueError("the trace's token_texts do not match its tokens")
    tags = tag_tokens(texts, tagger) if tags is None else tags
    if len(tags) != len(texts):
        raise ValueError("tags must give one tag per token")
    life = lifetimes(trace).mean(axis=(0, 1))
    frame = pd.DataFrame({"tag": tags, "lifetime": life}).dropna(subset=["tag"])
    table = (frame.groupby("tag", sort=False)["lifetime"].agg(mean_lifetime="mean", count="size")
             .reset_index().sort_values(["mean_lifetime", "tag"], ascending=[False, True], kind="stable")
             .reset_index(drop=True))
    table["count"] = table["count"].astype(np.int64)
    table.attrs["mean_lifetime_all"] = float(frame["lifetime"].mean()) if len(frame) else float("nan")
    return table
