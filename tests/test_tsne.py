"""backend/analysis/tsne.py (t-SNE of keys before/after RoPE) and viz/tsne.py (its figure), on real tiny-model keys."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.analysis import metrics
from backend.policies import parse_spec
from backend.engine.runner import compute_traces
from backend.analysis.tsne import clip_perplexity, embed, embed_keys
from tests.conftest import make_tiny
from viz import tsne_figure


@pytest.fixture(scope="module")
def keys():
    lm = make_tiny()
    ids = torch.randint(0, 101, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    (trace,), _ = compute_traces(lm, ["tova:budget=8"], [parse_spec("tova:budget=8")], ids, record_layers=(0, 1))
    samples = metrics.key_samples(trace, 1, 0)  # recorded layer 1, KV head 0
    return samples.before_rope.astype(np.float64), samples.after_rope.astype(np.float64), trace


def test_keys_before_rope_are_a_rotation_of_the_cached_keys(keys):
    before, after, _ = keys
    np.testing.assert_allclose(before[0], after[0], atol=1e-6)  # position 0 is not rotated
    half = after.shape[1] // 2
    pair_norm = lambda k: np.hypot(k[:, :half], k[:, half:])  # noqa: E731
    np.testing.assert_allclose(pair_norm(before), pair_norm(after), rtol=1e-5, atol=1e-6)
    assert not np.allclose(before[5:], after[5:])


def test_embed_keys_returns_finite_coordinates_and_is_deterministic(keys):
    before, after, trace = keys
    n = len(trace.tokens)
    cb, ca = embed_keys(before, after, seed=0)
    assert cb.shape == (n, 2) and ca.shape == (n, 2)
    assert np.isfinite(cb).all() and np.isfinite(ca).all()
    assert cb.std(axis=0).min() > 0 and ca.std(axis=0).min() > 0  # not collapsed
    cb2, ca2 = embed_keys(before, after, seed=0)
    np.testing.assert_array_equal(cb, cb2)
    np.testing.assert_array_equal(ca, ca2)
    assert not np.allclose(cb, ca)  # before and after RoPE are different maps


@pytest.mark.parametrize("n", [1, 2, 4, 5, 7, 12])
def test_embed_handles_few_points(n):
    x = np.random.default_rng(n).standard_normal((n, 8)).astype(np.float16)
    coords = embed(x, seed=0)
    assert coords.shape == (n, 2) and np.isfinite(coords).all()
    np.testing.assert_array_equal(coords, embed(x, seed=0))


def test_identical_keys_embed_without_nan():
    """t-SNE's gradient is NaN when every point is the same (e.g. keys of a padded head): all sit at 0."""
    np.testing.assert_array_equal(embed(np.ones((40, 8))), np.zeros((40, 2)))


def test_perplexity_is_clipped_and_bad_input_rejected():
    assert clip_perplexity(30, 1000) == 30
    assert clip_perplexity(30, 10) == 3
    assert clip_perplexity(30, 2) == 1
    with pytest.raises(ValueError):
        embed_keys(np.zeros((5, 4)), np.zeros((6, 4)))
    bad = np.ones((6, 4))
    bad[2, 1] = np.nan
    with pytest.raises(ValueError):
        embed(bad)


def test_tsne_figure_two_panels_kept_vs_evicted_coloured_by_position(keys):
    before, after, trace = keys
    cb, ca = embed_keys(before, after, seed=0)
    n = len(trace.tokens)
    kept = trace.reads(1)[0, n - 1]
    assert kept.any() and not kept.all()
    token_texts = trace.meta["token_texts"]
    fig = tsne_figure(cb, ca, kept, token_texts, np.arange(n))
    assert [t.name for t in fig.data] == ["kept", "evicted", "kept", "evicted"]
    for trace_, coords, sel in zip(fig.data, (cb, cb, ca, ca), (kept, ~kept, kept, ~kept)):
        np.testing.assert_allclose(trace_.x, coords[sel, 0])
        np.testing.assert_allclose(trace_.y, coords[sel, 1])
        np.testing.assert_array_equal(trace_.marker.color, np.flatnonzero(sel))
        assert trace_.marker.coloraxis == "coloraxis"
        assert [int(c[0]) for c in trace_.customdata] == np.flatnonzero(sel).tolist()
        assert trace_.customdata[0][1] == token_texts[np.flatnonzero(sel)[0]].replace("<", "&lt;").replace(">", "&gt;")
    assert fig.data[0].xaxis == "x" and fig.data[2].xaxis == "x2"
    assert fig.data[0].marker.symbol != fig.data[1].marker.symbol
    assert [a.text for a in fig.layout.annotations] == ["keys before RoPE", "keys after RoPE"]
    assert fig.layout.coloraxis.cmax == n - 1
    with pytest.raises(ValueError):
        tsne_figure(cb, ca[:-1], kept, token_texts)
