"""Quest and StreamingLLM with re-rotation on small blocks worked out by hand."""
import numpy as np
import pytest
import torch

from backend import api
from backend.policies import Quest, Sinks, SpecError, StreamingLLM, parse_spec
from backend.policies.base import Block
from backend.engine.runner import compute_traces, rope_function
from backend.api import RunRequest
from viz import panels
from viz.divergence import divergence_notes


def keys(*rows) -> torch.Tensor:
    """One KV head's keys [1, M, d] from rows of numbers."""
    return torch.tensor([rows], dtype=torch.float64)


def quest_reads(policy, q, k, first=None, layer=5):
    """What each query of the block reads (bool [H_kv, n, M]) and the block's result; q [H_q, n, d]."""
    first = k.shape[1] - q.shape[1] if first is None else first
    block = Block(q=q, k=k, v=torch.ones_like(k), first=first, scaling=1.0, layer=layer, n_layers=30)
    _, result = policy.attend_block({}, block)
    return result.reads, result


# Pages of 2 tokens (d = 2): page 0 keys (1, 0), (0, 1): min (0, 0), max (1, 1); page 1 keys (2, -2), (-2, 2):
# min (-2, -2), max (2, 2); page 2 keys (0.5, 0.5) twice. The query (1, 1) sits at position 6, alone on page 3,
# whose bound (10) is the highest but which is read anyway: it never takes another page's place.
PAGES = keys([1, 0], [0, 1], [2, -2], [-2, 2], [0.5, 0.5], [0.5, 0.5], [5, 5])
ONES = torch.tensor([[[1.0, 1.0]]], dtype=torch.float64)  # one query head, one query: (1, 1)


def test_quest_reads_the_page_with_the_highest_bound_not_the_highest_score():
    # Bounds sum_i max(q_i min_i, q_i max_i): page 0 = 1 + 1 = 2, page 1 = 2 + 2 = 4, page 2 = 0.5 + 0.5 = 1.
    # Exact q.k: page 0 at most 1, page 1 exactly 0, page 2 exactly 1. Budget 4 = 2 pages: its own + the best.
    reads, _ = quest_reads(Quest(budget=4, page_size=2, dense_layers=0), ONES, PAGES)
    assert np.flatnonzero(reads[0, 0]).tolist() == [2, 3, 6]  # page 1, and the query's own page


def test_quest_bound_takes_the_min_key_on_a_negative_query_channel():
    # q = (-1, 0): a page's bound is -(min of its first channel). Page 0 (-3, 4): 3; page 1 (-1, 0): 1;
    # page 2 (2, 2): -2. q . max would pick page 1 (0 > -2 > -4).
    k = keys([-3, 0], [4, 0], [-1, 0], [0, 0], [2, 0], [2, 0], [0, 0])
    q = torch.tensor([[[-1.0, 0.0]]], dtype=torch.float64)
    reads, _ = quest_reads(Quest(budget=4, page_size=2, dense_layers=0), q, k)
    assert np.flatnonzero(reads[0, 0]).tolist() == [0, 1, 6]


def test_quest_always_reads_the_page_holding_the_query_up_to_itself():
    # Pages of 4; query at 5 (page 1 = 4..7) with a bound that prefers page 0... its own page is read anyway,
    # positions 4 and 5 only (6 and 7 come later in the prompt block), and only whole earlier pages compete.
    k = keys(*[[1.0, 0.0]] * 4, *[[-9.0, 0.0]] * 4)
    q = torch.tensor([[[1.0, 0.0]] * 4], dtype=torch.float64)  # queries 4..7 of one prompt block
    reads, result = quest_reads(Quest(budget=4, page_size=4, dense_layers=0), q, k, first=4)
    assert [np.flatnonzero(r).tolist() for r in reads[0]] == [[4], [4, 5], [4, 5, 6], [4, 5, 6, 7]]
    assert result.stats["pages_read"][:, 0].tolist() == [1, 1, 1, 1]  # budget 4 = one page: its own


def test_quest_keeps_its_first_layers_dense():
    policy = Quest(budget=4, page_size=2, dense_layers=2)
    dense, _ = quest_reads(policy, ONES, PAGES, layer=1)
    sparse, _ = quest_reads(policy, ONES, PAGES, layer=2)
    assert dense[0, 0].all() and np.flatnonzero(sparse[0, 0]).tolist() == [2, 3, 6]


def test_quest_ties_go_to_the_earlier_page():
    k = keys(*[[1.0, 1.0]] * 6, [0.0, 0.0])  # pages 0, 1 and 2 hold the same keys: equal bounds
    reads, _ = quest_reads(Quest(budget=4, page_size=2, dense_layers=0), ONES, k)
    assert np.flatnonzero(reads[0, 0]).tolist() == [0, 1, 6]


def test_quest_group_sum_picks_one_page_set_per_kv_head_and_each_lets_query_heads_choose():
    # Two query heads on one KV head: head a bounds page 0 at 4 and page 1 at 0, head b page 0 at 0, page 1 at 3.
    k = keys([4, 0], [4, 0], [0, 3], [0, 3], [0, 0])
    q = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)
    summed, result = quest_reads(Quest(budget=4, page_size=2, dense_layers=0), q, k)
    assert np.flatnonzero(summed[0, 0]).tolist() == [0, 1, 4]  # group sums: page 0 (4) beats page 1 (3)
    each, result_each = quest_reads(Quest(budget=4, page_size=2, dense_layers=0, group="each"), q, k)
    assert np.flatnonzero(each[0, 0]).tolist() == [0, 1, 2, 3, 4]  # the union of each head's choice
    assert result.stats["pages_read"].tolist() == [[2]] and result_each.stats["pages_read"].tolist() == [[3]]


def test_quest_attends_exactly_over_the_pages_it_reads():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 3, 8), (2, 20, 8), (2, 20, 8)))
    policy = Quest(budget=8, page_size=4, dense_layers=0)
    _, result = policy.attend_block({}, Block(q=q, k=k, v=v, first=17, scaling=0.3, layer=3, n_layers=4))
    for head in range(4):
        kv = head // 2
        for i in range(3):
            read = torch.from_numpy(result.reads[kv, i])
            assert read.sum() <= 8 and read[16: 18 + i].all()  # its own page (16..19) up to itself
            weights = torch.softmax((q[head, i] @ k[kv, read].T) * 0.3, -1)
            torch.testing.assert_close(result.out[i, head], weights @ v[kv, read])


def test_quest_parameters_are_checked():
    with pytest.raises(SpecError, match="page_size"):
        parse_spec("quest:budget=8,page_size=16")
    with pytest.raises(SpecError, match="group"):
        parse_spec("quest:group=max")
    assert Quest.for_budget(40).page_size == 10 and Quest.for_budget(128).page_size == 16


# ----------------------------------------------------------------------------------------- StreamingLLM


def test_streamingllm_caches_sinks_then_the_window_in_cache_order():
    where, exists = StreamingLLM(budget=5, sinks=2).cache_of(torch.tensor([2, 4, 9]), 10)
    assert where.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 7, 8, 9]]
    assert exists.tolist() == [[True] * 3 + [False] * 2, [True] * 5, [True] * 5]


def rerotated_reference(policy, q_pre, k_pre, v, first, rope):
    """The authors' way, one query at a time: its cache (``cache_of``) rotated at 0..L-1, the query at its place."""
    n_q_heads, n, dim = q_pre.shape
    n_kv_heads = k_pre.shape[0]
    group = n_q_heads // n_kv_heads
    where, exists = policy.cache_of(torch.arange(first, first + n), k_pre.shape[1])
    out = torch.empty(n, n_q_heads, dim, dtype=q_pre.dtype)
    for i in range(n):
        kept = where[i][exists[i]]
        keys = rope(k_pre[:, kept], torch.arange(len(kept)))
        query = rope(q_pre[:, i:i + 1], torch.tensor([len(kept) - 1]))[:, 0]
        for h in range(n_q_heads):
            weights = torch.softmax(query[h] @ keys[h // group].T * dim ** -0.5, -1)
            out[i, h] = weights @ v[h // group, kept]
    return out, where, exists


@pytest.mark.parametrize("first, n", [(0, 12), (3, 1), (9, 1), (5, 15), (14, 6)])
@pytest.mark.parametrize("budget, sinks", [(5, 2), (6, 0), (8, 4)])
def test_streamingllm_equals_rotating_each_querys_cache(tiny, first, n, budget, sinks):
    """The block computation (window scores at text positions, sinks against the query at its place in the
    cache) against re-rotating every query's cache as the authors' ``pos_shift`` does."""
    rope = rope_function(tiny)
    g = torch.Generator().manual_seed(first * 31 + n)
    dim = tiny.model.config.hidden_size // tiny.model.config.num_attention_heads
    q_pre = torch.randn(6, n, dim, generator=g, dtype=torch.float64)
    k_pre, v = (torch.randn(2, first + n, dim, generator=g, dtype=torch.float64) for _ in range(2))
    q, k = rope(q_pre, torch.arange(first, first + n)), rope(k_pre, torch.arange(first + n))
    policy = StreamingLLM(budget=budget, sinks=sinks)
    block = Block(q=q, k=k, v=v, first=first, scaling=dim ** -0.5, q_pre=q_pre, k_pre=k_pre, rope=rope)
    _, result = policy.attend_block({}, block)
    expected, where, exists = rerotated_reference(policy, q_pre, k_pre, v, first, rope)
    # Equal up to the RoPE tables' float32 angles (transformers builds cos/sin from float32 frequencies), so
    # rotating by t and by t - slid agree to ~1e-7, not to float64 rounding.
    torch.testing.assert_close(result.out, expected, atol=1e-6, rtol=1e-6)
    for i in range(n):
        assert np.flatnonzero(result.reads[0, i]).tolist() == sorted(where[i][exists[i]].tolist())
        np.testing.assert_allclose(result.attn[:, i].sum(-1), 1.0, atol=1e-6)


def test_streamingllm_with_real_rope_moves_only_the_sinks(tiny):
    """Query 9 with budget 5: inside the window the distance to each key is as in the text, so with no sinks
    the output is the original-position window's; with sinks it is not (sink 0 sits 4 back, not 9)."""
    rope = rope_function(tiny)
    g = torch.Generator().manual_seed(1)
    dim = tiny.model.config.hidden_size // tiny.model.config.num_attention_heads
    q_pre, k_pre, v = (torch.randn(*s, generator=g, dtype=torch.float64)
                       for s in ((1, 1, dim), (1, 10, dim), (1, 10, dim)))
    q, k = rope(q_pre, torch.tensor([9])), rope(k_pre, torch.arange(10))  # the model's keys at text positions

    def original(kept):  # what sinks computes: the same tokens at their positions in the text
        weights = torch.softmax(q[0, 0] @ k[0, kept].T, -1)
        return weights @ v[0, kept]

    def streaming(sinks):
        block = Block(q=q, k=k, v=v, first=9, scaling=1.0, q_pre=q_pre, k_pre=k_pre, rope=rope)
        return StreamingLLM(budget=5, sinks=sinks).attend_block({}, block)[1].out[0, 0]

    torch.testing.assert_close(streaming(0), original([5, 6, 7, 8, 9]))
    assert not torch.allclose(streaming(2), original([0, 1, 7, 8, 9]), atol=1e-6)
    # ... and it is the re-rotated cache's attention: keys at 0..4, the query at 4.
    keys_in_cache = rope(k_pre[:, [0, 1, 7, 8, 9]], torch.arange(5))
    weights = torch.softmax(rope(q_pre, torch.tensor([4]))[0, 0] @ keys_in_cache[0].T, -1)
    torch.testing.assert_close(streaming(2), weights @ v[0, [0, 1, 7, 8, 9]])


def test_streamingllm_reads_what_sinks_reads_and_differs_once_tokens_drop(tiny, text_ids):
    budget = 8
    (rerotated, sinks), full = compute_traces(tiny, ["streamingllm", "sinks"], [StreamingLLM(budget=budget), Sinks(budget=budget)],
                                   text_ids, record_layers=())
    for layer in range(tiny.n_layers):
        np.testing.assert_array_equal(rerotated.reads(layer), sinks.reads(layer))
    # Query t reads positions 0..t at their own positions until t = budget - 1: the same as Full.
    np.testing.assert_allclose(rerotated.logprobs[:budget], full.logprobs[:budget], atol=1e-9)
    np.testing.assert_allclose(sinks.logprobs[:budget], full.logprobs[:budget], atol=1e-9)
    gap = np.abs(rerotated.logprobs[budget:] - sinks.logprobs[budget:])
    assert gap.min() > 1e-9  # every later step: the sinks sit elsewhere


def test_divergence_view_explains_rerotation_when_streamingllm_runs(tiny_session):
    prompt = "one two three four five six seven eight nine ten"
    run_both = api.run(RunRequest(prompt=prompt, specs=["sinks:budget=6", "streamingllm:budget=6"],
                                          mode="prompt"), tiny_session)
    _, shown = panels.divergence(run_both)
    assert shown.startswith(divergence_notes(["streamingllm"])) and "Sec. 3.2" in shown and "no continuations" in shown
    assert divergence_notes(["sinks:budget=40", "tova:budget=40"]) == ""  # only when streamingllm runs
