"""Needle-in-a-haystack grids: one heatmap per policy, context length across, needle depth down, green where
the answer held the needle (the style of the needle-in-a-haystack plots in KV-cache papers)."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

MAX_COLUMNS = 3  # heatmaps side by side before wrapping


def needle_figure(df: pd.DataFrame, title: str = "Needle in a haystack"):
    """``df`` has the columns of ``grid.csv`` (spec, length, depth, found; several seeds are averaged)."""
    specs = list(dict.fromkeys(df["spec"])) if len(df) else []
    if not specs:
        fig = go.Figure()
        fig.update_layout(title=f"{title}: no cells", template="plotly_white")
        return fig
    columns = min(MAX_COLUMNS, len(specs))
    rows = math.ceil(len(specs) / columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=specs, horizontal_spacing=0.06,
                        vertical_spacing=0.5 / max(rows, 1) if rows > 1 else 0.1)
    lengths = sorted(df["length"].unique())
    depths = sorted(df["depth"].unique())
    for index, spec in enumerate(specs):
        part = df[df["spec"] == spec]
        rate = part.groupby(["depth", "length"])["found"].mean().unstack("length").reindex(index=depths,
                                                                                            columns=lengths)
        fig.add_trace(go.Heatmap(
            z=rate.to_numpy(dtype=float), x=[str(length) for length in lengths],
            y=[f"{depth:.0%}" for depth in depths], zmin=0, zmax=1, showscale=index == 0,
            colorscale=[[0, "#d73027"], [0.5, "#fee08b"], [1, "#1a9850"]],
            colorbar={"title": "found"}, xgap=2, ygap=2,
            hovertemplate=f"{spec}<br>length %{{x}}, depth %{{y}}: found %{{z:.0%}}<extra></extra>"),
            row=index // columns + 1, col=index % columns + 1)
    fig.update_xaxes(title_text="context length (tokens)", type="category")
    fig.update_yaxes(title_text="needle depth", type="category", autorange="reversed")
    fig.update_layout(title=title, template="plotly_white", height=260 * rows + 120)
    return fig
