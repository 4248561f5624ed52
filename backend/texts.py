"""Texts and NLTK data that ship with the repository, so nothing is downloaded at run time.

``assets/nltk_data`` has NLTK's own layout (``corpora/*.zip``, ``taggers/*.zip``): the C-Span inaugural
and State of the Union corpora (public domain) and NLTK's English averaged perceptron POS tagger
(``assets/nltk_data/NOTICE.md`` gives the sources and licences). The corpora are read straight from
their zips; ``pos.py`` finds the tagger here before it looks anywhere else.
"""
from __future__ import annotations

import zipfile
from pathlib import Path

NLTK_DATA = Path(__file__).resolve().parents[1] / "assets" / "nltk_data"
CORPORA = ("inaugural", "state_union")


def _corpus_zip(corpus: str) -> Path:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; shipped: {', '.join(CORPORA)}")
    return NLTK_DATA / "corpora" / f"{corpus}.zip"


def corpus_files(corpus: str) -> list[str]:
    """The documents of a shipped corpus, e.g. ``['1789-Washington.txt', ...]``, in name order."""
    with zipfile.ZipFile(_corpus_zip(corpus)) as z:
        return sorted(Path(name).name for name in z.namelist() if name.endswith(".txt"))


def corpus_text(corpus: str, name: str) -> str:
    """One document of a shipped corpus as text (undecodable bytes replaced)."""
    if name not in corpus_files(corpus):
        raise ValueError(f"{corpus} has no document {name!r}")
    with zipfile.ZipFile(_corpus_zip(corpus)) as z:
        return z.read(f"{corpus}/{name}").decode("utf-8", "replace")


def inaugural(name: str = "1789-Washington.txt") -> str:
    """An inaugural address (Washington's first by default): the real text the tests and benchmarks score."""
    return corpus_text("inaugural", name)


def examples(folder: Path, lead: str = "needle") -> dict[str, str]:
    """label -> text of every ``*.txt`` in ``folder`` (the label is the file's stem, underscores as spaces):
    ``lead`` first when there, then from the shortest text to the longest, so a list of one-liners ends in
    texts of thousands of tokens."""
    found = {path.stem.replace("_", " "): path.read_text().strip() for path in sorted(folder.glob("*.txt"))}
    order = sorted(found, key=lambda label: (label != lead, len(found[label]), label))
    return {label: found[label] for label in order}
