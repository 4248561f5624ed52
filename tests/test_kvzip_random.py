"""Random (the leaderboards' baseline) and KVzip (context reconstruction) on hand-worked numbers.

The invariants every policy shares (budget >= length is Full, prompt path = decoding, forks) are in
tests/test_registry.py; these are the rules that define the two policies.
"""
import copy
import math
from types import SimpleNamespace

import numpy as np
import torch

from backend.policies import KVzip, Random, parse_spec
from backend.policies.random_eviction import uniform
from backend.engine.reconstruction import RereadCache
from backend.engine.runner import compute_traces

# --- Random ------------------------------------------------------------------------------------------------


def test_random_same_seed_same_trace_another_seed_another(tiny, text_ids):
    def evicted(seed):
        (trace,), _ = compute_traces(tiny, ["random"], [Random(budget=8, seed=seed)], text_ids, record_layers=())
        return trace.evicted_at

    assert (evicted(3) >= 0).any()
    np.testing.assert_array_equal(evicted(3), evicted(3))
    assert not np.array_equal(evicted(3), evicted(4))


def test_random_drops_only_once_the_cache_is_full():
    policy = Random(budget=4, seed=0)
    positions = np.array([[0, 1, 2], [0, 1, 2]])
    assert policy.step({}, None, np.ones((2, 3), bool), 2, positions)[1] is None  # 3 < 4 cached: nothing leaves
    positions = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    _, victims = policy.step({}, None, np.ones((2, 4), bool), 3, positions)
    assert victims.shape == (2,) and all(0 <= v < 4 for v in victims)


def test_random_draw_depends_on_seed_step_head_and_position_not_on_column_order():
    # The engine hands the prompt path and the decode path different columns: the draw must follow positions.
    positions = np.array([[5, 9, 12, 40], [5, 9, 12, 40]])
    u = Random(seed=7).score({}, None, 41, positions)
    assert ((0 <= u) & (u < 1)).all() and not np.array_equal(u[0], u[1])  # heads draw apart
    order = [2, 0, 3, 1]
    np.testing.assert_array_equal(Random(seed=7).score({}, None, 41, positions[:, order]), u[:, order])
    np.testing.assert_array_equal(Random(seed=7).score({}, None, 41, positions[:, 1:]), u[:, 1:])
    assert not np.array_equal(uniform(8, 41, positions), u) and not np.array_equal(uniform(7, 42, positions), u)


def test_random_drops_are_spread_over_the_cache_none_protected_not_always_the_oldest():
    # Walk a cache of 8 through 4,000 steps per head: the victim's rank among the cached tokens (0 = the
    # oldest, 7 = the current token) should be uniform, 1/8 each: a window always drops rank 0.
    policy, heads, budget = Random(budget=8, seed=1), 2, 8
    held = np.tile(np.arange(budget - 1), (heads, 1))
    ranks = []
    for t in range(budget - 1, budget - 1 + 4000):
        positions = np.concatenate([held, np.full((heads, 1), t)], 1)
        _, victims = policy.step({}, None, np.ones((heads, budget), bool), t, positions)
        ranks += list(victims)
        held = np.stack([np.delete(positions[h], victims[h]) for h in range(heads)])
    share = np.bincount(ranks, minlength=budget) / len(ranks)
    assert np.abs(share - 1 / budget).max() < 0.02, share  # 8,000 draws: sd of a share ~ 0.004


# --- KVzip ----------------------------------------------------------------------------------------------


def test_kvzip_prompts_are_the_authors_first_piece_then_later_pieces_quoting_8_tokens():
    policy = KVzip(budget=8, chunk=5)
    ids = list(range(100, 112))

    def encode(text):
        return [len(text)]  # one stand-in token per instruction

    assert policy.pieces(0, 12) == [(0, 5), (5, 10), (10, 12)]
    assert policy.pieces(8, 12) == [(8, 12)]
    first = policy.prompt(ids, 0, 5, encode, [7, 7])
    assert first == [len("\n\nRepeat the previous context exactly.")] + [7, 7] + ids[0:5]
    later = policy.prompt(ids, 10, 12, encode, [7])
    quoted = ids[2:10]  # the 8 tokens before the piece
    assert later == [len(KVzip.LATER)] + quoted + [7] + ids[10:12]
    assert KVzip.LATER == "\n\nRepeat the part of the previous context exactly, starting with "


def test_kvzip_score_is_the_max_over_the_groups_query_heads_and_the_pass_of_a_softmax_over_sinks_piece_and_pass():
    # One KV head, two query heads (g), head size 1, two pass tokens after 4 cached positions; sinks = 1,
    # piece = positions 2, 3. Keys 0, ln 3, ln 2, 0 and 0, 0 for the pass; g0's query is 1, g1's is -1.
    keys = torch.tensor([0.0, math.log(3), math.log(2), 0.0, 0.0, 0.0], dtype=torch.float64).view(1, 1, 6, 1)
    values = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float64).view(1, 1, 6, 1)
    query = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64).view(1, 2, 2, 1)

    def attend(alive):
        side = RereadCache([keys[:, :, :4]], [values[:, :, :4]], [np.array([alive])], 2, 4, sinks=1)
        out = side.attend(0, query, keys, values, scaling=1.0)
        return side.scores[0], out

    score, out = attend([True] * 4)
    # The score's softmax spans position 0 (sink), 2, 3 (piece) and the pass (not position 1):
    # g0, first pass query: e^s = 1, 2, 1 | 1 over 5 -> 2/5, 1/5; second: | 1, 1 over 6 -> 1/3, 1/6.
    # g1, first pass query: e^s = 1, 1/2, 1 | 1 over 3.5 -> 1/7, 2/7; second: over 4.5 -> 1/9, 2/9.
    np.testing.assert_allclose(score, [[2 / 5, 2 / 7]])  # position 2 from g0, position 3 from g1
    # The pass itself reads everything cached: g0's first query puts 3/8 on position 1, whose value is 1.
    assert out.shape == (1, 2, 2, 1) and math.isclose(out[0, 0, 0, 0].item(), 3 / 8)
    _, out = attend([True, False, True, True])  # position 1 no longer cached: the pass cannot read it
    assert out[0, 0, 0, 0].item() == 0.0


def test_kvzip_keeps_the_tokens_the_reconstruction_attends_to_most(tiny, text_ids):
    # Independently: the model reads prompt + "Repeat the previous context exactly." + "\n\nAnswer: " (the
    # tiny tokenizer has no chat template) + prompt in one eager forward; a prompt token's score is the max
    # attention from the repeat part, over the query heads of its KV head's group; the sinks and the best
    # others are kept.
    prompt, budget, sinks = text_ids[:24], 8, 2
    policy = KVzip(budget=budget, sinks=sinks)
    (trace,), _ = compute_traces(tiny, ["kvzip"], [policy], prompt, mode="generate", max_new_tokens=2, record_layers=())
    repeat = [ord(c) % 101 for c in KVzip.FIRST + KVzip.NO_TEMPLATE] + prompt
    eager = copy.deepcopy(tiny.model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = eager(torch.tensor([prompt + repeat]), output_attentions=True).attentions
    n, group = len(prompt), tiny.n_heads // tiny.n_kv_heads
    assert trace.meta["extra_pass_tokens"] == len(repeat)
    for layer, attn in enumerate(attentions):
        score = attn[0, :, n:, :n].reshape(tiny.n_kv_heads, group, len(repeat), n).amax(dim=(1, 2)).numpy()
        for head in range(tiny.n_kv_heads):
            best = np.argsort(-score[head, sinks:], kind="stable")[: budget - sinks] + sinks
            expected = sorted([*range(sinks), *best.tolist()])
            kept = np.flatnonzero(trace.evicted_at[layer, head, :n] != n).tolist()
            assert kept == expected, (layer, head)
    assert set(np.unique(trace.evicted_at[..., :n])) == {-1, n}  # one compression, when the prompt was read


def test_kvzip_rereads_each_token_once_and_the_summary_shows_the_extra_pass(tiny, text_ids):
    import viz.panels

    policy = parse_spec("kvzip:budget=8,interval=4")
    traces, full = compute_traces(tiny, ["kvzip:budget=8,interval=4", "snapkv:budget=8,window=2"],
                       [policy, parse_spec("snapkv:budget=8,window=2")], text_ids, record_layers=())
    # Passes after tokens 12, 16, ..., 40 (none while 8 or fewer are cached): the first re-reads tokens 0-11
    # after the first prompt; each later one re-reads its 4 new tokens after the later prompt and 8 quoted.
    suffix = len(KVzip.NO_TEMPLATE)
    expected = len(KVzip.FIRST) + suffix + 12 + 7 * (len(KVzip.LATER) + 8 + suffix + 4)
    assert traces[0].meta["extra_pass_tokens"] == expected
    assert "extra_pass_tokens" not in traces[1].meta
    assert sorted(set(np.unique(traces[0].evicted_at)) - {-1}) == [12, 16, 20, 24, 28, 32, 36, 40]
    table = viz.panels.summary_table(SimpleNamespace(traces=traces, full=full))
    assert list(table["Extra pass"]) == [f"{expected:,} tokens ({expected / 40:.1f}x the text)", "—"]
    assert table["Decides"][0] == "every 4 tokens, after a reconstruction pass"


def test_kvzip_makes_no_pass_when_nothing_would_be_dropped(tiny, text_ids):
    (trace,), full = compute_traces(tiny, ["kvzip"], [KVzip(budget=64)], text_ids[:30], mode="generate", max_new_tokens=3,
                         record_layers=())
    assert trace.meta["extra_pass_tokens"] == 0 and (trace.evicted_at == -1).all()
