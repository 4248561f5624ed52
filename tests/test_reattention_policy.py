"""ReAttention as a KV Lens policy: chunks, re-rotation, ties, and the needle on the default model."""
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.policies import ReAttention
from backend.policies.base import Block
from backend.engine.runner import compute_traces, generate, score_text

NEEDLE = Path(__file__).resolve().parents[1] / "assets" / "examples" / "needle.txt"


def test_chunks_follow_algorithm_1():
    policy = ReAttention(budget=24, global_size=2, span=4, topk=2, chunk=4)  # local = 14
    assert policy.local == 14
    assert policy.chunks(0, 27) == [(0, 16), (16, 20), (20, 24), (24, 27)]
    assert policy.chunks(30, 1) == [(30, 31)]  # decoding: one token per step (Algorithm 2)
    assert policy.chunks(30, 3, decoding=True) == [(30, 31), (31, 32), (32, 33)]  # teacher-forced decoding


def test_scope_covering_the_text_equals_full(tiny, text_ids):
    (trace,), full = compute_traces(tiny, ["reattention"], [ReAttention(budget=40, global_size=2, span=4, topk=2, chunk=4)],
                         text_ids, record_layers=())
    np.testing.assert_allclose(trace.logprobs, full.logprobs, atol=1e-6)
    assert trace.selected[..., -1, :].all()  # the last query read every token


def test_reads_stay_within_the_scope(tiny, text_ids):
    policy = ReAttention(budget=20, global_size=2, span=3, topk=2, chunk=4)
    cache, _, _ = score_text(tiny, text_ids, [policy])
    counts = cache.selected(1).sum(-1)
    assert counts.max() <= policy.budget and (counts[..., policy.budget:] >= policy.global_size + 1).all()
    assert counts[..., -1].min() < len(text_ids)


def test_rerotation_puts_selected_keys_at_contiguous_positions():
    calls = []

    def rope(x, positions):
        calls.append((x.clone(), positions.clone()))
        return x

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 1, 8), (2, 40, 8), (2, 40, 8)))
    policy = ReAttention(budget=16, global_size=2, span=2, topk=2, chunk=1)  # local = 10
    _, result = policy.attend_block({}, Block(q=q, k=k, v=v, first=39, scaling=0.3, q_pre=q, k_pre=k, rope=rope))
    (keys, key_positions), (_, query_positions) = calls  # every KV head in one call each
    for h in range(2):
        kept = np.flatnonzero(result.reads[h, 0])
        assert kept[:2].tolist() == [0, 1] and kept[-10:].tolist() == list(range(30, 40))
        # The head's kept keys, gaps dropped and order kept, get positions 0..L-1.
        torch.testing.assert_close(keys[h, :len(kept)], k[h, kept])
        assert key_positions[:len(kept)].tolist() == list(range(len(kept)))
        assert query_positions.view(2, 1)[h].tolist() == [len(kept) - 1]  # the query sits on its own key


def test_ties_go_to_the_earlier_position(tiny):
    """In layer 0 a key before RoPE depends only on its token: a run of one repeated token ties exactly."""
    ids = [3, 4] + [7] * 30 + [9, 10, 11, 12, 13, 14]
    policy = ReAttention(budget=12, global_size=2, span=1, topk=1, chunk=1)  # local = 9
    cache, _, _ = score_text(tiny, ids, [policy])
    reads = cache.selected(1)[0]  # layer 0: [H_kv, T, T]
    last = len(ids) - 1
    middle = np.flatnonzero(reads[:, last, 2: last + 1 - policy.local].any(0)) + 2
    assert middle.tolist() == [2]  # every middle key is the same token 7: the earliest wins


def test_decoding_token_by_token_equals_chunks_of_one_on_the_prompt_path(tiny, text_ids):
    """Algorithm 2 (one token per step) is Algorithm 1 with chunk = 1: generating, then scoring the same
    text teacher-forced, gives the same selections and the same greedy tokens."""
    policy = ReAttention(budget=20, global_size=2, span=3, topk=2, chunk=1)
    prompt = text_ids[:30]
    decoded, outputs, _ = generate(tiny, prompt, [policy], max_new_tokens=8)
    text = prompt + outputs[1]
    scored, stats, _ = score_text(tiny, text, [policy])
    np.testing.assert_array_equal(decoded.selected(1), scored.selected(1))
    assert stats["top1_ids"][1, len(prompt) - 1:].tolist() == outputs[1]


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="leaves local"):
        ReAttention(budget=20, global_size=4, span=8, topk=2, chunk=4)


def test_needle_is_read_at_the_answer_step_on_the_default_model(default_lm):
    """assets/examples/needle.txt: the room number sits ~20 tokens in, ~220 tokens before the question.
    With a 40-token scope ReAttention reads it while answering and answers right."""
    text = NEEDLE.read_text().strip()
    ids = default_lm.encode(text, chat=True)
    policy = ReAttention(budget=40)
    cache, outputs, _ = generate(default_lm, ids, [policy], max_new_tokens=12)
    answer = default_lm.tokenizer.decode(outputs[1])
    assert "317" in answer, answer
    start = next(i for i in range(len(ids)) if default_lm.tokenizer.decode(ids[i: i + 3]).strip() == "317")
    needle = [start, start + 1, start + 2]
    assert start < 45 and len(ids) - start > 5 * policy.budget  # far outside the local window
    # The step whose output is the first digit of the answer: it must read the needle in some layers.
    digits = [i for i, t in enumerate(outputs[1]) if default_lm.tokenizer.decode([t]).strip().startswith("3")]
    step = len(ids) - 1 + digits[0]
    reads = cache.selected(1)[:, :, step]  # [L, H_kv, T]
    layers_reading_needle = reads[:, :, needle].any(axis=(1, 2)).sum()
    assert layers_reading_needle >= 20, layers_reading_needle  # of 30 layers
    assert reads.sum(-1).max() <= policy.budget


def test_prompt_path_cuts_its_own_chunks_whatever_the_runner_chunk(tiny, text_ids):
    policy = ReAttention(budget=20, global_size=2, span=3, topk=2, chunk=4)
    a, s_a, _ = score_text(tiny, text_ids, [policy], chunk=7)  # 7 does not line up with the policy's chunks
    b, s_b, _ = score_text(tiny, text_ids, [policy], chunk=len(text_ids))
    np.testing.assert_array_equal(a.selected(1), b.selected(1))
    np.testing.assert_array_equal(s_a["logprobs"], s_b["logprobs"])


def test_chunks_attended_in_groups_equal_the_block_at_once(tiny, text_ids, monkeypatch):
    """A block's chunks attend in groups that bound the padded logits (a prompt's opening chunk is hundreds of
    queries, the rest 16): one chunk a group gives what the whole block at once gives."""
    import backend.policies.reattention as reattention

    policy = ReAttention(budget=20, global_size=2, span=3, topk=2, chunk=4)
    whole = len(text_ids)
    monkeypatch.setattr(reattention, "ATTEND_ELEMENTS", {"cpu": 1 << 40, "cuda": 1 << 40})
    a, s_a, _ = score_text(tiny, text_ids, [policy], chunk=whole)
    monkeypatch.setattr(reattention, "ATTEND_ELEMENTS", {"cpu": 1, "cuda": 1})
    b, s_b, _ = score_text(tiny, text_ids, [policy], chunk=whole)
    np.testing.assert_array_equal(a.selected(1), b.selected(1))
    np.testing.assert_allclose(s_a["logprobs"], s_b["logprobs"], atol=1e-6)
