"""A generated continuation as one line of plain text, for a table cell beside its policy's numbers.

A cell shows no line breaks or tabs, so they become visible marks; a long continuation is cut with an
ellipsis (the Divergence tab shows it whole). Plain text: whatever shows it escapes it.
"""
from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from types import MappingProxyType

MAX_CHARS = 160  # about two lines of the summary table
VISIBLE = MappingProxyType({"\n": "⏎", "\t": "⇥"})


def continuation_cell(token_texts: Sequence[str], max_chars: int = MAX_CHARS) -> str:
    """The tokens' texts joined, line breaks as ⏎ and tabs as ⇥, other control characters dropped, and cut
    to ``max_chars`` characters (the last one an ellipsis) when longer."""
    text = "".join(VISIBLE.get(c, c) for c in "".join(token_texts).replace("\r\n", "\n")
                   if c in VISIBLE or unicodedata.category(c) != "Cc")
    return text if len(text) <= max_chars else text[:max_chars - 1] + "…"
