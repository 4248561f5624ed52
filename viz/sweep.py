"""Perplexity against budget, a line per policy and Full as the topline (TOVA Fig. 3)."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


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
        fig.add_hline(y=float(full["ppl"].iloc[0]), line_dash="dash", line_color="black",
                      annotation_text=f"Full {float(full['ppl'].iloc[0]):.2f}", annotation_position="bottom right")
    budgets = sorted(int(b) for b in curves["budget"].dropna().unique())
    tokens = int(df["tokens"].iloc[0]) if len(df) else 0
    fig.update_layout(title=f"Perplexity vs budget ({tokens} tokens)", template="plotly_white",
                      xaxis={"type": "log", "title": "budget (tokens each query reads, log2 scale)",
                             "tickvals": budgets, "ticktext": [str(b) for b in budgets]},
                      yaxis={"type": "log", "title": "perplexity (log scale)"})
    return fig
