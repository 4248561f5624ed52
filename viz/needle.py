"""Needle-in-a-haystack grids: one heatmap per policy, context length across, needle depth down, green where
the answer held the needle (the style of the needle-in-a-haystack plots in KV-cache papers), and the grid's
cells as an HTML table. Every text from the table (specs, the model's answers) reaches the page escaped."""
from __future__ import annotations

import html
import math

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .style import finish, plotly_text

MAX_COLUMNS = 4  # heatmaps side by side before wrapping
FOUND_COLORS = ((0, "#d73027"), (0.5, "#fee08b"), (1, "#1a9850"))


def _panels(df: pd.DataFrame) -> tuple[list[str], pd.Series]:
    """One panel per spec, per (model, spec) when the table holds several models: titles and each row's."""
    several = "model" in df and df["model"].nunique() > 1
    keys = (df["model"].astype(str) + " · " + df["spec"].astype(str)) if several else df["spec"].astype(str)
    return list(dict.fromkeys(keys)), keys


def _hover_answers(part: pd.DataFrame) -> str:
    """What a cell's hover says of its answers: the answer (one seed) or how many seeds found the needle."""
    if len(part) == 1:
        answer = str(part["answer"].iloc[0]) if "answer" in part else ""
        shown = answer if len(answer) <= 60 else answer[:59] + "…"
        number = plotly_text(str(part["number"].iloc[0])) if "number" in part else ""
        return f"needle {number}, answer: {plotly_text(shown) or '∅'}"
    return f"{int(part['found'].sum())} of {len(part)} seeds found it"


def needle_figure(df: pd.DataFrame, title: str = "Needle in a haystack"):
    """``df`` has the columns of ``grid.csv`` (spec, length, depth, found; several seeds are averaged)."""
    titles, keys = _panels(df) if len(df) else ([], None)
    if not titles:
        fig = go.Figure()
        return finish(fig, f"{title}: no cells")
    columns = min(MAX_COLUMNS, len(titles))
    rows = math.ceil(len(titles) / columns)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=[plotly_text(t) for t in titles],
                        horizontal_spacing=0.05, vertical_spacing=min(0.5 / rows, 0.12) if rows > 1 else 0.1)
    lengths = sorted(df["length"].unique())
    depths = sorted(df["depth"].unique())
    for index, key in enumerate(titles):
        part = df[keys == key]
        rate = part.groupby(["depth", "length"])["found"].mean().unstack("length").reindex(index=depths,
                                                                                            columns=lengths)
        answers = {cell: _hover_answers(rows_) for cell, rows_ in part.groupby(["depth", "length"])}
        hover = [[answers.get((depth, length), "no cell") for length in lengths] for depth in depths]
        fig.add_trace(go.Heatmap(
            z=rate.to_numpy(dtype=float), x=[str(length) for length in lengths],
            y=[f"{depth:.0%}" for depth in depths], zmin=0, zmax=1, showscale=index == 0,
            colorscale=FOUND_COLORS, colorbar={"title": "found", "tickformat": ".0%"}, xgap=2, ygap=2,
            customdata=hover, name=plotly_text(key),
            hovertemplate=f"{plotly_text(key)}<br>length %{{x}}, depth %{{y}}: found %{{z:.0%}}"
                          f"<br>%{{customdata}}<extra></extra>"),
            row=index // columns + 1, col=index % columns + 1)
    fig.update_xaxes(title_text="context length (tokens)", type="category")
    fig.update_yaxes(type="category", autorange="reversed")
    fig.update_yaxes(title_text="needle depth", col=1)
    return finish(fig, title, height=240 * rows + 130)


def found_rates(df: pd.DataFrame) -> pd.DataFrame:
    """Per spec (and model): cells and the share where the answer held the needle, in the table's order."""
    group = ["model", "spec"] if "model" in df and df["model"].nunique() > 1 else ["spec"]
    rates = df.groupby(group, sort=False)["found"].agg(cells="size", found="mean").reset_index()
    return rates


def needle_table_html(df: pd.DataFrame, max_rows: int = 200) -> str:
    """The grid's cells as an HTML table (spec, length, depth, needle, found, answer), every cell escaped:
    the answers are the model's own text and may hold anything."""
    columns = [c for c in ("model", "spec", "length", "depth", "number", "found", "answer") if c in df]
    if "model" in columns and df["model"].nunique() <= 1:
        columns.remove("model")
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for _, row in df.head(max_rows).iterrows():
        cells = []
        for c in columns:
            value = row[c]
            text = f"{value:.0%}" if c == "depth" else ("yes" if value else "no") if c == "found" else str(value)
            style = f" style='color:{'#1a9850' if value else '#d73027'}'" if c == "found" else ""
            cells.append(f"<td{style}>{html.escape(text)}</td>")
        body.append(f"<tr>{''.join(cells)}</tr>")
    more = f"<p>{len(df) - max_rows} more cells not shown.</p>" if len(df) > max_rows else ""
    return (f"<table class='kvlens-needle-table'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
            f"</table>{more}")
