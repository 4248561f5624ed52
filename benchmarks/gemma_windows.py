"""What a policy does on Gemma 3's sliding-window layers: the masks of Full and two policies in a local layer
(window 512) and a global layer of Gemma 3 270M, on 1,536 tokens of the inaugural addresses.

    python -m benchmarks.gemma_windows [--tokens 1536] [--budget 256] [--out docs/gemma-windows]

Writes ``<out>.html`` (the figure) and, where Debian's chromium is installed, ``<out>.png`` (its screenshot), and
prints what each query reads per layer (the mean count at the last step).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
import plotly.io as pio
from plotly.subplots import make_subplots

from backend.analysis import reads
from backend.engine.models import GEMMA_MODEL, shared_model
from backend.engine.runner import compute_traces
from backend.policies import parse_spec
from backend.texts import corpus_files, corpus_text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--out", default="docs/gemma-windows")
    args = parser.parse_args()
    lm = shared_model(GEMMA_MODEL)
    text = "\n\n".join(corpus_text("inaugural", name) for name in corpus_files("inaugural")[-6:])
    ids = lm.tokenizer(text).input_ids[: args.tokens]
    specs = [f"tova:budget={args.budget}", f"sinks:budget={args.budget}"]
    traces, full = compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, record_layers=())
    local, glob = 0, lm.features.windows.index(None)
    shown = [full, *traces]
    figure = make_subplots(rows=2, cols=len(shown), shared_xaxes=True, shared_yaxes=True,
                           subplot_titles=[f"{t.spec}, layer {layer} ({'window ' + str(t.window(layer)) if t.window(layer) else 'global'})"
                                           for layer in (local, glob) for t in shown],
                           horizontal_spacing=0.03, vertical_spacing=0.08)
    size = reads.bin_size(len(ids), 192)
    for row, layer in enumerate((local, glob), start=1):
        for col, trace in enumerate(shown, start=1):
            share = reads.binned_reads(trace, [layer], [0], size)
            figure.add_heatmap(z=share, colorscale="Blues", zmin=0, zmax=1, showscale=col == len(shown) and row == 1,
                               x0=0, dx=size, y0=0, dy=size, row=row, col=col)
            window = trace.window(layer)
            if window:  # the model's own edge: left of it this layer reads nothing, whatever the policy keeps
                figure.add_shape(type="line", x0=0, y0=window, x1=len(ids) - 1 - window, y1=len(ids) - 1,
                                 line=dict(color="#555555", width=1.5, dash="dash"), row=row, col=col)
            count = trace.reads_at(layer, len(ids) - 1).sum()
            print(f"{trace.spec:18s} layer {layer:2d}: the last query reads {count} of {len(ids)} tokens")
    figure.update_yaxes(autorange="reversed", title_text="step")
    figure.update_xaxes(title_text="position")
    note = ("dashed: the model's own window edge (a local layer reads nothing left of it); "
            "white below it in the global layer: the policy's evictions")
    figure.update_layout(title=f"Gemma 3 270M, {len(ids)} tokens: what each query reads (blue) in a sliding-window "
                               f"layer and a global layer<br><sup>{note}</sup>",
                         width=1200, height=760, margin=dict(t=100))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    pio.write_html(figure, out.with_suffix(".html"), include_plotlyjs=True)
    browser = shutil.which("chromium")
    if browser:
        from playwright.sync_api import sync_playwright

        with sync_playwright() as p:
            page = p.chromium.launch(executable_path=browser, args=["--no-sandbox", "--disable-gpu"]).new_page(
                viewport={"width": 1200, "height": 760})
            page.set_content(pio.to_html(figure, include_plotlyjs=True, full_html=True))
            page.wait_for_timeout(1500)
            page.screenshot(path=str(out.with_suffix(".png")))
    print(f"wrote {out.with_suffix('.html')}" + (f" and {out.with_suffix('.png')}" if browser else ""))


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
