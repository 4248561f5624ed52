"""viz/: every figure and HTML view checked against real traces of the tiny model."""
from __future__ import annotations

import re
from html.parser import HTMLParser
from types import SimpleNamespace

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

from backend.analysis import metrics
from backend.policies import parse_spec
from backend.engine.runner import compute_traces
from tests.conftest import make_tiny
from viz import (continuations_html, divergence_figure, first_token_retention_figure,
                 heatmap_values, kept_tokens_html, lifetime_by_position_figure, mask_heatmap, mask_heatmaps,
                 non_recent_share_figure, policy_colors, pos_table, pos_table_html, score_curves_figure,
                 score_over_steps_figure, summary_table)
from viz import panels
from viz.colors import FAMILY_COLORS, family
from viz.continuation import continuation_cell
from viz.heatmap import DEFAULT_DECADES, MAX_CELLS, NOT_READ_GAP

SPECS = ["tova:budget=8", "a2sf:budget=8,alpha=0.3", "oracle:budget=8"]
BUDGET = 8
NASTY = ["<script>alert('x')</script>", " a & b", "\n", '"q"', "&amp;", "<b>", " end\n\n", "%{y}"]


@pytest.fixture(scope="module")
def lm():
    return make_tiny()


@pytest.fixture(scope="module")
def prompt_run(lm):
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    traces, full = compute_traces(lm, SPECS, [parse_spec(s) for s in SPECS], ids, mode="prompt", record_layers=(0, 1))
    return {t.spec: t for t in traces}, full


@pytest.fixture(scope="module")
def generate_run(lm):
    ids = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    traces, full = compute_traces(lm, SPECS, [parse_spec(s) for s in SPECS], ids, mode="generate", max_new_tokens=12,
                       record_layers=(0, 1))
    return traces, full


def texts(trace):
    return trace.meta["token_texts"]


# ---------------------------------------------------------------- heatmaps


def test_mask_heatmap_z_is_the_read_mask_of_the_chosen_layer_and_head(prompt_run):
    traces, _ = prompt_run
    tr = traces["tova:budget=8"]
    reads = tr.reads(1)[1]
    n = len(tr.tokens)
    lower = np.tril(np.ones((n, n), bool))
    assert reads[lower].any() and not reads[lower].all()  # both kept and evicted cells exist
    fig = mask_heatmap(reads, texts(tr), "TOVA layer 1 head 1")
    assert len(fig.data) == 1 and isinstance(fig.data[0], go.Heatmap)
    z = np.asarray(fig.data[0].z)
    assert z.shape == (n, n)
    np.testing.assert_array_equal(z[lower], reads[lower].astype(np.float32))
    assert np.isnan(z[~lower]).all()
    # a different layer's mask is different, so the comparison above discriminates
    assert not np.array_equal(z[lower], tr.reads(0)[1][lower].astype(np.float32))
    labels = list(fig.data[0].x)
    assert len(labels) == n and labels[5] == f"5 {texts(tr)[5]}".replace("<", "&lt;").replace(">", "&gt;")
    assert list(fig.data[0].y) == labels
    for part in ("%{x}", "%{y}", "%{z"):
        assert part in fig.data[0].hovertemplate
    assert fig.layout.yaxis.autorange == "reversed"
    assert fig.layout.template.layout.paper_bgcolor in ("white", "#fff", "#ffffff", "rgb(255,255,255)")


def test_mask_heatmap_with_attention_shows_log_weights_of_read_cells(prompt_run):
    traces, _ = prompt_run
    tr = traces["a2sf:budget=8,alpha=0.3"]
    assert tr.meta["recorded_layers"] == [0, 1]
    reads = tr.reads(0)[0]
    att = tr.attention.rows(0, 0)
    assert (att[~reads] == 0).all()  # the format: zero where not read
    zmax = 0.9
    fig = mask_heatmap(reads, texts(tr), "A2SF", attention=att, zmax=zmax)
    z = np.asarray(fig.data[0].z)
    top = np.log10(zmax)
    floor = top - DEFAULT_DECADES
    with np.errstate(divide="ignore"):
        expected = np.clip(np.log10(att), floor, top)
    np.testing.assert_allclose(z[reads], expected[reads], rtol=1e-5, atol=1e-5)
    n = len(tr.tokens)
    evicted = np.tril(np.ones((n, n), bool)) & ~reads
    assert evicted.any()
    np.testing.assert_allclose(z[evicted], floor - NOT_READ_GAP, atol=1e-6)
    assert np.isnan(z[np.triu(np.ones((n, n), bool), 1)]).all()
    assert fig.data[0].coloraxis == "coloraxis2"
    assert fig.layout.coloraxis2.cmax == pytest.approx(top)
    assert fig.layout.coloraxis2.cmin == pytest.approx(floor - NOT_READ_GAP)
    assert "not read" in fig.layout.coloraxis2.colorbar.ticktext


def test_mask_heatmap_accepts_share_of_layers_and_heads(prompt_run):
    traces, _ = prompt_run
    tr = traces["tova:budget=8"]
    all_reads = np.stack([tr.reads(layer) for layer in range(tr.meta["n_layers"])])
    share = all_reads.mean(axis=(0, 1))
    n = len(tr.tokens)
    lower = np.tril(np.ones((n, n), bool))
    assert ((share[lower] > 0) & (share[lower] < 1)).any()  # layers really disagree somewhere
    fig = mask_heatmap(share, texts(tr), "TOVA, all layers")
    z = np.asarray(fig.data[0].z)
    np.testing.assert_allclose(z[lower], share[lower], rtol=1e-6)
    assert "%" in fig.data[0].hovertemplate
    with pytest.raises(ValueError):
        mask_heatmap(all_reads[0], texts(tr))  # [H, T, T] is not one layer/head


def test_mask_heatmaps_one_panel_per_policy_with_a_shared_scale(prompt_run):
    traces, full = prompt_run
    panels = {}
    for name, tr in [("full", full)] + list(traces.items()):
        panels[name] = dict(reads=tr.reads(1)[0], token_texts=texts(tr), attention=tr.attention.rows(1, 0))
    fig = mask_heatmaps(panels, "layer 1, head 0")
    assert len(fig.data) == len(panels)
    zmax = max(float(np.max(np.where(p["reads"], p["attention"].astype(np.float32), 0))) for p in panels.values())
    assert fig.layout.coloraxis2.cmax == pytest.approx(np.log10(zmax))
    for trace, (name, panel) in zip(fig.data, panels.items()):
        assert trace.coloraxis == "coloraxis2"
        expected = heatmap_values(panel["reads"], panel["attention"], zmax=zmax)
        np.testing.assert_array_equal(np.asarray(trace.z), expected)
    # the panels differ (eviction policies read less than Full)
    assert not np.array_equal(np.asarray(fig.data[0].z), np.asarray(fig.data[1].z))
    colors = policy_colors(list(panels))
    titles = {a.text: a.font.color for a in fig.layout.annotations if a.text in panels}
    assert titles == {name: colors[name] for name in panels}
    assert len(fig.layout.shapes) == 0
    # mask-only panels share the kept/evicted scale instead
    masks = mask_heatmaps({k: dict(reads=v["reads"], token_texts=v["token_texts"]) for k, v in panels.items()})
    assert {t.coloraxis for t in masks.data} == {"coloraxis"}
    assert masks.layout.coloraxis.cmin == 0 and masks.layout.coloraxis.cmax == 1


def test_heatmap_labels_and_titles_are_escaped():
    n = len(NASTY)
    reads = np.tril(np.ones((n, n), bool))
    fig = mask_heatmaps({"<b>bad</b> & co": dict(reads=reads, token_texts=NASTY)}, title="<i>t</i>")
    labels = list(fig.data[0].x)
    assert labels[0] == "0 &lt;script&gt;alert('x')&lt;/scr…"  # long texts are cut before escaping
    assert labels[1] == "1 ␣a␣&amp;␣b" and labels[2] == "2 ↵"
    assert not any("<" in lab for lab in labels)
    assert "<" not in fig.layout.title.text
    assert all("<b>" not in (a.text or "") for a in fig.layout.annotations)


def test_panels_refuse_a_long_text_that_was_not_binned():
    """A panel carries at most MAX_CELLS cells per axis: a [T, T] of a long text must be binned first."""
    n = MAX_CELLS + 1
    with pytest.raises(ValueError, match="bin or window"):
        mask_heatmap(np.tri(n, dtype=bool), [" w"] * n)


def test_binned_cells_show_shares_labels_and_the_diagonal_by_hand():
    """T = 5 in cells of 2 (backend.analysis.reads bins them; tests/test_reads.py works the numbers by hand): a cell
    wholly above the diagonal is blank, labels name each cell's positions and tokens."""
    shares = np.array([[1, 0, 0], [.5, 1, 0], [0, 1, 1]], np.float32)
    fig = mask_heatmap(shares, list("abcde"), "m", size=2)
    nan = np.nan
    np.testing.assert_allclose(np.asarray(fig.data[0].z), [[1, nan, nan], [.5, 1, nan], [0, 1, 1]])
    assert fig.data[0].x == ("0–1 ab", "2–3 cd", "4 e") and fig.data[0].y == fig.data[0].x
    assert "share read" in fig.data[0].hovertemplate and "2 tokens per cell" in fig.layout.title.text
    mass = np.array([[1, 0, 0], [.25, .75, 0], [0, .5, .5]])
    weights = mask_heatmap(shares, list("abcde"), "w", attention=mass, size=2)
    np.testing.assert_allclose(np.asarray(weights.data[0].z)[2, 1:], np.log10([.5, .5]), atol=1e-6)


def test_a_zoom_window_is_labelled_by_its_own_steps_and_positions():
    """Steps 3..5 x positions 2..5 of a 6-token text: j > t is blank, labels and ticks start where the window does."""
    reads = np.tri(6, dtype=bool)[3:6, 2:6]
    fig = mask_heatmap(reads, list("abcdef"), "zoom", first_step=3, first_pos=2)
    z = np.asarray(fig.data[0].z)
    assert np.isnan(z[0, 2:]).all() and np.isnan(z[1, 3]) and not np.isnan(z[2]).any()
    assert fig.data[0].y == ("3 d", "4 e", "5 f") and fig.data[0].x == ("2 c", "3 d", "4 e", "5 f")
    assert fig.layout.xaxis.ticktext[0] == "2" and fig.layout.yaxis.ticktext[0] == "3"


def rgb_at(colorscale, cmin: float, cmax: float, z: float) -> np.ndarray:
    """The colour plotly.js draws for ``z``: linear interpolation between the scale's stops, as RGB."""
    import plotly.colors as pcolors

    def rgb(color):
        return np.array(pcolors.hex_to_rgb(color) if color.startswith("#") else pcolors.unlabel_rgb(color), float)

    at = (min(max(z, cmin), cmax) - cmin) / (cmax - cmin)
    stops = [(float(p), rgb(c)) for p, c in colorscale]
    for (p0, c0), (p1, c1) in zip(stops, stops[1:]):
        if p0 <= at <= p1:
            return c0 if p1 == p0 else c0 + (c1 - c0) * (at - p0) / (p1 - p0)
    raise ValueError(f"{z} is off the scale")


def long_run(n=4096, kept=(100, 700, 1500, 2222, 3000), window=64):
    """Full, sinks (token 0 + the last 63) and an eviction policy keeping the last 64 tokens everywhere and,
    in one of 2 x 3 layers/heads only (layer 1, head 2), the tokens ``kept`` for ever."""
    from types import SimpleNamespace

    from tests.test_metrics import make_trace

    j = np.arange(n)
    shape = dict(n_layers=2, n_kv_heads=3)
    recent = np.broadcast_to(np.where(j + window < n, j + window, -1), (2, 3, n)).copy()
    recent[1, 2, list(kept)] = -1
    sinks = np.broadcast_to(np.where((j > 0) & (j + window - 1 < n), j + window - 1, -1), (2, 3, n))
    traces = [make_trace(n, policy="full", **shape), make_trace(n, evicted_at=sinks, policy="sinks", **shape),
              make_trace(n, evicted_at=recent, policy="tova", **shape)]
    return SimpleNamespace(run_id="long", traces=traces, full=traces[0])


def test_binned_masks_show_a_few_kept_old_tokens_apart_from_empty_cells():
    """4096 tokens in cells of 16 over 2 layers x 3 heads: one head keeping token 700 reads 16 of a cell's 256 x 6
    pairs (1%), which a linear scale shows as good as empty; on the log scale its colour is far from nothing's."""
    from viz import panels, share_scale

    run, size, window = long_run(), 16, 64
    fig = panels.heatmaps(run, "all", "all")
    cells = {t.name: np.asarray(t.z) for t in fig.data if isinstance(t, go.Heatmap)}
    assert set(cells) == {"full", "sinks", "tova"} and all(z.shape == (256, 256) for z in cells.values())
    axis = fig.layout.coloraxis3
    nothing = rgb_at(axis.colorscale, axis.cmin, axis.cmax, 0.0)
    np.testing.assert_array_equal(nothing, pcolors_rgb("#F2C9C2"))
    rows = np.arange(256)[:, None]
    cols = np.arange(256)[None, :]
    outside = (cols + 1) * size - 1 + window <= rows * size  # every token of the cell left before its first query
    kept_cols = np.zeros(256, bool)
    kept_cols[[p // size for p in (100, 700, 1500, 2222, 3000)]] = True
    tova = cells["tova"]
    old_kept = outside & kept_cols[None, :]
    assert old_kept.sum() > 500
    np.testing.assert_allclose(tova[old_kept], 16 / (256 * 6), rtol=1e-6)  # one token x 16 queries in 1 of 6 heads
    np.testing.assert_array_equal(tova[outside & ~kept_cols[None, :]], 0.0)  # nothing read: exactly 0
    assert (share_scale.position(tova[old_kept]) > 0.3).all()
    far = [np.linalg.norm(rgb_at(axis.colorscale, axis.cmin, axis.cmax, z) - nothing) for z in tova[old_kept][:50]]
    assert min(far) > 150  # RGB distance: a different hue and lightness, not a shade of rose
    # (On a linear rose -> blue scale the same cell sits 1% of the way from rose.)
    sinks = cells["sinks"]
    np.testing.assert_array_equal(sinks[outside & (cols > 0)], 0.0)
    assert (sinks[outside[:, 0], 0] > 0).all()  # token 0 stays: column 0 is read all the way down
    np.testing.assert_allclose(sinks[16:, 0], 16 / 256, rtol=1e-6)  # one token of 16, read by 16 queries
    full = cells["full"]
    causal = cols <= rows
    np.testing.assert_array_equal(full[causal], 1.0)  # the darkest colour everywhere below the diagonal
    assert np.isnan(full[~causal]).all()
    heat = next(t for t in fig.data if isinstance(t, go.Heatmap))
    assert heat.coloraxis == "coloraxis3" and "share read: %{z:.2~p}" in heat.hovertemplate
    bar = [t for t in fig.data if not isinstance(t, go.Heatmap)]
    assert len(bar) == 1 and fig.layout.coloraxis4.colorbar.ticktext[0] == "nothing"
    assert not fig.layout.coloraxis3.showscale and "16 tokens per cell" in fig.layout.title.text


def test_one_token_per_cell_shares_and_the_step_row_take_the_log_share_scale():
    """Zoomed to one token per cell over all layers and heads, a token one head of six keeps is 1/6 of a cell;
    in the step row (Play's strip) an old token kept by one head is 1/48 of a cell (8 tokens, 6 heads): both far
    from rose."""
    from viz import panels, share_scale

    run = long_run()
    zoom = panels.heatmaps(run, "all", "all", zoom=(3900, 640, 128))
    heat = next(t for t in zoom.data if isinstance(t, go.Heatmap) and t.name == "tova")
    assert heat.coloraxis == "coloraxis3" and "%{z:.2~p} of layers/heads" in heat.hovertemplate
    z = np.asarray(heat.z)
    assert z[0, 700 - 640] == pytest.approx(1 / 6)  # token 700, step 3900
    one = panels.heatmaps(run, "1", "2", zoom=(3900, 640, 128))  # one layer and head: kept or not, in two colours
    assert next(t for t in one.data if isinstance(t, go.Heatmap)).coloraxis == "coloraxis"
    row = panels.step_row(run, 4000, "all", "all")
    strip = next(t for t in row.data if isinstance(t, go.Heatmap))
    assert strip.coloraxis == "coloraxis" and list(row.layout.coloraxis.colorscale) == [
        tuple(stop) for stop in share_scale.colorscale()]
    cells = np.asarray(strip.z)[list(strip.y).index("tova")]
    kept_cell = cells[700 // row_size(row)]
    assert row_size(row) == 8 and kept_cell == pytest.approx(1 / 48)
    axis = row.layout.coloraxis
    nothing = rgb_at(axis.colorscale, axis.cmin, axis.cmax, 0.0)
    assert np.linalg.norm(rgb_at(axis.colorscale, axis.cmin, axis.cmax, kept_cell) - nothing) > 150


def row_size(fig) -> int:
    return int(next(t for t in fig.data if isinstance(t, go.Heatmap)).dx)


def test_the_masks_draw_the_models_own_window_where_a_layer_has_one():
    """Gemma's local layers read only the latest `window` keys: a dashed edge at token = step - window, in the
    chosen windowed layer or over all layers (saying how many), and none on a global layer."""
    from viz import panels

    run = long_run()
    for trace in run.traces:
        trace.meta["layer_windows"] = [512, None]
    everything = panels.heatmaps(run, "all", "all")
    assert "the model's own window, 512 keys in 1 of 2 layers" in everything.layout.title.text
    edges = [s for s in everything.layout.shapes if s.line.dash == "dash"]
    assert len(edges) == 3  # one per panel
    edge = edges[0]  # cells of 16 tokens: step 512 -> token 0 down to step 4095 -> token 3583
    assert (edge.x0, edge.y0) == pytest.approx(((0 + .5) / 16 - .5, (512 + .5) / 16 - .5))
    assert (edge.x1, edge.y1) == pytest.approx(((3583 + .5) / 16 - .5, (4095 + .5) / 16 - .5))
    zoomed = panels.heatmaps(run, "0", "all", zoom=(600, 0, 256))  # steps 600-855 x tokens 0-255, a cell each
    edges = [s for s in zoomed.layout.shapes if s.line.dash == "dash"]
    assert len(edges) == 3 and (edges[0].x0, edges[0].y0, edges[0].x1, edges[0].y1) == (88, 0, 255, 167)
    assert not [s for s in panels.heatmaps(run, "0", "all", zoom=(1000, 0, 256)).layout.shapes  # all beyond it
                if s.line.dash == "dash"]
    assert "512 keys" in zoomed.layout.title.text and "layers" not in zoomed.layout.title.text.split("·")[-1]
    assert not [s for s in panels.heatmaps(run, "1", "all").layout.shapes if s.line.dash == "dash"]


def pcolors_rgb(hex_color: str) -> np.ndarray:
    import plotly.colors as pcolors

    return np.array(pcolors.hex_to_rgb(hex_color), float)


# ---------------------------------------------------------------- text highlight


class Spans(HTMLParser):
    """Collects the kvl-tok spans: position, classes, attributes, unescaped text."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.spans, self._open, self.scripts = [], None, 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script":
            self.scripts += 1
        if tag == "span" and "kvl-tok" in (attrs.get("class") or "").split():
            self._open = dict(attrs, classes=set(attrs["class"].split()), text="")
            self.spans.append(self._open)

    def handle_endtag(self, tag):
        if tag == "span":
            self._open = None

    def handle_data(self, data):
        if self._open is not None:
            self._open["text"] += data


def parse(html_text):
    parser = Spans()
    parser.feed(html_text)
    return parser


def positions(spans, cls):
    return {int(s["data-pos"]) for s in spans if cls in s["classes"]}


def test_kept_tokens_html_marks_exactly_the_tokens_cached_at_the_step(prompt_run):
    traces, _ = prompt_run
    tr = traces["tova:budget=8"]
    step = 30
    kept = tr.reads(0)[0, step]
    html_text = kept_tokens_html(texts(tr), kept, step)
    spans = parse(html_text).spans
    assert [int(s["data-pos"]) for s in spans] == list(range(len(tr.tokens)))
    assert "".join(s["text"] for s in spans) == "".join(texts(tr))
    assert positions(spans, "kvl-kept") == set(np.flatnonzero(kept).tolist())
    assert len(positions(spans, "kvl-kept")) == BUDGET
    assert positions(spans, "kvl-current") == {step}
    assert positions(spans, "kvl-future") == set(range(step + 1, len(tr.tokens)))
    assert positions(spans, "kvl-evicted") == set(range(step + 1)) - set(np.flatnonzero(kept).tolist())
    # The states' looks are the view's classes, set once in its own <style> (a kept token's shade is its own).
    assert ".kvl-future{color:#707070" in html_text and ".kvl-current{outline:2px solid" in html_text
    assert all("background" in s["style"] for s in spans if "kvl-kept" in s["classes"])
    # another step gives another highlight
    other = parse(kept_tokens_html(texts(tr), tr.reads(0)[0, 20], 20)).spans
    assert positions(other, "kvl-kept") != positions(spans, "kvl-kept")


def test_kept_tokens_html_escapes_every_token_and_keeps_newlines():
    n = len(NASTY)
    kept = np.array([True, False, True, True, False, True, True, False])
    html_text = kept_tokens_html(NASTY, kept, step=5, weights=np.linspace(0.1, 0.8, n), title="<t> & co")
    parsed = parse(html_text)
    assert parsed.scripts == 0 and "<script>" not in html_text and "<b>" not in html_text
    assert "&lt;script&gt;" in html_text and " a &amp; b" in html_text and "&amp;amp;" in html_text
    assert [s["text"] for s in parsed.spans] == NASTY  # round trip: escaped, not altered
    assert "\n" in parsed.spans[2]["text"] and "pre-wrap" in html_text
    assert "weight 0.4" in parsed.spans[3]["title"]
    assert "&lt;t&gt; &amp; co" in html_text
    assert positions(parsed.spans, "kvl-kept") == {0, 2, 3, 5}


def test_kept_tokens_html_shades_by_share_across_layers(prompt_run):
    traces, _ = prompt_run
    tr = traces["tova:budget=8"]
    step = 35
    share = np.stack([tr.reads(layer)[:, step] for layer in range(tr.meta["n_layers"])]).mean(axis=(0, 1))
    assert len(set(np.round(share[share > 0], 3))) > 1
    spans = parse(kept_tokens_html(texts(tr), share, step)).spans
    assert positions(spans, "kvl-kept") == set(np.flatnonzero(share > 0).tolist())
    alpha = {}
    for s in spans:
        if "kvl-kept" in s["classes"]:
            alpha[int(s["data-pos"])] = float(re.search(r"rgba\([^)]*,([0-9.]+)\)", s["style"]).group(1))
            assert float(s["data-kept"]) == pytest.approx(share[int(s["data-pos"])], abs=1e-3)
    for a in alpha:  # a higher share always gives a stronger highlight
        for b in alpha:
            if share[a] > share[b] + 1e-9:
                assert alpha[a] > alpha[b]
    with pytest.raises(ValueError):
        kept_tokens_html(texts(tr), share * 3, step)


def test_continuations_html_marks_first_divergence_from_full(generate_run, lm):
    traces, full = generate_run
    ref = full.generated_ids.tolist()
    rows = [dict(policy="full", tokens=[lm.tokenizer.decode([i]) for i in ref], diverge=None)]
    expected = {}
    for tr in traces:
        div = metrics.first_divergence(tr, full)
        expected[tr.spec] = div
        rows.append(dict(policy=tr.spec, tokens=texts(tr)[tr.meta["n_prompt"]:], diverge=div))
    assert any(d is not None for d in expected.values())
    html_text = continuations_html(rows)
    cards = re.findall(r'<div class="kvl-cont" data-policy="([^"]*)" data-diverge="([^"]*)"', html_text)
    assert [c[0] for c in cards] == ["full"] + [tr.spec for tr in traces]
    chunks = html_text.split('<div class="kvl-cont"')[1:]
    for (name, _), chunk in zip(cards, chunks):
        spans = parse(chunk).spans
        div = expected.get(name)
        assert positions(spans, "kvl-diverge") == (set() if div is None else {div})
        assert positions(spans, "kvl-after") == (set() if div is None else set(range(div + 1, len(spans))))


def test_continuations_html_escapes_names_and_tokens():
    html_text = continuations_html([dict(policy="<img src=x onerror=alert(1)>", tokens=NASTY, diverge=1)])
    assert "<img" not in html_text and "<script>" not in html_text
    assert "&lt;img src=x onerror=alert(1)&gt;" in html_text
    assert [s["text"] for s in parse(html_text).spans] == NASTY


# ---------------------------------------------------------------- score curves


def accumulate(attention: np.ndarray, alpha: float) -> np.ndarray:
    """Row t = sum_q<=t alpha^(t-q) attention[q] (A2SF Eq. 5; alpha = 1 is A2S)."""
    out = np.zeros_like(attention, dtype=np.float64)
    acc = np.zeros(attention.shape[1])
    for t, row in enumerate(attention.astype(np.float64)):
        acc = alpha * acc + row
        out[t] = acc
    return out


def top_budget(scores: np.ndarray, budget: int) -> np.ndarray:
    """keep[t, j]: j among the ``budget`` highest scores of row t over j <= t."""
    n = len(scores)
    keep = np.zeros((n, n), bool)
    for t in range(n):
        cand = scores[t, :t + 1]
        keep[t, np.argsort(-cand, kind="stable")[:budget]] = True
    return keep


@pytest.fixture(scope="module")
def scores(prompt_run):
    _, full = prompt_run
    att = full.attention.rows(0, 0).astype(np.float64)
    a2s, a2sf = accumulate(att, 1.0), accumulate(att, 0.3)
    return a2s, a2sf, top_budget(a2s, BUDGET), top_budget(a2sf, BUDGET), texts(full)


def bars(fig, row_axis, name):
    (trace,) = [t for t in fig.data if t.name == name and t.yaxis == row_axis]
    return np.asarray(trace.x, int), np.asarray(trace.y, float), trace


def test_score_curves_mark_the_top_budget_tokens(scores):
    a2s, a2sf, keep_a2s, keep_a2sf, token_texts = scores
    step = 33
    assert not np.array_equal(keep_a2s[step], keep_a2sf[step])  # forgetting changes the choice here
    at = slice(0, step + 1)
    fig = score_curves_figure(a2s[step, at], a2sf[step, at], token_texts, step, keep_a2s[step, at],
                              keep_a2sf[step, at], alpha=0.3)
    for axis, score, keep in (("y", a2s, keep_a2s), ("y2", a2sf, keep_a2sf)):
        kx, ky, kept_trace = bars(fig, axis, "kept")
        ex, ey, _ = bars(fig, axis, "evicted")
        np.testing.assert_array_equal(kx, np.flatnonzero(keep[step, :step + 1]))
        np.testing.assert_allclose(ky, score[step, kx])
        assert len(kx) == BUDGET and len(kx) + len(ex) == step + 1
        assert ky.min() >= ey.max()  # the kept bars are the highest
        assert list(kept_trace.customdata) == [token_texts[j].replace("<", "&lt;").replace(">", "&gt;") for j in kx]
    assert "0.3" in fig.layout.annotations[1].text
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"  # token 0's spike flattens the rest
    assert bars(fig, "y", "kept")[2].marker.color == FAMILY_COLORS["h2o"]
    assert bars(fig, "y2", "kept")[2].marker.color == FAMILY_COLORS["a2sf"]


def test_score_curves_of_a_long_text_are_a_line_and_kept_markers_on_log_axes():
    """1000 tokens: A2S piles 500 onto token 0 and ~1 on the rest, A2SF forgets down to 1e-30; a bar each
    would be thinner than a pixel and a linear axis one spike."""
    from viz.curves import BAR_LIMIT

    n = 1000
    assert n > BAR_LIMIT
    a2s = np.r_[500.0, np.linspace(2, 0.5, n - 1)]
    a2s[700] = 0.0  # never read: no place on a log axis
    a2sf = np.logspace(-30, 0, n)
    keep_a2s, keep_a2sf = np.zeros(n, bool), np.zeros(n, bool)
    keep_a2s[:8], keep_a2sf[[100, 500, 998, 999]] = True, True
    fig = score_curves_figure(a2s, a2sf, [f" t{i}" for i in range(n)], n - 1, keep_a2s, keep_a2sf, alpha=0.3)
    assert not any(isinstance(t, go.Bar) for t in fig.data)
    for axis, score, keep in (("y", a2s, keep_a2s), ("y2", a2sf, keep_a2sf)):
        (line,) = [t for t in fig.data if t.name == "all tokens" and t.yaxis == axis]
        (kept,) = [t for t in fig.data if t.name == "kept" and t.yaxis == axis]
        assert (line.x0, line.dx, line.mode) == (0, 1, "lines")
        np.testing.assert_allclose(np.asarray(line.y, float), np.where(score > 0, score, np.nan), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(kept.x), np.flatnonzero(keep))
        np.testing.assert_allclose(np.asarray(kept.y, float), score[keep], rtol=1e-6)
        assert kept.customdata[0] == f"␣t{np.flatnonzero(keep)[0]}" and kept.mode == "markers"  # the token text
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    # A2S: from a decade below its lowest kept score (token 7's) to above token 0's 500
    low, high = fig.layout.yaxis.range
    assert low == pytest.approx(np.log10(a2s[7] / 10)) and high > np.log10(500)
    # A2SF: down to a decade below token 100's 1e-27: the tokens forgotten further run off the foot
    assert fig.layout.yaxis2.range[0] == pytest.approx(np.log10(a2sf[100] / 10))


def test_score_over_steps_follows_each_token(scores):
    a2s, a2sf, keep_a2s, keep_a2sf, token_texts = scores
    show = [0, 3, 10]
    fig = score_over_steps_figure(a2s[:, show].T, a2sf[:, show].T, show, token_texts, alpha=0.3)
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == 2 * len(show)
    for i, j in enumerate(show):
        top, bottom = lines[2 * i], lines[2 * i + 1]
        assert (top.x0, top.dx, len(top.y)) == (j, 1, len(a2s) - j)  # steps j..T-1
        np.testing.assert_allclose(top.y, a2s[j:, j], rtol=1e-6)
        np.testing.assert_allclose(bottom.y, a2sf[j:, j], rtol=1e-6)
        assert top.line.color == bottom.line.color and top.yaxis == "y" and bottom.yaxis == "y2"
    # with keep masks the line stops where the token is gone, and an x marks that step
    j = next(j for j in range(BUDGET, 30) if not keep_a2sf[j:, j].all())
    fig = score_over_steps_figure(a2s[:, [j]].T, a2sf[:, [j]].T, [j], token_texts, alpha=0.3, keep_a2s=keep_a2s[:, [j]].T,
                                  keep_a2sf=keep_a2sf[:, [j]].T)
    gone = j + int(np.argmin(keep_a2sf[j:, j]))
    (line,) = [t for t in fig.data if t.mode == "lines" and t.yaxis == "y2"]
    y = np.asarray(line.y, float)
    assert np.isnan(y[gone - j:]).all() and np.isfinite(y[:gone - j]).all()
    (marker,) = [t for t in fig.data if t.mode == "markers" and t.yaxis == "y2"]
    assert list(marker.x) == [gone]


def test_score_over_steps_is_on_log_axes_so_a_sink_leaves_the_others_readable():
    """A sink scoring 1000 next to a token scoring 0.5: on log axes both lines span decades of their own."""
    steps = 40
    sink, other = np.linspace(1, 1000, steps), np.full(steps, 0.5)
    forgotten = 0.3 ** np.arange(steps)  # A2SF's forgetting, 10^-20 at the end
    fig = score_over_steps_figure(np.stack([sink, other]), np.stack([sink, forgotten]), [0, 0], ["a"], alpha=0.3)
    assert fig.layout.yaxis.type == fig.layout.yaxis2.type == "log"
    low, high = fig.layout.yaxis.range
    assert low <= np.log10(0.5) and high >= 3  # the 0.5 line sits inside the axis, not on its floor
    low2, _ = fig.layout.yaxis2.range
    assert low2 == pytest.approx(np.log10(1000) - 6)  # six decades below the top, no further


# ---------------------------------------------------------------- divergence and summary


def test_divergence_figure_plots_kl_and_running_top1(prompt_run):
    traces, full = prompt_run
    series = {spec: dict(kl=tr.kl_to_full, top1=tr.top1_ids == full.top1_ids) for spec, tr in traces.items()}
    fig = divergence_figure(series)
    colors = policy_colors(list(series))
    assert len(fig.data) == 2 * len(series)
    for i, (spec, tr) in enumerate(traces.items()):
        kl, agree = fig.data[2 * i], fig.data[2 * i + 1]
        np.testing.assert_allclose(kl.y, tr.kl_to_full, rtol=1e-6)
        matches = tr.top1_ids == full.top1_ids
        np.testing.assert_allclose(agree.y, np.cumsum(matches) / np.arange(1, len(matches) + 1))
        assert agree.y[-1] == pytest.approx(metrics.top1_agreement(tr, full))
        assert kl.line.color == agree.line.color == colors[spec]
        assert kl.yaxis == "y" and agree.yaxis == "y2"
        assert (kl.x0, kl.dx, kl.x) == (0, 1, None)  # steps 0..n-1 need no array of x
    assert fig.layout.yaxis.title.text and fig.layout.xaxis2.title.text
    stepped = divergence_figure({"tova": dict(kl=[.1, .2], top1=[1, 0], steps=[5, 6])})
    assert list(stepped.data[0].x) == [5, 6] and list(stepped.data[1].x) == [5, 6]


def test_policy_colors_are_stable_across_figures_and_subsets():
    everything = ["full", "tova:budget=64", "tova:budget=32", "a2sf:budget=64", "mystery"]
    colors = policy_colors(everything)
    assert len(set(colors.values())) == len(everything)
    assert colors["full"] == FAMILY_COLORS["full"] and colors["tova:budget=64"] == FAMILY_COLORS["tova"]
    assert policy_colors(["a2sf:budget=64", "tova:budget=64"]) == {k: colors[k] for k in ("a2sf:budget=64",
                                                                                          "tova:budget=64")}
    assert family("A2SF (alpha=0.3)") == "a2sf" and family("Ideal") == "oracle"
    series = {k: dict(kl=[0.1, 0.2], top1=[1, 0]) for k in everything}
    div = divergence_figure(series, colors=colors)
    ret = first_token_retention_figure({k: 0.5 for k in everything}, colors=colors)
    life = lifetime_by_position_figure({k: np.arange(5.0) for k in everything}, colors=colors)
    assert [t.line.color for t in div.data[::2]] == [colors[k] for k in everything]
    assert [t.marker.color for t in ret.data] == [colors[k] for k in everything]
    assert [t.marker.color for t in life.data] == [colors[k] for k in everything]


def test_summary_table_formats_every_column(prompt_run):
    traces, full = prompt_run
    rows = [dict(policy=spec, **metrics.summary_row(tr, full)) for spec, tr in traces.items()]
    rows[0]["oracle_similarity"] = 0.8125
    df = summary_table(rows)
    assert list(df.columns) == ["Policy", "Perplexity", "Mean KL to Full (nats)", "Top-1 agreement",
                                "Similarity to oracle"]
    assert list(df["Policy"]) == list(traces)
    first = rows[0]
    assert df.loc[0, "Perplexity"] == f"{first['ppl']:.2f}"
    assert df.loc[0, "Mean KL to Full (nats)"] == f"{first['kl_to_full']:.4f}"
    assert df.loc[0, "Top-1 agreement"] == f"{100 * first['top1_agreement']:.1f}%"
    assert df.loc[0, "Similarity to oracle"] == "81.2%" and df.loc[1, "Similarity to oracle"] == "—"
    raw = summary_table(rows, formatted=False)
    assert raw["Perplexity"].dtype == float and np.isnan(raw.loc[1, "Similarity to oracle"])
    assert raw.loc[2, "Top-1 agreement"] == pytest.approx(rows[2]["top1_agreement"])


def test_a_continuation_cell_shows_line_breaks_and_tabs_and_cuts_long_text():
    assert continuation_cell([" The", " end.\r\n", "\tNext", "\x00", "\n"]) == " The end.⏎⇥Next⏎"
    assert continuation_cell(["abcdef"], max_chars=6) == "abcdef"
    cut = continuation_cell(["abc", "defg"], max_chars=6)
    assert cut == "abcde…" and len(cut) == 6


def test_the_summary_shows_each_continuation_in_generate_mode_and_none_in_prompt_mode(lm, prompt_run):
    ids = torch.randint(0, 101, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    specs = ["tova:budget=8", "full", "sinks:budget=8"]
    traces, full = compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, mode="generate", max_new_tokens=6,
                                  record_layers=())
    traces = [t.with_spec(spec) for t, spec in zip(traces, specs)]
    traces[2].meta["token_texts"][-2:] = ["\n", "<b>" * 80]  # a line break, then more than a cell holds
    summary = panels.summary_table(SimpleNamespace(traces=traces, full=full))
    assert summary.columns[-1] == "Continuation" and list(summary["Policy"]) == specs
    n = full.meta["n_prompt"]
    assert summary.loc[1, "Continuation"] == "".join(full.meta["token_texts"][n:])  # Full's row: Full's answer
    assert summary.loc[0, "Continuation"] == "".join(traces[0].meta["token_texts"][n:])
    sinks = summary.loc[2, "Continuation"]
    assert "⏎<b><b>" in sinks and sinks.endswith("…") and len(sinks) == 160
    prompt_traces, prompt_full = prompt_run
    in_prompt_mode = panels.summary_table(SimpleNamespace(traces=list(prompt_traces.values()), full=prompt_full))
    assert "Continuation" not in in_prompt_mode.columns


# ---------------------------------------------------------------- retention


def test_retention_figures_show_the_given_numbers(prompt_run):
    traces, _ = prompt_run
    evicting = {k: tr for k, tr in traces.items() if tr.evicted_at is not None}
    n_layers = next(iter(evicting.values())).meta["n_layers"]
    # first token: share of steps it is read, per layer (lines) and overall (bars)
    per_layer = {k: np.array([tr.reads(layer)[:, :, 0].mean() for layer in range(n_layers)])
                 for k, tr in evicting.items()}
    fig = first_token_retention_figure(per_layer)
    for trace, (k, v) in zip(fig.data, per_layer.items()):
        assert isinstance(trace, go.Scatter) and trace.name == k
        np.testing.assert_allclose(trace.y, v)
    overall = {k: float(v.mean()) for k, v in per_layer.items()}
    bars_fig = first_token_retention_figure(overall)
    assert [t.y[0] for t in bars_fig.data] == pytest.approx(list(overall.values()))
    assert all(isinstance(t, go.Bar) for t in bars_fig.data)
    # lifetime by position: steps each position stays read, mean over layers and heads
    lifetimes = {k: np.stack([tr.reads(layer) for layer in range(n_layers)]).sum(axis=2).mean(axis=(0, 1))
                 for k, tr in evicting.items()}
    fig = lifetime_by_position_figure(lifetimes, max_pos=25)
    for trace, (k, v) in zip(fig.data, lifetimes.items()):
        np.testing.assert_array_equal(trace.x, np.arange(25))
        np.testing.assert_allclose(trace.y, v[:25])
    assert fig.layout.barmode == "group"
    assert not np.allclose(fig.data[0].y, fig.data[1].y)
    # non-recent share per step: cached tokens older than the last 4
    window = 4
    shares = {}
    for k, tr in evicting.items():
        r = tr.reads(0)[0]
        t = np.arange(len(r))[:, None]
        old = r & (np.arange(len(r))[None, :] <= t - window)
        shares[k] = old.sum(1) / r.sum(1)
    fig = non_recent_share_figure(shares, window=window)
    for trace, v in zip(fig.data, shares.values()):
        np.testing.assert_allclose(trace.y, v)
    assert "4" in fig.layout.title.text


def test_pos_table_sorts_formats_and_escapes():
    df = pd.DataFrame({"pos": ["NOUN", "<PUNCT>", "VERB"], "tova": [3.25, 9.5, np.nan], "window": [1.0, 2.0, 3.0]})
    table = pos_table(df)
    assert list(table["pos"]) == ["<PUNCT>", "NOUN", "VERB"]
    assert list(table["tova"]) == ["9.5", "3.2", "—"]
    html_text = pos_table_html(df)
    assert "&lt;PUNCT&gt;" in html_text and "<PUNCT>" not in html_text


def test_figures_have_titles_axis_labels_and_the_light_template(prompt_run, scores):
    traces, full = prompt_run
    a2s, a2sf, keep_a2s, keep_a2sf, token_texts = scores
    tr = traces["tova:budget=8"]
    figs = [
        mask_heatmap(tr.reads(0)[0], texts(tr), "m"),
        score_curves_figure(a2s[20, :21], a2sf[20, :21], token_texts, 20, keep_a2s[20, :21], keep_a2sf[20, :21], 0.3),
        score_over_steps_figure(a2s[:, [1, 2]].T, a2sf[:, [1, 2]].T, [1, 2], token_texts, alpha=0.3),
        divergence_figure({"tova": dict(kl=tr.kl_to_full, top1=tr.top1_ids == full.top1_ids)}),
        first_token_retention_figure({"tova": 0.9}),
        lifetime_by_position_figure({"tova": np.ones(30)}),
        non_recent_share_figure({"tova": np.ones(30) / 2}),
    ]
    for fig in figs:
        assert fig.layout.title.text
        assert fig.layout.xaxis.title.text or fig.layout.xaxis2.title.text
        assert fig.layout.yaxis.title.text
        assert fig.layout.template.layout.plot_bgcolor in ("white", "#fff", "#ffffff", "rgb(255,255,255)")
        assert all(t.hovertemplate for t in fig.data)


def test_side_by_side_panels_get_fewer_x_ticks():
    """Three panels share the width: at most 6 position ticks each on x (labels would collide), more on y."""
    n = 252
    reads = np.tri(n, dtype=bool)
    fig = mask_heatmaps({p: dict(reads=reads, token_texts=[" w"] * n) for p in SPECS})
    assert len(fig.layout.xaxis.ticktext) <= 6 and len(fig.layout.xaxis3.ticktext) <= 6
    assert len(fig.layout.yaxis.ticktext) > 10
    assert fig.layout.xaxis.ticktext[:2] == ("0", "50")
