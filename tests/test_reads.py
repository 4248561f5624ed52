"""backend/analysis/reads.py: read intervals, per-step counts and heatmap bins, by hand and against dense masks."""
import numpy as np
import pytest

from backend.analysis import metrics, reads
from tests.test_metrics import make_trace

# Reads {0} {0,1} {1,2} {1,2,3} {2,3,4}: token 0 leaves at step 2, token 1 at step 4, the rest stay.
EVICTED = [[[2, 4, -1, -1, -1]]]
ATTENTION = np.array([[1, 0, 0, 0, 0],
                      [.5, .5, 0, 0, 0],
                      [0, .4, .6, 0, 0],
                      [0, .1, .2, .7, 0],
                      [0, 0, .2, .3, .5]])


def test_cells_show_the_share_of_their_arrived_pairs_that_were_read():
    """Cells of 2: steps 2-3 x positions 0-1 hold 4 arrived pairs, 2 read (token 1 at steps 2, 3) -> 0.5;
    steps 2-3 x positions 2-3 hold 3 arrived pairs ((2,3) has not arrived), all read -> 1."""
    trace = make_trace(5, evicted_at=EVICTED)
    np.testing.assert_allclose(reads.binned_reads(trace, [0], [0], 2), [[1, 0, 0], [.5, 1, 0], [0, 1, 1]])
    np.testing.assert_array_equal(reads.causal_pairs(5, 2), [[3, 0, 0], [4, 3, 0], [2, 2, 1]])


def test_cells_of_attention_sum_their_tokens_and_average_their_queries():
    """Steps 2-3 x positions 0-1: (0 + .4 + 0 + .1) / 2 queries = .25; step 4 x positions 2-3: .2 + .3 = .5."""
    trace = make_trace(5, evicted_at=EVICTED, attention=ATTENTION[None, None], recorded_layers=(0,))
    np.testing.assert_allclose(reads.binned_attention(trace, 0, 0, 2), [[1, 0, 0], [.25, .75, 0], [0, .5, .5]],
                               atol=1e-3)  # float16 storage


def test_per_step_counts_the_intervals_each_query_lies_in():
    pos, start, end = reads.intervals(make_trace(5, evicted_at=EVICTED), 0)
    assert end.tolist() == [2, 4, 5, 5, 5]
    assert reads.per_step(start, end, 5).tolist() == [1, 2, 2, 3, 3]


def test_overlaps_cut_pairs_of_intervals_on_the_same_token():
    a = (np.array([0, 0, 1]), np.array([0, 5, 1]), np.array([3, 9, 4]))  # token 0 read twice
    b = (np.array([1, 0]), np.array([2, 2]), np.array([8, 6]))
    start, end = reads.overlaps(a, b)
    assert sorted(zip(start.tolist(), end.tolist())) == [(2, 3), (2, 4), (5, 6)]


def random_traces(n=37, n_layers=2, n_heads=2, seed=0):
    """An eviction trace (random eviction steps) and a selection trace (random reads, each query its own token)."""
    rng = np.random.default_rng(seed)
    j = np.arange(n)
    gone = j + 1 + rng.integers(0, n, (n_layers, n_heads, n))
    evicted = np.where(gone >= n + 3, -1, np.minimum(gone, n))
    selected = np.tril(rng.random((n_layers, n_heads, n, n)) < 0.3) | np.eye(n, dtype=bool)
    kw = dict(n_layers=n_layers, n_kv_heads=n_heads, budget=4)
    return make_trace(n, evicted_at=evicted, **kw), make_trace(n, selected=selected, **kw), make_trace(n, **kw)


def dense(trace):
    return np.stack([trace.reads(layer) for layer in range(trace.meta["n_layers"])])  # [L, H, T, T]


@pytest.mark.parametrize("size", [1, 2, 5, 36])
def test_bins_equal_the_dense_mask_averaged_over_each_cell(size):
    n = 37
    causal = np.tri(n, dtype=bool)
    for trace in random_traces(n):
        masks = dense(trace)
        for layers, heads in (([0], [1]), ([0, 1], [0, 1])):
            chosen = masks[np.ix_(layers, heads)].reshape(-1, n, n)
            cells = reads.binned_reads(trace, layers, heads, size)
            bins = cells.shape[0]
            for a in range(bins):
                for b in range(bins):
                    rows, cols = slice(a * size, (a + 1) * size), slice(b * size, (b + 1) * size)
                    arrived = causal[rows, cols].sum() * len(chosen)
                    expected = chosen[:, rows, cols].sum() / arrived if arrived else 0.0
                    assert cells[a, b] == pytest.approx(expected, rel=1e-6)


def test_windows_and_single_steps_equal_the_dense_mask():
    for trace in random_traces():
        masks = dense(trace)
        window = reads.window_reads(trace, [1], [0], slice(10, 30), slice(5, 20))
        assert window.dtype == bool
        np.testing.assert_array_equal(window, masks[1, 0, 10:30, 5:20])
        np.testing.assert_allclose(reads.window_reads(trace, [0, 1], [0, 1], slice(10, 30), slice(5, 20)),
                                   masks[:, :, 10:30, 5:20].mean(axis=(0, 1)))
        np.testing.assert_array_equal(reads.read_share_at(trace, [0], [1], 20), masks[0, 1, 20])
        np.testing.assert_allclose(reads.read_share_at(trace, [0, 1], [0, 1], 20), masks[:, :, 20].mean(axis=(0, 1)))


def test_similarity_and_non_recent_share_equal_their_dense_definitions():
    """The interval arithmetic of metrics gives the numbers of the [T, T] definitions, for every pair of kinds."""
    eviction, selection, full = random_traces()
    _, other_selection, _ = random_traces(seed=1)
    for a in (eviction, selection, full):
        for b in (selection, other_selection, eviction):
            ma, mb = dense(a).astype(np.float64), dense(b).astype(np.float64)
            cos = (ma * mb).sum(-1) / np.sqrt(ma.sum(-1) * mb.sum(-1))  # [L, H, T]
            got = metrics.mask_similarity(a, b, from_step=3)["per_layer"]
            np.testing.assert_allclose(got, cos[:, :, 3:].mean(axis=(1, 2)))
        masks, n, budget = dense(a), len(a.tokens), 4
        old = np.tri(n, n, -budget, dtype=bool)[budget:]
        share = (masks[:, :, budget:] & old).sum(-1) / masks[:, :, budget:].sum(-1)
        np.testing.assert_allclose(metrics.non_recent_share(a)["per_layer"], share.mean(axis=(1, 2)))
        np.testing.assert_array_equal(metrics.lifetimes(a), masks.sum(axis=2))
