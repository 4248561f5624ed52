"""The text itself, marked up with what the cache holds: HTML strings (no Gradio here).

``kept_tokens_html``: what the viewer sees is the running text with every token the query at
``step`` still reads highlighted like a text marker (stronger = more layers/heads keep it when
``kept`` is a share), the token at ``step`` outlined, evicted tokens in grey, and tokens after
``step`` (not yet arrived) faded. Hovering a token shows its position, kept share and weight. This
is TOVA Fig. 7 / App. E read as text instead of a grid (which words survive in the multi-state).
A long text shows a window of ``WINDOW`` tokens around the step in full and, outside it, only the
tokens still read (at most ``MAX_OUTSIDE``, the most kept first), with the gaps between them counted:
8192 spans of HTML would be megabytes, and the far-away tokens a cache keeps are what matters there.

``continuations_html``: each policy's own greedy continuation side by side, the first token where
it leaves Full's continuation outlined in red and the rest tinted (TOVA Table 1-style qualitative
comparison of long generations).

Every token text and policy name goes through ``html.escape``; newlines stay newlines
(``white-space: pre-wrap``).
"""
from __future__ import annotations

import html
from collections.abc import Mapping, Sequence

import numpy as np

from .colors import HIGHLIGHT_RGB, policy_colors

BOX_STYLE = ("font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 14px; "
             "line-height: 1.9; white-space: pre-wrap; word-break: break-word; color: #1d1d1d; "
             "background: #ffffff; padding: 10px 12px; border: 1px solid #e3e3e3; border-radius: 6px;")
LEGEND_STYLE = "font-family: sans-serif; font-size: 12px; color: #444; margin: 0 0 6px 0;"
GAP_STYLE = "color: #6b6b6b; background: #f3f3f3; border-radius: 3px; padding: 0 4px; font-size: 12px;"
WINDOW = 512  # tokens shown in full around the step
AFTER_STEP = 32  # of them, how many come after the step (the text that has not arrived yet)
MAX_OUTSIDE = 256  # kept tokens shown outside the window


def _esc(text: str) -> str:
    return html.escape(str(text), quote=True)


def _highlight(alpha: float) -> str:
    r, g, b = HIGHLIGHT_RGB
    return f"rgba({r},{g},{b},{alpha:.3f})"


def _kept_share(kept: np.ndarray) -> np.ndarray:
    kept = np.asarray(kept)
    if kept.dtype == bool:
        return kept.astype(np.float64)
    share = np.nan_to_num(kept.astype(np.float64), nan=0.0)
    if share.size and (share.min() < 0 or share.max() > 1 + 1e-6):
        raise ValueError("kept must be bool or a share in [0, 1]")
    return share


def text_window(n: int, step: int, size: int = WINDOW) -> tuple[int, int]:
    """(first, end) of the ``size`` positions shown in full: the whole text when it fits, else the ones
    ending ``AFTER_STEP`` tokens after ``step``."""
    if n <= size:
        return 0, n
    end = min(n, max(step + 1 + AFTER_STEP, size))
    return end - size, end


def _shown_outside(share: np.ndarray, step: int, window: tuple[int, int], max_outside: int) -> np.ndarray:
    """Positions outside the window, up to the step, still read: the ``max_outside`` most kept, in order."""
    outside = np.flatnonzero(share[: step + 1] > 0)
    outside = outside[(outside < window[0]) | (outside >= window[1])]
    if len(outside) > max_outside:
        outside = np.sort(outside[np.argsort(-share[outside], kind="stable")[:max_outside]])
    return outside


def _gap(count: int, kept_hidden: int) -> str:
    what = f"{count} token{'s' if count != 1 else ''}" + (f", {kept_hidden} of them kept" if kept_hidden else "")
    return f'<span class="kvl-gap" style="{GAP_STYLE}">⋯ {_esc(what)} ⋯</span>'


EVIDENCE_STYLE = "text-decoration: underline 3px #D35400; text-underline-offset: 3px"
# The tokens' shared looks, once per view rather than on each of thousands of spans (only a kept token's shade
# and its attention underline are its own).
TOKEN_CSS = ("<style>.kvl-tok{border-radius:3px;padding:1px 0}.kvl-future{color:#707070;font-style:italic}.kvl-evicted{color:#6b6b6b}"
             ".kvl-evidence{text-decoration:underline 3px #D35400;text-underline-offset:3px}"
             ".kvl-current{outline:2px solid #C0392B;outline-offset:1px}</style>")


def _token_span(j: int, text: str, s: float, step: int, w: np.ndarray | None, wmax: float,
                evidence: bool = False) -> str:
    styles = []
    if j > step:
        state = "future"
    elif s > 0:
        state = "kept"
        styles.append(f"background:{_highlight(0.25 + 0.65 * s)}")
    else:
        state = "evicted"
    classes = ["kvl-tok", f"kvl-{state}"]
    if evidence:  # the answer's evidence (analysis/evidence.py): underlined whether kept or not
        classes.append("kvl-evidence")
    if j == step:
        classes.append("kvl-current")
    if j > step:
        tip = f"position {j} · not arrived yet"
    elif s >= 1.0:
        tip = f"position {j} · kept"
    elif s <= 0.0:
        tip = f"position {j} · evicted"
    else:
        tip = f"position {j} · kept by {s:.0%} of layers/heads"
    if evidence:
        tip += " · evidence"
    if w is not None and j <= step:
        tip += f" · weight {w[j]:.4g}"
        if wmax > 0 and w[j] > 0:
            styles.append(f"box-shadow:inset 0 -3px 0 rgba(43,92,138,{min(1.0, w[j] / wmax):.3f})")
    style = f' style="{";".join(styles)}"' if styles else ""
    return (f'<span class="{" ".join(classes)}" data-pos="{j}" data-kept="{s:.3g}" '
            f'title="{_esc(tip)}"{style}>{_esc(text)}</span>')


def kept_tokens_html(token_texts: Sequence[str], kept: np.ndarray, step: int, weights: np.ndarray | None = None,
                     title: str | None = None, window: tuple[int, int] | None = None,
                     max_outside: int = MAX_OUTSIDE, evidence: np.ndarray | None = None) -> str:
    """The text with the tokens cached at ``step`` highlighted; returns an HTML fragment.

    ``kept``: bool [T] (``Trace.reads_at(layer, step)[head]``) or float [T] in [0, 1] (share of layers
    or heads that still read each token): highlight opacity grows with the share. ``weights``: optional
    [T] attention weights of the query at ``step``, shown on hover and as an underline whose strength
    follows weight / max weight. ``window``: the positions ``(first, end)`` shown in full (default
    ``text_window``: all of a short text); outside it only kept tokens up to the step appear, at most
    ``max_outside``, with ``kvl-gap`` markers counting what lies between.
    Each token is a ``<span class="kvl-tok kvl-{kept|evicted|future}">`` with ``data-pos`` and
    ``data-kept`` attributes; the token at ``step`` also has class ``kvl-current``. ``evidence``: positions of the
    answer's evidence, underlined (class ``kvl-evidence``) and shown kept or not; outside the window it takes up to
    half of the ``max_outside`` shown there (the nearest to the step first).
    """
    n = len(token_texts)
    share = _kept_share(kept)
    if share.shape != (n,):
        raise ValueError(f"kept must have one value per token ({n}), got shape {share.shape}")
    if not 0 <= step < n:
        raise ValueError(f"step must be within 0..{n - 1}, got {step}")
    w, wmax = None, 0.0
    if weights is not None:
        w = np.nan_to_num(np.asarray(weights, np.float64), nan=0.0)
        if w.shape != (n,):
            raise ValueError(f"weights must have one value per token ({n}), got shape {w.shape}")
        wmax = float(w[: step + 1].max())
    first, end = text_window(n, step) if window is None else (max(0, window[0]), min(n, window[1]))
    marked = np.zeros(n, bool)
    if evidence is not None:
        at = np.asarray(evidence, np.int64)
        marked[at[(at >= 0) & (at < n)]] = True
    # Outside the window the evidence takes up to half of the ``max_outside`` shown there (the nearest to the step),
    # the most kept tokens the rest: a text whose every twentieth token is evidence stays as small as any other.
    far = np.flatnonzero(marked)
    far = far[(far < first) | (far >= end)]
    far = np.sort(far[np.argsort(np.abs(far - step), kind="stable")[:max_outside // 2]])
    others = _shown_outside(np.where(marked, 0.0, share), step, (first, end), max_outside - len(far))
    shown = np.union1d(np.union1d(np.arange(first, end), far), others)
    kept_before = np.r_[0, np.cumsum(share[: step + 1] > 0)]  # kept tokens before each position (up to the step)

    def kept_between(a: int, b: int) -> int:  # kept tokens at positions a..b-1 (none after the step)
        return int(kept_before[min(b, step + 1)] - kept_before[min(a, step + 1)])

    parts, previous = [], -1
    for j in shown.tolist():
        if j > previous + 1:
            parts.append(_gap(j - previous - 1, kept_between(previous + 1, j)))
        parts.append(_token_span(j, token_texts[j], float(share[j]), step, w, wmax, bool(marked[j])))
        previous = j
    if previous < n - 1:
        parts.append(_gap(n - 1 - previous, kept_between(previous + 1, n)))
    n_kept = int((share[: step + 1] > 0).sum())
    partial = "" if (first, end) == (0, n) else f" · positions {first}–{end - 1} in full, kept tokens elsewhere"
    legend = (f'<div class="kvl-legend" style="{LEGEND_STYLE}">'
              + (f"<strong>{_esc(title)}</strong> · " if title else "")
              + f"step {step}: {n_kept} of {step + 1} tokens still read{partial} · "
              f'<span style="background: {_highlight(0.9)}; padding: 0 4px">kept</span> '
              '<span style="color: #6b6b6b">evicted</span> '
              '<span style="outline: 2px solid #C0392B; padding: 0 3px">current</span> '
              '<span style="color: #707070; font-style: italic">not yet</span>'
              + (f' <span style="{EVIDENCE_STYLE}">evidence</span> ({int(marked[: step + 1].sum())} of '
                 f'{int(marked.sum())} arrived, {int((marked & (share > 0))[: step + 1].sum())} kept)'
                 if marked.any() else "")
              + '</div>')
    return (f'<div class="kvl-text">{TOKEN_CSS}{legend}<div class="kvl-box" style="{BOX_STYLE}">{"".join(parts)}'
            '</div></div>')


def continuations_html(rows: Sequence[Mapping], colors: Mapping[str, str] | None = None) -> str:
    """Generated continuations side by side, each marked where it first leaves Full's.

    ``rows``: one mapping per policy with ``policy`` (name), ``tokens`` (continuation token texts)
    and ``diverge`` (index of the first token that differs from Full's continuation, or None when
    it never does; ``backend.analysis.metrics.first_divergence`` computes it from the traces). Tokens before ``diverge`` are
    plain, the token at ``diverge`` has class ``kvl-diverge`` (red outline), later ones are tinted.
    """
    names = [str(r["policy"]) for r in rows]
    colors = dict(colors) if colors else policy_colors(names)
    cards = []
    for row, name in zip(rows, names):
        tokens = list(row["tokens"])
        div = row.get("diverge")
        spans = []
        for i, text in enumerate(tokens):
            if div is None or i < div:
                spans.append(f'<span class="kvl-tok" data-pos="{i}">{_esc(text)}</span>')
            elif i == div:
                spans.append(f'<span class="kvl-tok kvl-diverge" data-pos="{i}" title="first token unlike Full" '
                             f'style="outline: 2px solid #C0392B; outline-offset: 1px; '
                             f'background: rgba(192,57,43,0.15); border-radius: 3px">{_esc(text)}</span>')
            else:
                spans.append(f'<span class="kvl-tok kvl-after" data-pos="{i}" '
                             f'style="background: rgba(192,57,43,0.07)">{_esc(text)}</span>')
        if div is None:
            note = "same as Full"
        elif div >= len(tokens):
            note = f"stops after {len(tokens)} tokens"
        else:
            note = f"leaves Full at token {div}"
        color = colors.get(name, "#444444")
        header = (f'<div style="font-family: sans-serif; font-size: 13px; margin-bottom: 4px">'
                  f'<span style="display: inline-block; width: 10px; height: 10px; border-radius: 2px; '
                  f'background: {color}; margin-right: 6px"></span>'
                  f'<strong style="color: {color}">{_esc(name)}</strong> '
                  f'<span style="color: #666">· {_esc(note)}</span></div>')
        body = f'<div class="kvl-box" style="{BOX_STYLE}">{"".join(spans)}</div>'
        cards.append(f'<div class="kvl-cont" data-policy="{_esc(name)}" data-diverge="{"" if div is None else div}" '
                     f'style="min-width: 0">{header}{body}</div>')
    return ('<div class="kvl-continuations" style="display: grid; '
            'grid-template-columns: repeat(auto-fit, minmax(240px, 1fr)); gap: 10px">' + "".join(cards) + "</div>")
