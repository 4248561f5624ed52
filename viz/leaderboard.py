"""The task leaderboard: score against compression ratio, a line per policy with its interval over the samples,
Full's score as the topline (kvpress's leaderboard plot); and the table of the same numbers as HTML."""
from __future__ import annotations

import html

import pandas as pd
import plotly.graph_objects as go

from .colors import policy_colors
from .style import finish, plotly_text


def _title_parts(rows: pd.DataFrame, task: str) -> tuple[str, str, str]:
    """The model, the view (the average, or a task at its lengths) and the setting."""
    model = ", ".join(dict.fromkeys(rows["model"].astype(str)))
    setting = ", ".join(f"query-{s}" for s in dict.fromkeys(rows["setting"].astype(str)))
    found = sorted(int(n) for n in dict.fromkeys(rows["length"]))
    # Several lengths in k as the columns name them, short enough for a phone's line: "1k, 4k, 8k".
    lengths = f"{found[0]:,} tokens" if len(found) == 1 else ", ".join(f"{n / 1024:g}k" for n in found)
    if task == "average":
        return model, f"mean over the tasks Full solves at {lengths}", setting
    return model, f"{task} at {lengths}", setting


def _title(rows: pd.DataFrame, task: str) -> str:
    model, view, setting = _title_parts(rows, task)
    return f"{model}: {view} ({setting})"


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
    column), every cell escaped; the policies best first by their mean over the ratios, as the heatmap lists them."""
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
        graded = part[part["policy"] != "full"]
        order = graded.groupby("policy", sort=False)["score"].mean().sort_values(ascending=False, kind="stable")
        for policy in order.index:
            rows = graded[graded["policy"] == policy]
            by_ratio = dict(zip(rows["ratio"].astype(float), rows["score"].astype(float)))
            cells = "".join(f"<td>{by_ratio[r]:.2f}</td>" if r in by_ratio else "<td></td>" for r in ratios)
            body.append(f"<tr><td>{html.escape(str(policy))}</td>{cells}</tr>")
    return (f'<table class="kvlens-leaderboard"><thead><tr><th>policy \\ ratio</th>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table>")


def ordered_groups_html(groups: list[dict], where: str = "") -> str:
    """Which policies the samples tell apart (``leaderboard.ordered_groups``): per ratio, the policies in the
    grades' order as groups, ``>`` where a group's first is told apart from the next group's, and how many pairs
    are; every name escaped. ``where``: the samples they are (e.g. "at 1,024 tokens"). One line when no pair is
    told apart at any ratio; empty without groups."""
    if not groups:
        return ""
    where = f" {html.escape(where)}" if where else ""
    if not any(row["pairs_ordered"] for row in groups):
        return (f'<p class="kvlens-leaderboard-groups">Told apart on the same samples{where}: none of the '
                f"{int(groups[0]['pairs'])} pairs, at any ratio.</p>")
    body = []
    for row in groups:
        ranked = (" &gt; ".join(", ".join(html.escape(str(p)) for p in group) for group in row["groups"])
                  if row["pairs_ordered"] else "none told apart")
        body.append(f"<tr><td>{float(row['ratio']):g}</td><td>{int(row['pairs_ordered'])} of {int(row['pairs'])}"
                    f"</td><td>{ranked}</td></tr>")
    return (f'<table class="kvlens-leaderboard-groups"><caption>Told apart on the same samples{where} (a sign test per pair '
            "over the samples they score differently, Holm's correction over a ratio's pairs, 5%): in the grades' "
            "order, &gt; starts a new group at the first policy the samples put below the group's first."
            "</caption><thead><tr><th>ratio</th><th>pairs told apart</th><th>groups, best first</th></tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


FAINT = "rgba(255,255,255,0.72)"  # laid over the rows not picked, so the picked one stands out


def leaderboard_heatmap(summary: pd.DataFrame, task: str | None = None, order: list[str] | None = None,
                        pick: str | None = None,
                        groups: dict[tuple[int, float], list[list[str]]] | None = None) -> go.Figure:
    """The grades of one task (``task``; default the first) as a policy x ratio grid, each cell its score (with
    its sample count on hover), policies top to bottom in ``order`` (default: best mean first). ``pick``: one
    policy drawn strong, the rest faint. ``groups``: per (length, ratio) the groups the samples tell apart (best
    first); a line under a cell marks where a new group starts in that column. A colour-blind-safe scale (cividis)."""
    task = task if task is not None else str(summary["task"].iloc[0])
    rows = summary[(summary["task"] == task) & (summary["policy"] != "full")]
    lengths = sorted(int(n) for n in rows["length"].unique())
    columns = sorted({(int(n), float(r)) for n, r in zip(rows["length"], rows["ratio"])})  # a column per length, ratio
    if order is None:
        order = list(rows.groupby("policy", sort=False)["score"].mean().sort_values(ascending=False, kind="stable").index)
    order = [str(p) for p in order if p in set(rows["policy"].astype(str))]
    cell = {(str(p), int(n), float(r)): (float(v), int(k))
            for p, n, r, v, k in zip(rows["policy"], rows["length"], rows["ratio"], rows["score"], rows["samples"])}
    z = [[cell.get((p, *c), (None, 0))[0] for c in columns] for p in order]
    n = [[cell.get((p, *c), (None, 0))[1] for c in columns] for p in order]
    ratios = [r for _, r in columns]
    labels = [plotly_text(p) for p in order]
    x = [f"{r:g}" if len(lengths) == 1 else f"{n // 1024}k · {r:g}" for n, r in columns]
    fig = go.Figure(go.Heatmap(
        z=z, x=x, y=labels, customdata=n, colorscale="Cividis", zmin=0, zmax=1, xgap=2, ygap=2,
        text=[[("" if v is None else f"{v:.2f}") for v in row] for row in z], texttemplate="%{text}",
        textfont={"size": 11},
        colorbar={"title": {"text": "score", "side": "right"}, "thickness": 12},
        hovertemplate="%{y} at ratio %{x}: %{z:.2f} over %{customdata} samples<extra></extra>"))
    if pick in order:
        for i, policy in enumerate(order):
            if policy != pick:
                fig.add_shape(type="rect", x0=-0.5, x1=len(ratios) - 0.5, y0=i - 0.5, y1=i + 0.5, line_width=0,
                              fillcolor=FAINT, layer="above")
        at = order.index(pick)
        fig.add_shape(type="rect", x0=-0.5, x1=len(ratios) - 0.5, y0=at - 0.5, y1=at + 0.5,
                      line={"color": "#C0392B", "width": 3}, fillcolor="rgba(0,0,0,0)", layer="above")
    for column, (length, ratio) in enumerate(columns):
        ranked = (groups or {}).get((length, ratio)) or []
        for group in ranked[1:]:  # a new group starts at its first policy: a line above that cell
            first = next((p for p in group if p in order), None)
            if first is not None:
                y = order.index(first) - 0.5
                fig.add_shape(type="line", x0=column - 0.5, x1=column + 0.5, y0=y, y1=y,
                              line={"color": "#E69F00", "width": 3}, layer="above")
    full = rows["full_score"].iloc[0] if len(rows) else float("nan")
    lines = list(_title_parts(summary[summary["task"] == task], task)) if len(rows) else [task]
    if pd.notna(full):  # Full's score at each length, in the columns' order
        fulls = rows.groupby("length", sort=True)["full_score"].first()
        lines[-1] += "; Full " + ", ".join(f"{float(v):.2f}" for v in fulls)
        if not bool(rows["full_solves"].iloc[0]):
            lines[-1] += ": Full fails it, so no policy is graded on it"
    fig = finish(fig, ": ".join(lines), height=max(400, 200 + 26 * len(order)),
                 xaxis={"title": "compression ratio<br>(share of the "
                        + ("context's KV removed)" if len(lengths) == 1 else "KV removed, by length)"), "type": "category",
                        "side": "top"},
                 yaxis={"autorange": "reversed", "automargin": True, "type": "category"})
    # A line each for the model, the view and the setting, each short enough for a phone's narrow plot; the title's
    # margin grows to hold them above the ratios.
    fig.update_layout(title={"text": "<br>".join(plotly_text(line) for line in lines), "font": {"size": 14},
                             "automargin": True, "yref": "container", "y": 1, "yanchor": "top",
                             "pad": {"t": 34}},  # below the page's "Plot" label
                      margin={"t": 175})  # the title's three lines, then the ratios' title and ticks
    return fig
