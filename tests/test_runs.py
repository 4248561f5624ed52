"""Runs through the store: replay equals recompute; only missing policies are computed."""
import numpy as np

from backend import runs
from backend.policies import H2O, TOVA, Window
from backend.runs import replay_or_compute
from backend.traces.store import TraceStore


def test_second_run_replays_and_equals_the_first(tiny, text_ids, tmp_path):
    store = TraceStore(tmp_path)
    first = replay_or_compute(tiny, ["tova:budget=5", "window:budget=5"], [TOVA(budget=5), Window(budget=5)], text_ids,
                         store=store, record_layers=(0,))
    again = replay_or_compute(tiny, ["tova:budget=5", "window:budget=5"], [TOVA(budget=5), Window(budget=5)], text_ids,
                         store=store, record_layers=(0,))
    assert first.replayed == [False, False] and again.replayed == [True, True]
    for a, b in zip(first.traces + [first.full], again.traces + [again.full]):
        assert a.meta == b.meta
        for name, value in a.arrays().items():
            np.testing.assert_array_equal(value, b.arrays()[name])


def test_only_missing_policies_are_computed(tiny, text_ids, tmp_path, monkeypatch):
    store = TraceStore(tmp_path)
    replay_or_compute(tiny, ["tova:budget=5"], [TOVA(budget=5)], text_ids, store=store, record_layers=())
    calls = []
    real_run = runs.compute_traces
    monkeypatch.setattr(runs, "compute_traces", lambda lm, specs, *a, **k: calls.append(specs) or real_run(lm, specs, *a, **k))
    result = replay_or_compute(tiny, ["tova:budget=5", "h2o:budget=6"], [TOVA(budget=5), H2O(budget=6)], text_ids,
                          store=store, record_layers=())
    assert calls == [["h2o:budget=6"]] and result.replayed == [True, False]


def test_key_depends_on_what_determines_the_trace(tiny, text_ids):
    key = runs.trace_key(tiny, text_ids, TOVA(budget=5), "prompt", 64, (0,))
    assert key == runs.trace_key(tiny, text_ids, TOVA(budget=5), "prompt", 32, (0,))  # unused in prompt mode
    assert key != runs.trace_key(tiny, text_ids, TOVA(budget=6), "prompt", 64, (0,))
    assert key != runs.trace_key(tiny, text_ids[:-1], TOVA(budget=5), "prompt", 64, (0,))
    assert key != runs.trace_key(tiny, text_ids, TOVA(budget=5, heads="head"), "prompt", 64, (0,))
    assert key != runs.trace_key(tiny, text_ids, TOVA(budget=5), "generate", 64, (0,))
    assert key != runs.trace_key(tiny, text_ids, TOVA(budget=5), "prompt", 64, (1,))


def test_a_changed_policy_or_engine_never_replays_old_traces(tiny, text_ids, tmp_path, monkeypatch):
    store = TraceStore(tmp_path)
    first = replay_or_compute(tiny, ["tova:budget=5"], [TOVA(budget=5)], text_ids, store=store, record_layers=())
    monkeypatch.setattr(TOVA, "version", TOVA.version + 1)  # the policy's code changed
    again = replay_or_compute(tiny, ["tova:budget=5"], [TOVA(budget=5)], text_ids, store=store, record_layers=())
    assert again.replayed == [False] and again.keys != first.keys and again.full_key == first.full_key
    monkeypatch.setattr(runs, "ENGINE_VERSION", runs.ENGINE_VERSION + 1)  # the engine changed
    third = replay_or_compute(tiny, ["tova:budget=5"], [TOVA(budget=5)], text_ids, store=store, record_layers=())
    assert third.replayed == [False] and third.full_key != first.full_key
