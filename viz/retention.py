"""Which tokens policies keep, summarised: first token, lifetime by position, non-recent share, POS.

* ``first_token_retention_figure``: share of the time the first token is still cached, per
  policy (bars) or per layer/step (lines). TOVA Sec. 5 (the first token is almost never dropped).
* ``lifetime_by_position_figure``: mean number of steps each of the first ``max_pos`` positions
  stays cached, grouped bars per policy. TOVA Fig. 8.
* ``non_recent_share_figure``: share of cached tokens that lie outside the most recent window,
  per policy (bars) or along the steps (lines). TOVA Sec. 5 (TOVA keeps far-back tokens, unlike a
  window).
* ``pos_table`` / ``pos_table_html``: a part-of-speech table (rows = tags, columns = policies)
  sorted and formatted. TOVA Sec. 5.2 / Table 2 (which word classes survive longest).

The numbers come from the caller (backend/analysis/metrics.py); these functions only draw them.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .colors import policy_colors
from .style import finish, plotly_text


def _share_figure(values_by_policy: Mapping, colors, title: str, y_title: str, x_title: str,
                  percent: bool, height: int) -> go.Figure:
    """Bars when every value is a scalar, else one line per policy over x = 0..n-1."""
    names = list(values_by_policy)
    colors = dict(colors) if colors else policy_colors(names)
    arrays = {k: np.atleast_1d(np.asarray(values_by_policy[k], np.float64)) for k in names}
    scalar = all(np.ndim(values_by_policy[k]) == 0 for k in names)
    fmt = ".1%" if percent else ".3g"
    fig = go.Figure()
    for name in names:
        label = plotly_text(name)
        color = colors.get(name, "#444444")
        if scalar:
            fig.add_trace(go.Bar(x=[label], y=arrays[name], name=label, marker_color=color,
                                 hovertemplate=f"%{{x}}<br>{y_title}: %{{y:{fmt}}}<extra></extra>"))
        else:
            y = arrays[name]
            fig.add_trace(go.Scatter(x=np.arange(len(y)), y=y, mode="lines+markers" if len(y) <= 64 else "lines",
                                     name=label, line=dict(color=color, width=2), marker=dict(size=6),
                                     hovertemplate=f"%{{fullData.name}}<br>{x_title} %{{x}}<br>{y_title}: "
                                                   f"%{{y:{fmt}}}<extra></extra>"))
    fig.update_yaxes(title_text=y_title, tickformat=".0%" if percent else None,
                     range=[0, 1.03] if percent else None, rangemode="tozero")
    fig.update_xaxes(title_text="policy" if scalar else x_title)
    if scalar:
        fig.update_layout(showlegend=False)
    return finish(fig, title, height=height)


def first_token_retention_figure(retention_by_policy: Mapping, colors: Mapping[str, str] | None = None,
                                 x_title: str = "layer", title: str | None = None, height: int = 420) -> go.Figure:
    """Share of steps (after it arrives) at which token 0 is still cached, per policy.

    ``retention_by_policy``: name -> a share in [0, 1] (one bar per policy) or an array of shares
    (one line per policy, x = layer or step as ``x_title`` says).
    """
    return _share_figure(retention_by_policy, colors, title or "How often the first token is still cached",
                         "first token kept", x_title, True, height)


def non_recent_share_figure(share_by_policy: Mapping, window: int | None = None,
                            colors: Mapping[str, str] | None = None, x_title: str = "decode step",
                            title: str | None = None, height: int = 420) -> go.Figure:
    """Share of the cached tokens that are not among the ``window`` most recent, per policy.

    ``share_by_policy``: name -> a share (bars) or an array of shares per step (lines).
    """
    what = f"outside the last {window} tokens" if window else "non-recent"
    return _share_figure(share_by_policy, colors, title or f"Share of cached tokens {what}",
                         f"cached tokens {what}", x_title, True, height)


def lifetime_by_position_figure(lifetimes_by_policy: Mapping, max_pos: int = 25,
                                colors: Mapping[str, str] | None = None, title: str | None = None,
                                height: int = 420) -> go.Figure:
    """Mean number of steps each of the first ``max_pos`` positions stays cached: grouped bars (TOVA Fig. 8).

    ``lifetimes_by_policy``: name -> array [T] of mean steps kept per position (averaged over layers,
    heads or texts by the caller). One bar trace per policy, x = positions 0..max_pos-1 (fewer when
    the text is shorter).
    """
    names = list(lifetimes_by_policy)
    colors = dict(colors) if colors else policy_colors(names)
    fig = go.Figure()
    for name in names:
        life = np.asarray(lifetimes_by_policy[name], np.float64)[:max_pos]
        label = plotly_text(name)
        fig.add_trace(go.Bar(x=np.arange(len(life)), y=life, name=label, marker_color=colors.get(name, "#444444"),
                             hovertemplate="%{fullData.name}<br>position %{x}<br>kept for %{y:.1f} steps"
                                           "<extra></extra>"))
    fig.update_layout(barmode="group", bargap=0.15, legend=dict(orientation="h", y=1.1, x=1, xanchor="right"))
    fig.update_xaxes(title_text="token position", dtick=1 if max_pos <= 40 else None)
    fig.update_yaxes(title_text="steps kept (mean)", rangemode="tozero")
    return finish(fig, title or f"How long each of the first {max_pos} tokens stays cached", height=height)


def pos_table(df: pd.DataFrame, value_format: str = "{:.1f}", sort_by: str | None = None) -> pd.DataFrame:
    """Part-of-speech table formatted for display: one row per tag, one column per policy.

    ``df``: index (or a ``pos`` / ``tag`` column) = POS tags, numeric columns = a value per policy
    (e.g. mean steps kept, or share kept). Rows are sorted by ``sort_by`` (default: the first
    numeric column), descending; numbers become strings via ``value_format``; NaN -> em dash.
    """
    table = df.copy()
    for key in ("pos", "tag", "POS"):
        if key in table.columns:
            table = table.set_index(key)
            break
    numeric = [c for c in table.columns if pd.api.types.is_numeric_dtype(table[c])]
    if numeric:
        table = table.sort_values(sort_by or numeric[0], ascending=False, kind="stable")
    out = table.copy()
    for col in numeric:
        out[col] = [("—" if pd.isna(v) else value_format.format(v)) for v in table[col]]
    out.index.name = out.index.name or "POS"
    return out.reset_index()


def pos_table_html(df: pd.DataFrame, value_format: str = "{:.1f}", sort_by: str | None = None) -> str:
    """``pos_table`` as an HTML table; every cell and header escaped."""
    table = pos_table(df, value_format, sort_by)
    return table.to_html(index=False, escape=True, border=0, classes="kvl-pos-table")
