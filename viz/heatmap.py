"""Which cached tokens each query read: decode step (rows) x token position (columns).

What the viewer sees: one cell per (query step t, token j). Row t is what the query at position t
read; the triangle above the diagonal (j > t, tokens that have not arrived yet) is left white.

* Mask only (``attention=None``, a bool mask of one layer and head): read cells are dark blue, evicted /
  not-selected cells pale rose.
* A share (a float array in [0, 1]: of the layers/heads that read each cell, or, binned with ``size`` > 1,
  of the cell's pairs that were read), on the **log colour scale** of ``share_scale`` (0.1% .. 100%, light
  to dark, exactly 0 = nothing read in rose): a cell holding one kept token among a thousand pairs, or a
  token one head of ninety keeps, is visibly not empty (a linear scale rounds it to nothing, and every
  policy draws the same diagonal band).
* With ``attention`` of the same shape (one layer and head): read cells show the attention weight
  on a **log10 colour scale** (Viridis over ``decades`` decades below ``zmax``; weights below that
  floor, exact zeros included, get the floor colour), and cells not read get a rose band just below
  the floor, so "evicted" and
  "read with tiny weight" stay distinguishable. ``z`` then holds log10(weight) for read cells and
  ``floor - 0.5`` for cells not read; the colour bar is labelled in plain weights.

``mask_heatmaps`` puts one panel per policy side by side with one shared colour scale (one ``zmax``
for all), as in TOVA Fig. 7 / App. E (which tokens TOVA keeps along a text) and A2SF Fig. 4
(attention maps under different eviction rules). Each panel is a single ``go.Heatmap`` trace with
category axes labelled ``"j token"``, so hover shows step, position and token text without per-cell
strings.

Long texts come binned (``backend/analysis/reads.py``): a cell of ``size`` x ``size`` (steps x positions) shows
the share of its pairs ``(t, j <= t)`` that were read, and with attention the weight its queries put on
its tokens (summed over the cell's tokens, averaged over its queries). A zoom shows a window of steps
and positions at full resolution (``first_step`` / ``first_pos`` say where it starts). A panel holds at
most ``MAX_CELLS`` cells per axis: the figure never carries a [T, T] array of a long text.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.colors as pcolors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from . import share_scale
from .colors import EVICTED_COLOR, KEPT_COLOR, policy_colors
from .style import finish, plotly_text, tick_stride, token_labels

NOT_READ_GAP = 0.5  # how far below the log floor the "not read" value sits
DEFAULT_DECADES = 4.0
MAX_CELLS = 512  # cells per axis a panel accepts (bin or window a long text first)

MASK_AXIS = "coloraxis"
WEIGHT_AXIS = "coloraxis2"
SHARE_AXIS = "coloraxis3"  # binned masks: the log share scale
SHARE_BAR_AXIS = "coloraxis4"  # its colour bar (see share_scale)


def _check_cells(name: str, a: np.ndarray) -> None:
    if a.ndim != 2:
        raise ValueError(f"{name} must be [steps, positions] for one layer/head (or an aggregate), got shape {a.shape}")
    if max(a.shape) > MAX_CELLS:
        raise ValueError(f"{name} has {a.shape} cells; bin or window the text first (backend/analysis/reads.py), "
                         f"at most {MAX_CELLS} per axis")


def future_cells(shape: tuple[int, int], size: int = 1, first_step: int = 0, first_pos: int = 0) -> np.ndarray:
    """bool [a, b]: cells whose every token arrives after every query of the cell (above the diagonal)."""
    last_step = first_step + np.arange(shape[0]) * size + size - 1
    first_token = first_pos + np.arange(shape[1]) * size
    return first_token[None, :] > last_step[:, None]


def attention_zmax(attention: np.ndarray, reads: np.ndarray | None = None) -> float:
    """The largest attention weight among read cells (for a shared colour scale)."""
    att = np.asarray(attention, np.float32)
    if reads is not None:
        att = np.where(np.asarray(reads) > 0, att, 0.0)
    top = float(np.nanmax(att)) if att.size else 0.0
    return top if top > 0 else 1.0


def log_range(zmax: float, decades: float = DEFAULT_DECADES) -> tuple[float, float]:
    """(floor, top) of the log10 weight colour scale."""
    top = math.log10(zmax)
    return top - decades, top


def heatmap_values(reads: np.ndarray, attention: np.ndarray | None = None, zmax: float | None = None,
                   decades: float = DEFAULT_DECADES, size: int = 1, first_step: int = 0,
                   first_pos: int = 0) -> np.ndarray:
    """The ``z`` a panel shows (float32 [steps, positions]); see the module docstring for its meaning.

    NaN marks cells above the diagonal that nobody read (tokens not arrived yet).
    """
    reads = np.asarray(reads)
    _check_cells("reads", reads)
    read = reads > 0
    future = future_cells(reads.shape, size, first_step, first_pos) & ~read
    if attention is None:
        z = reads.astype(np.float32)
    else:
        att = np.asarray(attention, np.float32)
        if att.shape != reads.shape:
            raise ValueError(f"attention {att.shape} and reads {reads.shape} must have the same shape")
        floor, top = log_range(zmax if zmax else attention_zmax(att, reads), decades)
        with np.errstate(divide="ignore", invalid="ignore"):
            logw = np.log10(np.maximum(att, 0.0))
        logw = np.clip(np.nan_to_num(logw, nan=floor, neginf=floor), floor, top)
        z = np.where(read, logw, floor - NOT_READ_GAP).astype(np.float32)
    z[future] = np.nan
    return z


def _mask_coloraxis() -> dict:
    return dict(cmin=0.0, cmax=1.0,
                colorscale=[[0.0, EVICTED_COLOR], [0.5, "#9DB6CF"], [1.0, KEPT_COLOR]],
                colorbar=dict(title=dict(text="read", side="right"), tickvals=[0, 0.5, 1],
                              ticktext=["evicted", "50%", "kept"], thickness=14))


def _weight_coloraxis(floor: float, top: float) -> dict:
    low = floor - NOT_READ_GAP
    span = top - low
    band = (floor - low) / span  # normalized end of the "not read" band
    viridis = pcolors.sequential.Viridis
    scale = [[0.0, EVICTED_COLOR], [band * 0.999, EVICTED_COLOR]]
    scale += [[band + (1 - band) * i / (len(viridis) - 1), c] for i, c in enumerate(viridis)]
    ticks = [low + NOT_READ_GAP / 2] + [float(d) for d in range(math.ceil(floor), math.floor(top) + 1)]
    labels = ["not read"] + [f"{10.0 ** d:g}" for d in ticks[1:]]
    if not ticks[1:] or top - ticks[-1] > 0.25:
        ticks.append(top)
        labels.append(f"{10.0 ** top:.2g}")
    return dict(cmin=low, cmax=top, colorscale=scale,
                colorbar=dict(title=dict(text="attention", side="right"), tickvals=ticks, ticktext=labels,
                              thickness=14))


def _hovertemplate(reads: np.ndarray, attention: np.ndarray | None, floor: float | None, size: int) -> str:
    if size > 1:
        head = "steps (queries) %{y}<br>tokens %{x}<br>"
        if attention is not None:
            return (head + "log10 weight on these tokens: %{z:.2f}<br>"
                    f"<i>{floor - NOT_READ_GAP:.2f} = none read</i><extra></extra>")
        return head + f"share read: {share_scale.HOVER}<extra></extra>"
    head = "step (query) %{y}<br>token %{x}<br>"
    if attention is not None:
        return (head + "log10 weight: %{z:.2f}<br>"
                f"<i>{floor - NOT_READ_GAP:.2f} = not read (evicted)</i><extra></extra>")
    if reads.dtype == bool:
        return head + "read: %{z:.0f} (1 = kept, 0 = evicted)<extra></extra>"
    return head + f"read by {share_scale.HOVER} of layers/heads<extra></extra>"


def _checked_panel(panel: Mapping) -> dict:
    """A panel's cells and where they sit in the text (defaults: one token per cell from step and position 0)."""
    reads = np.asarray(panel["reads"])
    _check_cells("reads", reads)
    attention = panel.get("attention")
    if attention is not None:
        attention = np.asarray(attention, np.float32)
    return dict(reads=reads, attention=attention, token_texts=panel["token_texts"], size=int(panel.get("size", 1)),
                first_step=int(panel.get("first_step", 0)), first_pos=int(panel.get("first_pos", 0)))


def _labels(panel: Mapping) -> tuple[list[str], list[str]]:
    """Category labels of the rows (steps) and columns (positions): unique, so hover names the tokens."""
    n_rows, n_cols = panel["reads"].shape
    texts, size = panel["token_texts"], panel["size"]
    return (token_labels(texts, size=size, start=panel["first_step"], count=n_rows),
            token_labels(texts, size=size, start=panel["first_pos"], count=n_cols))


def _coloraxis_of(panel: Mapping) -> str:
    if panel["attention"] is not None:
        return WEIGHT_AXIS
    return MASK_AXIS if panel["reads"].dtype == bool and panel["size"] == 1 else SHARE_AXIS


def _panel(panel: Mapping, zmax, decades) -> go.Heatmap:
    reads, attention, size = panel["reads"], panel["attention"], panel["size"]
    if attention is not None:
        zmax = zmax if zmax else attention_zmax(attention, reads)
    z = heatmap_values(reads, attention, zmax, decades, size, panel["first_step"], panel["first_pos"])
    rows, cols = _labels(panel)
    floor = log_range(zmax, decades)[0] if attention is not None else None
    return go.Heatmap(z=z, x=cols, y=rows, coloraxis=_coloraxis_of(panel),
                      hoverongaps=False, hovertemplate=_hovertemplate(reads, attention, floor, size),
                      xgap=0, ygap=0)


def _binning_note(size: int) -> str:
    return "" if size == 1 else f" · {size} tokens per cell"


def _axes(fig: go.Figure, panel: Mapping, row=None, col=None, cols: int = 1) -> None:
    """Position ticks; the x axis gets fewer when ``cols`` panels share the width, so labels do not collide."""
    row_labels, col_labels = _labels(panel)

    def ticks(labels: list[str], first: int, target: int) -> dict:
        stride = tick_stride(len(labels), target)
        return dict(tickmode="array", tickvals=labels[::stride],
                    ticktext=[str(first + k * panel["size"]) for k in range(0, len(labels), stride)],
                    showgrid=False, zeroline=False, tickangle=0)

    kw = {} if row is None else dict(row=row, col=col)
    fig.update_xaxes(title_text="token position", constrain="domain",
                     **ticks(col_labels, panel["first_pos"], max(4, 16 // cols)), **kw)
    fig.update_yaxes(title_text="decode step (query position)", autorange="reversed",
                     **ticks(row_labels, panel["first_step"], 16), **kw)


def _coloraxes(fig: go.Figure, axes: set[str], zmax: float | None, decades: float) -> None:
    """Lay out the colour axes the panels use; their bars share the height (one above the other)."""
    bars = []
    if MASK_AXIS in axes:
        fig.update_layout(coloraxis=_mask_coloraxis())
        bars.append("coloraxis")
    if SHARE_AXIS in axes:
        fig.update_layout(coloraxis3=share_scale.coloraxis(), coloraxis4=share_scale.colorbar_axis())
        fig.add_trace(share_scale.colorbar_trace(SHARE_BAR_AXIS))
        bars.append("coloraxis4")
    if WEIGHT_AXIS in axes:
        fig.update_layout(coloraxis2=_weight_coloraxis(*log_range(zmax, decades)))
        bars.append("coloraxis2")
    for i, axis in enumerate(bars):
        place = dict(len=0.9, y=0.5) if len(bars) == 1 else dict(len=0.9 / len(bars), y=1 - (i + 0.5) / len(bars))
        fig.update_layout({f"{axis}_colorbar": place})


def mask_heatmap(reads: np.ndarray, token_texts: Sequence[str], title: str = "", attention: np.ndarray | None = None,
                 zmax: float | None = None, decades: float = DEFAULT_DECADES, height: int = 560, size: int = 1,
                 first_step: int = 0, first_pos: int = 0) -> go.Figure:
    """One layer/head (or an aggregate): step x position, kept vs evicted, optionally attention weights.

    ``reads``: bool [s, p] (e.g. ``Trace.reads(layer)[head]`` of a short text) or float [s, p] in [0, 1]
    (share of layers/heads reading each cell, or of a binned cell's pairs). ``attention``: [s, p] weights of
    the same layer/head (``TopAttention.rows``), shown on a log colour scale topped at ``zmax`` (default:
    the largest weight read). Cell ``(i, k)`` covers steps ``first_step + i * size ..`` and positions
    ``first_pos + k * size ..``, ``size`` of each. TOVA Fig. 7 / App. E, A2SF Fig. 4 (one panel of them).
    """
    panel = _checked_panel(dict(reads=reads, token_texts=token_texts, attention=attention, size=size,
                                first_step=first_step, first_pos=first_pos))
    attention = panel["attention"]
    if attention is not None and not zmax:
        zmax = attention_zmax(attention, panel["reads"])
    fig = go.Figure(_panel(panel, zmax, decades))
    _coloraxes(fig, {_coloraxis_of(panel)}, zmax, decades)
    _axes(fig, panel)
    return finish(fig, title + _binning_note(panel["size"]), height=height, plot_bgcolor="white")


def mask_heatmaps(panels: Mapping[str, Mapping], title: str = "", zmax: float | None = None,
                  decades: float = DEFAULT_DECADES, cols: int | None = None,
                  colors: Mapping[str, str] | None = None, panel_height: int = 420) -> go.Figure:
    """One subplot per policy, one shared colour scale (TOVA Fig. 7 / App. E, A2SF Fig. 4).

    ``panels`` maps a policy name to ``dict(reads=..., token_texts=..., attention=None, size=1,
    first_step=0, first_pos=0)`` as for ``mask_heatmap``. Panels with attention share one log colour
    scale topped at ``zmax`` (default: the largest weight read in any panel); mask panels share the
    kept/evicted scale, binned ones the log share scale. Panel titles take the policy colours.
    """
    names = list(panels)
    if not names:
        raise ValueError("mask_heatmaps needs at least one panel")
    colors = dict(colors) if colors else policy_colors(names)
    panels = {name: _checked_panel(panels[name]) for name in names}
    with_att = [panels[k]["attention"] is not None for k in names]
    if any(with_att) and not zmax:
        zmax = max(attention_zmax(panels[k]["attention"], panels[k]["reads"]) for k, a in zip(names, with_att) if a)
    cols = cols or min(len(names), 3)
    rows = math.ceil(len(names) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[plotly_text(k) for k in names],
                        horizontal_spacing=0.07, vertical_spacing=0.12 if rows > 1 else 0.08)
    for i, name in enumerate(names):
        panel = panels[name]
        trace = _panel(panel, zmax, decades)
        trace.name = plotly_text(name)
        trace.hovertemplate = trace.hovertemplate.replace("<extra></extra>", "<extra>%{fullData.name}</extra>")
        r, c = i // cols + 1, i % cols + 1
        fig.add_trace(trace, row=r, col=c)
        _axes(fig, panel, row=r, col=c, cols=cols)
        if c > 1:
            fig.update_yaxes(title_text=None, row=r, col=c)
    for annotation, name in zip(fig.layout.annotations, names):
        annotation.font = dict(color=colors.get(name, "#333"), size=14)
    _coloraxes(fig, {_coloraxis_of(panels[name]) for name in names}, zmax, decades)
    finish(fig, title + _binning_note(max(p["size"] for p in panels.values())), height=panel_height * rows + 80,
           plot_bgcolor="white")
    return fig


def mark_window(fig: go.Figure, window: int, steps: tuple[int, int], positions: tuple[int, int], size: int = 1,
                color: str = "#555555") -> go.Figure:
    """A dashed line in every panel where the model's own sliding window ends (token = step - ``window``): on
    such a layer a query reads nothing to its left, whatever the policy keeps. The panels show the steps and
    positions ``(first, last)`` of ``steps`` / ``positions``, ``size`` tokens a cell."""
    start = max(steps[0], positions[0] + window)  # the first shown step whose window edge is shown
    end = min(steps[1], positions[1] + window)
    if start > end:
        return fig

    def at(token: int, first: int) -> float:  # a token's centre in cell coordinates (cell k spans k +- 0.5)
        return (token - first + 0.5) / size - 0.5

    for trace in fig.data:
        if isinstance(trace, go.Heatmap):
            fig.add_shape(type="line", xref=trace.xaxis or "x", yref=trace.yaxis or "y",
                          x0=at(start - window, positions[0]), y0=at(start, steps[0]),
                          x1=at(end - window, positions[0]), y1=at(end, steps[0]),
                          line=dict(color=color, width=1.5, dash="dash"))
    return fig


EVIDENCE_COLOR = "#D35400"


def evidence_cells(positions, first: int, size: int, n_cells: int) -> list[tuple[int, int]]:
    """The runs of cells [a, b] (inclusive) that hold an evidence position, for columns starting at token
    ``first`` with ``size`` tokens a cell and ``n_cells`` cells."""
    cells = np.unique((np.asarray(positions, np.int64) - first) // size)
    cells = cells[(cells >= 0) & (cells < n_cells)]
    if not len(cells):
        return []
    breaks = np.flatnonzero(np.diff(cells) > 1)
    starts = np.r_[cells[0], cells[breaks + 1]]
    ends = np.r_[cells[breaks], cells[-1]]
    return list(zip(starts.tolist(), ends.tolist()))


def mark_columns(fig: go.Figure, cells: list[tuple[int, int]], color: str = EVIDENCE_COLOR,
                 opacity: float = 0.22) -> go.Figure:
    """A band over every heatmap panel at the columns ``cells`` (runs of cell indices, ``evidence_cells``): where
    the answer's evidence sits, so a reader sees when each policy stopped reading it."""
    bands = [dict(type="rect", xref=trace.xaxis or "x", x0=a - 0.5, x1=b + 0.5, yref=f"{trace.yaxis or 'y'} domain",
                  y0=0, y1=1, fillcolor=color, opacity=opacity, line=dict(width=0), layer="above")
             for trace in fig.data if isinstance(trace, go.Heatmap) for a, b in cells]
    if bands:  # at once: add_shape one by one costs time in the number already there (minutes for 2,000 bands)
        fig.update_layout(shapes=[*fig.layout.shapes, *bands])
    return fig


def mark_row(fig: go.Figure, row: int, color: str = "#C0392B") -> go.Figure:
    """A line across every panel through row ``row`` (a cell index: the step Play or the step slider is at)."""
    for trace in fig.data:
        if not isinstance(trace, go.Heatmap):  # a colour bar's marker trace
            continue
        x, y = trace.xaxis or "x", trace.yaxis or "y"
        fig.add_shape(type="line", xref=f"{x} domain", x0=0, x1=1, yref=y, y0=row, y1=row,
                      line=dict(color=color, width=1.5, dash="dot"), opacity=0.8)
    return fig
