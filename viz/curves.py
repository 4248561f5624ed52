"""Accumulated attention scores with and without forgetting (A2S vs A2SF).

``score_curves_figure`` mirrors A2SF Fig. 1: at one decode step, every token's accumulated score
against its position, A2S (alpha = 1, H2O's score) on top and A2SF (forgetting factor alpha) below, the
tokens each rule keeps in the policy colour and the rest in grey. The viewer sees A2S piling score onto
early tokens (they have been attended to for longer) while A2SF lets recent, relevant tokens win.

Both y axes are **log**: an attention sink's score is hundreds to thousands of times a typical token's
(a sink taking half of every query's attention scores half the step count under A2S), so on a linear axis every panel is one
spike at token 0 and the rest lies flat on the floor; on a log axis the two rules read side by side at
every position. The x axis stays the position, not the rank: where the kept tokens sit (early for A2S,
recent for A2SF) is what the figure is for. Up to ``BAR_LIMIT`` tokens each is a bar; past that bars
are thinner than a pixel, so every token's score is one grey line and each kept token a coloured
marker on it. A score of exactly 0 (no recorded weight) has no place on a log axis and is left out; the
axis reaches a decade below the lowest kept score, so evicted tokens scored far lower run off its foot.

``score_over_steps_figure`` mirrors A2SF Fig. 6: the score of a few chosen tokens along the
generation steps, A2S above and A2SF below; with keep masks, a line stops where its token is
evicted (an x marks the step). Its y axes are log too, so a followed sink does not flatten the other
tokens' lines, and A2SF's forgetting (a factor alpha a step) reads as a straight descent; they reach
``OVER_STEPS_DECADES`` decades below the highest score.

Inputs are plain arrays (``backend.analysis.metrics.score_curves`` computes them): for the snapshot, every
token's score at the step and whether it is kept ([step + 1] each); for the curves, one row per
followed token over all the steps ([m, T]). Nothing here is [T, T]: at 8k tokens that would be 512 MB.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import plotly.colors as pcolors
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from .colors import FAMILY_COLORS
from .style import finish, plotly_text, visible_token

EVICTED_BAR = "#C8C8C8"
BAR_LIMIT = 256  # tokens drawn as bars; a longer text is a line of scores and a marker per kept token
NAMED_TOKENS = 2048  # past this many tokens the grey line's hover gives the position only (texts weigh 100s of kB)
OVER_STEPS_DECADES = 6  # the scores over the steps: a forgotten token's fall below that leaves the axis


def _shaped(name: str, a, shape: tuple) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {a.shape}")
    return a


def _texts(token_texts: Sequence[str], n: int) -> np.ndarray:
    texts = list(token_texts) + [""] * max(0, n - len(token_texts))
    return np.array([plotly_text(visible_token(t)) for t in texts[:n]], dtype=object)


def _row_titles(alpha: float) -> tuple[str, str]:
    return "A2S (alpha = 1, H2O's score)", f"A2SF (alpha = {alpha:g})"


def score_curves_figure(a2s: np.ndarray, a2sf: np.ndarray, token_texts: Sequence[str], step: int,
                        keep_a2s: np.ndarray, keep_a2sf: np.ndarray, alpha: float, title: str | None = None,
                        colors: Mapping[str, str] | None = None, height: int = 560) -> go.Figure:
    """Every token's accumulated score at ``step`` by position, A2S above, A2SF below, log y; kept tokens coloured.

    ``a2s`` / ``a2sf``: float [step + 1], the scores at ``step`` of tokens 0..step; ``keep_*``: bool
    [step + 1], the tokens each rule keeps there. Up to ``BAR_LIMIT`` tokens, each panel has two bar traces
    named ``kept`` and ``evicted``; beyond, a grey line named ``all tokens`` (every score, 0 left out; past ``NAMED_TOKENS``
    tokens without their texts) and
    markers named ``kept``. x = token positions. ``colors`` may override the kept colours with keys
    ``'a2s'`` and ``'a2sf'``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    shape = (step + 1,)
    a2s, a2sf = _shaped("a2s", a2s, shape), _shaped("a2sf", a2sf, shape)
    keep_a2s = _shaped("keep_a2s", keep_a2s, shape).astype(bool)
    keep_a2sf = _shaped("keep_a2sf", keep_a2sf, shape).astype(bool)
    colors = dict(colors or {})
    kept_colors = (colors.get("a2s", FAMILY_COLORS["h2o"]), colors.get("a2sf", FAMILY_COLORS["a2sf"]))
    texts = _texts(token_texts, step + 1)
    names = _row_titles(alpha)
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1,
                        subplot_titles=[f"{names[0]}: {int(keep_a2s.sum())} kept",
                                        f"{names[1]}: {int(keep_a2sf.sum())} kept"])
    draw = _bars if step + 1 <= BAR_LIMIT else _line_and_markers
    for row, (scores, keep, color, label) in enumerate(
            zip((a2s, a2sf), (keep_a2s, keep_a2sf), kept_colors, names), start=1):
        # float32 halves the figure's JSON; a score needs no more digits
        for trace in draw(scores.astype(np.float32), keep, texts, color, label, step, first_row=row == 1):
            fig.add_trace(trace, row=row, col=1)
        fig.update_yaxes(title_text="accumulated score (log)", type="log", exponentformat="power",
                         range=_log_range(scores, keep), row=row, col=1)
    fig.update_xaxes(title_text="token position", row=2, col=1)
    fig.update_xaxes(range=[-0.5, step + 0.5])
    fig.update_layout(barmode="overlay", bargap=0.1, legend=dict(orientation="h", y=1.08, x=1, xanchor="right"))
    return finish(fig, title or f"Accumulated attention score of each token at step {step}", height=height)


def _log_range(scores: np.ndarray, keep: np.ndarray) -> list[float] | None:
    """From a decade below the lowest kept score to above the highest: every kept token shows, and evicted
    tokens far below (A2SF's forgotten ones, 10^-40 and less) fall off the bottom instead of stretching it."""
    positive = scores[scores > 0]
    if not positive.size:
        return None
    kept = scores[keep & (scores > 0)]
    low = float((kept if kept.size else positive).min()) / 10
    return [math.log10(low), math.log10(float(positive.max())) + 0.2]


def _hover(label: str, state: str | None, step: int, named: bool = True) -> str:
    said = "" if state is None else f"<br>{state} at step {step}"
    text = ": %{customdata}" if named else ""
    return f"<b>{label}</b><br>token %{{x}}{text}<br>score %{{y:.4g}}{said}<extra></extra>"


def _bars(values: np.ndarray, keep: np.ndarray, texts: np.ndarray, color: str, label: str, step: int,
          first_row: bool) -> list[go.Bar]:
    """A bar per token: the kept ones in ``color``, the rest grey (A2SF Fig. 1)."""
    pos = np.arange(len(values), dtype=np.int32)
    return [go.Bar(x=pos[sel], y=values[sel], customdata=texts[sel], name=state, marker_color=col, marker_line_width=0,
                   legendgroup=state, showlegend=first_row, hovertemplate=_hover(label, state, step))
            for state, sel, col in (("kept", keep, color), ("evicted", ~keep, EVICTED_BAR))]


def _line_and_markers(values: np.ndarray, keep: np.ndarray, texts: np.ndarray, color: str, label: str, step: int,
                      first_row: bool) -> list[go.Scatter]:
    """Every score as one grey line (0 left out: a log axis has no place for it), kept tokens as markers."""
    pos = np.flatnonzero(keep).astype(np.int32)
    named = len(values) <= NAMED_TOKENS
    every = go.Scatter(x0=0, dx=1, y=np.where(values > 0, values, np.nan), customdata=texts if named else None,
                       mode="lines",
                       name="all tokens", line=dict(color=EVICTED_BAR, width=1), legendgroup="all",
                       showlegend=first_row, hovertemplate=_hover(label, None, step, named))
    kept = go.Scatter(x=pos, y=values[pos], customdata=texts[pos], mode="markers", name="kept",
                      marker=dict(color=color, size=5), legendgroup="kept", showlegend=first_row,
                      hovertemplate=_hover(label, "kept", step))
    return [every, kept]


def score_over_steps_figure(a2s: np.ndarray, a2sf: np.ndarray, tokens_to_show: Sequence[int],
                            token_texts: Sequence[str], alpha: float | None = None,
                            keep_a2s: np.ndarray | None = None, keep_a2sf: np.ndarray | None = None,
                            title: str | None = None, height: int = 560) -> go.Figure:
    """Score of each chosen token vs decode step, A2S above, A2SF below (A2SF Fig. 6).

    ``a2s`` / ``a2sf``: float [m, T], row i = the scores of token ``tokens_to_show[i]`` at every step;
    ``keep_*``: optional bool [m, T], whether it is kept at each step. One colour per token (the same in
    both panels, one legend entry toggling both). Line for token j: steps j..T-1 (given as ``x0`` and
    ``dx``, so only the scores travel). With a keep mask, the line ends at the last step the token is
    kept and an ``x`` marker sits at the step it is gone.
    """
    tokens = [int(t) for t in tokens_to_show]
    a2s, a2sf = np.asarray(a2s), np.asarray(a2sf)
    if a2s.ndim != 2 or len(a2s) != len(tokens):
        raise ValueError(f"a2s must be [m, T] with one row per token ({len(tokens)}), got shape {a2s.shape}")
    n = a2s.shape[1]
    a2sf = _shaped("a2sf", a2sf, a2s.shape)
    keeps = [None if k is None else _shaped("keep", k, a2s.shape).astype(bool) for k in (keep_a2s, keep_a2sf)]
    palette = pcolors.qualitative.Dark24
    names = _row_titles(alpha) if alpha is not None else ("A2S (alpha = 1)", "A2SF")
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.1, subplot_titles=list(names))
    for i, j in enumerate(tokens):
        if not 0 <= j < n:
            raise ValueError(f"token {j} is outside 0..{n - 1}")
        color = palette[i % len(palette)]
        label = f"{j} {_texts(token_texts[j:j + 1], 1)[0]}"
        for row, (scores, keep) in enumerate(zip((a2s, a2sf), keeps), start=1):
            values = scores[i, j:].astype(np.float32)
            values[values <= 0] = np.nan  # no place on a log axis
            gone = None
            if keep is not None and not keep[i, j:].all():
                gone = int(np.argmin(keep[i, j:]))
                values[gone:] = np.nan
            fig.add_trace(go.Scatter(
                x0=j, dx=1, y=values, mode="lines", name=label, legendgroup=label, showlegend=row == 1,
                line=dict(color=color, width=2),
                hovertemplate="token %{fullData.name}<br>step %{x}<br>score %{y:.4g}<extra></extra>"),
                row=row, col=1)
            if gone is not None:
                last = float(scores[i, j + max(gone - 1, 0)])  # the score it left with
                fig.add_trace(go.Scatter(
                    x=[j + gone], y=[last if last > 0 else np.nan], mode="markers",
                    marker=dict(symbol="x", size=9, color=color), legendgroup=label, showlegend=False,
                    name=f"{label} evicted",
                    hovertemplate="token %{fullData.name} at step %{x}<extra></extra>"),
                    row=row, col=1)
    for row, scores in enumerate((a2s, a2sf), start=1):
        top = float(np.max(scores, initial=0.0))
        low = float(np.min(scores[scores > 0], initial=top)) / 2
        floor = max(low, top * 10.0 ** -OVER_STEPS_DECADES)
        fig.update_yaxes(title_text="accumulated score (log)", type="log", exponentformat="power", row=row, col=1,
                         range=[math.log10(floor), math.log10(top) + 0.2] if top > 0 else None)
    fig.update_xaxes(title_text="decode step", row=2, col=1)
    return finish(fig, title or "Accumulated score of chosen tokens over the steps", height=height)
