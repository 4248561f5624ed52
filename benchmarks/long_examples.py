"""The long examples of ``assets/examples/``: public-domain speeches and needle haystacks of 2k to 8k tokens.

    python -m benchmarks.long_examples          # rewrites the files and prints each one's token count

The speeches come whole from the shipped NLTK corpora (``backend/texts.py``); the needle texts are the needle
grid's haystacks (``backend/experiments/needle.py``): corpus sentences with "The secret number is N." a tenth
of the way in and the question at the end. Lengths are counted as generate mode sees the text, a user turn
of the default model's chat template, and every example leaves room for the longest answer the app allows
(``LIMITS.new_tokens``) within the model's context, so both modes run it at any setting.
"""
from __future__ import annotations

import re
from pathlib import Path

from backend.api import LIMITS
from backend.engine.models import LoadedModel
from backend.experiments.needle import Cell, haystack
from backend.texts import corpus_text

FOLDER = Path(__file__).resolve().parents[1] / "assets" / "examples"
# file stem -> (corpus, document, heading): the app labels an example by its stem, underscores as spaces.
SPEECHES = {
    "inaugural_1933_2k_tokens": ("inaugural", "1933-Roosevelt.txt",
                                 "PRESIDENT FRANKLIN D. ROOSEVELT'S FIRST INAUGURAL ADDRESS\n\nMarch 4, 1933"),
    "state_of_the_union_1964_4k_tokens": ("state_union", "1964-Johnson.txt", None),  # the corpus has a heading
    "state_of_the_union_1996_8k_tokens": ("state_union", "1996-Clinton.txt", None),
}
NEEDLES = {"needle_4k_tokens": 4096, "needle_8k_tokens": 8192}  # file stem -> context the haystack fills
NEEDLE_DEPTH = 0.1  # the fact comes early: most of the text lies between it and the question
# Prompt tokens (chat template included) each size in a stem may have.
BANDS = {"2k": (1800, 2400), "4k": (3600, 4200), "8k": (7400, 8192 - LIMITS.new_tokens)}


def band(stem: str) -> tuple[int, int]:
    """The token band of a long example, from the size its name gives."""
    size = re.search(r"_(\d+k)_tokens$", stem)
    if size is None or size.group(1) not in BANDS:
        raise ValueError(f"{stem!r} names no size of {', '.join(BANDS)}")
    return BANDS[size.group(1)]


def speech(corpus: str, document: str, heading: str | None) -> str:
    """A corpus document as a reader expects it: no trailing spaces, one blank line between paragraphs."""
    text = "\n".join(line.rstrip() for line in corpus_text(corpus, document).strip().splitlines())
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text if heading is None else f"{heading}\n\n{text}"


def needle_cell(stem: str) -> Cell:
    return Cell(NEEDLES[stem], NEEDLE_DEPTH)


def build(lm: LoadedModel) -> dict[str, str]:
    """file stem -> text of every long example (``lm`` measures the needle haystacks)."""
    texts = {stem: speech(*source) for stem, source in SPEECHES.items()}
    for stem in NEEDLES:
        texts[stem], _ = haystack(lm, needle_cell(stem), new_tokens=LIMITS.new_tokens)
    return texts


def main() -> None:
    from .common import model

    lm = model()
    for stem, text in build(lm).items():
        tokens = len(lm.encode(text, chat=True))
        low, high = band(stem)
        if not low <= tokens <= high or len(text) > LIMITS.text_chars:
            raise SystemExit(f"{stem}: {tokens} tokens, {len(text):,} characters; the band is {low}-{high} tokens")
        (FOLDER / f"{stem}.txt").write_text(text + "\n")
        print(f"{stem}: {tokens} tokens, {len(text):,} characters")


if __name__ == "__main__":
    main()
