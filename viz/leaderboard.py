"""The task leaderboard: score against compression ratio, a line per policy with its interval over the samples,
Full's score as the topline (kvpress's leaderboard plot); and the table of the same numbers as HTML."""
from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go

from .colors import policy_colors
from .style import finish, plotly_text


def _title(rows: pd.DataFrame, task: str) -> str:
    model = ", ".join(dict.fromkeys(rows["model"].astype(str)))
    setting = ", ".join(f"query-{s}" for s in dict.fromkeys(rows["setting"].astype(str)))
    if task == "average":
        return f"{model}: mean over the tasks Full solves ({setting})"
    lengths = ", ".join(f"{int(n):,}" for n in dict.fromkeys(rows["length"]))
    return f"{model}: {task} at {lengths} tokens ({setting})"


def leaderboard_figure(summary: pd.DataFrame, task: str | None = None) -> go.Figure:
    """Score against ratio from ``leaderboard.summarize`` (or ``averaged``) rows of one task (``task``; default
    the first), one model and setting: a line per policy with its 95% interval as error bars; Full's score is a
    dashed line, and a task Full fails says so in the title."""
    task = task if task is not None else str(summary["task"].iloc[0])
    rows = summary[summary["task"] == task]
    fig = go.Figure()
    curves = rows[rows["policy"] != "full"]
    colors = policy_colors(list(dict.fromkeys(curves["policy"].astype(str))))
    for policy, part in curves.groupby("policy", sort=False):
        part = part.sort_values("ratio")
        mean = part["score"].to_numpy(float)
        upper = (part["hi"].to_numpy(float) - mean).clip(min=0)
        lower = (mean - part["lo"].to_numpy(float)).clip(min=0)
        fig.add_trace(go.Scatter(
            x=part["ratio"].astype(float), y=mean, mode="lines+markers", name=plotly_text(str(policy)),
            line={"color": colors.get(str(policy))}, customdata=part["samples"].astype(int),
            error_y={"type": "data", "array": upper, "arrayminus": lower, "visible": True, "thickness": 1.0},
            hovertemplate="%{fullData.name} ratio %{x}: %{y:.2f} (%{customdata} samples)<extra></extra>"))
    full = float(rows["full_score"].iloc[0]) if len(rows) else float("nan")
    title = _title(rows, task) if len(rows) else task
    if pd.notna(full):
        fig.add_hline(y=full, line_dash="dash", line_color="black",
                      annotation_text=f"Full {full:.2f}", annotation_position="top right")
        if not bool(rows["full_solves"].iloc[0]):
            title += ": Full fails it, so no policy is graded on it"
    ratios = sorted(float(r) for r in curves["ratio"].dropna().unique())
    return finish(fig, title, height=440,
                  xaxis={"title": "compression ratio (share of the context's KV pairs removed)",
                         "tickvals": ratios, "ticktext": [f"{r:g}" for r in ratios]},
                  yaxis={"title": "score (share of the references in the answer)", "range": [-0.05, 1.05]})


def leaderboard_table_html(summary: pd.DataFrame) -> str:
    """One row per policy, one column per ratio: the mean score over the samples (Full's score in the task
    column), every cell escaped."""
    if summary.empty:
        return "<p>No leaderboard rows.</p>"
    ratios = sorted(float(r) for r in summary.loc[summary["policy"] != "full", "ratio"].dropna().unique())
    head = "".join(f"<th>{r:g}</th>" for r in ratios)
    body = []
    for (task, length), part in summary.groupby(["task", "length"], sort=False):
        full = float(part["full_score"].iloc[0])
        where = html.escape(f"{task}" + (f" at {int(length):,}" if int(length) else ""))
        failed = "" if bool(part["full_solves"].iloc[0]) else " (Full fails it)"
        body.append(f'<tr><th colspan="{len(ratios) + 1}">{where}: Full {full:.2f}{failed}</th></tr>')
        for policy, rows in part[part["policy"] != "full"].groupby("policy", sort=False):
            by_ratio = dict(zip(rows["ratio"].astype(float), rows["score"].astype(float)))
            cells = "".join(f"<td>{by_ratio[r]:.2f}</td>" if r in by_ratio else "<td></td>" for r in ratios)
            body.append(f"<tr><td>{html.escape(str(policy))}</td>{cells}</tr>")
    return (f'<table class="kvlens-leaderboard"><thead><tr><th>policy \\ ratio</th>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def ordered_groups_html(groups: list[dict]) -> str:
    """Which policies the samples tell apart (``leaderboard.ordered_groups``): per ratio, the policies in the
    grades' order as groups, ``>`` where a group's first is told apart from the next group's, and how many pairs
    are; every name escaped. Empty without groups."""
    if not groups:
        return ""
    body = []
    for row in groups:
        ranked = " &gt; ".join(", ".join(html.escape(str(p)) for p in group) for group in row["groups"])
        body.append(f"<tr><td>{float(row['ratio']):g}</td><td>{int(row['pairs_ordered'])} of {int(row['pairs'])}"
                    f"</td><td>{ranked}</td></tr>")
    return ('<table class="kvlens-leaderboard-groups"><caption>Told apart on the same samples (a sign test per pair '
            "over the samples they score differently, Holm's correction over a ratio's pairs, 5%): in the grades' "
            "order, &gt; starts a new group at the first policy the samples put below the group's first."
            "</caption><thead><tr><th>ratio</th><th>pairs told apart</th><th>groups, best first</th></tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")
