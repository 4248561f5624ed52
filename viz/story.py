"""The run's story at a glance: each policy's answer beside Full's, and a strip of what its query read.

What the viewer sees, one row per policy (Full first): its name in its colour, its answer in full (wrapped,
never cut), and a strip over the text's positions, each cell coloured as the masks' share of layers and KV
heads that read it (``share_scale``: rose = nothing, then light to dark), blank after the step, with the
evidence (the strings that hold the answer) outlined. So "sinks answers 1234 and never read 317" is one look.
Under it, the numbers against Full as a table that wraps rather than scrolls sideways.

Plain HTML and inline SVG (a few kB), no plotly: the page's first picture costs no script. Every name and
text is escaped.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.colors as pcolors

from . import share_scale
from .heatmap import EVIDENCE_COLOR
STRIP_HEIGHT = 18
LEVELS = 32  # distinct ramp colours a strip uses


@dataclass(frozen=True)
class StoryRow:
    policy: str
    color: str
    answer: str  # plain text; "" in prompt mode
    note: str  # e.g. "same as Full", "leaves Full at token 5"
    cells: np.ndarray  # float [cells]: the share read per cell (NaN after the step)


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _cell_colors(cells: np.ndarray) -> list[str]:
    """A colour per cell: white after the step, rose for nothing read, else the ramp at the share's log."""
    where = share_scale.position(np.nan_to_num(cells, nan=0.0))
    levels = np.round(np.clip(where, 0, 1) * (LEVELS - 1)).astype(int)
    ramp = pcolors.sample_colorscale(share_scale.RAMP, list(np.linspace(0, 1, LEVELS)))
    colors = []
    for value, at, level in zip(cells, where, levels):
        colors.append("#ffffff" if np.isnan(value) else share_scale.NOTHING_COLOR if at < 0 else ramp[level])
    return colors


def strip_svg(cells: np.ndarray, evidence: Sequence[tuple[int, int]] = (), label: str = "") -> str:
    """One row of cells as an SVG that stretches to its box; ``evidence``: runs of cells ``(first, last)`` outlined
    (``heatmap.evidence_cells``)."""
    n = max(len(cells), 1)
    rects = []
    colors = _cell_colors(np.asarray(cells, np.float64))
    start = 0
    for i in range(1, n + 1):  # runs of one colour become one rect
        if i == n or colors[i] != colors[start]:
            rects.append(f'<rect x="{start}" y="0" width="{i - start}" height="1" fill="{colors[start]}"/>')
            start = i
    marks = []
    for first, last in evidence:
        marks.append(f'<rect x="{first}" y="0" width="{last - first + 1}" height="1" fill="none" '
                     f'stroke="{EVIDENCE_COLOR}" stroke-width="3" vector-effect="non-scaling-stroke"/>')
    return (f'<svg class="kvl-strip" role="img" aria-label="{_esc(label)}" viewBox="0 0 {n} 1" '
            f'preserveAspectRatio="none" width="100%" height="{STRIP_HEIGHT}">{"".join(rects)}{"".join(marks)}</svg>')


def story_html(rows: Sequence[StoryRow], caption: str, evidence_cells: Sequence[tuple[int, int]] = (),
               metrics: pd.DataFrame | None = None) -> str:
    """The answers and their strips (``rows``, Full's first), then ``metrics`` (one row per policy) when given."""
    body = []
    for row in rows:
        swatch = f'<span class="kvl-swatch" style="background:{row.color}"></span>'
        answer = _esc(row.answer) if row.answer else '<span class="kvl-muted">(teacher-forced: no answer)</span>'
        note = f' <span class="kvl-muted">· {_esc(row.note)}</span>' if row.note else ""
        read = f"What the query of {row.policy} read"
        body.append(f'<tr data-policy="{_esc(row.policy)}"><th scope="row">{swatch}{_esc(row.policy)}</th>'
                    f'<td class="kvl-answer">{answer}{note}</td>'
                    f'<td class="kvl-read">{strip_svg(row.cells, evidence_cells, read)}</td></tr>')
    legend = ('<span class="kvl-key"><i style="background:#0c2c84"></i>read by every layer and head</span>'
              '<span class="kvl-key"><i style="background:#7fcdbb"></i>by a few</span>'
              f'<span class="kvl-key"><i style="background:{share_scale.NOTHING_COLOR}"></i>by none</span>'
              + (f'<span class="kvl-key"><i style="border:2px solid {EVIDENCE_COLOR}"></i>evidence</span>'
                 if len(evidence_cells) else ""))
    table = ('<table class="kvl-story"><colgroup><col class="kvl-c1"><col class="kvl-c2"><col class="kvl-c3">'
             '</colgroup><thead><tr><th scope="col">Policy</th><th scope="col">Answer</th>'
             f'<th scope="col">{_esc(caption)}</th></tr></thead><tbody>{"".join(body)}</tbody></table>')
    numbers = "" if metrics is None else metrics_html(metrics)
    return f'<div class="kvl-story-box">{table}<div class="kvl-legend">{legend}</div>{numbers}</div>'


def metrics_html(frame: pd.DataFrame) -> str:
    """The numbers against Full, a row per policy, in a table that wraps to its box."""
    head = "".join(f'<th scope="col">{_esc(c)}</th>' for c in frame.columns)
    rows = []
    for _, values in frame.iterrows():
        cells = [f'<th scope="row">{_esc(values.iloc[0])}</th>']
        cells += [f'<td data-label="{_esc(c)}">{_esc(v)}</td>' for c, v in zip(frame.columns[1:], values.iloc[1:])]
        rows.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<details class="kvl-numbers" open><summary>The numbers against Full</summary>'
            f'<table class="kvl-metrics"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
            f'</details>')
