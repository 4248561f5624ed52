"""Scissorhands and Keyformer on small attention rows worked out by hand."""
import numpy as np
import pytest
import torch

from backend.policies import H2O, SpecError, parse_spec
from backend.policies import keyformer as keyformer_module
from backend.policies.keyformer import Keyformer, gumbel
from backend.policies.scissorhands import Scissorhands
from backend.engine.runner import score_text
from tests.conftest import make_tiny


def walk(policy, rows):
    """Feed the attention rows of queries 0..n-1 to one KV head (a dropped token's attention is 0);
    return the final state and what each step dropped (None, or the list of columns)."""
    state, alive, dropped = policy.init_state(1), np.ones((1, len(rows)), bool), []
    for t, row in enumerate(rows):
        kept = alive[:, : t + 1]
        assert np.all(np.array(row)[~kept[0]] == 0), "a dropped token draws no attention"
        state, victims = policy.step(state, np.array([row], float), kept, t)
        dropped.append(None if victims is None else np.atleast_1d(victims[0]).tolist())
        if victims is not None:
            alive[0, victims[0]] = False
    return state, dropped


def low_counts(state):
    return np.bitwise_count(state["low"]["bits"]).sum(-1)


# Averages 1, 1/2, 1/3, 1/4: token 0 is below at steps 2 and 3, token 1 at steps 1 and 3, token 2 at step 2.
BELOW = [[1.0], [0.6, 0.4], [0.2, 0.5, 0.3], [0.1, 0.2, 0.3, 0.4]]


def test_scissorhands_counts_the_steps_a_token_falls_below_the_average_attention():
    state, dropped = walk(Scissorhands(budget=10, recent=1), BELOW)
    assert dropped == [None] * 4  # 4 tokens < budget 10: nothing leaves
    assert low_counts(state).tolist() == [[2, 2, 1, 0]]


def test_scissorhands_counts_only_the_last_window_steps():
    state, _ = walk(Scissorhands(budget=10, recent=1, window=2), BELOW)
    assert low_counts(state).tolist() == [[2, 1, 1, 0]]  # token 1's step-1 count has left the window


def test_scissorhands_threshold_is_the_average_over_the_tokens_read():
    # Token 1 is dropped before step 3, so step 3's query reads 3 tokens: the average is 1/3, not 1/4.
    policy = Scissorhands(budget=10, recent=1)
    state, alive = policy.init_state(1), np.array([[True, False, True, True]])
    state, _ = policy.step(state, np.array([[0.3, 0.0, 0.4, 0.3]]), alive, 3)
    assert low_counts(state).tolist() == [[1, 0, 0, 1]]  # .3 < 1/3 < .4


# Token 0 draws most attention throughout; tokens 1 and 2 fall below the average most often.
PERSIST = [[1.0], [0.7, 0.3], [0.6, 0.1, 0.3], [0.5, 0.1, 0.15, 0.25],
           [0.5, 0.0, 0.0, 0.2, 0.3], [0.4, 0.0, 0.0, 0.1, 0.2, 0.3]]


def test_scissorhands_drops_the_m_least_persistent_tokens_at_once_then_waits_until_full():
    policy = Scissorhands(budget=4, recent=1, drop=0.5)
    assert policy.m == 2
    state, dropped = walk(policy, PERSIST)
    # Step 3: full (4 tokens). Counts below average: token 0: 0, token 1: 3, token 2: 2, token 3 is recent.
    # Step 4: 3 tokens, room left. Step 5: full again; token 3 and 4 were below 1/3 and 1/4 twice, token 0 never.
    assert dropped == [None, None, None, [1, 2], None, [3, 4]]
    assert low_counts(state)[0, [0, 5]].tolist() == [0, 0]


def test_scissorhands_spares_the_recent_window_and_breaks_ties_by_the_earliest_position():
    rows = [[1.0], [0.5, 0.5], [0.8, 0.1, 0.1]]  # step 2 (full): tokens 1 and 2 fall below 1/3, once each
    assert walk(Scissorhands(budget=3, recent=0, drop=0.34), rows)[1] == [None, None, [1]]  # tie: the earlier
    assert walk(Scissorhands(budget=3, recent=1, drop=0.34), rows)[1] == [None, None, [1]]
    assert walk(Scissorhands(budget=3, recent=2, drop=0.34), rows)[1] == [None, None, [0]]  # 1 and 2 are recent
    rows = [[1.0], [0.5, 0.5], [0.4, 0.5, 0.1]]  # only the current token falls below
    assert walk(Scissorhands(budget=3, recent=0, drop=0.34), rows)[1] == [None, None, [2]]
    assert walk(Scissorhands(budget=3, recent=1, drop=0.34), rows)[1] == [None, None, [0]]


# Alg. 1-2 by hand at the paper's defaults (m = 0.5 x budget), budget 6, r = 1. Counts below the average 1/n
# by step 5 (full): token 1: 5 (steps 1-5), token 2: 4, token 3: 2 (steps 4, 5), tokens 0 and 4: 0.
# m = 3 go at once: 1, 2, 3. Steps 6 and 7 hold 4 and 5 tokens: nothing leaves. Step 8 is full again;
# counts: token 4: 3 (steps 6-8), token 6: 3, token 7: 2, tokens 0 and 5: 0, token 8 recent: 4, 6, 7 go.
PAPER = [[1.0], [0.7, 0.3], [0.5, 0.2, 0.3], [0.4, 0.1, 0.2, 0.3], [0.4, 0.05, 0.1, 0.15, 0.3],
         [0.3, 0.05, 0.05, 0.1, 0.3, 0.2], [0.4, 0, 0, 0, 0.2, 0.3, 0.1], [0.4, 0, 0, 0, 0.1, 0.25, 0.15, 0.1],
         [0.35, 0, 0, 0, 0.1, 0.2, 0.1, 0.15, 0.1]]


def test_scissorhands_at_the_papers_defaults_drops_half_the_budget_when_full_then_waits_m_steps():
    policy = Scissorhands(budget=6, recent=1)
    assert (policy.drop, policy.window, policy.m) == (0.5, 400, 3)
    state, dropped = walk(policy, PAPER)
    assert dropped == [None] * 5 + [[1, 2, 3], None, None, [4, 6, 7]]
    assert low_counts(state)[0, [0, 5]].tolist() == [0, 0]


def test_scissorhands_average_is_over_the_tokens_read_or_over_every_token_seen():
    # Token 1 is dropped before step 3: 3 tokens read (average 1/3), 4 seen (Alg. 2's 1/t: 1/4).
    attn, alive = np.array([[0.2, 0.0, 0.5, 0.3]]), np.array([[True, False, True, True]])
    for average, low in (("read", [1, 0, 0, 1]), ("seen", [1, 0, 0, 0])):
        policy = Scissorhands(budget=10, recent=1, average=average)
        state, _ = policy.step(policy.init_state(1), attn, alive, 3)
        assert low_counts(state).tolist() == [low]
    with pytest.raises(SpecError, match="average"):
        parse_spec("scissorhands:budget=16,average=mean")


def test_scissorhands_drop_amount_is_a_fraction_of_the_budget_within_what_is_not_recent():
    assert Scissorhands(budget=64).m == 32  # the paper's m = 0.5 budget, with r = 10, w = 400
    assert Scissorhands(budget=64, drop=0.4).m == 26  # the value cold-compress names as the paper's
    assert Scissorhands(budget=12, recent=10).m == 2
    assert Scissorhands(budget=5, recent=0, drop=0.01).m == 1
    assert Scissorhands.for_budget(4) == Scissorhands(budget=4, recent=2)
    with pytest.raises(SpecError, match="recent < budget"):
        parse_spec("scissorhands:budget=8")


def test_scissorhands_drops_as_many_tokens_from_every_head():
    attn = np.array([[0.4, 0.1, 0.2, 0.3], [0.1, 0.4, 0.3, 0.2]])  # below 1/4: head 0 tokens 1, 2; head 1 0, 3
    policy = Scissorhands(budget=4, recent=1, drop=0.5)
    _, victims = policy.step(policy.init_state(2), attn, np.ones((2, 4), bool), 3)
    assert victims.tolist() == [[1, 2], [0, 1]]  # head 1: token 3 is recent; then 1 and 2 tie at 0: the earlier


ROWS = [[1.0], [0.6, 0.4], [0.2, 0.5, 0.3]]


@pytest.fixture
def no_noise(monkeypatch):
    monkeypatch.setattr(keyformer_module, "gumbel", lambda seed, layer, t, positions: np.zeros(positions.shape))


def test_keyformer_without_noise_at_temperature_one_is_h2o(no_noise):
    state, dropped = walk(Keyformer(budget=3, recent=1, tau_init=1.0, tau_end=1.0), ROWS)
    np.testing.assert_allclose(state["score"], [[1.8, 0.9, 0.3]])  # softmax(log a) = a: accumulated attention
    assert dropped == [None, None, [1]] and walk(H2O(budget=3, recent=1), ROWS)[1] == dropped


def test_keyformer_temperature_flattens_the_scores(no_noise):
    # tau = 2: softmax(log a / 2) = sqrt(a) / sum sqrt(a); [.64, .36] -> [.8, .6] / 1.4.
    state, _ = walk(Keyformer(budget=3, recent=1, tau_init=2.0, tau_end=2.0), [[1.0], [0.64, 0.36]])
    np.testing.assert_allclose(state["score"], [[1 + 4 / 7, 3 / 7]])


def test_keyformer_temperature_rises_linearly_from_tau_init_to_tau_end():
    policy = Keyformer(tau_init=1.0, tau_end=2.0, steps=128)
    assert [policy.tau(t) for t in (0, 32, 128, 5000)] == [1.0, 1.25, 2.0, 2.0]


def test_keyformer_adds_a_gumbel_softmax_row_over_the_cached_tokens():
    attn = np.array([[0.5, 0.0, 0.3, 0.2]])  # token 1 was dropped
    kept = np.array([[True, False, True, True]])
    policy = Keyformer(budget=10, tau_init=1.5, tau_end=1.5, seed=3)
    state, _ = policy.step(policy.layer_state(1, 2), attn, kept, 3)
    z = (np.log(attn[0, [0, 2, 3]]) + gumbel(3, 2, 3, np.array([[0, 2, 3]]))[0]) / 1.5  # layer 2's noise
    expected = np.exp(z) / np.exp(z).sum()
    np.testing.assert_allclose(state["score"][0, [0, 2, 3]], expected)
    assert state["score"][0, 1] == 0.0


def test_keyformer_noise_follows_the_token_position_not_its_column():
    everything = gumbel(7, 0, 12, np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]))
    compacted = gumbel(7, 0, 12, np.array([[0, 3, 4], [1, 2, 4]]))
    np.testing.assert_array_equal(compacted, [everything[0, [0, 3, 4]], everything[1, [1, 2, 4]]])
    assert everything[0, 0] != everything[1, 0]  # each KV head draws its own noise
    assert (gumbel(7, 0, 13, np.array([[0, 1, 2]])) != everything[0, :3]).all()  # and fresh noise every step
    assert (gumbel(8, 0, 12, np.array([[0, 1, 2]])) != everything[0, :3]).all()


def test_keyformer_noise_is_drawn_afresh_in_every_layer_and_reproducible_by_seed():
    positions = np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])
    layers = [gumbel(7, layer, 12, positions) for layer in range(4)]
    for a in range(4):
        for b in range(a):
            assert (layers[a] != layers[b]).all()  # same seed, step, heads and positions; another layer
    np.testing.assert_array_equal(gumbel(7, 2, 12, positions), layers[2])


def test_keyformer_keeps_its_layer_in_its_state():
    policy = Keyformer(budget=3, recent=1, seed=5)
    state = policy.layer_state(2, 3)
    assert state["layer"].tolist() == [3] and state["score"].shape == (2, 0)
    assert policy.init_state(2)["layer"].tolist() == [0]
    state, _ = policy.step(state, np.array([[0.6, 0.4], [0.5, 0.5]]), np.ones((2, 2), bool), 1)
    assert state["layer"].tolist() == [3] and state["score"].shape == (2, 2)


def test_keyformer_layers_with_the_same_attention_keep_different_tokens(text_ids):
    # q = 0 in every layer: each query reads its tokens uniformly, in every layer alike, so only the noise
    # tells the layers apart.
    lm = make_tiny(layers=3)
    with torch.no_grad():
        for layer in lm.model.model.layers:
            layer.self_attn.q_proj.weight.zero_()

    def evicted(seed):
        cache, _, _ = score_text(lm, text_ids, [Keyformer(budget=8, seed=seed)], chunk=16)
        return cache.evicted_at(1)  # [L, H, T]

    first = evicted(1)
    assert (first >= 0).any()
    assert not np.array_equal(first[0], first[1]) and not np.array_equal(first[1], first[2])
    np.testing.assert_array_equal(evicted(1), first)


def test_keyformer_noise_is_standard_gumbel():
    g = gumbel(0, 0, 5, np.arange(200_000)[None, :])[0]
    assert abs(g.mean() - np.euler_gamma) < 0.01 and abs(g.var() - np.pi**2 / 6) < 0.03


def test_keyformer_same_seed_gives_the_same_trace_and_another_seed_another(tiny, text_ids):
    def trace(seed):
        cache, stats, _ = score_text(tiny, text_ids, [Keyformer(budget=8, seed=seed)], chunk=16)
        return cache.evicted_at(1), stats["logprobs"][1]

    (first, lp_first), (again, lp_again), (other, _) = trace(1), trace(1), trace(2)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(lp_first, lp_again)
    assert (first != other).any()


def test_keyformer_scores_a_token_alike_whichever_column_holds_it():
    # Before compaction token 1's column is still there (dropped); after it, positions 0, 2, 3 fill 3 columns.
    policy = Keyformer(budget=10, seed=5)
    wide, _ = policy.step(policy.init_state(1), np.array([[0.5, 0.0, 0.3, 0.2]]),
                          np.array([[True, False, True, True]]), 3)
    narrow, _ = policy.step(policy.init_state(1), np.array([[0.5, 0.3, 0.2]]), np.ones((1, 3), bool), 3,
                            np.array([[0, 2, 3]]))
    np.testing.assert_allclose(narrow["score"], wide["score"][:, [0, 2, 3]])
