"""Compression policies on hand-worked numbers: Expected Attention (a Gaussian of future queries
under the averaged RoPE rotation, times the value norm) and R-KV (importance minus key redundancy, when the
decoding buffer fills); and the engine's plumbing they read (the window's queries and the model's RoPE)."""
import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from backend.policies import CacheView, CompressionPolicy, parse_spec
from backend.policies.expected_attention import ExpectedAttention, mean_rotation
from backend.policies.rkv import RKV, redundancy
from backend.engine.runner import compute_traces, score_text

QUARTER = math.pi / 2  # the test RoPE turns a 2-d query a quarter turn per position


def quarter_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """RoPE for d = 2 with one frequency, pi/2 per position: R_p = [[cos, -sin], [sin, cos]] (rotate_half form)."""
    angle = positions.double()[:, None] * QUARTER  # [L, 1]
    return x * torch.cos(angle) + torch.cat([-x[..., 1:], x[..., :1]], -1) * torch.sin(angle)


def rotated(pre, positions) -> np.ndarray:
    """Queries [H, G, w, 2] before RoPE -> after RoPE at ``positions`` (what the engine gives the view)."""
    pre = np.asarray(pre, float)
    h, g, w, d = pre.shape
    out = quarter_rope(torch.from_numpy(pre.reshape(h * g, w, d)), torch.tensor(positions))
    return out.numpy().reshape(h, g, w, d)


def view(keys, values=None, kept=None, queries=None, positions=(), rope=quarter_rope) -> CacheView:
    keys = np.asarray(keys, float)[None] if np.ndim(keys) == 2 else np.asarray(keys, float)
    n = keys.shape[1]
    return CacheView(t=n - 1, n_prompt=None, layer=0, n_layers=1, attn_window=np.zeros((1, 0, n)), keys=keys,
                     values=np.ones_like(keys) if values is None else np.asarray(values, float)[None],
                     kept=np.ones((1, n), bool) if kept is None else np.asarray(kept, bool)[None],
                     queries=queries, query_positions=np.asarray(positions, np.int64), rope=rope)


def kept_positions(policy, v) -> list[int]:
    return np.flatnonzero(policy.keep(v)[0]).tolist()


# --- Expected Attention ----------------------------------------------------------------------------------

def test_expected_attention_averages_rope_over_the_coming_positions():
    # After query 3, the next two positions are 4 (a full turn: I) and 5 (a quarter turn): the mean of both.
    np.testing.assert_allclose(mean_rotation(quarter_rope, 4, 2, 2), [[0.5, -0.5], [0.5, 0.5]], atol=1e-12)
    np.testing.assert_allclose(mean_rotation(quarter_rope, 4, 1, 2), np.eye(2), atol=1e-12)


def test_expected_attention_is_exp_of_rotated_mean_plus_half_variance_then_softmax_times_value_norm():
    # Queries before RoPE (1, 1) at position 2 and (3, 1) at 3: mean (2, 1), covariance [[1, 0], [0, 0]].
    # Averaged rotation over positions 4, 5: R = [[.5, -.5], [.5, .5]], so mean' = (.5, 1.5) and
    # cov' = R cov R^T = .25 everywhere. Keys (2, 0) and (0, 2) (tokens 2 and 3 are no longer cached):
    # logits 1/sqrt(2) + 1/4 and 3/sqrt(2) + 1/4, i.e. softmax (1 / (1 + e^sqrt 2), e^sqrt 2 / (1 + e^sqrt 2)),
    # times the value norms 5 and 1.
    queries = rotated([[[[1, 1], [3, 1]]]], [2, 3])
    v = view(keys=[[2, 0], [0, 2], [0, 0], [0, 0]], values=[[3, 4], [1, 0], [1, 0], [1, 0]],
             kept=[True, True, False, False], queries=queries, positions=[2, 3])
    policy = ExpectedAttention(budget=1, sinks=0, n_future=2, epsilon=0.0)
    a = 1 / (1 + math.exp(math.sqrt(2)))
    np.testing.assert_allclose(policy.score(v)[0, :2], [5 * a, 1 - a], rtol=1e-7)
    assert kept_positions(policy, v) == [0]  # the value norm (5 vs 1) outweighs the attention (.20 vs .80)


def test_expected_attention_covariance_favours_keys_along_the_queries_spread():
    # Same statistics: mean' = (.5, 1.5), cov' = .25 everywhere. Keys (-2, 6) and (4, 4) have the same mean
    # term 8/sqrt(2); the variance term k^T cov' k / 2d is 16/16 = 1 and 64/16 = 4: the second key wins.
    queries = rotated([[[[1, 1], [3, 1]]]], [2, 3])
    v = view(keys=[[-2, 6], [4, 4], [0, 0], [0, 0]], kept=[True, True, False, False], queries=queries,
             positions=[2, 3])
    policy = ExpectedAttention(budget=1, sinks=0, n_future=2, epsilon=0.0)
    b = 1 / (1 + math.exp(-3))
    np.testing.assert_allclose(policy.score(v)[0, :2] / math.sqrt(2), [1 - b, b], rtol=1e-7)  # value norms sqrt 2
    assert kept_positions(policy, v) == [1]  # without the covariance term they tie, and ties keep token 0


def test_expected_attention_gqa_takes_each_query_heads_softmax_then_their_mean():
    # One query per head (no covariance), at position 3; the next position, 4, is a full turn (R = I).
    # Head 0: q = sqrt2 (ln 3, 0), exps over the keys (1, 0), (0, 1), 0, 0 are 3, 1, 1, 1;
    # head 1: q = sqrt2 (0, ln 2): 1, 2, 1, 1. Mean of the two softmaxes: (3/6 + 1/5) / 2, ...
    pre = math.sqrt(2) * np.array([[[[math.log(3), 0]], [[0, math.log(2)]]]])  # [H=1, G=2, w=1, d=2]
    v = view(keys=[[1, 0], [0, 1], [0, 0], [0, 0]], queries=rotated(pre, [3]), positions=[3])
    score = ExpectedAttention(budget=2, sinks=0, n_future=1, epsilon=0.0).score(v)[0]
    expected = (np.array([3, 1, 1, 1]) / 6 + np.array([1, 2, 1, 1]) / 5) / 2
    np.testing.assert_allclose(score / math.sqrt(2), expected, rtol=1e-7)  # value norms (1, 1): sqrt 2


def test_expected_attention_keeps_the_sinks_and_leaves_their_queries_out_of_the_statistics():
    queries = rotated([[[[50, -50], [1, 1], [3, 1]]]], [0, 2, 3])  # an outlier query at the sink's position
    keys = [[0, 0], [2, 0], [0, 2], [0, 0]]
    with_sink = ExpectedAttention(budget=2, sinks=1, n_future=2, epsilon=0.0)
    score = with_sink.score(view(keys, queries=queries, positions=[0, 2, 3]))
    without = with_sink.score(view(keys, queries=queries[:, :, 1:], positions=[2, 3]))
    assert score[0, 0] == np.inf
    np.testing.assert_allclose(score[0, 1:], without[0, 1:], rtol=1e-12)
    assert kept_positions(with_sink, view(keys, queries=queries, positions=[0, 2, 3]))[0] == 0


# --- R-KV ------------------------------------------------------------------------------------------------

def test_rkv_redundancy_marks_older_copies_and_spares_the_latest():
    # Keys 0, 1, 2 are copies, 3 is unique. Each copy's latest other copy is its retained one: S02, S12 and
    # S21 are zeroed, S01, S10, S20 stay 1. Column means over the 4 keys: .5, .25, 0, 0, then a softmax.
    r = redundancy(np.array([[1.0, 0], [1, 0], [1, 0], [0, 1]]), threshold=0.5, retain=1)
    e = np.exp([0.5, 0.25, 0, 0])
    np.testing.assert_allclose(r, e / e.sum(), rtol=1e-7)
    assert r[0] > r[1] > r[2] == r[3]


def test_rkv_threshold_decides_which_similar_keys_are_copies():
    # cos(k0, k1) = .4, cos(k1, k2) ~ .92, cos(k0, k2) = 0. At threshold .5 only k1, k2 are copies (S12, S21
    # zeroed): column means .4/3, .4/3, 0. At .3, k0's copy k1 is zeroed too: .4/3, 0, 0.
    keys = np.array([[1.0, 0], [0.4, math.sqrt(1 - 0.16)], [0, 1]])
    for threshold, means in ((0.5, [0.4 / 3, 0.4 / 3, 0]), (0.3, [0.4 / 3, 0, 0])):
        e = np.exp(means)
        np.testing.assert_allclose(redundancy(keys, threshold, 1), e / e.sum(), rtol=1e-7)


def test_rkv_keeps_important_tokens_that_are_not_redundant():
    # Prefix 0..3, window token 4 (window 1; its query at position 4, q = sqrt2 (ln 2, ln 3)). Keys: three
    # copies (1, 0), a unique (0, 1), the window's (-1, 0). Importance (softmax over the prefix): 2/9, 2/9,
    # 2/9, 1/3. Redundancy: column means (1, 0, -1, 0, -3) / 5 (the window's key is opposite the copies),
    # softmax. Score = .1 importance - .9 redundancy keeps the latest copy (2) and the unique token (3).
    q = math.sqrt(2) * np.array([[[[math.log(2), math.log(3)]]]])
    v = view(keys=[[1, 0], [1, 0], [1, 0], [0, 1], [-1, 0]], queries=q, positions=[4], rope=None)
    policy = RKV(budget=3, window=1, kernel=1)
    e = np.exp(np.array([1, 0, -1, 0, -3]) / 5)
    expected = 0.1 * np.array([2, 2, 2, 3]) / 9 - 0.9 * (e / e.sum())[:4]
    np.testing.assert_allclose(policy.score(v)[0, :4], expected, rtol=1e-7)
    assert kept_positions(policy, v) == [2, 3, 4]
    # Attention alone (lambda 1) keeps the unique token and the earliest of the tied copies, as SnapKV would.
    assert kept_positions(RKV(budget=3, window=1, kernel=1, mix_lambda=1.0), v) == [0, 3, 4]


def test_rkv_importance_pools_the_groups_logits_by_max_before_the_softmax():
    # Two query heads: (ln 2, 0) and (0, ln 3) (times sqrt2). Max logits over the group: ln 2, ln 3 ->
    # softmax 2/5, 3/5 (the mean of the two softmaxes would give .458, .542).
    q = math.sqrt(2) * np.array([[[[math.log(2), 0]], [[0, math.log(3)]]]])
    v = view(keys=[[1, 0], [0, 1], [5, 5]], queries=q, positions=[2], rope=None)
    np.testing.assert_allclose(RKV(budget=2, window=1, kernel=1, mix_lambda=1.0).score(v)[0, :2], [0.4, 0.6],
                               rtol=1e-7)


def test_rkv_compresses_each_time_the_cache_reaches_budget_plus_buffer():
    policy = RKV()  # budget 64, the paper's buffer, 128 tokens
    # Generate mode, a prompt over the budget: once it is read, then each time 128 tokens have been added.
    assert [t for t in range(400) if policy.compresses_after(t, 100)] == [99, 227, 355]
    # A prompt within the budget leaves nothing to drop: the first compression comes at 64 + 128 tokens.
    assert [t for t in range(400) if policy.compresses_after(t, 10)] == [191, 319]
    assert [t for t in range(400) if policy.compresses_after(t, 64)] == [191, 319]
    # Prompt mode: at budget + interval tokens, then every interval tokens.
    assert [t for t in range(400) if policy.compresses_after(t, None)] == [191, 319]
    assert [t for t in range(400) if RKV(budget=100, every=0).compresses_after(t, 150)] == [149]
    assert policy.schedule("generate") == "once after a prompt over 64 tokens, then when the cache reaches 64 + 128"
    assert policy.schedule("prompt") == "when the cache reaches 64 + 128 tokens"


def test_rkv_first_compression_comes_at_budget_plus_buffer_in_prompt_mode(tiny, text_ids):
    policy = parse_spec("rkv:budget=8,window=2,interval=6")
    (trace,), _ = compute_traces(tiny, [policy.spec()], [policy], text_ids[:28], record_layers=())
    assert set(np.unique(trace.evicted_at)) == {-1, 14, 20, 26}
    reads = trace.reads(0).sum(-1)  # [H, T]: up to 8 + 6, then 8 kept + 1, ..., 6 since each compression
    assert (reads[:, :14] == np.arange(1, 15)).all()
    assert (reads[:, 14:26] == np.tile(8 + np.arange(1, 7), 2)).all()


def test_rkv_first_compression_comes_at_budget_plus_buffer_after_a_short_prompt(tiny, text_ids):
    policy = parse_spec("rkv:budget=8,window=2,every=4")
    (trace,), _ = compute_traces(tiny, [policy.spec()], [policy], text_ids[:6], mode="generate", max_new_tokens=12,
                                 record_layers=())
    assert set(np.unique(trace.evicted_at)) == {-1, 12, 16}


def test_rkv_cache_grows_to_budget_plus_buffer_while_decoding_then_back(tiny, text_ids):
    prompt = text_ids[:24]
    policy = parse_spec("rkv:budget=8,window=2,every=4")
    (trace,), _ = compute_traces(tiny, [policy.spec()], [policy], prompt, mode="generate", max_new_tokens=10, record_layers=())
    assert set(np.unique(trace.evicted_at)) == {-1, 24, 28, 32}
    after = trace.reads(0)[:, 24:].sum(-1)  # [H, decoding steps]: 8 kept + 1, 2, 3, 4 since the compression
    assert (after == 8 + np.array([1, 2, 3, 4, 1, 2, 3, 4, 1, 2])).all()


# --- What the engine gives them ----------------------------------------------------------------------------

@dataclass(frozen=True)
class QueryProbe(CompressionPolicy):
    """Records the views it is given (not registered)."""

    name: ClassVar[str] = "query_probe"
    seen: ClassVar[list] = []
    interval: int = 8

    @property
    def window_queries(self) -> int:
        return 3

    def score(self, v):
        QueryProbe.seen.append((v.layer, v.t, v.queries, v.query_positions, v.rope))
        return np.zeros(v.kept.shape)


def test_the_views_queries_rotated_back_are_the_q_projection(tiny, text_ids):
    ids = text_ids[:20]
    projected = {}  # layer -> [T, heads, d]: the q projection, before RoPE
    attn = [layer.self_attn for layer in tiny.model.model.layers]
    d = attn[0].head_dim

    def keep(layer):
        def hook(_module, _inputs, out):
            projected[layer] = out[-1].reshape(out.shape[1], -1, d).double()  # the probe's row (row 0 is Full's)
        return hook

    hooks = [a.q_proj.register_forward_hook(keep(i)) for i, a in enumerate(attn)]
    QueryProbe.seen.clear()
    try:
        score_text(tiny, ids, [QueryProbe(budget=4)], chunk=len(ids))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted((layer, t) for layer, t, *_ in QueryProbe.seen) == [(0, 7), (0, 15), (1, 7), (1, 15)]
    for layer, t, queries, positions, rope in QueryProbe.seen:
        assert positions.tolist() == [t - 2, t - 1, t]
        n_kv, group, w, _ = queries.shape
        back = rope(torch.from_numpy(queries.reshape(n_kv * group, w, d)), torch.from_numpy(-positions))
        expected = projected[layer][torch.from_numpy(positions)].transpose(0, 1)  # [heads, w, d]: head h*G + g
        np.testing.assert_allclose(back.numpy(), expected.numpy(), atol=1e-6)  # cos, sin are float32
