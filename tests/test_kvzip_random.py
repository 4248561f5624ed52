"""Random (the leaderboards' baseline) and KVzip (context reconstruction) on hand-worked numbers.

The invariants every policy shares (budget >= length is Full, prompt path = decoding, forks) are in
tests/test_registry.py; these are the rules that define the two policies.
"""
import copy
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from backend.policies import KVzip, Random, SpecError, parse_spec
from backend.policies.random_eviction import uniform
from backend.engine.attention import PolicyCache
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


def _splitmix_chain(seed, t, positions, layer=None):
    """The draw as Random documents it, written plainly: splitmix64's finaliser over (seed, [layer,] step, KV head,
    position) in turn, every round on whole arrays of 64-bit integers."""
    from backend.policies.base import splitmix64 as _mix
    from backend.policies.random_eviction import _GAMMA

    positions = np.asarray(positions, dtype=np.int64)
    heads = np.arange(positions.shape[0], dtype=np.uint64)[:, None]
    x = _mix(np.full(positions.shape, seed, np.uint64) + _GAMMA)
    values = (np.uint64(t), heads, positions.astype(np.uint64))
    for value in values if layer is None else (np.uint64(layer), *values):
        x = _mix((x ^ value) + _GAMMA)
    return (x >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def test_random_draws_are_splitmix64s_chain_to_the_bit():
    """The shipped leaderboards' and lessons' Random rows were drawn from this chain: a faster form of it must give
    the same bits, seeds past 2**32, layers and steps at 32k included."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        heads, columns = int(rng.integers(1, 9)), int(rng.integers(1, 600))
        positions = np.sort(rng.integers(0, 40_000, (heads, columns)), axis=1)
        seed = int(rng.integers(0, 2**63)) if trial % 3 else trial % 5
        t, layer = int(rng.integers(0, 40_000)), None if trial % 2 else int(rng.integers(0, 40))
        np.testing.assert_array_equal(uniform(seed, t, positions, layer), _splitmix_chain(seed, t, positions, layer))
    np.testing.assert_allclose(uniform(7, 41, np.array([[5, 9, 12, 40]])), [[0.93821619, 0.32346201, 0.56492399,
                                                                              0.1658576]], atol=1e-8)


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


def test_random_layers_share_the_draws_by_default_or_each_layer_draws_its_own(tiny, text_ids):
    # "shared", as kvpress's RandomPress with a seed (it re-seeds in every layer); "each", as it without one.
    def evicted(layers):
        policy = Random(budget=8, seed=3, layers=layers)
        (trace,), _ = compute_traces(tiny, ["random"], [policy], text_ids, record_layers=())
        return trace.evicted_at  # [L, H, T]

    shared, each = evicted("shared"), evicted("each")
    np.testing.assert_array_equal(shared[0], shared[1])
    assert not np.array_equal(each[0], each[1])
    np.testing.assert_array_equal(evicted("each"), each)
    with pytest.raises(SpecError, match="layers"):
        parse_spec("random:budget=8,layers=all")


@pytest.mark.parametrize("mode", ["prompt", "generate"])
def test_random_walks_a_block_in_one_layer_and_the_others_replay_it_to_the_bit(tiny, text_ids, monkeypatch, mode):
    # Its shared draws ignore the layer (Policy.decides_alike_in_every_layer): the first layer walks each block, the
    # others take its decisions (PolicyCache.replay). Every trace is the same to the bit with the replay off, where
    # every layer walks; with draws of its own each layer walks either way.
    steps = []
    step = Random.step
    monkeypatch.setattr(Random, "step", lambda self, *args: steps.append(self.layers) or step(self, *args))
    policies = [Random(budget=8, seed=3), Random(budget=8, seed=3, layers="each")]

    def run(replay: bool):
        monkeypatch.setattr(PolicyCache, "replay", replay)
        steps.clear()
        traces, full = compute_traces(tiny, ["shared", "each"], policies, text_ids, mode=mode, max_new_tokens=5,
                                      record_layers=())
        return [*traces, full], steps.count("shared"), steps.count("each")

    (replayed, shared_steps, each_steps), (walked, shared_alone, each_alone) = run(True), run(False)
    layers = tiny.model.config.num_hidden_layers
    assert layers > 1 and shared_steps >= len(text_ids) and each_steps == each_alone == shared_alone
    assert shared_steps * layers == shared_alone
    for one, other in zip(replayed, walked):
        assert one.meta == other.meta
        mine, theirs = one.arrays(), other.arrays()
        assert sorted(mine) == sorted(theirs)
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=f"{one.spec}: {name}")
    assert (replayed[0].evicted_at >= 0).any()


# --- KVzip ----------------------------------------------------------------------------------------------


def test_kvzip_prompts_are_the_authors_first_piece_then_later_pieces_quoting_8_tokens():
    policy = KVzip(budget=8, chunk=5, sinks=2)
    ids = list(range(100, 112))

    def encode(text):
        return [len(text)]  # one stand-in token per instruction

    assert policy.pieces(2, 12) == [(2, 7), (7, 12)]
    assert policy.pieces(8, 12) == [(8, 12)]
    # A plain text: the context starts after the sinks, and its first piece gets the first prompt.
    first = policy.prompt(ids, 2, 7, encode, [7, 7], prefix=0)
    assert first == [len("\n\nRepeat the previous context exactly.")] + [7, 7] + ids[2:7]
    later = policy.prompt(ids, 7, 12, encode, [7], prefix=0)
    quoted = ids[0:7]  # the tokens before the piece, at most 8
    assert later == [len("\n\nRepeat the part of the previous context exactly, starting with ")] + quoted + [7] + ids[7:12]
    # kvpress quotes without the trailing space.
    kvpress = KVzip(budget=8, chunk=5, sinks=2, quote_space=False).prompt(ids, 7, 12, encode, [7], prefix=0)
    assert kvpress[0] == len("\n\nRepeat the part of the previous context exactly, starting with")
    # A chat prompt whose header is 5 tokens: the context starts after it, unless the header is re-read.
    assert policy.prompt(ids, 5, 10, encode, [7], prefix=5)[0] == len(KVzip.FIRST)
    assert policy.rereads_from(policy.init_state(1), prefix=5) == 5
    assert KVzip(budget=8, sinks=2, prefix="reread").rereads_from(policy.init_state(1), prefix=5) == 2
    assert policy.rereads_from(policy.init_state(1), prefix=0) == 2  # never the sinks


def test_kvzip_model_scope_ranks_every_layer_and_head_together_on_a_hand_built_table():
    # Two layers x two heads x 6 positions, sinks 1, budget 2: 2 x 2 x 2 = 8 slots in all, 4 go to the sinks.
    # The other 4 go to the best scores wherever they are: 0.9 (L0 h0 p3), 0.8 (L1 h1 p2), 0.7 (L1 h1 p5),
    # 0.6 (L1 h1 p4); layer 0's head 1 keeps only its sink, layer 1's head 1 keeps 4 tokens.
    table = np.array([[[0, .1, .2, .9, .1, .1], [0, .2, .1, .1, .05, .05]],
                      [[0, .3, .1, .1, .2, .5], [0, .1, .8, .3, .6, .7]]])
    table[0, 0, 5] = .55  # the fifth best: it is dropped
    held = [np.ones((2, 6), bool), np.ones((2, 6), bool)]

    def plan(**kw):
        policy = KVzip(budget=2, sinks=1, **kw)
        states = []
        for layer in range(2):
            state = policy.init_state(2)
            policy.record(state, 1, 6, table[layer, :, 1:])
            states.append(state)
        policy.plan(states, held, t=5, prefix=0)
        return [np.flatnonzero(s["plan"][h]).tolist() for s in states for h in range(2)]

    assert plan() == [[0, 3], [0], [0], [0, 2, 4, 5]]
    # layer: each layer's 2 x 2 slots over its heads (kvpress's layerwise=True); head: 2 per head.
    assert plan(scope="layer") == [[0, 3, 5], [0], [0], [0, 2, 5]]
    assert plan(scope="head") == [[0, 3], [0, 1], [0, 5], [0, 2]]
    # A position no longer held is never kept, and the slots go to the next best.
    held[1][1, 2] = False
    assert plan() == [[0, 3, 5], [0], [0], [0, 4, 5]]
    # Only a compression over the scope's total would drop anything.
    policy = KVzip(budget=3, sinks=1)
    uneven = [np.array([[1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0]], bool)] * 2  # 6 held per layer, 3 x 2 allowed
    assert not policy.would_drop(uneven, prefix=0)
    assert KVzip(budget=3, sinks=1, scope="head").would_drop(uneven, prefix=0)
    # A kept chat header is besides the budget: 2 header tokens per head leave 4 per layer, within 3 x 2.
    assert not KVzip(budget=2, sinks=1, scope="layer").would_drop(uneven, prefix=3)
    assert KVzip(budget=2, sinks=1, scope="layer", prefix="zero").would_drop(uneven, prefix=3)


def test_kvzip_prefix_keep_zero_or_reread():
    # A 3-token chat header (a sink, then 2): kept besides the budget (the authors), scored 0 (kvpress: it goes
    # first), or scored as the context.
    policy = KVzip(budget=3, sinks=1)
    state = policy.init_state(1)
    policy.record(state, 3, 6, np.array([[.5, .2, .1]]))
    held = [np.ones((1, 6), bool)]
    for prefix, kept in (("keep", [0, 1, 2, 3, 4]), ("zero", [0, 3, 4])):
        p = KVzip(budget=3, sinks=1, prefix=prefix)
        p.plan([state], held, t=5, prefix=3)
        assert np.flatnonzero(state["plan"][0]).tolist() == kept, prefix
    p = KVzip(budget=3, sinks=1, prefix="reread")
    p.record(state, 1, 3, np.array([[.3, .05]]))  # the pass re-read the header too
    p.plan([state], held, t=5, prefix=3)
    assert np.flatnonzero(state["plan"][0]).tolist() == [0, 1, 3]


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
    # tiny tokenizer has no chat template) + the prompt after its sinks in one eager forward; a prompt token's
    # score is the max attention from the repeat part, over the query heads of its KV head's group, the
    # softmax spanning the sinks, the re-read tokens and the pass; the sinks and the best others are kept,
    # per head (scope=head) or over all layers and heads (scope=model).
    prompt, budget, sinks = text_ids[:24], 8, 2
    repeat = [ord(c) % 101 for c in KVzip.FIRST + KVzip.NO_TEMPLATE] + prompt[sinks:]
    eager = copy.deepcopy(tiny.model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        attentions = eager(torch.tensor([prompt + repeat]), output_attentions=True).attentions
    n, group = len(prompt), tiny.n_heads // tiny.n_kv_heads
    # The eager softmax spans the whole cache; re-normalise it over the sinks, the re-read part and the pass.
    scores = []
    for attn in attentions:
        a = attn[0, :, n:, :].double()
        p = a / a.sum(-1, keepdim=True)  # nothing to leave out: the sinks, the re-read part, the pass
        scores.append(p[..., sinks:n].reshape(tiny.n_kv_heads, group, len(repeat), n - sinks).amax(dim=(1, 2)).numpy())
    scores = np.stack(scores)  # [L, H, n - sinks]

    def kept_of(trace):
        return [[np.flatnonzero(trace.evicted_at[layer, head, :n] != n).tolist() for head in range(tiny.n_kv_heads)]
                for layer in range(len(attentions))]

    (trace,), _ = compute_traces(tiny, ["kvzip"], [KVzip(budget=budget, sinks=sinks, scope="head")], prompt,
                                 mode="generate", max_new_tokens=2, record_layers=())
    assert trace.meta["extra_pass_tokens"] == len(repeat)
    expected = [[sorted([*range(sinks), *(np.argsort(-scores[layer, head], kind="stable")[: budget - sinks]
                                          + sinks).tolist()]) for head in range(tiny.n_kv_heads)]
                for layer in range(len(attentions))]
    assert kept_of(trace) == expected
    assert set(np.unique(trace.evicted_at[..., :n])) == {-1, n}  # one compression, when the prompt was read

    (trace,), _ = compute_traces(tiny, ["kvzip"], [KVzip(budget=budget, sinks=sinks)], prompt,
                                 mode="generate", max_new_tokens=2, record_layers=())
    slots = budget * tiny.n_kv_heads * len(attentions) - sinks * tiny.n_kv_heads * len(attentions)
    best = np.argsort(-scores, axis=None, kind="stable")[:slots]
    chosen = np.zeros(scores.shape, bool)
    chosen.flat[best] = True
    expected = [[[*range(sinks), *(np.flatnonzero(chosen[layer, head]) + sinks).tolist()]
                 for head in range(tiny.n_kv_heads)] for layer in range(len(attentions))]
    assert kept_of(trace) == expected
    assert len({len(k) for layer in expected for k in layer}) > 1  # the heads' shares differ


def test_kvzip_rereads_each_token_once_and_the_summary_shows_the_extra_pass(tiny, text_ids):
    import viz.panels

    policy = parse_spec("kvzip:budget=8,interval=4")
    traces, full = compute_traces(tiny, ["kvzip:budget=8,interval=4", "snapkv:budget=8,window=2"],
                       [policy, parse_spec("snapkv:budget=8,window=2")], text_ids, record_layers=())
    # Passes after tokens 12, 16, ..., 40 (none while 8 or fewer are cached): the first re-reads tokens 4-11
    # (never the 4 sinks) after the first prompt; each later one re-reads its 4 new tokens after the later
    # prompt and 8 quoted.
    suffix = len(KVzip.NO_TEMPLATE)
    expected = len(KVzip.FIRST) + suffix + 8 + 7 * (len(KVzip.LATER + " ") + 8 + suffix + 4)
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


@pytest.mark.slow
def test_kvzip_pass_rereads_the_context_after_the_chat_header_and_after_the_sinks_of_a_plain_text(default_lm):
    from backend.engine.reconstruction import _encode, assistant_turn, template_header

    text = open("assets/examples/needle.txt").read()
    lm = default_lm
    chat = lm.encode(text, chat=True)
    # SmolLM2's header, by hand: "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by
    # Hugging Face<|im_end|>\n<|im_start|>user\n" is 24 tokens; the needle prompt is 241.
    assert len(chat) == 241 and template_header(lm, chat) == 24
    assert lm.tokenizer.decode(chat[:24]).endswith("<|im_end|>\n<|im_start|>user\n")
    first = len(_encode(lm, KVzip.FIRST)) + len(assistant_turn(lm, KVzip.NO_TEMPLATE))
    prefixes = {"keep": 241 - 24, "zero": 241 - 24, "reread": 241 - 4}
    traces, _ = compute_traces(lm, list(prefixes), [KVzip(budget=32, prefix=p) for p in prefixes], chat,
                               mode="generate", max_new_tokens=1, record_layers=())
    for (prefix, reread), trace in zip(prefixes.items(), traces):
        assert trace.meta["extra_pass_tokens"] == first + reread, prefix
        kept = trace.evicted_at[..., :241] == -1
        assert kept[..., :4].all()  # the sinks, always
        assert kept[..., 4:24].all() == (prefix == "keep")
        if prefix == "zero":
            assert not kept[..., 4:24].any()  # scored 0: the header goes first
    plain = lm.encode(text)
    assert template_header(lm, plain) == 0
    (trace,), _ = compute_traces(lm, ["kvzip"], [KVzip(budget=32)], plain, mode="generate", max_new_tokens=1,
                                 record_layers=())
    assert trace.meta["extra_pass_tokens"] == first + len(plain) - 4  # never the sinks


def test_rows_that_would_make_the_same_pass_share_it_and_score_as_alone(tiny, text_ids, monkeypatch):
    """KVzip at budgets 8 and 9, compressing every 4 tokens: at the first compression (after token 12) both rows
    hold the whole text, so that reconstruction goes through the model once, for both; from then on their caches
    differ and each makes its own. Every row's trace is the one it gets alone, and counts the pass's tokens."""
    from backend.engine import reconstruction

    made = []
    one_pass = reconstruction._pass

    def counted(lm, cache, row, *args):
        made.append(row)
        return one_pass(lm, cache, row, *args)

    monkeypatch.setattr(reconstruction, "_pass", counted)
    specs = ["kvzip:budget=8,interval=4", "kvzip:budget=9,interval=4"]
    both, _ = compute_traces(tiny, specs, [parse_spec(s) for s in specs], text_ids, record_layers=(0,))
    shared = list(made)
    alone = []
    for spec in specs:
        made.clear()
        (trace,), _ = compute_traces(tiny, [spec], [parse_spec(spec)], text_ids, record_layers=(0,))
        alone.append((trace, len(made)))
    # Row 0 is Full; rows 1 and 2 pass after tokens 12, 16, ..., 40: the first pass is row 1's, for both.
    assert [passes for _, passes in alone] == [8, 8]
    assert shared == [1] + [1, 2] * 7
    for spec, trace, (own, _) in zip(specs, both, alone):
        np.testing.assert_array_equal(trace.evicted_at, own.evicted_at, err_msg=spec)
        np.testing.assert_allclose(trace.logprobs, own.logprobs, atol=1e-9, err_msg=spec)
        assert trace.meta["extra_pass_tokens"] == own.meta["extra_pass_tokens"] > 0
    assert not np.array_equal(both[0].evicted_at, both[1].evicted_at)
