"""t-SNE maps of cached keys before and after RoPE, side by side (ReAttention Fig. 8-9).

What the viewer sees: two scatter panels, "before RoPE" and "after RoPE", one point per cached
token. Colour = token position (one shared colour bar, so a smooth gradient across a panel means the
keys are organised by position); filled circles = tokens the policy keeps, thin crosses (same colours) =
tokens it evicted. Hover shows position, token text and kept/evicted. The coordinates come from
``backend.analysis.tsne.embed_keys``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import finish, plotly_text, visible_token

POSITION_SCALE = "Plasma"


def _coords(name: str, c, n: int | None) -> np.ndarray:
    c = np.asarray(c, np.float64)
    if c.ndim != 2 or c.shape[1] != 2 or (n is not None and len(c) != n):
        raise ValueError(f"{name} must be [T, 2] (T = {n}), got shape {c.shape}")
    return c


def tsne_figure(coords_before: np.ndarray, coords_after: np.ndarray, kept: np.ndarray | None,
                token_texts: Sequence[str], positions: Sequence[int] | None = None, title: str | None = None,
                height: int = 500) -> go.Figure:
    """Two panels (before / after RoPE) of 2-D key coordinates, colour = position, kept vs evicted marked.

    ``coords_*``: [T, 2] from ``backend.analysis.tsne.embed_keys``. ``kept``: bool [T] (e.g. what the last
    query read) or None (all shown as kept). ``token_texts``: text of each point; ``positions``:
    its position in the text (default 0..T-1). Traces per panel: ``kept`` then ``evicted``.
    """
    before = _coords("coords_before", coords_before, None)
    n = len(before)
    after = _coords("coords_after", coords_after, n)
    pos = np.arange(n) if positions is None else np.asarray(positions, np.int64)
    kept = np.ones(n, bool) if kept is None else np.asarray(kept, bool)
    if pos.shape != (n,) or kept.shape != (n,) or len(token_texts) != n:
        raise ValueError("positions, kept and token_texts need one entry per point")
    texts = np.array([plotly_text(visible_token(t)) for t in token_texts], dtype=object)
    cmax = float(pos.max()) if n else 1.0
    fig = make_subplots(rows=1, cols=2, subplot_titles=["keys before RoPE", "keys after RoPE"],
                        horizontal_spacing=0.08)
    styles = {
        "kept": dict(symbol="circle", size=8, line=dict(width=0.5, color="#333333")),
        "evicted": dict(symbol="x-thin-open", size=8, line=dict(width=1.5)),
    }
    for col, coords in enumerate((before, after), start=1):
        for state, sel in (("kept", kept), ("evicted", ~kept)):
            fig.add_trace(go.Scatter(
                x=coords[sel, 0], y=coords[sel, 1], mode="markers", name=state, legendgroup=state,
                showlegend=col == 1, customdata=np.stack([pos[sel], texts[sel]], axis=1) if sel.any() else None,
                marker=dict(color=pos[sel], coloraxis="coloraxis", **styles[state]),
                hovertemplate=f"position %{{customdata[0]}}: %{{customdata[1]}}<br>{state}<extra></extra>"),
                row=1, col=col)
        fig.update_xaxes(showticklabels=False, title_text="t-SNE 1", row=1, col=col)
        fig.update_yaxes(showticklabels=False, title_text="t-SNE 2" if col == 1 else None, row=1, col=col)
    fig.update_layout(coloraxis=dict(colorscale=POSITION_SCALE, cmin=0, cmax=max(cmax, 1.0),
                                     colorbar=dict(title=dict(text="position", side="right"), thickness=14)),
                      legend=dict(orientation="h", y=-0.1, yanchor="top", x=0.5, xanchor="center"))
    finish(fig, title or "Cached keys, t-SNE: before vs after RoPE", height=height)
    return fig.update_layout(margin=dict(b=90))  # room for the legend under the axis titles
