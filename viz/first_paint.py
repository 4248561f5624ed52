"""The landing's first paint: a still copy of the first screen inside the page's HTML.

Gradio draws nothing until its client has built every component of the page from its config, one long task of
0.3-1 s on two cores, after its script has loaded; until then a visitor looks at a blank page. This copy, sent in
the HTML itself, shows the shipped run's answers at once: the header, the page's tabs, the prompt and Run on the
left, the summary (each answer beside Full's, and what its query read) on the right, laid out as Gradio lays them
out, so that the page replaces it in place.

Gradio's components arrive one by one as their scripts load, each pushing the ones below it down. The page stays
hidden (``visibility``: laid out, not drawn) until the first screen's components are all there; then the copy
leaves the document and the page shows in the same frame. So the visitor sees one picture, then the page, and
nothing jumps. Twenty seconds at most (a slow phone builds the page for several): past that the page shows as it
is.

The copy is a picture of the page, not the page: it takes no clicks (they reach the page beneath), is inert
(nothing in it takes focus, screen readers skip it), and repeats none of the page's ids. It names no font the page
loads later, so nothing in it moves when one arrives."""
from __future__ import annotations

import html
import json
import re
from collections.abc import Sequence

ELEMENT_ID = "kvl-first-paint"
READY_CLASS = "kvl-ready"  # on <html> once the page shows
# The first screen's components, by the last part of each to arrive.
FIRST_SCREEN = ("#summary .kvl-story-box", "#policy-set input", "#policies button", "#run", "#layer input",
                "#step input", "#play-options button", "#examples button")
REVEAL_AFTER_MS = 20_000

# Gradio's layout, measured in Chromium at 390-1920 px: its container's widths by breakpoint and 32 px sides, the
# run page's two columns (scale 1 and 3, at least 300 and 320 px, 16 px apart), and on a phone the answers above
# the controls (assets/style.css).
STYLE = f"""
#{ELEMENT_ID} {{ position: fixed; inset: 0; z-index: 50; overflow: hidden; pointer-events: none; background: #fff;
  color: #27272a; font-family: ui-sans-serif, system-ui, sans-serif; font-size: 14px; }}
@media (prefers-color-scheme: dark) {{ #{ELEMENT_ID} {{ background: #0b0f19; color: #f3f4f6; }} }}
html:not(.{READY_CLASS}) gradio-app {{ visibility: hidden; }}
#{ELEMENT_ID} .kvl-fp-page {{ box-sizing: border-box; margin: 0 auto; padding: 16px 32px; }}
@media (min-width: 640px) {{ #{ELEMENT_ID} .kvl-fp-page {{ max-width: 640px; }} }}
@media (min-width: 768px) {{ #{ELEMENT_ID} .kvl-fp-page {{ max-width: 768px; }} }}
@media (min-width: 1024px) {{ #{ELEMENT_ID} .kvl-fp-page {{ max-width: 1024px; }} }}
@media (min-width: 1280px) {{ #{ELEMENT_ID} .kvl-fp-page {{ max-width: 1280px; }} }}
@media (min-width: 1536px) {{ #{ELEMENT_ID} .kvl-fp-page {{ max-width: none; }} }}
#{ELEMENT_ID} .kvl-fp-header {{ padding: 12px; }}
#{ELEMENT_ID} h1 {{ font-size: 20px; font-weight: 700; margin: 0 0 2px 0; }}
#{ELEMENT_ID} h1 span {{ font-size: 15px; font-weight: 400; }}
#{ELEMENT_ID} .kvl-fp-link {{ margin-right: 6px; white-space: nowrap; color: #2563eb; text-decoration: underline; }}
#{ELEMENT_ID} .kvl-fp-tabs {{ display: flex; margin: 4px 0 20px; border-bottom: 1px solid #e5e7eb; overflow: hidden; }}
#{ELEMENT_ID} .kvl-fp-tabs span {{ padding: 6px 16px 9px; color: #4b5563; white-space: nowrap; }}
#{ELEMENT_ID} .kvl-fp-tabs span:first-child {{ color: #c2410c; border-bottom: 2px solid #f97316; }}
#{ELEMENT_ID} .kvl-fp-columns {{ display: flex; gap: 16px; align-items: flex-start; }}
#{ELEMENT_ID} .kvl-fp-controls {{ flex: 1 1 0; min-width: 300px; }}
#{ELEMENT_ID} .kvl-fp-answers {{ flex: 3 1 0; min-width: 320px; padding: 14px 12px; box-sizing: border-box;
  font-size: 13px; }}
#{ELEMENT_ID} .kvl-fp-answers table {{ border: 1px solid #e5e7eb; }}
#{ELEMENT_ID} .kvl-fp-answers th, #{ELEMENT_ID} .kvl-fp-answers td {{ border: 1px solid #e5e7eb; }}
#{ELEMENT_ID} .kvl-fp-box {{ box-sizing: border-box; border: 1px solid #e5e7eb; border-radius: 8px; padding: 12px;
  margin-bottom: 16px; overflow: hidden; }}
#{ELEMENT_ID} .kvl-fp-box b {{ display: block; font-weight: 400; color: #6b7280; margin: 6px 0 8px; }}
#{ELEMENT_ID} .kvl-fp-prompt {{ height: 316px; }}
#{ELEMENT_ID} .kvl-fp-prompt p {{ margin: 0 0 28px; height: 176px; overflow: hidden; line-height: 1.4;
  border: 1px solid #e5e7eb; border-radius: 6px; padding: 8px 10px; }}
#{ELEMENT_ID} .kvl-fp-fold {{ height: 40px; line-height: 40px; padding: 0 12px; }}
#{ELEMENT_ID} .kvl-fp-run {{ height: 40px; line-height: 40px; border-radius: 8px; text-align: center;
  background: #a63d00; color: #fff; font-weight: 600; font-size: 16px; margin-bottom: 16px; }}
#{ELEMENT_ID} .kvl-fp-controls > p {{ margin: 0 0 16px; line-height: 1.6; font-size: 13px; }}
@media (max-width: 700px) {{
  #{ELEMENT_ID} .kvl-fp-columns {{ flex-direction: column-reverse; }}
  #{ELEMENT_ID} .kvl-fp-controls, #{ELEMENT_ID} .kvl-fp-answers {{ min-width: 0; width: 100%; }}
}}
"""

# Shows the page (and removes the copy) once every part of FIRST_SCREEN is in it, or after REVEAL_AFTER_MS;
# <html data-shown> says which.
SCRIPT = f"""<script>(() => {{
  const parts = {json.dumps(FIRST_SCREEN)}, root = document.documentElement;
  const show = how => {{
    watch.disconnect();
    if (root.classList.contains({json.dumps(READY_CLASS)})) return;
    root.dataset.shown = how;
    root.classList.add({json.dumps(READY_CLASS)});
    document.getElementById({json.dumps(ELEMENT_ID)}).remove();
  }};
  const watch = new MutationObserver(() => parts.every(part => document.querySelector(part)) && show("parts"));
  watch.observe(root, {{childList: true, subtree: true}});
  setTimeout(() => show("timeout"), {REVEAL_AFTER_MS});
}})();</script>"""


def first_paint_html(header: str, pages: Sequence[str], prompt: str, policy_set: str, fold: str, summary: str,
                     lines: Sequence[str], stylesheet: str = "") -> str:
    """The copy, a ``<div>`` to go first in the page's body.

    ``header`` and ``summary`` are the page's own HTML (trusted: the app made them); ``pages`` (the page's tab
    labels), ``prompt``, ``policy_set``, ``fold`` (the policies' fold's label) and ``lines`` (the cost and status
    under Run) are text, escaped here.
    ``stylesheet`` is the app's CSS, which the summary's classes need before Gradio adds it to the page."""
    tabs = "".join(f"<span>{html.escape(label)}</span>" for label in pages)
    under_run = "".join(f"<p>{html.escape(line)}</p>" for line in lines)
    return (f'<div id="{ELEMENT_ID}" aria-hidden="true" inert><style>{stylesheet}{STYLE}</style>{SCRIPT}'
            f'<div class="kvl-fp-page"><div class="kvl-fp-header">{_as_text(_without_ids(header))}</div>'
            f'<div class="kvl-fp-tabs">{tabs}</div>'
            f'<div class="kvl-fp-columns"><div class="kvl-fp-controls">'
            f'<div class="kvl-fp-box kvl-fp-prompt"><b>Prompt</b><p>{html.escape(prompt)}</p>'
            f'<b>Policies: a named set, or pick below</b>{html.escape(policy_set)}</div>'
            f'<div class="kvl-fp-box kvl-fp-fold">{html.escape(fold)}</div>'
            f'<div class="kvl-fp-run">Run</div>{under_run}</div>'
            f'<div class="kvl-fp-answers">{_without_ids(summary)}</div></div></div></div>')


def _as_text(markup: str) -> str:
    """Links drawn as links that go nowhere: the copy holds nothing to click."""
    return re.sub(r"<a\b[^>]*>", '<span class="kvl-fp-link">', markup).replace("</a>", "</span>")


def _without_ids(markup: str) -> str:
    """The page's HTML without its ids: the copy must not answer for the page's elements."""
    return re.sub(r'\sid="[^"]*"', "", markup)
