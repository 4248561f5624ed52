"""The masks' row at one step: what the query at that step reads, one strip per policy.

What the viewer sees: for each policy a horizontal strip over the token positions, coloured as the masks'
shares are (``share_scale``: rose = nothing read, then light to dark on a log scale from 0.1% to 100%),
blank after the step (tokens not yet written), and a red line at the step itself. A long text comes in
cells of ``size`` positions, each the share of its tokens (and of the chosen layers and heads) read
(``backend.analysis.reads.binned_row``): one old token kept by one head of ninety still shows. The figure
is a few kilobytes at any length, so Play can redraw it at every step while the full masks (megabytes at 8k)
wait until it pauses.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import plotly.graph_objects as go

from . import share_scale
from .colors import policy_colors
from .style import finish, plotly_text

STEP_LINE = "#C0392B"  # the outline of the current token in the kept-tokens view


def step_row_figure(rows: Mapping[str, np.ndarray], step: int, n: int, size: int = 1, title: str = "",
                    colors: Mapping[str, str] | None = None) -> go.Figure:
    """``rows``: policy name -> float [ceil(n / size)], the share of each cell's positions the query at ``step``
    reads (NaN after the step), shorter for a text that ended early; ``n``: the longest text's length in tokens.
    Rows are drawn top to bottom in order."""
    names = list(rows)
    if not names:
        raise ValueError("step_row_figure needs at least one policy")
    cells = -(-n // size)
    z = np.full((len(names), cells), np.nan, np.float32)  # a continuation that stopped early is blank after it
    for i, name in enumerate(names):
        row = np.asarray(rows[name], np.float32)
        if row.ndim != 1 or len(row) > cells:
            raise ValueError(f"a row has at most {cells} cells ({n} tokens, {size} per cell), got {row.shape}")
        z[i, : len(row)] = row
    labels = [plotly_text(name) for name in names]
    where = "token %{x:.0f}" if size == 1 else f"tokens %{{x:.0f}} ± {size // 2}"
    fig = go.Figure(go.Heatmap(
        z=z, y=labels, x0=(size - 1) / 2, dx=size, coloraxis="coloraxis", hoverongaps=False, xgap=0, ygap=2,
        hovertemplate=f"%{{y}}<br>{where}<br>read: {share_scale.HOVER}<extra></extra>"))
    bar = share_scale.colorbar_axis("read", thickness=12, len=1.0, y=0.5)
    shown = ("nothing", "1%", "100%")  # a strip a few rows high has room for three labels
    ticks = [(v, t) for v, t in zip(bar["colorbar"]["tickvals"], bar["colorbar"]["ticktext"]) if t in shown]
    bar["colorbar"].update(tickvals=[v for v, _ in ticks], ticktext=[t for _, t in ticks])
    fig.update_layout(coloraxis=share_scale.coloraxis(), coloraxis2=bar)
    fig.add_trace(share_scale.colorbar_trace("coloraxis2"))
    fig.add_shape(type="line", x0=step, x1=step, y0=0, y1=1, yref="paper", line=dict(color=STEP_LINE, width=2))
    colors = dict(colors) if colors else policy_colors(names)
    fig.update_yaxes(autorange="reversed", automargin=True, tickvals=labels,
                     ticktext=[f'<span style="color:{colors.get(name, "#333")}">{label}</span>'
                               for name, label in zip(names, labels)])
    fig.update_xaxes(title_text="token position", range=[-0.5, n - 0.5], showgrid=False, zeroline=False)
    note = "" if size == 1 else f" · {size} tokens per cell"
    return finish(fig, (title or f"What the query at step {step} reads") + note, height=130 + 40 * len(names),
                  plot_bgcolor="white")
