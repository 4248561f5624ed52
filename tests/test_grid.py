"""Needle grids and sweeps as grids of jobs: the haystack, the checkpoint, and the same table
serially and on a real local Ray (``ray.init(num_cpus=2)``) with the default model."""
import json

import pandas as pd
import pytest

from backend.experiments import grid as grid_module
from backend.experiments.grid import GridError, job_key, run_grid
from backend.experiments.needle import BASE_CUE, NEEDLE, QUESTION, Cell, found, haystack, needle_frame, needle_jobs
from backend.experiments.sweep import summarize


# --- The haystack ----------------------------------------------------------------------------------------

def test_needle_number_has_5_to_7_digits_and_follows_the_seed():
    numbers = {Cell(1024, d / 10, seed).number() for d in range(11) for seed in range(5)}
    assert all(5 <= len(n) <= 7 and n[0] != "0" for n in numbers)
    assert len(numbers) > 40  # different cells hide different numbers
    assert Cell(1024, 0.5, 3).number() == Cell(1024, 0.5, 3).number()


def test_found_wants_the_whole_number():
    assert found("The secret number is 317204.", "317204")
    assert found("It is 1,234,567", "1234567")
    assert not found("The number is 3172041.", "317204")
    assert not found("I do not know.", "317204")


def test_haystack_fills_the_length_and_puts_the_needle_at_its_depth(default_lm):
    cell = Cell(512, 0.0, seed=1)
    text, ids = haystack(default_lm, cell, new_tokens=16)
    assert 512 - 16 - 60 <= len(ids) <= 512 - 16  # whole sentences: less than a sentence short
    needle = NEEDLE.format(number=cell.number())
    assert text.startswith(needle) and text.endswith(QUESTION)
    end_text, _ = haystack(default_lm, Cell(512, 1.0, seed=1), new_tokens=16)
    assert end_text.endswith(NEEDLE.format(number=Cell(512, 1.0, seed=1).number()) + "\n\n" + QUESTION)
    middle, _ = haystack(default_lm, Cell(512, 0.5, seed=1), new_tokens=16)
    at = middle.index(NEEDLE.format(number=Cell(512, 0.5, seed=1).number())) / len(middle)
    assert 0.35 < at < 0.65
    assert haystack(default_lm, cell, new_tokens=16) == (text, ids)  # deterministic


def test_a_model_without_a_chat_template_is_cued_to_answer(tiny):
    """A base model, packaged (chat=False) or local (chat allowed but no template), completes a cue instead."""
    assert tiny.chat and not tiny.chats  # the tiny tokenizer has no chat template
    text, ids = haystack(tiny, Cell(200, 0.5, seed=1), new_tokens=16)
    assert text.endswith(QUESTION + BASE_CUE) and len(ids) <= 200 - 16


# --- Checkpoint and errors (no model: a stand-in worker) --------------------------------------------------

class CountingWorker:
    calls: list = []

    def __init__(self, no_cache=False, threads=None):
        pass

    def run(self, job):
        CountingWorker.calls.append(job["payload"]["n"])
        if job["payload"]["n"] == "boom":
            raise RuntimeError("the model ran out of memory\nsecond line")
        return [{"n": job["payload"]["n"], "square": job["payload"]["n"] ** 2}]


def jobs_of(*values):
    return [{"kind": "test", "model": "m", "payload": {"n": v}} for v in values]


def test_a_rerun_skips_the_jobs_the_checkpoint_holds(tmp_path, monkeypatch):
    monkeypatch.setattr(grid_module, "Worker", CountingWorker)
    CountingWorker.calls = []
    checkpoint = tmp_path / "cells.jsonl"
    first = run_grid(jobs_of(1, 2), checkpoint=checkpoint)
    assert CountingWorker.calls == [1, 2]
    with checkpoint.open("a") as out:
        out.write('{"key": "cut short by a cra')  # a crash mid-line: ignored, that job runs again
    CountingWorker.calls = []
    again = run_grid(jobs_of(1, 2, 3), checkpoint=checkpoint)
    assert CountingWorker.calls == [3]
    assert again[:2] == first and again[2] == [{"n": 3, "square": 9}]
    keys = [json.loads(line)["key"] for line in checkpoint.read_text().splitlines() if line.endswith("}")]
    assert job_key(jobs_of(3)[0]) in keys


def test_a_failed_job_is_one_line_and_the_finished_ones_stay(tmp_path, monkeypatch):
    monkeypatch.setattr(grid_module, "Worker", CountingWorker)
    checkpoint = tmp_path / "cells.jsonl"
    with pytest.raises(GridError, match=r"^job 2 of 3 failed: RuntimeError: the model ran out of memory$") as err:
        run_grid(jobs_of(1, "boom", 3), checkpoint=checkpoint)
    assert "\n" not in str(err.value)
    assert len(checkpoint.read_text().splitlines()) == 1


# --- Sweeps over documents --------------------------------------------------------------------------------

def test_summary_is_the_mean_with_a_students_t_interval():
    df = pd.DataFrame({"model": "m", "document": ["a", "b", "a"], "policy": ["tova", "tova", "full"],
                       "budget": [8, 8, None], "spec": ["tova:budget=8", "tova:budget=8", "full"],
                       "ppl": [10.0, 20.0, 9.0], "kl_to_full": [0.1, 0.3, 0.0]})
    summary = summarize(df).set_index("spec")
    # Two documents: mean 15, sd 7.0711, t(0.975, 1 dof) = 12.7062 -> half-width 12.7062 * 7.0711 / sqrt(2).
    assert summary.loc["tova:budget=8", "ppl_mean"] == 15.0
    assert summary.loc["tova:budget=8", "ppl_hi"] == pytest.approx(15 + 63.531, abs=1e-3)
    assert summary.loc["tova:budget=8", "ppl_lo"] == pytest.approx(15 - 63.531, abs=1e-3)
    assert summary.loc["tova:budget=8", "kl_mean"] == pytest.approx(0.2)
    assert summary.loc["full", "documents"] == 1 and pd.isna(summary.loc["full", "ppl_hi"])


# --- The real thing: default model, serial and on a local Ray ---------------------------------------------

@pytest.fixture(scope="module")
def default_lm():
    from backend.api import get_model

    return get_model()


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray at a time: each takes the machine's cores
def test_a_needle_grid_is_the_same_serially_and_on_a_local_ray(default_lm, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    specs = ["full", "window:budget=32", "tova:budget=32"]
    jobs = needle_jobs(default_lm.name, specs, lengths=[96, 160], depths=[0.0, 1.0], new_tokens=20)
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "serial-store"))
    serial = needle_frame(run_grid(jobs, checkpoint=tmp_path / "serial.jsonl"))
    # A separate, empty store: the Ray workers compute every cell again rather than replay the serial run.
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "ray-store"))
    on_ray = needle_frame(run_grid(jobs, address="local", workers=2, checkpoint=tmp_path / "ray.jsonl"))
    assert len(serial) == len(jobs) * len(specs) == 12
    pd.testing.assert_frame_equal(serial, on_ray)
    assert serial[serial["policy"] == "full"]["found"].all()  # the full cache finds every short needle
    assert list(serial.columns[:8]) == ["model", "policy", "budget", "spec", "length", "depth", "found", "answer"]
