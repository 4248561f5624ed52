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
