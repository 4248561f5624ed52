"""Pictures of why a leaderboard answer was right or wrong, from the store alone: for each picked row, the verdict,
the kept tokens at the answer's first step (the evidence underlined, every layer and KV head) and the masks of all
layers with the evidence's columns banded, as one PNG (Debian's chromium through Playwright).

    python -m benchmarks.evidence_shots --leaderboard out/smol-niah-2/leaderboard.csv \\
        --pick tova:ratio=0.75@2@agnostic --pick kvzip:ratio=0.875@2@agnostic --out docs/evidence

Each ``--pick`` is ``SPEC@SAMPLE@SETTING``; writes ``<out>-<policy>-<ratio>.png`` and prints each verdict.
"""
from __future__ import annotations

import argparse
import html
import json
import tempfile
from pathlib import Path

import pandas as pd

from backend import api
from backend.analysis.evidence import answer_step
from backend.experiments.evidence_rows import explain
from backend.traces.store import TraceStore
from viz import panels


def page(row: pd.Series, store: TraceStore, tokenizer) -> tuple[str, str, str]:
    """(verdict, kept-tokens HTML, masks figure HTML) of one leaderboard row."""
    run = api.reopen(str(row.run_id), store)
    references = json.loads(row.references)
    run.request.evidence, run.request.evidence_end = references, int(row.context_tokens)  # links made before
    trace = run.traces[0]
    _, rows = explain(tokenizer, [(row.spec, trace, float(row.score))], run.full, references, int(row.context_tokens))
    step = answer_step(trace)
    kept = panels.kept_tokens(run, step, "all", "all", window=96, far=64)
    masks = panels.heatmaps(run, "all", "all", step=step)
    masks.update_layout(height=420, width=1100)
    return rows[1]["verdict"], kept, masks.to_html(full_html=False, include_plotlyjs=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--leaderboard", required=True)
    parser.add_argument("--pick", action="append", required=True, help="SPEC@SAMPLE@SETTING")
    parser.add_argument("--out", default="docs/evidence")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    df = pd.read_csv(args.leaderboard, keep_default_na=False, na_values=[""])
    store = TraceStore()
    tokenizer = api.get_model(str(df["model"].iloc[0])).tokenizer
    with sync_playwright() as p, tempfile.TemporaryDirectory() as tmp:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium")
        for pick in args.pick:
            spec, sample, setting = pick.split("@")
            row = df[(df["spec"] == spec) & (df["sample"] == int(sample)) & (df["setting"] == setting)].iloc[0]
            verdict, kept, masks = page(row, store, tokenizer)
            print(f"{pick}: {verdict}")
            body = (f"<html><body style='width:1120px;font-family:sans-serif'><p style='font-size:15px'><b>"
                    f"{html.escape(spec)}</b>, sample {sample}, query-{setting}: {html.escape(verdict)}</p>{kept}"
                    f"{masks}</body></html>")
            path = Path(tmp) / "page.html"
            path.write_text(body)
            shot = browser.new_page(viewport={"width": 1140, "height": 900})
            shot.goto(path.as_uri())
            shot.wait_for_selector(".js-plotly-plot", timeout=30_000)
            name, _, params = spec.partition(":")
            target = Path(f"{args.out}-{name}-{params.split('=')[-1]}.png")
            shot.screenshot(path=str(target), full_page=True)
            shot.close()
            print(f"wrote {target}")
        browser.close()


if __name__ == "__main__":
    main()
