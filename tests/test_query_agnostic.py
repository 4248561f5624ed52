"""Query-agnostic runs: the policies decide over the context before the question is read.

A prefill policy's decision then cannot depend on the question: the context's kept tokens are the same under
two different questions, and the question's tokens are neither scored nor evicted at the compression. In a
query-aware run (the default) the question is part of what the policy scores, so its decision may change.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from backend.engine.runner import block_ends, compute_traces
from backend.policies import parse_spec
from backend.runs import replay_or_compute, trace_key
from backend.traces.store import TraceStore

CONTEXT = 48


def _ids(question_seed: int) -> list[int]:
    context = torch.randint(0, 101, (CONTEXT,), generator=torch.Generator().manual_seed(7)).tolist()
    question = torch.randint(0, 101, (12,), generator=torch.Generator().manual_seed(question_seed)).tolist()
    return context + question


def _evicted(tiny, ids, spec, context_end):
    traces, _ = compute_traces(tiny, [spec], [parse_spec(spec)], ids, "generate", max_new_tokens=3,
                               record_layers=(), context_end=context_end)
    return traces[0]


@pytest.mark.parametrize("spec", ["snapkv:budget=16,window=4", "knorm:budget=16", "expected_attention:budget=16"])
def test_the_question_does_not_change_a_prefill_decision_over_the_context(tiny, spec):
    one, other = _ids(1), _ids(2)
    a, b = _evicted(tiny, one, spec, CONTEXT), _evicted(tiny, other, spec, CONTEXT)
    # Compressed at the context's end, from the context alone: the same tokens go, at the same step.
    np.testing.assert_array_equal(a.evicted_at[..., :CONTEXT], b.evicted_at[..., :CONTEXT])
    assert ((a.evicted_at[..., :CONTEXT] == CONTEXT) | (a.evicted_at[..., :CONTEXT] == -1)).all()
    assert (a.evicted_at[..., :CONTEXT] == CONTEXT).sum(-1).min() == CONTEXT - 16  # the budget, per head
    # The question's tokens come after the compression: none is scored away.
    assert (a.evicted_at[..., CONTEXT:len(one)] == -1).all()
    assert a.meta["context_end"] == CONTEXT


def test_a_query_aware_decision_reads_the_question(tiny):
    spec = "snapkv:budget=16,window=4"
    one, other = _ids(1), _ids(2)
    a, b = _evicted(tiny, one, spec, None), _evicted(tiny, other, spec, None)
    # Compressed after the question, from its last queries: the question is scored, and changes the choice.
    assert ((a.evicted_at == len(one)) | (a.evicted_at == -1)).all()
    assert not np.array_equal(a.evicted_at[..., :CONTEXT], b.evicted_at[..., :CONTEXT])
    assert "context_end" not in a.meta


def test_a_per_step_policy_is_the_same_in_both_settings_and_replays(tiny, tmp_path):
    ids = _ids(1)
    tova = parse_spec("tova:budget=16")
    aware, agnostic = _evicted(tiny, ids, "tova:budget=16", None), _evicted(tiny, ids, "tova:budget=16", CONTEXT)
    np.testing.assert_array_equal(aware.evicted_at, agnostic.evicted_at)
    np.testing.assert_array_equal(aware.generated_ids, agnostic.generated_ids)
    assert trace_key(tiny, ids, tova, "generate", 3, (), CONTEXT) == trace_key(tiny, ids, tova, "generate", 3, ())
    snap = parse_spec("snapkv:budget=16")
    assert trace_key(tiny, ids, snap, "generate", 3, (), CONTEXT) != trace_key(tiny, ids, snap, "generate", 3, ())
    store = TraceStore(tmp_path)
    replay_or_compute(tiny, ["tova:budget=16"], [tova], ids, "generate", 3, store, record_layers=())
    again = replay_or_compute(tiny, ["tova:budget=16"], [tova], ids, "generate", 3, store, record_layers=(),
                              context_end=CONTEXT)
    assert again.replayed == [True]


def test_no_block_straddles_the_context_end():
    assert block_ends(16, 60, [], stops=(CONTEXT,)) == [16, 32, 48, 60]
    assert block_ends(20, 60, [], stops=(CONTEXT,)) == [20, 40, 48, 60]
    assert block_ends(20, 60, [], stops=()) == [20, 40, 60]


def test_a_context_end_outside_the_prompt_is_refused(tiny):
    with pytest.raises(ValueError, match="context_end"):
        _evicted(tiny, _ids(1), "knorm:budget=16", 0)
    with pytest.raises(ValueError, match="generate mode"):
        compute_traces(tiny, ["knorm:budget=16"], [parse_spec("knorm:budget=16")], _ids(1), "prompt",
                       record_layers=(), context_end=CONTEXT)
