"""Metrics on small hand-made traces whose answers are worked out by hand (plus RoPE vs transformers)."""
import numpy as np
import pytest
import torch

from backend.analysis import metrics
from backend.policies import A2SF
from backend.traces.trace import FORMAT_VERSION, Trace


def make_trace(n, *, evicted_at=None, selected=None, attention=None, keys=None, recorded_layers=(), budget=None,
               mode="prompt", n_prompt=None, logprobs=None, top1_ids=None, kl=None, generated_ids=None,
               scored_ids=None, tokens=None, n_layers=1, n_kv_heads=1, policy="test", rope_inv_freq=None,
               scaling=1.0):
    """A Trace of ``n`` tokens with just the arrays a test needs (the rest zero)."""
    tokens = np.arange(n, dtype=np.int32) if tokens is None else np.asarray(tokens, np.int32)
    scored = tokens if scored_ids is None else np.asarray(scored_ids, np.int32)
    s = len(scored)
    n_prompt = n if n_prompt is None else n_prompt
    meta = {"format_version": FORMAT_VERSION, "spec": policy, "policy": policy,
            "params": {} if budget is None else {"budget": budget}, "kind": "eviction", "mode": mode,
            "model": "hand", "model_fingerprint": "hand", "n_layers": n_layers, "n_kv_heads": n_kv_heads,
            "n_heads": n_kv_heads, "n_prompt": n_prompt, "score_start": 0 if mode == "prompt" else n_prompt - 1,
            "token_texts": [f"<{t}>" for t in tokens], "recorded_layers": list(recorded_layers),
            "rope_attention_scaling": scaling}

    def arr(values, dtype, default):
        return np.asarray(values if values is not None else default, dtype)

    return Trace(meta=meta, tokens=tokens, scored_ids=scored,
                 logprobs=arr(logprobs, np.float32, np.zeros(s - 1)),
                 top1_ids=arr(top1_ids, np.int32, np.zeros(s - 1)),
                 kl_to_full=arr(kl, np.float32, np.zeros(s - 1)),
                 evicted_at=None if evicted_at is None else np.asarray(evicted_at, np.int32),
                 selected=None if selected is None else np.asarray(selected, bool),
                 generated_ids=None if generated_ids is None else np.asarray(generated_ids, np.int32),
                 attention=None if attention is None else np.asarray(attention, np.float16),
                 keys=None if keys is None else np.asarray(keys, np.float16),
                 rope_inv_freq=None if rope_inv_freq is None else np.asarray(rope_inv_freq, np.float32))


def rows(*sets, n):
    """bool [n_rows, n]: row t is True at the positions in sets[t]."""
    out = np.zeros((len(sets), n), bool)
    for t, positions in enumerate(sets):
        out[t, list(positions)] = True
    return out


# Window, budget 2, 4 tokens: step t drops t-1, so token j leaves at j+2 (token 3 never does).
WINDOW_2 = [[[2, 3, 4, -1]]]  # reads: {0} {0,1} {1,2} {2,3}
# Oracle, budget 2, 4 tokens: every query reads token 0 and itself.
ORACLE_2 = rows({0}, {0, 1}, {0, 2}, {0, 3}, n=4)[None, None]


# --- Per-step divergence from Full ---------------------------------------------------------------------

def test_kl_per_step_counts_only_fulls_continuation_in_generate_mode():
    prompt = make_trace(4, kl=[0.1, 0.2, 0.3])
    assert metrics.kl_per_step(prompt) == pytest.approx([0.1, 0.2, 0.3])
    generated = make_trace(4, mode="generate", n_prompt=2, kl=[0.1, 0.2, 0.3])  # score_start = 1
    assert metrics.kl_per_step(generated) == pytest.approx([0.2, 0.3])
    assert metrics.kl_per_step(generated).mean() == pytest.approx(metrics.mean_kl_to_full(generated))


def test_top1_match_per_step_marks_positions_where_fulls_top_token_is_kept():
    full = make_trace(5, top1_ids=[5, 0, 7, 0])
    policy = make_trace(5, top1_ids=[5, 6, 7, 8])
    assert metrics.top1_match_per_step(policy, full).tolist() == [True, False, True, False]
    assert metrics.top1_match_per_step(policy, full).mean() == metrics.top1_agreement(policy, full)
    full_g = make_trace(5, mode="generate", n_prompt=2, top1_ids=[5, 0, 7, 0])
    policy_g = make_trace(5, mode="generate", n_prompt=2, top1_ids=[5, 6, 7, 8])
    assert metrics.top1_match_per_step(policy_g, full_g).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="same text"):
        metrics.top1_match_per_step(make_trace(5, scored_ids=[9, 1, 2, 3, 4]), full)


def test_first_divergence_is_the_index_of_the_first_different_generated_token():
    def gen(continuation, prompt=(1, 2, 3)):
        tokens = list(prompt) + list(continuation)
        return make_trace(len(tokens), tokens=tokens, mode="generate", n_prompt=len(prompt),
                          generated_ids=continuation)

    full = gen([4, 5, 6])
    assert metrics.first_divergence(gen([4, 5, 7]), full) == 2
    assert metrics.first_divergence(gen([9, 5, 6]), full) == 0
    assert metrics.first_divergence(gen([4, 5, 6]), full) is None
    assert metrics.first_divergence(gen([4, 5]), full) == 2  # a strict prefix diverges where it stops
    with pytest.raises(ValueError, match="same prompt"):
        metrics.first_divergence(gen([4, 5, 6], prompt=(1, 2, 8)), full)
    with pytest.raises(ValueError, match="generate-mode"):
        metrics.first_divergence(make_trace(6), full)


# --- Similarity to the oracle --------------------------------------------------------------------------

def test_mask_similarity_is_the_row_cosine_of_read_masks_per_layer():
    # Layer 0: Window vs Oracle rows: {0}/{0} -> 1, {0,1}/{0,1} -> 1, {1,2}/{0,2} -> 1/2, {2,3}/{0,3} -> 1/2.
    # Layer 1: the policy reads exactly what the oracle reads -> 1.
    evicted = [WINDOW_2[0], [[5, 5, 5, -1]]]  # layer 1: nothing ever dropped before the end
    policy = make_trace(4, evicted_at=evicted, n_layers=2)
    oracle_reads = np.concatenate([ORACLE_2, np.tril(np.ones((4, 4), bool))[None, None]])
    oracle = make_trace(4, selected=oracle_reads, n_layers=2)
    sim = metrics.mask_similarity(policy, oracle)
    assert sim["layers"] == [0, 1]
    assert sim["per_layer"] == pytest.approx([0.75, 1.0])
    assert sim["overall"] == pytest.approx(0.875)
    assert metrics.mask_similarity(policy, oracle, from_step=2)["per_layer"] == pytest.approx([0.5, 1.0])


def test_mask_similarity_of_full_to_oracle_counts_the_extra_reads():
    full = make_trace(4)  # reads everything up to t
    oracle = make_trace(4, selected=ORACLE_2)
    # rows: 1, 1, |{0,2}| / sqrt(3 * 2), |{0,3}| / sqrt(4 * 2)
    expected = (1 + 1 + 2 / np.sqrt(6) + 2 / np.sqrt(8)) / 4
    assert metrics.mask_similarity(full, oracle)["overall"] == pytest.approx(expected)


def test_similarities_refuse_traces_on_different_tokens():
    a = make_trace(4, evicted_at=WINDOW_2)
    b = make_trace(4, selected=ORACLE_2, tokens=[0, 1, 2, 9])
    with pytest.raises(ValueError, match="same tokens"):
        metrics.mask_similarity(a, b)
    with pytest.raises(ValueError, match="same tokens"):
        metrics.attention_similarity(a, b)


def test_attention_similarity_uses_the_layers_both_traces_recorded():
    # Layer 3 recorded by both: rows t0 [1, 0] vs [1, 0] -> 1; t1 [.6, .8] vs [.8, .6] -> .96; mean .98.
    # (Layer 0 against it would give 1 and 0.6: mean 0.8.)
    attn_a = np.array([[[[1, 0], [0, 1]]], [[[1, 0], [0.6, 0.8]]]])  # layers 0 and 3
    attn_b = np.array([[[[1, 0], [0.8, 0.6]]]])  # layer 3 only
    a = make_trace(2, attention=attn_a, recorded_layers=(0, 3), n_layers=4)
    b = make_trace(2, attention=attn_b, recorded_layers=(3,), n_layers=4)
    sim = metrics.attention_similarity(a, b)
    assert sim["layers"] == [3]
    assert sim["per_layer"] == pytest.approx([0.98], abs=1e-3)  # float16 storage
    assert sim["overall"] == pytest.approx(0.98, abs=1e-3)
    with pytest.raises(ValueError, match="no recorded layer in common"):
        metrics.attention_similarity(make_trace(2, attention=attn_b, recorded_layers=(0,), n_layers=4), b)
    with pytest.raises(ValueError, match="recorded attention"):
        metrics.attention_similarity(make_trace(2, n_layers=4), b)


# --- Retention -----------------------------------------------------------------------------------------

def test_lifetimes_count_the_steps_each_token_was_read():
    window = make_trace(4, evicted_at=WINDOW_2)
    assert metrics.lifetimes(window).tolist() == [[[2, 2, 2, 1]]]  # evicted_at - j; the last one T - j
    assert metrics.lifetimes(make_trace(4)).tolist() == [[[4, 3, 2, 1]]]  # Full: T - j
    assert metrics.lifetimes(make_trace(4, selected=ORACLE_2)).tolist() == [[[4, 1, 1, 1]]]  # reads per column


def test_mean_lifetime_by_position_averages_layers_and_heads():
    trace = make_trace(4, evicted_at=[[[2, 3, 4, -1], [-1, -1, -1, -1]]], n_kv_heads=2)  # head 1 keeps all
    assert metrics.mean_lifetime_by_position(trace) == pytest.approx([3, 2.5, 2, 1])


def test_first_token_retention_is_the_share_of_steps_since_arrival():
    trace = make_trace(4, evicted_at=[[[2, 3, 4, -1], [-1, -1, -1, -1]]], n_kv_heads=2)
    # head 0: [2/4, 2/3]; head 1: [4/4, 3/3]; mean over heads
    assert np.allclose(metrics.first_token_retention(trace, i=2), [[0.75, 5 / 6]])
    assert metrics.first_token_retention(trace).shape == (1, 1)
    with pytest.raises(ValueError):
        metrics.first_token_retention(trace, i=0)


def test_non_recent_share_counts_reads_older_than_the_budget_window():
    # TOVA-like, budget 2, 5 tokens: reads {0} {0,1} {0,2} {0,3} {3,4}. Steps t >= 2 and old = j <= t-2:
    # t2: {0} of 2 -> 1/2; t3: {0} of 2 -> 1/2; t4: none -> 0. Mean 1/3.
    keeper = make_trace(5, evicted_at=[[[4, 2, 3, 5, -1]]], budget=2)
    share = metrics.non_recent_share(keeper)
    assert share["budget"] == 2
    assert share["per_layer"] == pytest.approx([1 / 3]) and share["overall"] == pytest.approx(1 / 3)
    window = make_trace(5, evicted_at=[[[2, 3, 4, 5, -1]]], budget=2)
    assert metrics.non_recent_share(window)["overall"] == 0.0
    # Full with budget=2: t2 1/3, t3 2/4, t4 3/5
    assert metrics.non_recent_share(make_trace(5), budget=2)["overall"] == pytest.approx((1 / 3 + 1 / 2 + 3 / 5) / 3)
    with pytest.raises(ValueError, match="no budget"):
        metrics.non_recent_share(make_trace(5))
    with pytest.raises(ValueError, match="longer than the budget"):
        metrics.non_recent_share(make_trace(2, evicted_at=[[[-1, -1]]], budget=2))


# --- A2S vs A2SF score curves --------------------------------------------------------------------------

# Values exact in float16, so the hand sums are exact.
S = [[1, 0, 0], [0.5, 0.5, 0], [0.125, 0.25, 0.625]]


def curves_trace(attention, layer=2):
    attention = np.asarray(attention)
    return make_trace(len(attention), attention=attention[None, None], recorded_layers=(layer,), n_layers=3)


def test_score_curves_accumulate_with_and_without_forgetting():
    trace = curves_trace(S)
    # A2S = column sums so far; A2SF: A_t = 0.25 * A_(t-1) + S_t.
    a2s = [[1, 0, 0], [1.5, 0.5, 0], [1.625, 0.75, 0.625]]
    a2sf = [[1, 0, 0], [0.75, 0.5, 0], [0.3125, 0.375, 0.625]]
    # Budget 2 at step 2: A2S keeps the old tokens {0, 1}, A2SF the ones attended lately {1, 2}.
    keep_a2s = [[True, False, False], [True, True, False], [True, True, False]]
    keep_a2sf = [[True, False, False], [True, True, False], [False, True, True]]
    for t in range(3):
        c = metrics.score_curves(trace, layer=2, head=0, alpha=0.25, budget=2, step=t, tokens=[0, 1, 2])
        assert c.a2s.tolist() == a2s[t][: t + 1] and c.a2sf.tolist() == a2sf[t][: t + 1]
        assert c.keep_a2s.tolist() == keep_a2s[t][: t + 1] and c.keep_a2sf.tolist() == keep_a2sf[t][: t + 1]
        # Over the steps: the columns of the same tables, and the same keep sets.
        assert c.a2s_over_steps.T.tolist() == a2s and c.a2sf_over_steps.T.tolist() == a2sf
        assert c.kept_a2s_over_steps.T.tolist() == keep_a2s and c.kept_a2sf_over_steps.T.tolist() == keep_a2sf
    # Followed by default: the tokens A2SF ranks highest at the step (the last one by default).
    assert metrics.score_curves(trace, 2, 0, alpha=0.25, budget=2).tokens.tolist() == [0, 1, 2]


def test_score_curves_match_the_a2sf_policys_own_recurrence():
    rng = np.random.default_rng(0)
    n = 30
    raw = np.tril(rng.random((n, n)))
    attention = (raw / raw.sum(1, keepdims=True)).astype(np.float16)
    trace = curves_trace(attention)
    policy, state = A2SF(budget=8, alpha=0.3), A2SF(budget=8, alpha=0.3).init_state(1)
    every = np.arange(n)
    for t in range(n):
        state = policy.update(state, attention[t:t + 1, : t + 1].astype(np.float64), t)
        c = metrics.score_curves(trace, 2, 0, alpha=0.3, budget=8, step=t, tokens=every)
        assert c.a2sf == pytest.approx(state["score"][0], rel=1e-12)
        assert c.a2sf_over_steps[: t + 1, t] == pytest.approx(state["score"][0], rel=1e-12)
        assert c.keep_a2s.sum() == min(t + 1, 8)
        # The keep set is the top-budget: no dropped token scores above a kept one.
        assert c.a2s[c.keep_a2s].min() >= c.a2s[~c.keep_a2s].max(initial=0)
        assert c.kept_a2sf_over_steps[: t + 1, t].tolist() == c.keep_a2sf.tolist()
        no_forgetting = metrics.score_curves(trace, 2, 0, 1.0, 8, step=t, tokens=[])
        assert np.allclose(no_forgetting.a2sf, c.a2s)  # alpha = 1 is A2S
        assert np.allclose(metrics.score_curves(trace, 2, 0, 0.0, 8, step=t, tokens=[]).a2sf,
                           attention[t, : t + 1])  # alpha = 0 forgets everything but the step's own row
    assert np.allclose(c.a2s_over_steps, np.cumsum(attention.astype(np.float64), axis=0).T)  # A2S: running sums


def test_score_curves_rank_ties_by_position_like_the_top_budget():
    # Steps 2 and 3 give tokens 0..2 equal scores: budget 2 keeps the earliest two, as a stable sort does.
    att = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0.25, 0.25, 0.25, 0.25]])
    c = metrics.score_curves(curves_trace(att), 2, 0, alpha=1.0, budget=2, step=3, tokens=[0, 1, 2, 3])
    assert c.a2s.tolist() == [1.75, 1.25, 0.75, 0.25]
    assert c.kept_a2s_over_steps[:, 2].tolist() == [True, True, False, False]  # 1.5, 1, 0.5: no tie
    ties = curves_trace([[1, 0, 0], [0, 1, 0], [0, 0, 1]])
    c = metrics.score_curves(ties, 2, 0, alpha=1.0, budget=2, tokens=[0, 1, 2])
    assert c.a2s.tolist() == [1, 1, 1] and c.keep_a2s.tolist() == [True, True, False]
    assert c.kept_a2s_over_steps[:, 2].tolist() == [True, True, False]


def test_score_curves_at_8k_follow_sparse_rows_without_a_t_by_t_array():
    """8192 tokens, top-16 rows: the dense [T, T] would be 512 MB; the answers are a [T] and a few [T]."""
    import tracemalloc

    n, k = 8192, 16
    rng = np.random.default_rng(3)
    pos = [np.unique(np.r_[0, t, rng.integers(0, t + 1, k - 2)]) for t in range(n)]
    top = np.full((1, 1, n, k), -1, np.int32)
    val = np.zeros((1, 1, n, k), np.float16)
    for t, p in enumerate(pos):
        top[0, 0, t, : len(p)] = p
        val[0, 0, t, : len(p)] = 1.0 / len(p)
    from backend.traces.recorded import TopAttention
    trace = make_trace(n, recorded_layers=(2,), n_layers=3)
    trace.attention = TopAttention(pos=top, val=val)
    tracemalloc.start()
    c = metrics.score_curves(trace, 2, 0, alpha=0.5, budget=256, step=5000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2 ** 20  # a [T, T] float64 alone is 512 MB
    assert c.a2s.shape == (5001,) and c.a2sf_over_steps.shape == (6, n)
    # Token 0 is in every row: its A2S is the running sum of its weights.
    assert c.a2s[0] == pytest.approx(sum(float(np.float16(1.0 / len(p))) for p in pos[:5001]), rel=1e-9)
    assert c.keep_a2s.sum() == 256 and c.kept_a2s_over_steps.sum(0).max() <= 6


def dense_scores_and_keep(pos, val, alpha, budget):
    """The definition, on a [T, T] array: A_t = alpha * A_(t-1) + S_t, and the top ``budget`` of tokens 0..t
    by a stable sort (ties: the earlier position)."""
    n = len(pos)
    rows = np.zeros((n, n))
    for t in range(n):
        rows[t, pos[t][pos[t] >= 0]] = val[t][pos[t] >= 0]
    scores, keep, acc = np.zeros((n, n)), np.zeros((n, n), bool), np.zeros(n)
    for t in range(n):
        acc = alpha * acc + rows[t]
        scores[t] = acc
        keep[t, np.argsort(-acc[: t + 1], kind="stable")[:budget]] = True
    return scores, keep


@pytest.mark.parametrize("alpha", [0.0, 1e-5, 0.05, 0.5, 1.0])
def test_followed_tokens_rank_like_a_stable_sort_of_every_token(alpha):
    """Sparse rows of 4 reads with weights in quarters (many ties), over 20 blocks of steps: the followed
    tokens' scores and keep flags equal the dense definition's, for budgets from 1 to half the text, also
    where small alphas make old scores sink below the smallest float (they tie at 0, ranked by position)."""
    n, rng = 640, np.random.default_rng(4)
    pos = np.full((n, 4), -1, np.int64)
    val = np.zeros((n, 4))
    for t in range(n):
        p = np.unique(np.r_[t, rng.integers(0, t + 1, 3)])
        pos[t, : len(p)] = p
        val[t, : len(p)] = np.round(rng.random(len(p)) * 4) / 4
    tokens = np.array([0, 1, 100, 333, 500, 639])
    for budget in (1, 40, 320):
        scores, keep = dense_scores_and_keep(pos, val, alpha, budget)
        got_scores, got_keep = metrics._follow(pos, val, alpha, budget, tokens)
        arrived = tokens[:, None] <= np.arange(n)[None, :]
        np.testing.assert_allclose(got_scores, np.where(arrived, scores[:, tokens].T, 0), rtol=1e-9, atol=1e-300)
        np.testing.assert_array_equal(got_keep, keep[:, tokens].T & arrived)
        assert got_keep.any() and not got_keep[:, budget:].all()  # both answers occur


def test_a_score_sinking_to_zero_ranks_among_the_zeros_by_position():
    """alpha = 1e-200: a score is 0 two steps after its last read. Row 31 reads token 1 (0.125) and tokens
    20-23 (0.25: the top 4); row 32 reads token 32, row 33 nothing. At step 33 only token 32 is above 0, so
    the top 4 is 32 and the earliest zeros 0, 1, 2: token 3 is out, beaten by token 1, which left the top
    before the block and sank to 0 within it."""
    n, alpha, budget = 40, 1e-200, 4
    pos = np.full((n, 5), -1, np.int64)
    val = np.zeros((n, 5))
    for t in range(n):
        pos[t, 0], val[t, 0] = t, 0.5
    pos[31], val[31] = [1, 20, 21, 22, 23], [0.125, 0.25, 0.25, 0.25, 0.25]
    pos[33, 0] = -1
    scores, keep = dense_scores_and_keep(pos, val, alpha, budget)
    assert np.flatnonzero(keep[33]).tolist() == [0, 1, 2, 32]
    tokens = np.array([3, 20, 32])  # token 1 is not followed: only its sinking makes it a candidate
    got_scores, got_keep = metrics._follow(pos, val, alpha, budget, tokens)
    np.testing.assert_array_equal(got_keep, keep[:, tokens].T & (tokens[:, None] <= np.arange(n)))
    assert not got_keep[0, 33]


def test_score_curves_need_a_recorded_layer():
    with pytest.raises(ValueError, match="recorded"):
        metrics.score_curves(curves_trace(S, layer=2), layer=1, head=0, alpha=0.5, budget=2)
    with pytest.raises(ValueError, match="recorded"):
        metrics.score_curves(make_trace(3), layer=0, head=0, alpha=0.5, budget=2)


# --- K cache before/after RoPE -------------------------------------------------------------------------

@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_unrotate_keys_inverts_transformers_rope(scaling):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    torch.manual_seed(0)
    n, d = 12, 16
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angle = torch.arange(n, dtype=torch.float64)[:, None] * inv_freq[None]
    emb = torch.cat([angle, angle], -1)[None]  # [1, T, d], transformers' layout
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    k = torch.randn(1, 2, n, d, dtype=torch.float64)
    _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
    back = metrics.unrotate_keys(k_rot[0].numpy(), inv_freq.numpy(), scaling)
    assert np.allclose(back, k[0].numpy(), atol=1e-10)
    assert not np.allclose(k_rot[0].numpy(), k[0].numpy(), atol=1e-3)  # the rotation did something


def test_a_trace_with_one_model_wide_rope_still_gives_the_keys_after_rope():
    """A stored trace that keeps one model-wide ``rope_inv_freq`` (rotate_half's layout) and the scaling in its
    metadata, not a RoPE per layer: its keys after RoPE are transformers' own."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    n, d, scaling = 6, 8, 1.25
    inv_freq = 1.0 / (10000 ** (np.arange(0, d, 2) / d))
    keys = np.random.default_rng(0).normal(size=(1, 1, n, d)).astype(np.float16)
    old = Trace.from_bytes(make_trace(n, keys=keys, recorded_layers=(0,), rope_inv_freq=inv_freq,
                                      scaling=scaling).to_bytes())
    angle = np.arange(n)[:, None] * inv_freq.astype(np.float32)[None].astype(np.float64)
    emb = torch.tensor(np.concatenate([angle, angle], -1))[None]
    _, expected = apply_rotary_pos_emb(*[torch.tensor(keys[0].astype(np.float64))] * 2, emb.cos() * scaling,
                                       emb.sin() * scaling)
    np.testing.assert_allclose(metrics.key_samples(old, 0, 0).after_rope, expected[0, 0].numpy(), atol=1e-5)


def test_key_samples_recover_the_models_keys_before_rope():
    from backend.engine.runner import compute_traces
    from backend.policies import parse_spec
    from tests.conftest import make_tiny
    lm = make_tiny()
    ids = list(range(3, 43))
    captured = {}
    def keep_output(module, inputs, output):
        captured["k"] = output[1].detach().double().numpy()  # batch row 1 = the window (row 0 is Full)

    hook = lm.model.model.layers[1].self_attn.k_proj.register_forward_hook(keep_output)
    try:
        traces, _ = compute_traces(lm, ["window:budget=8"], [parse_spec("window:budget=8")], ids, record_layers=(1,))
    finally:
        hook.remove()
    samples = metrics.key_samples(traces[0], layer=1, head=1)
    d = samples.after_rope.shape[-1]
    before = captured["k"].reshape(len(ids), -1, d)[:, 1]  # k_proj output of KV head 1, before RoPE
    assert np.allclose(samples.before_rope, before, atol=2e-2 * np.abs(before).max())
    assert not np.allclose(samples.after_rope, before, atol=2e-2 * np.abs(before).max())
    assert samples.kept.tolist() == [False] * 32 + [True] * 8  # the window's last 8 tokens
    with pytest.raises(ValueError, match="recorded"):
        metrics.key_samples(traces[0], layer=0, head=0)
