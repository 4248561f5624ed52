"""The runs that ship with the app (assets/runs/): they read, they are what the page's controls would compute now,
and once seeded into a store they reopen by their links and replay when asked again."""
import json

import pytest

from backend import api
from backend.experiments import shipped_runs
from backend.experiments.lessons import FIRST, SHOWCASE
from backend.traces.store import TraceStore
from benchmarks.shipped_runs import request_of


def test_every_showcase_run_is_shipped_and_reads():
    assert set(shipped_runs.names()) == set(SHOWCASE)
    for name in SHOWCASE:
        run = shipped_runs.load(name, request_type=api.RunRequest)
        assert [t.meta["policy"] for t in run.traces] == list(SHOWCASE[name].policies)
        assert run.full.meta["kind"] == "full" and api.RUN_ID.fullmatch(run.run_id)


def test_the_shipped_runs_are_not_stale(default_lm):
    """Each shipped run's trace keys (engine version, model, token ids, policy versions) are those the page's own
    request would be stored under today: a new ENGINE_VERSION or a changed example fails here. Regenerate with
    ``python -m benchmarks.shipped_runs``."""
    for name, setting in SHOWCASE.items():
        request = request_of(setting)
        shipped = shipped_runs.manifest(name)
        assert api.trace_keys(request) == (list(shipped.keys), shipped.full_key), name
        assert shipped.request == request.__dict__, name


def test_a_changed_example_makes_a_run_stale(default_lm):
    setting = SHOWCASE[FIRST]
    request = request_of(setting)
    request.prompt += " Thank you."
    assert api.trace_keys(request)[1] != shipped_runs.manifest(FIRST).full_key


def test_seeded_runs_reopen_by_their_links_and_replay_without_computing(tmp_path, default_lm):
    store = TraceStore(tmp_path / "store")
    assert set(shipped_runs.seed(store)) == set(SHOWCASE)
    found = shipped_runs.manifest(FIRST)
    reopened = api.reopen(found.run_id, store)
    assert reopened.keys == list(found.keys)
    again = api.run(request_of(SHOWCASE[FIRST]), store)
    assert all(again.replayed) and again.keys == list(found.keys)


def test_a_broken_manifest_is_one_line(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(shipped_runs.ShippedRunError, match="does not read"):
        shipped_runs.manifest("bad", tmp_path)
    (tmp_path / "odd.json").write_text(json.dumps({"run_id": "x", "request": {}, "keys": ["../../etc"],
                                                   "full_key": "ab" * 32}))
    with pytest.raises(shipped_runs.ShippedRunError, match="malformed key"):
        shipped_runs.manifest("odd", tmp_path)
    with pytest.raises(shipped_runs.ShippedRunError, match="No shipped run"):
        shipped_runs.manifest("../first", tmp_path)
