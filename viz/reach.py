"""Where each cache reaches: what one query reads in every layer and head, and what is read by distance.

``reach_figure`` answers "what does the cache hold at token t?": one panel per policy, one row per
(layer, KV head) (``'L12 H1'``, layer 0 on top), one column per bin of positions 0..t. A cell is the share
of the bin's tokens that the query at t read there, on the log share scale of the binned masks
(``share_scale``: 0.1% .. 100%, rose = nothing read). Bins wholly beyond a sliding-window layer's window
(Gemma 3's local layers) are grey: the model itself never reads there, so a rose cell is the policy's
eviction and a grey one the model's.

``distance_figure`` shows how far back each policy reads over the whole text: per policy a line of the
share of (query, token) pairs at each distance ``t - j`` that were read, over all steps, layers and heads,
on log axes (distance 0, the query's own token, has no place on them). Full reads everything the model
lets it (1 everywhere, or the share of global layers past a sliding window); a window policy drops to
~0 past its budget; TOVA and H2O keep a tail of old tokens, which the log y axis keeps apart from 0.

Inputs are plain arrays (``backend.analysis.reach`` computes them); a reach row holds at most a few hundred
columns and a distance line a few hundred bins, so nothing here grows with T squared.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import share_scale
from .colors import policy_colors
from .style import finish, plotly_text, tick_stride, token_labels

BEYOND_WINDOW_COLOR = "#A8A8A8"  # the model's limit: grey, apart from the rose of the policy's evictions
CELL_AXIS, BAR_AXIS = "coloraxis", "coloraxis2"
LOWEST_DECADE = 6  # the distance plot's y axis stops at 10^-6: one pair in a million


def _reach_panel(panel: Mapping, columns: list[str], rows: list[str], step: int) -> go.Heatmap:
    shares = np.asarray(panel["shares"], np.float32)
    beyond = np.asarray(panel["beyond_window"], bool)
    if shares.shape != (len(rows), len(columns)) or beyond.shape != shares.shape:
        raise ValueError(f"shares {shares.shape} and beyond_window {beyond.shape} must be "
                         f"[{len(rows)} rows, {len(columns)} columns]")
    # Beyond the window the cell is a gap: the plot's grey background shows through.
    z = np.where(beyond, np.nan, shares).astype(np.float32)
    return go.Heatmap(z=z, x=columns, y=rows, coloraxis=CELL_AXIS, hoverongaps=False, xgap=0, ygap=0,
                      hovertemplate=(f"%{{y}}, query {step}<br>tokens %{{x}}<br>share read: {share_scale.HOVER}"
                                     "<extra>%{fullData.name}</extra>"))


def reach_figure(panels: Mapping[str, Mapping], row_labels: Sequence[str], step: int, size: int,
                 title: str | None = None, colors: Mapping[str, str] | None = None,
                 cols: int | None = None) -> go.Figure:
    """One panel per policy: rows = (layer, KV head), columns = bins of ``size`` positions of 0..``step``.

    ``panels`` maps a policy name to ``dict(shares=float [rows, columns], beyond_window=bool [rows, columns],
    token_texts=...)`` (the arrays of ``backend.analysis.reach.Reach``; the texts label each column's tokens
    in the hover); ``row_labels`` name the rows (``'L12 H1'``). Grey cells lie beyond the row's sliding window;
    the rest show the share read on the log share scale.
    """
    names = list(panels)
    if not names:
        raise ValueError("reach_figure needs at least one panel")
    colors = dict(colors) if colors else policy_colors(names)
    rows = [plotly_text(label) for label in row_labels]
    cols = cols or (2 if len(names) > 3 else 1)
    grid = math.ceil(len(names) / cols)
    per_panel = min(420, max(220, 3 * len(rows) + 60))
    height = per_panel * grid + 130
    fig = make_subplots(rows=grid, cols=cols, subplot_titles=[plotly_text(k) for k in names],
                        horizontal_spacing=0.06, vertical_spacing=70 / height)
    any_beyond = False
    for i, name in enumerate(names):
        r, c = i // cols + 1, i % cols + 1
        columns = token_labels(panels[name]["token_texts"], n=step + 1, size=size)
        trace = _reach_panel(panels[name], columns, rows, step)
        trace.name = plotly_text(name)
        fig.add_trace(trace, row=r, col=c)
        any_beyond |= bool(np.asarray(panels[name]["beyond_window"]).any())
        _axes(fig, columns, rows, size, r, c, cols, last_row=i + cols >= len(names), height=per_panel - 60)
    for annotation, name in zip(fig.layout.annotations, names):
        annotation.font = dict(color=colors.get(name, "#333"), size=14)
    # The grey cells are gaps (no value): the bar names them with a band of their own.
    bands = [("beyond window", BEYOND_WINDOW_COLOR)] if any_beyond else []
    fig.update_layout(coloraxis=share_scale.coloraxis(),
                      coloraxis2=share_scale.colorbar_axis(title=f"share read by query {step}", bands=bands,
                                                           len=0.9, y=0.5))
    fig.add_trace(share_scale.colorbar_trace(BAR_AXIS))
    per_column = "" if size == 1 else f" · {size} tokens per column"
    return finish(fig, (title or f"What each layer and KV head reads at step {step}") + per_column,
                  height=height, plot_bgcolor=BEYOND_WINDOW_COLOR)


def _axes(fig: go.Figure, columns: list[str], rows: list[str], size: int, r: int, c: int, cols: int,
          last_row: bool, height: int) -> None:
    """Position ticks by first position; layer ticks on the first head of every few layers, 18 px apart at least."""
    stride = tick_stride(len(columns), max(4, 12 // cols))
    heads = next((i for i, label in enumerate(rows[1:], 1) if label.endswith(" H0")), len(rows))
    layer_stride = tick_stride(max(1, len(rows) // heads), max(2, height // 18)) * heads
    fig.update_xaxes(tickmode="array", tickvals=columns[::stride],
                     ticktext=[str(k * size) for k in range(0, len(columns), stride)], tickangle=0,
                     showgrid=False, zeroline=False, title_text="token position" if last_row else None, row=r, col=c)
    fig.update_yaxes(tickmode="array", tickvals=rows[::layer_stride], autorange="reversed", showgrid=False,
                     zeroline=False, title_text="layer, KV head" if c == 1 else None, row=r, col=c)


def distance_figure(series: Mapping[str, tuple[np.ndarray, np.ndarray]], title: str | None = None,
                    colors: Mapping[str, str] | None = None, height: int = 460) -> go.Figure:
    """A line per policy: the share of pairs read against distance back from the query, both axes log.

    ``series`` maps a policy name to ``(edges, share)`` of ``backend.analysis.reach.share_by_distance``: bin i
    holds distances ``edges[i] .. edges[i + 1] - 1`` and is drawn at its first distance. Bins where nothing
    was read leave a gap (a log axis has no 0).
    """
    names = list(series)
    colors = dict(colors) if colors else policy_colors(names)
    fig = go.Figure()
    lowest = 1.0
    for name in names:
        edges, share = (np.asarray(a) for a in series[name])
        if len(edges) != len(share) + 1:
            raise ValueError(f"{name}: edges ({len(edges)}) must be one more than shares ({len(share)})")
        shown = np.where(share > 0, share, np.nan).astype(np.float32)
        if np.isfinite(shown).any():
            lowest = min(lowest, float(np.nanmin(shown)))
        fig.add_trace(go.Scatter(
            x=edges[:-1].astype(np.int32), y=shown, customdata=(edges[1:] - 1).astype(np.int32),
            mode="lines", name=plotly_text(name), line=dict(color=colors.get(name, "#333"), width=2),
            hovertemplate="distance %{x}–%{customdata}: %{y:.2~p} read<extra>%{fullData.name}</extra>"))
    bottom = max(math.floor(math.log10(lowest)) if lowest < 1 else -1, -LOWEST_DECADE)
    decades = range(bottom, 1)
    fig.update_xaxes(type="log", title_text="distance back from the query (t − j tokens)")
    fig.update_yaxes(type="log", range=[bottom - 0.1, 0.05], tickvals=[10.0 ** d for d in decades],
                     ticktext=[f"{10.0 ** d:.{max(0, -d - 2)}%}" for d in decades], title_text="share of pairs read")
    return finish(fig, title or "How far back each policy reads: share of (query, token) pairs read, by distance",
                  height=height)
