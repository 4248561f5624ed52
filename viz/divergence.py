"""How far each policy's predictions drift from full attention, step by step.

``divergence_figure``: what the viewer sees is two stacked line charts over the scored positions,
one line per policy in its own colour: on top the per-step KL(Full || policy) of the next-token
distributions, below the running top-1 agreement with Full (share of positions so far where the
policy's most likely next token is Full's). This is TOVA's App. D view (perplexity/agreement as the
text goes on) and A2SF's accuracy-vs-Full comparison, per step instead of averaged.

``summary_table``: one row per policy: perplexity, mean KL to Full, top-1 agreement and similarity
to the oracle ("Ideal" top-k) selection, as a pandas DataFrame ready to show.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .colors import family, policy_colors
from .style import finish, plotly_text

SUMMARY_COLUMNS = ("Policy", "Perplexity", "Mean KL to Full (nats)", "Top-1 agreement", "Similarity to oracle")
_ALIASES = MappingProxyType({
    "Policy": ("policy", "name", "spec"),
    "Perplexity": ("ppl", "perplexity"),
    "Mean KL to Full (nats)": ("mean_kl", "kl", "kl_to_full"),
    "Top-1 agreement": ("top1_agreement", "top1"),
    "Similarity to oracle": ("oracle_similarity", "similarity_to_oracle", "oracle_sim"),
})
MISSING = "—"


# Shown with the divergence view when StreamingLLM runs: positions in the cache vs in the text.
REROTATION_NOTE = (
    "<p><b>StreamingLLM re-rotates; sinks does not.</b> <code>streamingllm</code> and <code>sinks</code> read the "
    "same tokens: the first few (attention sinks) and the latest ones. <code>sinks</code> keeps every key at its "
    "position in the text. <code>streamingllm</code> caches keys before RoPE and rotates them by their place in "
    "the cache, 0 to budget&nbsp;-&nbsp;1, the query at its own place, as the StreamingLLM paper does (Sec. 3.2). "
    "Inside the window the distance from query to key is the same either way, so only the sinks move: query t "
    "sees sink i budget&nbsp;-&nbsp;1&nbsp;-&nbsp;i positions back instead of t&nbsp;-&nbsp;i. Both are Full "
    "until the text outgrows the budget; after that, the gap between their curves is what the sinks' apparent "
    "distance does to the model. (Keeping positions below the budget is what lets the paper's models read past "
    "their training length.)</p>")


def divergence_notes(names: Sequence[str]) -> str:
    """HTML to show with the divergence figure for the policies in ``names`` (specs or names); "" if none."""
    return REROTATION_NOTE if "streamingllm" in {family(name) for name in names} else ""


def running_agreement(top1: Sequence) -> np.ndarray:
    """Running share of matches: element i = mean(top1[:i+1])."""
    m = np.asarray(top1, np.float64)
    return np.cumsum(m) / np.arange(1, len(m) + 1) if len(m) else m


def divergence_figure(series: Mapping[str, Mapping], colors: Mapping[str, str] | None = None,
                      title: str | None = None, log_kl: bool = False, height: int = 560) -> go.Figure:
    """Per-step KL(Full || policy) (top) and running top-1 agreement with Full (bottom), one line per policy.

    ``series``: policy name -> ``dict(kl=[...], top1=[...])`` per scored position (top1: 1/True where
    the policy's top-1 token equals Full's), optionally ``steps=[...]`` for the x values (default
    0..n-1). Trace order: for each policy, its KL line then its agreement line.
    """
    names = list(series)
    colors = dict(colors) if colors else policy_colors(names)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                        subplot_titles=["KL(Full || policy) per step", "running top-1 agreement with Full"])
    for name in names:
        data = series[name]
        kl = np.asarray(data["kl"], np.float64)
        agree = running_agreement(data["top1"])
        given = data.get("steps")
        steps = np.arange(len(kl)) if given is None else np.asarray(given)
        if len(agree) != len(kl) or len(steps) != len(kl):
            raise ValueError(f"{name}: kl, top1 and steps must have the same length")
        # Steps 0..n-1 travel as x0 and dx, the values as float32: a 32k-token run of six policies is
        # 1.5 MB of JSON instead of 6.
        x = dict(x0=0, dx=1) if given is None else dict(x=steps)
        kl, agree = kl.astype(np.float32), agree.astype(np.float32)
        color = colors.get(name, "#444444")
        label = plotly_text(name)
        fig.add_trace(go.Scatter(**x, y=kl, mode="lines", name=label, legendgroup=label,
                                 line=dict(color=color, width=1.6),
                                 hovertemplate="%{fullData.name}<br>step %{x}<br>KL %{y:.4f} nats<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(**x, y=agree, mode="lines", name=label, legendgroup=label, showlegend=False,
                                 line=dict(color=color, width=2),
                                 hovertemplate="%{fullData.name}<br>step %{x}<br>top-1 agreement so far %{y:.1%}"
                                               "<extra></extra>"),
                      row=2, col=1)
    fig.update_yaxes(title_text="KL (nats)", type="log" if log_kl else "linear", row=1, col=1)
    fig.update_yaxes(title_text="agreement", tickformat=".0%", range=[0, 1.03], row=2, col=1)
    fig.update_xaxes(title_text="scored position (step)", row=2, col=1)
    fig.update_layout(hovermode="x unified" if len(names) <= 8 else "closest")
    return finish(fig, title or "Divergence from full attention", height=height)


def _pick(row: Mapping, column: str):
    for key in _ALIASES[column]:
        if key in row and row[key] is not None:
            return row[key]
    return None


def _fmt(value, spec: str) -> str:
    if value is None:
        return MISSING
    try:
        number = float(value)
    except (TypeError, ValueError):
        return str(value)
    if math.isnan(number):
        return MISSING
    return format(number, spec)


def summary_table(rows: Sequence[Mapping], formatted: bool = True) -> pd.DataFrame:
    """One row per policy: Policy, Perplexity, Mean KL to Full (nats), Top-1 agreement, Similarity to oracle.

    ``rows``: mappings with ``policy`` and any of ``ppl``, ``mean_kl`` (or ``kl_to_full`` as
    ``backend.analysis.metrics.summary_row`` names it), ``top1_agreement``, ``oracle_similarity`` (a share in
    [0, 1]). Missing values show as an em dash. ``formatted=False`` keeps numbers (NaN for missing)
    for sorting; ``formatted=True`` gives strings: ppl 2 decimals, KL 4, shares as percentages.
    """
    records = []
    for row in rows:
        values = {col: _pick(row, col) for col in SUMMARY_COLUMNS}
        if values["Policy"] is None:
            raise ValueError(f"summary row without a policy name: {dict(row)}")
        records.append(values)
    df = pd.DataFrame.from_records(records, columns=list(SUMMARY_COLUMNS))
    if not formatted:
        for col in SUMMARY_COLUMNS[1:]:
            df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
        return df
    specs = {"Perplexity": ".2f", "Mean KL to Full (nats)": ".4f", "Top-1 agreement": ".1%",
             "Similarity to oracle": ".1%"}
    for col, spec in specs.items():
        df[col] = [_fmt(v, spec) for v in df[col]]
    df["Policy"] = df["Policy"].astype(str)
    return df
