"""What makes long texts affordable: Eviction rows only ever score the tokens they hold plus the
block; selection reads are stored as spans; recorded attention as top-k rows; ReAttention cuts prompts its
own way without forcing the other rows into one block."""
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.engine.attention import ATTN_IMPLEMENTATION, RowLayerState
from backend.policies import A2SF, H2O, TOVA, Full, Oracle, ReAttention, Sinks, SnapKV, SparQ
from backend.policies.base import top_positions, top_positions_block
from backend.traces.recorded import MIN_TOP_K, RECORD_BYTES, TopAttention, choose_top_k, key_positions
from backend.engine.models import LoadedModel
from backend.engine.runner import block_ends, compute_traces, default_record_layers, score_text
from backend.traces.spans import ReadSpans, SpanRecorder
from backend.traces.trace import Trace
from tests.conftest import TinyTokenizer


def random_masks(seed=0, layers=2, heads=3, n=40, share=0.3):
    rng = np.random.default_rng(seed)
    masks = (rng.random((layers, heads, n, n)) < share) & np.tri(n, dtype=bool)
    masks[..., np.arange(n), np.arange(n)] = True
    return masks


def test_a_block_that_changes_nothing_adds_no_span():
    """Queries that read exactly what the query before them read (possible when a query skips itself)."""
    recorder = SpanRecorder(1)
    same = np.array([[[True, True, False]]])
    recorder.add(same, 2)
    recorder.add(same, 3)
    (pos, start, end), = recorder.finish(4)
    assert pos.tolist() == [0, 1] and start.tolist() == [2, 2] and end.tolist() == [4, 4]


def test_spans_give_back_every_window_of_the_mask():
    masks = random_masks()
    spans = ReadSpans.from_masks(masks)
    np.testing.assert_array_equal(spans.dense(), masks)
    np.testing.assert_array_equal(spans.window(1, slice(5, 17), slice(3, 30)), masks[1][:, 5:17, 3:30])
    np.testing.assert_array_equal(spans.at(0, 13), masks[0][:, 13])
    np.testing.assert_array_equal(spans.counts(), masks.sum(2))


def test_spans_recorded_block_by_block_equal_spans_of_the_whole_mask():
    masks = random_masks(seed=3)
    whole = ReadSpans.from_masks(masks)
    for layer in range(masks.shape[0]):
        recorder = SpanRecorder(masks.shape[1])
        for lo in range(0, 40, 7):
            recorder.add(masks[layer][:, lo:lo + 7, :lo + 7], lo)
        for head, (pos, start, end) in enumerate(recorder.finish(40)):
            for mine, theirs in zip((pos, start, end), whole.head(layer, head)):
                np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("prompt", [0, 1, 13])
def test_spans_recorded_a_query_at_a_time_equal_spans_of_the_whole_mask(prompt):
    """A prompt block, then one query a step (decoding, ``SpanRecorder.add``'s one-query path)."""
    masks = random_masks(seed=4)
    whole = ReadSpans.from_masks(masks)
    for layer in range(masks.shape[0]):
        recorder = SpanRecorder(masks.shape[1])
        if prompt:
            recorder.add(masks[layer][:, :prompt, :prompt], 0)
        for t in range(prompt, 40):
            recorder.add(masks[layer][:, t:t + 1, :t + 1], t)
        for head, (pos, start, end) in enumerate(recorder.finish(40)):
            for mine, theirs in zip((pos, start, end), whole.head(layer, head)):
                np.testing.assert_array_equal(mine, theirs)


@pytest.mark.parametrize("seed, share", [(0, 0.3), (1, 0.05), (2, 0.9)])
def test_stored_spans_give_back_the_same_spans(seed, share):
    """The stored form (per-position counts, gaps and lengths: trace format 3) decodes to the very spans."""
    spans = ReadSpans.from_masks(random_masks(seed=seed, share=share, n=50))
    stored = spans.arrays()
    assert set(stored) == {"span_counts", "span_gap", "span_length"}
    assert all(a.dtype.kind == "u" and a.dtype.itemsize == 1 for a in stored.values())  # T = 50: a byte each
    back = ReadSpans.from_arrays(stored, spans.n_layers, spans.n_heads, spans.length)
    for name in ("offsets", "pos", "start", "end"):
        np.testing.assert_array_equal(getattr(back, name), getattr(spans, name))


def flickering_spans(n_rows=90, per_row=20_000, length=8192, seed=0) -> ReadSpans:
    """Spans as SparQ's at 8k leave them: many per position, most one query long (30 layers x 3 KV heads)."""
    rng = np.random.default_rng(seed)
    pos = np.sort(rng.integers(0, length // 2, (n_rows, per_row)), axis=1).ravel()
    first = np.r_[True, pos[1:] != pos[:-1]]
    rank = np.arange(len(pos)) - np.flatnonzero(first)[np.cumsum(first) - 1]  # the span's index at its position
    start = pos + 2 * rank
    offsets = np.arange(0, len(pos) + 1, per_row, dtype=np.int64)
    return ReadSpans(n_rows // 3, 3, length, offsets, *(a.astype(np.int32) for a in (pos, start, start + 1)))


def test_storing_and_reading_spans_back_takes_no_whole_array_temporaries():
    """A flickering selection row at 8k holds ~10^8 spans at 12 bytes each; storing them, reading them back and
    counting them must not cost several times that again (whole-array int64 temporaries take ~85 bytes a span:
    18 GB for SparQ at 8k on the default model)."""
    import tracemalloc

    spans = flickering_spans()
    n = len(spans.pos)

    def extra(step):
        """(what step returns, the most memory it took beyond what was held before it)."""
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        out = step()
        return out, tracemalloc.get_traced_memory()[1] - before

    tracemalloc.start()
    stored, storing = extra(spans.arrays)
    back, reading = extra(lambda: ReadSpans.from_arrays(stored, spans.n_layers, spans.n_heads, spans.length))
    _, counting = extra(back.counts)
    tracemalloc.stop()
    tables = 2 * 8 * spans.n_layers * spans.n_heads * spans.length  # [rows, T] counts in int64, and a copy
    assert storing < 10 * n + tables  # the stored gaps and lengths (2 bytes each at 8k, narrowed copies beside)
    assert reading < 14 * n + tables  # the 12 bytes a span the spans themselves take
    assert counting < 1 * n + tables
    np.testing.assert_array_equal(back.start, spans.start)


def test_stored_spans_of_a_head_that_read_nothing():
    masks = random_masks()
    masks[1, 2] = False  # layer 1, head 2 never read anything
    spans = ReadSpans.from_masks(masks)
    back = ReadSpans.from_arrays(spans.arrays(), 2, 3, 40)
    np.testing.assert_array_equal(back.dense(), masks)


def test_a_token_read_by_every_query_is_one_span():
    masks = np.tri(10, dtype=bool)[None, None]
    spans = ReadSpans.from_masks(masks)
    assert len(spans.pos) == 10  # one span per token: from its arrival to the end
    np.testing.assert_array_equal(spans.end, 10)


def test_block_selection_equals_step_by_step_top_positions_ties_included():
    rng = np.random.default_rng(0)
    score = rng.integers(0, 4, (2, 6, 12)).astype(float)  # many ties
    first = 6
    for heads in ("head", "layer"):
        block = top_positions_block(score, 4, heads, first)
        for i in range(6):
            t = first + i
            np.testing.assert_array_equal(block[:, i, : t + 1], top_positions(score[:, i, : t + 1], 4, heads))
            assert not block[:, i, t + 1:].any()


@pytest.mark.parametrize("policy", [Sinks(budget=6, sinks=2), H2O(budget=6), TOVA(budget=5), A2SF(budget=5)],
                         ids=lambda p: p.name)
def test_an_eviction_row_scores_only_what_it_holds_plus_the_block(policy, monkeypatch):
    """However long the text, a block's queries meet at most budget + block keys."""
    widths = []
    walk = RowLayerState._walk

    def spy(self, scores, *args):
        widths.append(scores.shape[-1])
        return walk(self, scores, *args)

    monkeypatch.setattr(RowLayerState, "_walk", spy)
    state = RowLayerState(policy, 2)
    torch.manual_seed(0)
    keys, values = torch.randn(2, 200, 8, dtype=torch.float64), torch.randn(2, 200, 8, dtype=torch.float64)
    for lo in range(0, 200, 10):
        state.attend(torch.randn(2, 3, 10, 8, dtype=torch.float64), keys[:, :lo + 10], values[:, :lo + 10], lo,
                     0.3, None)
        assert state.slots.shape[1] <= policy.budget
    assert max(widths) <= policy.budget + 10
    assert (state.evicted_at >= 0).sum(1).tolist() == [200 - policy.budget + 1] * 2


def test_reattention_cuts_blocks_at_its_chunks_and_no_longer_takes_the_whole_prompt():
    policy = ReAttention(budget=12, global_size=2, span=2, topk=2, chunk=4)  # opens with 8, then chunks of 4
    assert block_ends(10, 40, [Full(), policy]) == [8, 16, 24, 32, 40]
    assert block_ends(10, 40, [Full(), TOVA(budget=5)]) == [10, 20, 30, 40]
    assert block_ends(3, 30, [policy]) == [8, 12, 16, 20, 24, 28, 30]


def test_reattention_rows_whose_chunks_never_meet_do_not_make_one_huge_block():
    """Budgets 64 and 72 open at 48 and 56 with chunks of 16: no common cut after the start. Blocks stay
    within REACH chunks instead of becoming the whole prompt."""
    rows = [Full(), H2O(budget=256), ReAttention(budget=64), ReAttention(budget=72)]
    ends = block_ends(256, 8192, rows)
    assert ends[-1] == 8192 and max(np.diff([0, *ends])) <= 256 * 4
    assert block_ends(256, 8192, rows[:3])[:3] == [256, 512, 768]  # one grid (48 + 16k): 256 is one of its ends
    assert block_ends(250, 8192, rows[:3])[:3] == [240, 480, 720]


def test_reattention_in_blocks_equals_reattention_over_the_whole_prompt(tiny, text_ids):
    policy = ReAttention(budget=12, global_size=2, span=2, topk=2, chunk=4)
    whole, s_whole, (row, _) = score_text(tiny, text_ids, [policy, TOVA(budget=5)], chunk=len(text_ids))
    blocks, s_blocks, (same_row, _) = score_text(tiny, text_ids, [policy, TOVA(budget=5)], chunk=5)
    assert row == same_row == 2  # after TOVA, which departs from Full sooner
    np.testing.assert_allclose(s_whole["logprobs"], s_blocks["logprobs"], atol=1e-9)
    np.testing.assert_array_equal(whole.selected(row), blocks.selected(row))


def test_top_attention_keeps_the_largest_entries_and_is_exact_when_they_fit():
    rows = np.zeros((1, 1, 4, 4))
    rows[0, 0] = [[1, 0, 0, 0], [0.3, 0.7, 0, 0], [0.5, 0.1, 0.4, 0], [0.1, 0.2, 0.3, 0.4]]
    exact = TopAttention.from_dense(rows)
    assert exact.exact
    np.testing.assert_allclose(exact.dense(0)[0], rows[0, 0], atol=1e-3)
    np.testing.assert_allclose(exact.column(0, 0, 1), [0, 0.7, 0.1, 0.2], atol=1e-3)
    pos = np.array([[[[0, -1], [1, 0], [0, 2], [3, 2]]]], np.int32)  # the top 2 of each row
    top = TopAttention(pos=pos, val=np.where(pos >= 0, np.take_along_axis(rows, np.maximum(pos, 0), -1), 0)
                       .astype(np.float16))
    assert not top.exact
    np.testing.assert_allclose(top.rows(0, 0, slice(2, 4)), [[0.5, 0, 0.4, 0], [0, 0, 0.3, 0.4]], atol=1e-3)
    np.testing.assert_allclose(top.covered(0, 0), [1, 1, 0.9, 0.7], atol=1e-3)


def held_entries(length: int, k: int) -> int:
    """Entries the top-k rows of a text hold: query t holds min(t + 1, k)."""
    return sum(min(t + 1, k) for t in range(length))


@pytest.mark.parametrize("length", [2, 200, 341, 342, 1024, 4096, 8192, 14000])
def test_recorded_attention_takes_the_largest_k_its_bytes_allow(length):
    entries = RECORD_BYTES // (4 * 3 * 3)  # per layer and KV head, for 3 recorded layers x 3 KV heads
    k = choose_top_k(length, 3, 3)
    assert held_entries(length, k) <= entries
    assert k == length or held_entries(length, k + 1) > entries


def test_recorded_sizes_stay_bounded_at_8k():
    assert choose_top_k(8192, 3, 3) == 7 and choose_top_k(32768, 3, 3) == MIN_TOP_K
    assert choose_top_k(265, 3, 3) == 265  # the default example (241 prompt + 24 new tokens) is exact
    assert len(key_positions(8192)) == 512 and key_positions(8192)[[0, -1]].tolist() == [0, 8191]
    np.testing.assert_array_equal(key_positions(300), np.arange(300))


def test_a_stored_eviction_trace_stays_within_its_bound():
    """Stored, an eviction trace takes at most evicted_at's 4 bytes per (layer, KV head, token) plus 2 MiB. The
    recorded part (3 layers' top-k attention, k sized for 2 MiB of held entries, and 512 sampled keys) fits
    because the stored arrays compress (evicted_at's neighbours are close); at 8k tokens the default model's
    TOVA trace takes 3.4 MB of its 5.0 MB bound (docs/long-texts.md, "Stored trace sizes at 8k"). Here a
    random-weight Llama shaped like the default model's cache (30 layers, 3 KV heads, head dim 64), at 1024
    tokens: 8192 take minutes on two cores, and at 1024 the 2 MiB weigh most against the per-token part."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=101, hidden_size=48, intermediate_size=64, num_hidden_layers=30,
                                  num_attention_heads=3, num_key_value_heads=3, head_dim=64,
                                  max_position_embeddings=2048, tie_word_embeddings=False)
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper attention than the default init, as trained models have
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    lm = LoadedModel(name="cache-shaped", model=model, tokenizer=TinyTokenizer(), fingerprint="cache-shaped")
    ids = torch.randint(0, 101, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
    (trace,), _ = compute_traces(lm, ["tova:budget=256"], [TOVA(budget=256)], ids,
                                 record_layers=default_record_layers(lm))
    n_layers, n_heads, length = trace.evicted_at.shape
    assert (n_layers, n_heads, length) == (30, 3, 1024) and trace.evicted_at.max() > 0
    assert trace.attention.top_k == choose_top_k(1024, 3, 3) and trace.keys.shape == (3, 3, 512, 64)
    assert len(trace.to_bytes()) <= 4 * n_layers * n_heads * length + 2 * 2 ** 20


def test_a_recorded_eviction_row_keeps_whole_rows_when_its_budget_fits(tiny, text_ids, monkeypatch):
    """With k >= budget, an eviction row's recorded attention is exact even though k < T."""
    monkeypatch.setattr("backend.engine.runner.choose_top_k", lambda *args: 8)
    (trace,), _ = compute_traces(tiny, ["tova"], [TOVA(budget=6)], text_ids, record_layers=(0,))
    assert trace.attention.top_k == 8 and not trace.attention.exact
    np.testing.assert_allclose(trace.attention.covered(0, 0), 1.0, atol=2e-3)
    assert ((trace.attention.dense(0) > 0) == trace.reads(0)).all()


@pytest.mark.parametrize("policy", [Oracle(budget=5), SparQ(budget=6, r=2), SnapKV(budget=12, window=4, interval=8)],
                         ids=lambda p: p.name)
def test_traces_round_trip(tiny, text_ids, policy):
    (trace,), _ = compute_traces(tiny, [policy.name], [policy], text_ids, record_layers=(1,))
    back = Trace.from_bytes(trace.to_bytes())
    assert back.meta["format_version"] == 3
    for layer in range(2):
        np.testing.assert_array_equal(back.reads(layer), trace.reads(layer))
    np.testing.assert_array_equal(back.attention.pos, trace.attention.pos)
    np.testing.assert_array_equal(back.keys, trace.keys)
    np.testing.assert_array_equal(back.key_positions, trace.key_positions)
    if policy.kind == "selection":
        # Fewer spans than the bytes of the bit-packed mask they replace (at 8k: far fewer).
        assert "selected" not in back.arrays() and len(back.spans.pos) < 2 * 2 * len(text_ids) ** 2 / 8


def test_old_traces_are_refused_so_they_recompute(tiny, text_ids):
    (trace,), _ = compute_traces(tiny, ["tova"], [TOVA(budget=5)], text_ids, record_layers=())
    trace.meta["format_version"] = 1
    with pytest.raises(ValueError, match="format"):
        Trace.from_bytes(trace.to_bytes())


def test_texts_up_to_the_models_context_are_accepted_and_longer_ones_refused(tiny_session):
    from backend import api
    from backend.limits import Limits
    from backend.api import RequestError, RunRequest

    roomy = Limits(prompt_tokens=8192, row_tokens=10 ** 6)
    run = api.run(RunRequest(prompt="ab" * 250, specs=["tova:budget=8"], mode="prompt"), tiny_session,
                          limits=roomy)
    assert len(run.traces[0].tokens) == 500
    with pytest.raises(RequestError, match="reads at most 512"):  # the tiny model's context
        api.run(RunRequest(prompt="ab" * 260, specs=["tova:budget=8"], mode="prompt"), tiny_session,
                        limits=roomy)


def test_a_selection_row_costs_more_as_the_text_grows():
    from backend.limits import Limits, row_cost
    from backend.policies import POLICIES

    tova, snapkv, sparq = POLICIES["tova"](), POLICIES["snapkv"](), POLICIES["sparq"]()
    assert row_cost(tova, 8192) == 8192 and row_cost(snapkv, 8192) == 8192
    assert row_cost(sparq, 1000) == 1000 and row_cost(sparq, 8192) == 8 * 8192
    for name in ("oracle", "reattention", "quest"):
        assert row_cost(POLICIES[name](), 8192) == 8 * 8192
    # StreamingLLM is a selection policy by interface, but each query reads its window only.
    assert row_cost(POLICIES["streamingllm"](), 8192) == 8192
    assert row_cost(POLICIES["kvzip"](), 4096) == 2 * 4096  # its reconstruction pass re-reads the text
    limits = Limits()
    assert 4 * row_cost(tova, 8192) <= limits.row_tokens < 5 * row_cost(tova, 8192)
    assert row_cost(sparq, 8192) > limits.row_tokens  # not on a shared Space; an operator may raise it


def test_the_message_says_why_a_selection_row_at_length_is_refused(tiny_session, monkeypatch):
    from backend import limits as limits_module
    from backend import api
    from backend.limits import Limits
    from backend.api import RequestError, RunRequest

    monkeypatch.setattr(limits_module, "SELECTION_UNIT", 100)  # the tiny model's context is 512
    request = RunRequest(prompt="ab" * 240, specs=["tova:budget=8", "oracle:budget=8"], mode="prompt")
    with pytest.raises(RequestError, match=r"oracle read every key for every query: at 480 tokens each counts 4x"):
        api.run(request, tiny_session, limits=Limits(row_tokens=1000))


def test_a_compression_view_shows_the_last_querys_attention_on_every_token_it_holds(monkeypatch):
    """AdaKV's heads hold different counts (padded columns): the last query read every held token, so its
    window row is positive exactly where the view says a token is cached, position 0 included."""
    from backend.policies import AdaKV
    from tests.conftest import make_tiny

    lm = make_tiny(layers=2, heads=8, kv_heads=4)
    ids = torch.randint(0, 101, (160,), generator=torch.Generator().manual_seed(0)).tolist()
    views = []
    keep = AdaKV.keep

    def spy(self, view):
        views.append((view.attn_window[:, -1].copy(), view.kept.copy()))
        return keep(self, view)

    monkeypatch.setattr(AdaKV, "keep", spy)
    policy = AdaKV(budget=16, interval=4)
    score_text(lm, ids, [policy], chunk=7)
    assert len(views) > 40
    for last_row, kept in views:
        np.testing.assert_array_equal(last_row > 0, kept)
    monkeypatch.setattr(AdaKV, "keep", keep)
    one, _, _ = score_text(lm, ids, [policy], chunk=1)
    blocks, _, _ = score_text(lm, ids, [policy], chunk=7)
    np.testing.assert_array_equal(one.evicted_at(1), blocks.evicted_at(1))


def test_an_explicit_full_costs_nothing(tiny_session):
    """Full is the reference row every run computes: asking for it adds no row-tokens."""
    from backend import api
    from backend.api import RequestError, RunRequest
    from backend.limits import Limits

    limits = Limits(row_tokens=2 * 200)  # two eviction rows of 200 tokens
    api.run(RunRequest(prompt="ab" * 100, specs=["full", "tova:budget=8", "h2o:budget=8"], mode="prompt"),
            tiny_session, limits=limits)
    with pytest.raises(RequestError, match="3 policies x 200 tokens come to 600 row-tokens"):
        api.run(RunRequest(prompt="ab" * 100, specs=["full", "tova:budget=8", "h2o:budget=8", "a2sf:budget=8"],
                           mode="prompt"), tiny_session, limits=limits)
    two = Limits(policies=2)  # nor a place among the policies side by side
    api.check_run(RunRequest(prompt="ab", specs=["full", "tova:budget=8", "h2o:budget=8"]), two)
    for specs in (["tova:budget=8", "h2o:budget=8", "a2sf:budget=8"], ["full", "tova:budget=8", "h2o:budget=8",
                                                                      "a2sf:budget=8"]):
        with pytest.raises(RequestError, match="At most 2 policies side by side besides Full, got 3"):
            api.check_run(RunRequest(prompt="ab", specs=specs), two)
