"""backend/analysis/reach.py and viz/reach.py: what one step reads per layer and head, and reads by distance,
by hand on tiny traces and against dense masks."""
import numpy as np
import plotly.graph_objects as go
import pytest

from backend.analysis import reach
from tests.test_metrics import make_trace
from tests.test_reads import EVICTED, dense, random_traces

# EVICTED reads {0} {0,1} {1,2} {1,2,3} {2,3,4}: the pairs (t, j) by distance t - j:
# d = 0: all 5 read; d = 1: (1,0) (2,1) (3,2) (4,3), all 4 read; d = 2: (3,1) (4,2) read, (2,0) not;
# d = 3: (3,0) (4,1) not; d = 4: (4,0) not.


def windowed(trace, windows):
    trace.meta["layer_windows"] = list(windows)
    return trace


def test_reads_by_distance_by_hand():
    trace = make_trace(5, evicted_at=EVICTED)
    assert reach.read_by_distance(trace).tolist() == [5, 4, 2, 0, 0]
    edges, share = reach.share_by_distance(trace, per_decade=100)
    assert edges.tolist() == [1, 2, 3, 4, 5]  # one distance per bin, distance 0 left out
    np.testing.assert_allclose(share, [1, 2 / 3, 0, 0])
    # Full reads everything; with a window of 2 only distances 0 and 1 (the model's own limit)
    assert reach.read_by_distance(make_trace(5)).tolist() == [5, 4, 3, 2, 1]
    assert reach.read_by_distance(windowed(make_trace(5), [2])).tolist() == [5, 4, 0, 0, 0]


def test_distance_bins_pool_their_pairs():
    """Coarse bins of the hand trace: distances 1 | 2 | 3-4 hold 4 | 3 | 2 + 1 pairs, of which 4 | 2 | 0 were
    read; one bin for 1-4 holds 10 pairs, 6 read."""
    trace = make_trace(5, evicted_at=EVICTED)
    edges, share = reach.share_by_distance(trace, per_decade=3)
    assert edges.tolist() == [1, 2, 3, 5]
    np.testing.assert_allclose(share, [1, 2 / 3, 0])
    edges, share = reach.share_by_distance(trace, per_decade=1)
    assert edges.tolist() == [1, 5]
    np.testing.assert_allclose(share, [.6])
    assert reach.distance_edges(1000, per_decade=3).tolist() == [1, 2, 5, 10, 22, 46, 100, 215, 464, 1000]


def test_reads_by_distance_equal_the_dense_count_on_every_kind_of_trace():
    n = 37
    t, j = np.tril_indices(n)
    for trace in random_traces(n):
        masks = dense(trace)  # [L, H, T, T]
        expected = np.bincount(t - j, weights=masks[:, :, t, j].sum(axis=(0, 1)), minlength=n)
        np.testing.assert_array_equal(reach.read_by_distance(trace), expected)


def test_reach_at_a_step_bins_what_the_query_read_by_hand():
    trace = make_trace(5, evicted_at=EVICTED)
    # step 4 reads {2, 3, 4}; two columns of 3 positions: {0, 1, 2} -> 1/3, {3, 4} (only 2) -> 2/2
    at = reach.reach_at(trace, 4, max_columns=2)
    assert at.size == 3 and at.labels == ["L0 H0"] and at.windows == [None]
    np.testing.assert_allclose(at.shares, [[1 / 3, 1]], rtol=1e-6)
    assert not at.beyond_window.any()
    # step 3 reads {1, 2, 3}: positions 0..3 in columns of 2 -> 1/2, 2/2
    np.testing.assert_allclose(reach.reach_at(trace, 3, max_columns=2).shares, [[.5, 1]])


def test_reach_rows_are_every_layer_and_head_and_mark_the_model_window():
    """Two layers x two heads, layer 0 with a window of 2: at step 4 it reads {3, 4}, and positions 0-2 lie
    beyond the model's window; layer 1 (global) reads all five."""
    trace = windowed(make_trace(5, n_layers=2, n_kv_heads=2), [2, None])
    at = reach.reach_at(trace, 4)
    assert at.size == 1 and at.labels == ["L0 H0", "L0 H1", "L1 H0", "L1 H1"] and at.windows == [2, 2, None, None]
    np.testing.assert_array_equal(at.shares, [[0, 0, 0, 1, 1]] * 2 + [[1] * 5] * 2)
    np.testing.assert_array_equal(at.beyond_window, [[1, 1, 1, 0, 0]] * 2 + [[0] * 5] * 2)
    # in columns of 2 ({0,1} {2,3} {4}) only the first column is wholly beyond the window
    coarse = reach.reach_at(trace, 4, max_columns=3)
    np.testing.assert_array_equal(coarse.beyond_window[0], [1, 0, 0])
    np.testing.assert_allclose(coarse.shares[0], [0, .5, 1])


def test_reach_at_equals_the_dense_row_of_every_kind_of_trace():
    n, step = 37, 30
    for trace in random_traces(n):
        masks = dense(trace)[:, :, step, :step + 1]  # [L, H, step + 1]
        at = reach.reach_at(trace, step, max_columns=8)  # 31 positions in 8 columns of 4 (the last of 3)
        assert at.size == 4 and at.shares.shape == (4, 8)
        padded = np.zeros((2, 2, 32))
        padded[..., :31] = masks
        expected = padded.reshape(4, 8, 4).sum(-1) / np.array([4] * 7 + [3])
        np.testing.assert_allclose(at.shares, expected, rtol=1e-6)


def small_run(n=600, window=None):
    """Full, sinks (token 0 + the last 31) and a policy keeping the last 32 tokens and, in layer 1 head 1 only,
    tokens 10 and 50 for ever; 2 layers x 2 KV heads, layer 0 with the model's ``window`` when given."""
    from types import SimpleNamespace

    j = np.arange(n)
    shape = dict(n_layers=2, n_kv_heads=2)
    recent = np.broadcast_to(np.where(j + 32 < n, j + 32, -1), (2, 2, n)).copy()
    recent[1, 1, [10, 50]] = -1
    sinks = np.broadcast_to(np.where((j > 0) & (j + 31 < n), j + 31, -1), (2, 2, n))
    traces = [make_trace(n, policy="full", **shape), make_trace(n, evicted_at=sinks, policy="sinks", **shape),
              make_trace(n, evicted_at=recent, policy="<b>tova</b>", **shape)]
    if window:
        for trace in traces:
            windowed(trace, [window, None])
    return SimpleNamespace(run_id="small", traces=traces, full=traces[0])


def test_cache_reach_shows_every_layer_and_head_and_greys_what_lies_beyond_the_window():
    from viz import panels, share_scale

    run = small_run(window=100)
    picture, _ = panels.cache_reach(run, 10_000)  # past the end: the last step
    cells = [t for t in picture.data if isinstance(t, go.Heatmap)]
    assert [t.name for t in cells] == ["full", "sinks", "&lt;b&gt;tova&lt;/b&gt;"]  # names escaped
    assert list(cells[0].y) == ["L0 H0", "L0 H1", "L1 H0", "L1 H1"] and len(cells[0].x) == 300  # 600 in 2s
    assert cells[0].x[0].startswith("0–1 ") and cells[0].x[-1].startswith("598–599 ")
    full, sinks, tova = (np.asarray(t.z, float) for t in cells)
    # Layer 0 sees positions 500..599 from step 599: columns 0..249 lie wholly beyond its window (NaN: grey).
    beyond = np.zeros((4, 300), bool)
    beyond[:2, :250] = True
    for z in (full, sinks, tova):
        np.testing.assert_array_equal(np.isnan(z), beyond)
    np.testing.assert_array_equal(full[~beyond], 1.0)
    np.testing.assert_array_equal(sinks[2:, 0], 0.5)  # token 0 of the column {0, 1}
    np.testing.assert_array_equal(sinks[2:, 1:284], 0.0)  # then nothing until the last 31 tokens (569..599)
    assert (sinks[:, 285:] == 1).all()
    np.testing.assert_array_equal(tova[3, [5, 25]], 0.5)  # tokens 10 and 50, kept in layer 1 head 1 only
    np.testing.assert_array_equal(tova[2, :284], 0.0)
    assert share_scale.HOVER in cells[0].hovertemplate and "query 599" in cells[0].hovertemplate
    assert picture.layout.coloraxis.colorscale[0][1] == share_scale.NOTHING_COLOR
    bar = picture.layout.coloraxis2.colorbar
    assert bar.ticktext[:2] == ("beyond window", "nothing") and bar.ticktext[-1] == "100%"
    assert picture.layout.plot_bgcolor == "#A8A8A8"  # what the NaN cells show
    assert "2 tokens per column" in picture.layout.title.text
    # Without a window nothing is grey and the bar has no band for it.
    plain, _ = panels.cache_reach(small_run(), 300)
    assert not any(np.isnan(np.asarray(t.z, float)).any() for t in plain.data if isinstance(t, go.Heatmap))
    assert plain.layout.coloraxis2.colorbar.ticktext[0] == "nothing"
    assert len(next(t for t in plain.data if isinstance(t, go.Heatmap)).x) == 301  # positions 0..300, one each


def test_distance_lines_read_full_as_one_sinks_near_zero_and_a_kept_tail():
    from viz import panels

    run = small_run()
    _, lines = panels.cache_reach(run, 0)
    by_name = {t.name: t for t in lines.data}
    assert list(by_name) == ["full", "sinks", "&lt;b&gt;tova&lt;/b&gt;"]
    for name, trace in zip(by_name, run.traces):
        edges, share = reach.share_by_distance(trace)
        np.testing.assert_array_equal(trace_x := np.asarray(by_name[name].x), edges[:-1])
        np.testing.assert_array_equal(np.asarray(by_name[name].customdata), edges[1:] - 1)
        np.testing.assert_allclose(np.asarray(by_name[name].y, float), np.where(share > 0, share, np.nan), rtol=1e-6)
        assert trace_x[0] == 1
    full, sinks, tova = (np.asarray(by_name[k].y, float) for k in by_name)
    x, x_last = np.asarray(by_name["full"].x), np.asarray(by_name["full"].customdata)
    np.testing.assert_allclose(full, 1.0)

    def pooled(read_per_distance, first, last):  # read pairs over the 4 heads' pairs (600 - d each) of a bin
        d = np.arange(first, last + 1)
        return read_per_distance(d).sum() / (4 * (600 - d)).sum()

    # sinks reads distances 0..30 (its window); past them only token 0, once per head: 4 pairs at each distance
    assert (sinks[x_last <= 30] == 1).all()
    for a, b, y in zip(x[x >= 31], x_last[x >= 31], sinks[x >= 31]):
        assert y == pytest.approx(pooled(lambda d: 4 + 0 * d, a, b))
    # the policy reads 0..31 and past them tokens 10 and 50 in one head of four, while queries reach them
    assert (tova[x_last <= 31] == 1).all()
    for a, b, y in zip(x[x >= 32], x_last[x >= 32], tova[x >= 32]):
        assert y == pytest.approx(pooled(lambda d: (d < 590) * 1 + (d < 550), a, b))
    assert 0 < tova[x >= 32].max() < 0.01 and sinks[x >= 31].max() < 0.04
    assert lines.layout.xaxis.type == "log" and lines.layout.yaxis.type == "log"
    assert lines.layout.yaxis.ticktext[-1] == "100%"
