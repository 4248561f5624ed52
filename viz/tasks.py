"""One task sample as the page shows it: the question, its references, and each policy's score and answer (HTML,
every text escaped: the question comes from lm-eval's generator, the answers are the model's own text)."""
from __future__ import annotations

import html

import pandas as pd


def _text(value, limit: int = 400) -> str:
    """``value`` on one line, cut at ``limit`` characters, escaped."""
    text = " ".join(str(value).split())
    return html.escape(text if len(text) <= limit else text[:limit - 1] + "…")


def _score(value) -> str:
    return "" if pd.isna(value) else f"{float(value):.2f}"


def sample_status_html(question: str, references: list[str], table: pd.DataFrame, heading: str = "") -> str:
    """A heading (what ran), the question, the references, and per policy (Full first) its score and answer."""
    lines = [_text(heading)] if heading else []
    lines += [f"<b>Question:</b> {_text(question)}",
             f"<b>References:</b> {', '.join(_text(r) for r in references) or '(none)'}"]
    lines += [f"<b>{_text(row.spec)}</b>: score {_score(row.score)}, answer “{_text(row.answer)}”"
              for row in table.itertuples(index=False)]
    return "<div class='kvlens-sample'>" + "<br>".join(lines) + "</div>"


def sample_table_html(table: pd.DataFrame) -> str:
    """The sample's rows (spec, budget, score, answer) as an HTML table, every cell escaped."""
    columns = [c for c in ("spec", "budget", "score", "answer") if c in table]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for _, row in table.iterrows():
        cells = [_score(row[c]) if c == "score" else "" if pd.isna(row[c]) else _text(row[c]) for c in columns]
        body.append("<tr>" + "".join(f"<td>{cell}</td>" for cell in cells) + "</tr>")
    return (f"<table class='kvlens-needle-table'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody>"
            "</table>")


def _share(value) -> str:
    return "–" if value is None or pd.isna(value) else f"{100 * float(value):.0f}%"


def why_html(why: pd.DataFrame | None, evidence: str = "") -> str:
    """Why each policy answered as it did: the evidence (``evidence``, in words), then per policy (Full first) the
    share of the evidence its cache still read when the answer began, the layers that had lost all of it, the
    answer's first token's attention on it beside Full's, and the verdict in one line. Every text escaped."""
    if why is None or why.empty:
        return ""
    rows = []
    for row in why.itertuples(index=False):
        rows.append(f"<tr><td><b>{_text(row.name)}</b></td><td>{_score(row.score)}</td><td>{_share(row.held)}</td>"
                    f"<td>{int(row.lost_layers)}</td><td>{_share(row.attention)}</td><td>{_text(row.verdict, 600)}</td>"
                    "</tr>")
    head = "".join(f"<th>{h}</th>" for h in ("policy", "score", "evidence held", "layers that lost it",
                                             "attention on it", "why"))
    intro = f"<p><b>Evidence:</b> {_text(evidence)}</p>" if evidence else ""
    return (f"<div class='kvlens-why'>{intro}<table class='kvlens-needle-table'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")
