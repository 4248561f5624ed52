"""Perplexity against budget, a line per policy and Full as the topline (TOVA Fig. 3); over several
documents, the mean with its confidence interval (``sweep_ci_figure``)."""
from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from .colors import policy_colors
from .style import finish, plotly_text


def log_range(values, pad: float = 0.08) -> list[float] | None:
    """An explicit log-axis range (log10 units) around the positive ``values``. Plotly's autorange takes a
    horizontal line's (shape's) y as a log10 value on a log axis, so the Full topline alone stretched the
    axis to 1e22; a fixed range keeps it to the data."""
    import math

    finite = [float(v) for v in values if pd.notna(v) and float(v) > 0 and math.isfinite(float(v))]
    if not finite:
        return None
    lo, hi = math.log10(min(finite)), math.log10(max(finite))
    margin = max(hi - lo, 0.1) * pad
    return [lo - margin, hi + margin]


def add_topline(fig: go.Figure, ppl: float, text: str) -> None:
    """Full's perplexity as a dashed horizontal line with its label, on the log y axis (an annotation's y is
    in log10 units there, a line's in perplexity)."""
    fig.add_hline(y=ppl, line_dash="dash", line_color="black")
    fig.add_annotation(x=1, xref="x domain", y=math.log10(ppl), yref="y", text=text, showarrow=False,
                       xanchor="right", yanchor="bottom")


def sweep_figure(df: pd.DataFrame):
    """Plotly figure: perplexity vs budget (log2-spaced x ticks at the budgets), a line per policy, Full
    as a dashed horizontal line."""
    fig = go.Figure()
    curves = df[df["policy"] != "full"]
    for name, part in curves.groupby("policy", sort=False):
        part = part.sort_values("budget")
        fig.add_trace(go.Scatter(x=part["budget"].astype(float), y=part["ppl"], mode="lines+markers", name=name,
                                 hovertemplate="%{fullData.name} budget %{x}: ppl %{y:.3f}<extra></extra>"))
    full = df[df["policy"] == "full"]
    if len(full):
        add_topline(fig, float(full["ppl"].iloc[0]), f"Full {float(full['ppl'].iloc[0]):.2f}")
    budgets = sorted(int(b) for b in curves["budget"].dropna().unique())
    tokens = int(df["tokens"].iloc[0]) if len(df) else 0
    fig.update_layout(title=f"Perplexity vs budget ({tokens} tokens)", template="plotly_white",
                      xaxis={"type": "log", "title": "budget (tokens each query reads, log2 scale)",
                             "tickvals": budgets, "ticktext": [str(b) for b in budgets]},
                      yaxis={"type": "log", "title": "perplexity (log scale)", "range": log_range(df["ppl"])})
    return fig


def sweep_ci_figure(summary: pd.DataFrame, title: str = "Perplexity vs budget, mean over documents"):
    """Plotly figure from a sweep summary (model, policy, budget, spec, documents, ppl_mean, ppl_lo, ppl_hi):
    the mean perplexity against budget, a line per policy (per model and policy when there are several
    models) with its confidence interval as error bars, and Full as a dashed topline with its interval as a
    band. Blank bounds (a single document) draw no bar."""
    fig = go.Figure()
    several = summary["model"].nunique() > 1 if "model" in summary else False

    def label(model, policy) -> str:
        return plotly_text(f"{model} · {policy}" if several else str(policy))

    curves = summary[summary["policy"] != "full"]
    colors = policy_colors(list(dict.fromkeys(curves["policy"].astype(str))))
    group = ["model", "policy"] if several else ["policy"]
    for key, part in curves.groupby(group, sort=False):
        model, policy = key if several else ("", key[0] if isinstance(key, tuple) else key)
        part = part.sort_values("budget")
        mean = part["ppl_mean"].to_numpy(dtype=float)
        upper = (part["ppl_hi"].to_numpy(dtype=float) - mean).clip(min=0)
        lower = (mean - part["ppl_lo"].to_numpy(dtype=float)).clip(min=0)
        docs = part["documents"].astype(int).astype(str).to_numpy()
        fig.add_trace(go.Scatter(
            x=part["budget"].astype(float), y=mean, mode="lines+markers", name=label(model, policy),
            line={"color": colors.get(str(policy))}, customdata=docs,
            error_y={"type": "data", "array": upper, "arrayminus": lower, "visible": True, "thickness": 1.2},
            hovertemplate="%{fullData.name} budget %{x}: ppl %{y:.3f} (%{customdata} documents)<extra></extra>"))
    full = summary[summary["policy"] == "full"]
    budgets = sorted(int(b) for b in curves["budget"].dropna().unique())
    for _, row in full.iterrows():
        mean = float(row["ppl_mean"])
        name = label(row.get("model", ""), "Full")
        if budgets and pd.notna(row["ppl_lo"]) and pd.notna(row["ppl_hi"]) and row["ppl_hi"] > row["ppl_lo"]:
            # A filled trace, not a shape: shapes on a log axis take log10 values and stretch its range.
            lo, hi = float(row["ppl_lo"]), float(row["ppl_hi"])
            fig.add_trace(go.Scatter(x=[budgets[0], budgets[-1], budgets[-1], budgets[0]], y=[lo, lo, hi, hi],
                                     fill="toself", fillcolor="rgba(0,0,0,0.08)", line={"width": 0}, mode="lines",
                                     name=f"{name} 95%", showlegend=False, hoverinfo="skip"))
        add_topline(fig, mean, f"{name} {mean:.2f}")
    documents = sorted(int(d) for d in summary["documents"].dropna().unique())
    what = f"{documents[0]} document{'s' if documents[0] != 1 else ''}" if len(documents) == 1 else \
        f"{documents[0]}-{documents[-1]} documents"
    finish(fig, f"{title} ({what}; bars: 95% interval)", height=460,
           xaxis={"type": "log", "title": "budget (tokens each query reads, log2 scale)",
                  "tickvals": budgets, "ticktext": [str(b) for b in budgets]},
           yaxis={"type": "log", "title": "perplexity (log scale)",
                  "range": log_range(pd.concat([summary["ppl_mean"], summary["ppl_lo"], summary["ppl_hi"]]))})
    return fig
