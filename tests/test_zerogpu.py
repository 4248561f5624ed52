"""ZeroGPU (zerogpu.py): without ``spaces`` and with it off ZeroGPU the app's model calls are left as they are; on
a ZeroGPU Space each asks for the seconds its cost needs, runs with its model moved inside the GPU call, and
crosses the process boundary (pickled) with its one-line refusals intact. A fake ``spaces`` stands in for the
Space here: this machine has neither a ZeroGPU Space nor a GPU. (Nothing here imports the app at the top: the
subprocesses below import this module's fake before the app.)"""
import json
import os
import pickle
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import zerogpu
from backend import api
from backend.api import RequestError, RunRequest
from backend.engine.models import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parents[1]


def fake_spaces(zero_gpu: bool, asked: list, inside: list) -> types.ModuleType:
    """``spaces`` as a ZeroGPU Space has it: ``GPU(duration=...)`` asks the seconds, then runs the function on the
    far side of a pickle, as the forked worker does (``inside`` says while it runs)."""
    module = types.ModuleType("spaces")
    module.config = types.SimpleNamespace(Config=types.SimpleNamespace(zero_gpu=zero_gpu))

    def GPU(task=None, *, duration=None):
        if task is not None:
            return task if not zero_gpu else GPU(duration=duration)(task)

        def decorate(fn):
            if not zero_gpu:
                return fn

            def on_gpu(*args, **kwargs):
                asked.append(duration(*args, **kwargs) if callable(duration) else duration)
                args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
                inside.append(True)
                try:
                    return pickle.loads(pickle.dumps(fn(*args, **kwargs)))
                finally:
                    inside.pop()
            return on_gpu
        return decorate

    module.GPU = GPU
    return module


def test_without_spaces_the_functions_are_left_as_they_are(monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", None)  # import spaces raises ImportError
    assert not zerogpu.active()
    assert zerogpu.gpu(zerogpu.run_demand)(api.run) is api.run


def test_with_spaces_off_zerogpu_spaces_hands_them_back(monkeypatch):
    pytest.importorskip("spaces")  # requirements.txt installs it
    monkeypatch.delenv("SPACES_ZERO_GPU", raising=False)
    assert not zerogpu.active()
    assert zerogpu.gpu(zerogpu.run_demand)(api.run) is api.run
    import app

    assert app.compute_run.__name__ == "compute_run" and not hasattr(app.compute_run, "__wrapped__")


def test_seconds_follow_the_row_tokens_up_to_what_a_visitor_may_ask():
    assert zerogpu.seconds(zerogpu.Demand("m", 0)) == zerogpu.START_S
    most = (zerogpu.MAX_S - zerogpu.START_S) * zerogpu.ROW_TOKENS_PER_S
    assert zerogpu.seconds(zerogpu.Demand("m", most)) == zerogpu.MAX_S
    assert zerogpu.seconds(zerogpu.Demand("m", 1, extra_s=zerogpu.TASK_S)) == zerogpu.START_S + zerogpu.TASK_S + 1
    with pytest.raises(RequestError, match=f"more than the {zerogpu.MAX_S} s one GPU call may take") as caught:
        zerogpu.seconds(zerogpu.Demand("m", most + 1))
    assert "\n" not in str(caught.value)


def test_the_space_s_largest_default_run_fits_one_call():
    """Four eviction policies at 8k (32k row-tokens, the Space's limit) and Full's 8k row."""
    assert zerogpu.seconds(zerogpu.Demand(DEFAULT_MODEL, api.LIMITS.row_tokens + 8192)) < zerogpu.MAX_S


def test_demands_count_every_row_and_full(tiny_session):
    text = "the cat sat on the mat"  # 22 tokens for the tiny model: one a character
    run = RunRequest(prompt=text, specs=["tova:budget=6", "oracle:budget=6"], mode="prompt")
    assert zerogpu.run_demand(run) == zerogpu.Demand(DEFAULT_MODEL, 3 * 22)
    sweep = api.SweepRequest(prompt=text, jobs=[("tova", 4, "tova:budget=4"), ("tova", 8, "tova:budget=8"),
                                                ("sinks", 8, "sinks:budget=8")], max_rows=2)
    assert zerogpu.sweep_demand(sweep) == zerogpu.Demand(DEFAULT_MODEL, 3 * 22 + 2 * 22)  # Full in both batches
    jobs = api.needle_jobs(DEFAULT_MODEL, ["full", "tova:budget=16", "kvzip:budget=16"], [512, 1024], [0.0])
    assert zerogpu.needle_demand(jobs) == zerogpu.Demand(DEFAULT_MODEL, 4 * 512 + 4 * 1024)  # KVzip reads twice
    sample = api.SampleRequest(task="niah_single_1", sample=0, specs=["full", "tova:ratio=0.5"], length=1024)
    assert zerogpu.sample_demand(sample) == zerogpu.Demand(DEFAULT_MODEL, 2 * 1024, zerogpu.TASK_S)


def test_on_zerogpu_a_run_asks_its_seconds_and_moves_the_model_inside(tiny_session, monkeypatch):
    import app

    asked, inside, moved = [], [], []
    monkeypatch.setitem(sys.modules, "spaces", fake_spaces(True, asked, inside))
    monkeypatch.setattr(api, "move_model", lambda name, device: moved.append((name, device, bool(inside))))
    compute_run = zerogpu.gpu(zerogpu.run_demand)(app.compute_run)
    request = RunRequest(prompt="the cat sat on the mat", specs=["tova:budget=6"], mode="prompt")
    run = compute_run(request, None)
    assert asked == [zerogpu.seconds(zerogpu.Demand(DEFAULT_MODEL, 2 * 22))]
    assert moved == [(DEFAULT_MODEL, "cuda", True)]  # onto the GPU, inside the call that holds it
    np.testing.assert_array_equal(run.traces[0].evicted_at, api.run(request, tiny_session).traces[0].evicted_at)


def test_on_zerogpu_a_refusal_inside_the_call_keeps_its_one_line(tiny_session, monkeypatch):
    monkeypatch.setitem(sys.modules, "spaces", fake_spaces(True, [], []))
    monkeypatch.setattr(api, "move_model", lambda name, device: None)

    def refuse(request, progress=None):
        raise RequestError("The text and the new tokens come to 600 tokens; the model reads at most 512.")

    with pytest.raises(RequestError) as caught:
        zerogpu.gpu(zerogpu.run_demand)(refuse)(RunRequest(prompt="a cat", specs=["tova:budget=6"]))
    assert str(caught.value) == "The text and the new tokens come to 600 tokens; the model reads at most 512."


def test_a_forked_worker_opens_the_store_again(tiny_session, monkeypatch):
    assert zerogpu.own_store(tiny_session) is tiny_session
    monkeypatch.setattr(zerogpu, "_OPENED_IN", os.getpid() + 1)  # as if this process were the fork
    monkeypatch.setattr(zerogpu, "_worker_stores", {})
    again = zerogpu.own_store(tiny_session)
    assert again is not tiny_session and again.directory == tiny_session.directory
    assert zerogpu.own_store(tiny_session) is again


RUN_IN_APP = """
import json, sys
sys.path.insert(0, ".")
from tests.test_zerogpu import fake_spaces
asked = []
if sys.argv[1] == "absent":
    sys.modules["spaces"] = None
elif sys.argv[1] == "zerogpu":
    sys.modules["spaces"] = fake_spaces(True, asked, [])
import app, zerogpu
from backend import api
from backend.engine import models
from tests.conftest import make_tiny
models.LOADED[api.DEFAULT_MODEL] = make_tiny()
zerogpu.DEVICE = "cpu"  # no GPU here to move the model to
run = app.compute_run(api.RunRequest(prompt="the cat sat on the mat", specs=["tova:budget=6"], mode="prompt"))
sweep = app.compute_sweep(api.SweepRequest(prompt="the cat sat on the mat", jobs=[("tova", 6, "tova:budget=6")]))
print(json.dumps({"evicted_at": run.traces[0].evicted_at.tolist(), "ppl": sweep.table["ppl"].tolist(),
                  "asked": asked, "active": zerogpu.active()}))
"""


def _run_in_app(mode: str, tmp_path) -> dict:
    env = {**os.environ, "KVLENS_STORE_DIR": str(tmp_path / mode), "PYTHONPATH": str(ROOT)}
    env.pop("SPACES_ZERO_GPU", None)
    done = subprocess.run([sys.executable, "-c", RUN_IN_APP, mode], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_app_imports_and_runs_on_a_cpu_with_spaces_absent_present_and_on_zerogpu(tmp_path):
    absent, present, zero = (_run_in_app(mode, tmp_path) for mode in ("absent", "present", "zerogpu"))
    assert not absent["active"] and not present["active"] and zero["active"]
    assert absent["asked"] == present["asked"] == [] and len(zero["asked"]) == 2  # the run and the sweep
    assert absent["evicted_at"] == present["evicted_at"] == zero["evicted_at"]
    assert absent["ppl"] == present["ppl"] == zero["ppl"]
