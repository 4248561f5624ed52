"""Each policy's decision on small attention rows worked out by hand."""
from dataclasses import fields

import numpy as np
import pytest

from backend.policies import A2SF, H2O, POLICIES, TOVA, Oracle, Sinks, SpecError, Window, parse_spec


def kept(*bits):
    return np.array([bits], bool)


def test_window_keeps_last_n():
    w = Window(budget=3)
    assert w.step({}, None, kept(1, 1), 1)[1] is None  # 2 < 3: room left
    assert w.step({}, None, kept(1, 1, 1), 2)[1].tolist() == [0]  # full: the oldest leaves
    assert w.step({}, None, kept(0, 1, 1, 1), 3)[1].tolist() == [1]


def test_sinks_keep_first_tokens_and_drop_oldest_of_the_rest():
    s = Sinks(budget=4, sinks=2)
    assert s.step({}, None, kept(1, 1, 1, 1), 3)[1].tolist() == [2]
    assert s.step({}, None, kept(1, 1, 0, 1, 1), 4)[1].tolist() == [3]


def test_tova_layerwise_drops_lowest_mean_attention_even_the_current_token():
    attn = np.array([[0.5, 0.1, 0.2, 0.2], [0.1, 0.5, 0.3, 0.1]])  # 2 KV heads, query t=3
    # mean over heads: [.3, .3, .25, .15] -> the current token 3 goes, from both heads
    _, victims = TOVA(budget=4).step({}, attn, np.ones((2, 4), bool), 3)
    assert victims.tolist() == [3, 3]


def test_tova_headwise_drops_each_heads_lowest_earliest_on_ties():
    attn = np.array([[0.5, 0.1, 0.2, 0.2], [0.1, 0.5, 0.3, 0.1]])
    _, victims = TOVA(budget=4, heads="head").step({}, attn, np.ones((2, 4), bool), 3)
    assert victims.tolist() == [1, 0]  # head 1 ties 0 and 3 at .1: the earlier goes


def test_tova_ignores_tokens_already_dropped_and_waits_until_full():
    attn = np.array([[0.0, 0.6, 0.4]])
    assert TOVA(budget=3).step({}, attn, kept(0, 1, 1), 2)[1] is None
    assert TOVA(budget=2).step({}, attn, kept(0, 1, 1), 2)[1].tolist() == [2]


def test_tova_keep_first_protects_sinks():
    attn = np.array([[0.01, 0.5, 0.49]])
    assert TOVA(budget=3, sinks=1).step({}, attn, kept(1, 1, 1), 2)[1].tolist() == [2]


def run_steps(policy, rows):
    """Feed attention rows of queries 0..n-1 (all tokens kept until the policy drops one)."""
    state, alive, victims = policy.init_state(1), np.ones((1, len(rows)), bool), []
    for t, row in enumerate(rows):
        attn = np.array([row]) * alive[:, : t + 1]
        state, v = policy.step(state, attn, alive[:, : t + 1], t)
        victims.append(None if v is None else int(v[0]))
        if v is not None:
            alive[0, v[0]] = False
    return state, victims


ROWS = [[1.0], [0.6, 0.4], [0.2, 0.5, 0.3]]


def test_h2o_sums_attention_and_spares_the_recent_window():
    state, victims = run_steps(H2O(budget=3, recent=1), ROWS)
    np.testing.assert_allclose(state["a2s"], [[1.8, 0.9, 0.3]])
    assert victims == [None, None, 1]  # token 2 is recent; of 0 (1.8) and 1 (0.9), 1 goes


def test_h2o_default_recent_window_is_half_the_budget():
    assert H2O(budget=64).window == 32 and H2O(budget=5).window == 2


def test_a2sf_forgets_past_attention_by_alpha_per_step():
    state, victims = run_steps(A2SF(budget=3, alpha=0.5), ROWS)
    # Eq. 5: A_2 = S_2 + .5 S_1 + .25 S_0 = [.2+.3+.25, .5+.2, .3]
    np.testing.assert_allclose(state["score"], [[0.75, 0.7, 0.3]])
    assert victims == [None, None, 2]


def test_a2sf_with_alpha_one_accumulates_like_h2o():
    rows = [[1.0], [0.3, 0.7], [0.5, 0.1, 0.4], [0.2, 0.0, 0.5, 0.3], [0.1, 0.0, 0.3, 0.2, 0.4]]
    a, va = run_steps(A2SF(budget=3, alpha=1.0, window=1), rows)
    h, vh = run_steps(H2O(budget=3, recent=1), rows)
    assert va == vh
    np.testing.assert_allclose(a["score"], h["a2s"])


def test_oracle_reads_the_top_budget_exact_attention():
    _, mask = Oracle(budget=2).select({}, np.array([[0.1, 0.4, 0.2, 0.3]]), 3)
    assert mask.tolist() == [[False, True, False, True]]
    _, mask = Oracle(budget=2, heads="layer").select({}, np.array([[0.1, 0.4, 0.2, 0.3], [0.5, 0.1, 0.3, 0.1]]), 3)
    assert mask.tolist() == [[True, True, False, False]] * 2  # mean row [.3, .25, .25, .2]: tie -> earlier


@pytest.mark.parametrize("spec, expected", [
    ("tova:budget=64", TOVA(budget=64)),
    ("a2sf:budget=64,alpha=0.3", A2SF(budget=64, alpha=0.3)),
    (" H2O:budget=8, heads=layer ", H2O(budget=8, heads="layer")),
])
def test_parse_spec(spec, expected):
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec, message", [
    ("lru:budget=4", "unknown policy"),
    ("tova:budget=0", "budget must be an integer >= 1"),
    ("tova:budget=x", "budget must be an integer of at most 9 digits, got 'x'"),
    ("tova:bugdet=4", "unknown parameter 'bugdet'"),
    ("tova:budget", "expected key=value"),
    ("sinks:budget=4,sinks=4", "sinks < budget"),
    ("h2o:budget=4,heads=both", "heads must be one of"),
    ("a2sf:budget=4,alpha=2", "alpha must be in"),
])
def test_bad_specs_are_one_line_errors(spec, message):
    with pytest.raises(SpecError, match=message):
        parse_spec(spec)


@pytest.mark.parametrize("name", [name for name, cls in POLICIES.items() if cls.for_budget(8).budget is None])
def test_a_budget_given_to_a_policy_that_holds_every_token_says_so_and_names_what_it_takes(name):
    with pytest.raises(SpecError) as refused:
        parse_spec(f"{name}:budget=48")
    message = str(refused.value)
    assert message.startswith(f"{name}: ") and "holds every token and takes no budget" in message
    assert "\n" not in message and "must be an integer" not in message
    for param in fields(POLICIES[name]):
        assert param.name == "budget" or param.name in message


def test_kivi_refuses_a_budget_naming_its_bits_and_residual():
    with pytest.raises(SpecError, match=r"kivi: KIVI holds every token and takes no budget \(its parameters: .*bits.*"
                                        r"residual.*ratio\)"):
        parse_spec("kivi:budget=48")
    with pytest.raises(SpecError, match=r"full: Full holds every token and takes no budget \(it takes no parameters\)"):
        parse_spec("full:budget=48")
