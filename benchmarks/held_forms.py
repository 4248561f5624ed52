"""Policies that change the form of what they hold, on the needle example: each one's answer, its divergence from
Full, the error of what it holds, and its run's cost against a plain forward.

    .venv/bin/python -m benchmarks.held_forms [--text assets/examples/needle.txt] [--new 24] [--specs A;B;...]
    .venv/bin/python -m benchmarks.held_forms --shot docs/held-forms.png   # the Held forms view, as a picture

Generate mode in the chat template, float32, one batched run of every spec below with Full. Per spec: the greedy
answer; the mean KL(Full || policy) over Full's continuation (the divergence view's number); over the tokens it
holds reformed when the prompt has been read, the mean relative error of their keys and values against the model's
own (``form_key_error``, ``form_value_error``); ThinK's mean cost to the window's logits (``form_channel_error``); and
how far the continuation's queries' attention moved reading the held forms (``form_attention_shift``, the mean total
variation over layers, heads and those queries) with their outputs' mean relative error (``form_output_error``).
The run's seconds are printed beside one plain forward of the prompt in the same process.

``--shot`` instead draws the app's Held forms view of ThinK, CaM, KIVI and FINCH on the text (at the last of 16
generated queries) and saves it as a PNG through Chromium (Playwright).
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
SPECS = ("kivi:bits=8", "kivi:bits=4", "kivi:bits=2", "kivi:bits=2,residual=32,group=32",
         "think:budget=100000,channels=0.25", "think:budget=100000,channels=0.5", "think:budget=100000,channels=0.75",
         "snapkv:budget=64", "think:budget=64,channels=0.5",
         "gear:bits=2", "gear:bits=2,rank=8", "gear:bits=2,outliers=0.02")


SHOT_SPECS = ("think:budget=96,channels=0.5", "cam:budget=96", "kivi:residual=64,group=32", "finch:budget=96")


def shot(lm, ids: list[int], path: Path) -> None:
    """The Held forms figure of SHOT_SPECS on ``ids`` at the last query generated, saved as a PNG."""
    import tempfile
    import types

    from playwright.sync_api import sync_playwright

    from backend.engine.runner import compute_traces
    from backend.policies import parse_spec
    from viz import panels

    traces, full = compute_traces(lm, list(SHOT_SPECS), [parse_spec(s) for s in SHOT_SPECS], ids, mode="generate",
                                  max_new_tokens=16, record_layers=())
    # At the last query generated: the queries after the prompt read the held forms.
    figure = panels.held_forms(types.SimpleNamespace(traces=[full, *traces]), len(full.tokens) - 2, "all")
    with tempfile.TemporaryDirectory() as folder:
        page_path = Path(folder) / "forms.html"
        figure.write_html(page_path, include_plotlyjs=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path="/usr/bin/chromium")
            page = browser.new_page(viewport={"width": 1200, "height": int(figure.layout.height or 900)})
            page.goto(page_path.as_uri())
            page.wait_for_selector(".main-svg")
            page.screenshot(path=str(path), full_page=True)
            browser.close()
    print(f"wrote {path}")


def main() -> None:
    from backend.engine.models import load_model
    from backend.engine.runner import compute_traces
    from backend.policies import parse_spec

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--text", default=str(ROOT / "assets" / "examples" / "needle.txt"))
    parser.add_argument("--new", type=int, default=24, help="tokens generated")
    parser.add_argument("--shot", type=Path, help="draw the Held forms view to this PNG instead")
    parser.add_argument("--specs", help="these specs (separated by ;) instead of the default set")
    args = parser.parse_args()
    specs = args.specs.split(";") if args.specs else list(SPECS)
    lm = load_model()
    ids = lm.encode(Path(args.text).read_text(), chat=True)
    if args.shot:
        shot(lm, ids, args.shot)
        return
    n = len(ids)
    with torch.inference_mode():
        lm.model(torch.tensor([ids]))  # warm-up
        start = time.perf_counter()
        lm.model(torch.tensor([ids]))
        plain = time.perf_counter() - start
    start = time.perf_counter()
    traces, full = compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, mode="generate",
                                  max_new_tokens=args.new, record_layers=())
    seconds = time.perf_counter() - start
    print(f"{Path(args.text).name}: {n} prompt tokens, {args.new} new; Full answers "
          f"{lm.tokenizer.decode(full.generated_ids, skip_special_tokens=True).strip()!r}")
    print(f"one batched run of {len(specs)} policies and Full: {seconds:.1f} s; one plain forward of the prompt: "
          f"{plain:.2f} s ({seconds / plain:.0f}x)\n")
    print("| spec | answer | KL to Full (nats/token) | tokens held reformed | key error | value error | logit cost "
          "| attention moved | output error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, trace in zip(specs, traces):
        start_at = trace.meta["score_start"]
        kl = float(np.mean(trace.kl_to_full[start_at:]))
        forms = trace.forms
        cells = ["-"] * 6
        if forms:
            reformed = (forms["reformed_at"] >= 0) & (forms["reformed_at"] <= n) & (trace.evicted_at == -1)
            held = (trace.evicted_at[..., :n] == -1).sum()
            cells = [f"{reformed[..., :n].sum() / max(held, 1):.0%}",
                     f"{forms['key_error'][reformed].astype(float).mean():.1%}",
                     f"{forms['value_error'][reformed].astype(float).mean():.1%}",
                     f"{forms['channel_error'].mean():.1%}" if "channel_error" in forms else "-",
                     f"{forms['attention_shift'][..., n:].astype(float).mean():.1%}",
                     f"{forms['output_error'][..., n:].astype(float).mean():.1%}"]
        answer = lm.tokenizer.decode(trace.generated_ids, skip_special_tokens=True).strip()
        print(f"| `{spec}` | {answer!r} | {kl:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
