"""The colour scale of a share read (0..1) on a log axis, for pictures whose cells pool many tokens.

A cell that pools many (query, token) pairs (a binned mask cell, a column of the cache reach) shows the share
of them that were read. On a linear scale a few kept tokens among thousands round to the colour of nothing:
one old token TOVA keeps in a 32 x 32 cell is 3% of it, one in 90 layers/heads 0.03%. So the colour follows
log10(share) from ``FLOOR`` (0.1%) to 100%, light to dark, and a share of exactly 0 gets a colour of its
own (the rose of "evicted"): any cell holding a read token is visibly not empty, and a fully read cell is
darker than a sparse one. Shares between 0 and the floor take the floor colour.

Why the share and not the maximum: the maximum of read / not read is 1 in every cell that holds one read
pair, so Full and a policy keeping one token per cell would look the same; the log share keeps both facts.

The cells' ``z`` stays the share itself (hover shows it as a percentage and the figure carries one number
per cell); the log lives in the colour scale, whose stops sit at log-spaced shares (``STOPS_PER_DECADE``
of them per decade, so the piecewise-linear interpolation between stops follows the log closely). Such a
scale drawn as a colour bar would spend nine tenths of its length on 10%..100%, so the bar comes from an
empty marker trace on a second colour axis that is linear in log10(share): ``colorbar_trace``.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import plotly.colors as pcolors
import plotly.graph_objects as go

from .colors import EVICTED_COLOR

FLOOR = 1e-3  # the lightest colour: 0.1% of a cell's pairs read (or fewer, but not none)
STOPS_PER_DECADE = 8
NOTHING_COLOR = EVICTED_COLOR  # exactly nothing read
# Teal (few read) -> dark navy (all read). YlGnBu's pale start is cut so that the lightest colour stands
# apart from the rose of nothing read and from the white of tokens not yet arrived.
RAMP = tuple(pcolors.sequential.YlGnBu[3:])
HOVER = "%{z:.2~p}"  # d3 format: a percentage to two significant digits (0.035%, 3.1%, 100%)
_BAND = 0.5  # decades of the colour bar given to "nothing read" (and to each other band)


def position(share) -> np.ndarray:
    """Where a share sits along the ramp, 0 (``FLOOR`` or less) .. 1 (everything read); -1 for exactly 0."""
    share = np.asarray(share, np.float64)
    with np.errstate(divide="ignore"):
        along = (np.log10(np.maximum(share, FLOOR)) - math.log10(FLOOR)) / -math.log10(FLOOR)
    return np.where(share > 0, np.clip(along, 0.0, 1.0), -1.0)


def colorscale() -> list[list]:
    """Stops for ``z`` = share with ``cmin = 0``, ``cmax = 1``: the log ramp, and exactly 0 apart."""
    decades = -math.log10(FLOOR)
    shares = FLOOR ** (1 - np.arange(int(decades * STOPS_PER_DECADE) + 1) / (decades * STOPS_PER_DECADE))
    colors = pcolors.sample_colorscale(RAMP, list(position(shares)))
    # Just above 0 the ramp starts at its floor colour: the smallest share a cell can hold (one pair of
    # 128 x 128 cells in 90 heads, 7e-7) is far above 1e-12.
    return [[0.0, NOTHING_COLOR], [1e-12, colors[0]]] + [[float(s), c] for s, c in zip(shares, colors)]


def coloraxis() -> dict:
    """The colour axis of the cells (its own bar hidden: ``colorbar_trace`` draws a readable one)."""
    return dict(cmin=0.0, cmax=1.0, colorscale=colorscale(), showscale=False)


def colorbar_axis(title: str = "share read", bands: Sequence[tuple[str, str]] = (), **colorbar) -> dict:
    """The colour axis of the bar: linear in log10(share), with a band below the floor for 'nothing read' and,
    below that, one per ``(label, colour)`` in ``bands`` (cells a figure colours by other means)."""
    bands = [*bands, ("nothing", NOTHING_COLOR)]
    top, floor = 0.0, math.log10(FLOOR)
    low = floor - _BAND * len(bands)
    edges = [(low + _BAND * i - low) / (top - low) for i in range(len(bands) + 1)]
    scale = []
    for (_, color), start, end in zip(bands, edges, edges[1:]):
        scale += [[start, color], [end - 1e-6, color]]
    ramp = pcolors.sample_colorscale(RAMP, list(np.linspace(0, 1, 2 * len(RAMP))))
    scale += [[edges[-1] + (1 - edges[-1]) * i / (len(ramp) - 1), c] for i, c in enumerate(ramp)]
    decades = range(math.ceil(floor), 1)
    ticks = [low + _BAND * (i + 0.5) for i in range(len(bands))] + [float(d) for d in decades]
    labels = [label for label, _ in bands] + [f"{10.0 ** d:.{max(0, -d - 2)}%}" for d in decades]
    return dict(cmin=low, cmax=top, colorscale=scale,
                colorbar=dict(title=dict(text=title, side="right"), tickvals=ticks, ticktext=labels,
                              **{"thickness": 14, **colorbar}))


def colorbar_trace(axis: str) -> go.Scatter:
    """An empty marker trace on colour axis ``axis`` (laid out by ``colorbar_axis``): it draws only the bar."""
    return go.Scatter(x=[None], y=[None], mode="markers", marker=dict(color=[0.0], coloraxis=axis),
                      showlegend=False, hoverinfo="skip", name="share read")
