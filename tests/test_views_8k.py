"""Every view at 8192 tokens (30 layers x 3 KV heads, 5 eviction traces + an oracle, synthetic: no model)
stays light: at most 5 MB of plotly JSON or HTML, no [T, T] array in a figure, and no view's memory peak
near one (a [T, T] of bool is 64 MiB, of float32 256 MiB). Not timed: benchmarks/views_8k.py times them."""
from __future__ import annotations

import re
import tracemalloc

import numpy as np
import plotly.graph_objects as go
import pytest

from backend.analysis import reads
from benchmarks.views_8k import payload_bytes, synthetic_run, views
from viz import panels
from viz.heatmap import DEFAULT_DECADES, NOT_READ_GAP
from viz.highlight import MAX_OUTSIDE, WINDOW

N = 8192
MAX_BYTES = 5_000_000
MiB = 2 ** 20
# Most views peak at a few MiB (masks of all layers: ~25). Those that go through every head's reads or
# follow scores over all steps peak at ~35-65 MiB (the oracle's spans of 90 heads, 128-step score blocks).
HEAVY_VIEWS = ("summary", "retention", "A2S")
# One worker takes the module, so the 8k run below is made once (a module fixture is made on each worker it reaches).
pytestmark = pytest.mark.xdist_group("views_8k")


@pytest.fixture(scope="module")
def run():
    from backend.analysis import pos
    try:  # loading NLTK's tagger (~60 MiB) is a serving process's one-time start, not the view's work
        pos.load_tagger()
    except pos.TaggerUnavailable:
        pass
    return synthetic_run(N)


@pytest.fixture(autouse=True)
def quick_tsne(monkeypatch):
    """The embedding itself (seconds of scikit-learn) is not what these tests measure."""
    import backend.analysis.tsne
    monkeypatch.setattr(backend.analysis.tsne, "embed_keys", lambda before, after, **kw: (before[:, :2], after[:, :2]))


@pytest.mark.parametrize("name", [name for name in views(N) if not name.startswith("export")])
def test_each_view_at_8k_stays_under_5_mb_and_far_from_a_t_by_t_array(run, name):
    tracemalloc.start()
    try:
        result = views(N)[name](run)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert payload_bytes(result) < MAX_BYTES
    assert peak < (96 if any(word in name for word in HEAVY_VIEWS) else 32) * MiB
    for figure in result if isinstance(result, tuple) else (result,):
        if isinstance(figure, go.Figure):
            for trace in figure.data:
                for field in ("x", "y", "z"):
                    values = getattr(trace, field, None)
                    # 256 x 256 cells or a row of the text at most; a [T, T] would be 67 M values
                    assert values is None or np.asarray(values).size <= max(reads.MAX_BINS ** 2, 2 * N)


def test_masks_at_8k_are_binned_to_256_cells_and_zoom_is_one_token_per_cell(run):
    binned = panels.heatmaps(run, "all", "all")
    cells = [t for t in binned.data if isinstance(t, go.Heatmap)]  # the other trace draws the colour bar
    assert len(cells) == 6 and len(binned.data) == 7
    assert all(np.asarray(t.z).shape == (reads.MAX_BINS, reads.MAX_BINS) for t in cells)
    assert "32 tokens per cell" in binned.layout.title.text
    zoom = panels.heatmaps(run, "15", "1", zoom=(4000, 3900, 256))  # layer 15 is recorded: weights shown
    floor = zoom.layout.coloraxis2.cmax - DEFAULT_DECADES
    causal = np.arange(3900, 4156)[None, :] <= np.arange(4000, 4256)[:, None]
    for trace, policy in zip(zoom.data, run.traces):
        z = np.asarray(trace.z)
        assert z.shape == (256, 256) and trace.y[0].startswith("4000 ") and trace.x[0].startswith("3900 ")
        mask = policy.reads(15, slice(4000, 4256), slice(3900, 4156))[1]
        assert (z[mask] >= floor - 1e-6).all()  # read: a log weight (the floor when outside the top k)
        np.testing.assert_allclose(z[causal & ~mask], floor - NOT_READ_GAP, atol=1e-5)  # not read
        assert np.isnan(z[~causal]).all()
    sinks = next(t for t, p in zip(zoom.data, run.traces) if p.spec.startswith("sinks"))
    # Sinks + window at budget 256: query 4000 reads positions 3748..4000, so the window shows 101 of them.
    assert np.isfinite(np.asarray(sinks.z)[0, :101]).all() and np.isnan(np.asarray(sinks.z)[0, 101:]).all()


def test_cache_reach_at_8k_bins_every_layer_and_head_to_512_columns(run):
    picture, by_distance = panels.cache_reach(run, N - 1)
    cells = [t for t in picture.data if isinstance(t, go.Heatmap)]
    assert len(cells) == 6 and all(np.asarray(t.z).shape == (30 * 3, 512) for t in cells)
    assert cells[0].y[0] == "L0 H0" and cells[0].y[-1] == "L29 H2" and "16 tokens per column" in picture.layout.title.text
    full = next(t for t in by_distance.data if t.name == "full")
    np.testing.assert_allclose(np.asarray(full.y, float), 1.0)  # no sliding window: Full reads every distance
    assert len(full.x) < 120  # log-spaced bins, not 8191 distances


def test_kept_tokens_at_8k_show_a_window_and_the_far_kept_tokens(run):
    html_text = panels.kept_tokens(run, 6000, "3", "0")
    sinks = html_text.split('<div class="kvl-text">')[2]  # the second trace: sinks + window
    positions = [int(p) for p in re.findall(r'data-pos="(\d+)"', sinks)]
    assert len(positions) <= WINDOW + MAX_OUTSIDE
    assert positions[:4] == [0, 1, 2, 3]  # the sinks, far outside the window, still shown
    assert 6000 in positions and "kvl-gap" in sinks
    assert "&lt;b&gt;bold&lt;/b&gt;" in html_text and "<b>bold</b>" not in html_text  # user text stays escaped


def test_a_play_frame_at_8k_is_a_fraction_of_the_views_it_stands_for(run):
    """Play redraws the kept tokens, the scores at the step and the masks' row at every tick (twice a second):
    together well under the kept tokens and curves the step slider redraws, and far from the masks."""
    step = N - 200
    frame = [panels.kept_tokens(run, step, "all", "all", panels.PLAY_WINDOW, panels.PLAY_FAR),
             panels.score_snapshot(run, "15", "1", 0.3, step), panels.step_row(run, step, "all", "all")]
    full = [panels.kept_tokens(run, step, "all", "all"), *panels.score_curves(run, "15", "1", 0.3, step)]
    frame_bytes = sum(map(payload_bytes, frame))
    assert frame_bytes < 650_000 and frame_bytes < sum(map(payload_bytes, full)) / 2  # 6 policies here
    assert len(re.findall(r'data-pos="', frame[0])) <= len(run.traces) * (panels.PLAY_WINDOW + panels.PLAY_FAR)
