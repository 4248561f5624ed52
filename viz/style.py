"""Layout defaults and token labels shared by every figure."""
from __future__ import annotations

import html
from collections.abc import Sequence
from types import MappingProxyType

import plotly.graph_objects as go

TEMPLATE = "plotly_white"
FONT = MappingProxyType(dict(family="Inter, Segoe UI, Helvetica, Arial, sans-serif", size=13))
HOVERLABEL = MappingProxyType(dict(bgcolor="white", font_size=12, align="left"))


def visible_token(text: str, max_len: int = 24) -> str:
    """A token's text made visible on one line: space -> '␣', newline -> '↵', tab -> '⇥'; long texts cut."""
    shown = text.replace(" ", "␣").replace("\r", "").replace("\n", "↵").replace("\t", "⇥")
    if not shown:
        shown = "∅"
    if len(shown) > max_len:
        shown = shown[:max_len - 1] + "…"
    return shown


def markdown_text(text: str) -> str:
    """Escape text for a Gradio Markdown or HTML box. Quotes stay as typed: they need no escape outside an
    attribute, and Gradio's Markdown shows a numeric entity such as ``&#x27;`` as typed."""
    return html.escape(text, quote=False)


def plotly_text(text: str) -> str:
    """Escape text for plotly's HTML-like labels and hover boxes (it decodes &lt; &gt; &amp;)."""
    return html.escape(text, quote=False)


def token_labels(token_texts: Sequence[str], n: int | None = None, size: int = 1, start: int = 0,
                 count: int | None = None) -> list[str]:
    """Unique, escaped category labels ``'17 ␣cat'`` for token positions (hover and ticks).

    Positions ``start ..`` in ``count`` cells (default: up to ``n``, the text's length); with ``size`` > 1,
    one label per cell of ``size`` positions: ``'16–17 ␣the␣cat'``.
    """
    n = len(token_texts) if n is None else n
    count = -(-(n - start) // size) if count is None else count
    labels = []
    for cell in range(count):
        a = start + cell * size
        b = min(a + size, n) - 1
        text = "".join(token_texts[a: b + 1])  # positions past the texts (n > len) have none
        labels.append(f"{a}{'' if a == b or size == 1 else f'–{b}'} {plotly_text(visible_token(text))}")
    return labels


def tick_stride(n: int, target: int = 16) -> int:
    """A round stride giving about ``target`` ticks over n positions."""
    raw = max(1, n // target)
    for step in (1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000):
        if step >= raw:
            return step
    return raw


def finish(fig: go.Figure, title: str, height: int | None = None, **layout) -> go.Figure:
    """Apply the light template, title, fonts and hover style shared by every figure."""
    fig.update_layout(template=TEMPLATE, title=dict(text=plotly_text(title), x=0.01, xanchor="left"),
                      font=dict(FONT), hoverlabel=dict(HOVERLABEL), margin=dict(l=60, r=30, t=70, b=55), **layout)
    if height is not None:
        fig.update_layout(height=height)
    return fig
