"""The task leaderboard (``python -m backend tasks``): one batched run per sample, the grid runner's checkpoint
and Ray, the summaries' intervals, and the figures. Real RULER samples from lm-eval, on a tiny random model
whose tokenizer writes a character a token (lm-eval sizes the samples with it)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from backend.experiments.grid import run_grid
from backend.experiments.leaderboard import (COLUMNS, averaged, leaderboard_frame, summarize, task_jobs, task_specs,
                                             wilson)

ROOT = Path(__file__).resolve().parents[1]
LENGTH = 512  # characters, so tokens: niah_single_1's samples fit


def _command(tiny_dir: str, out: Path, samples: int = 2) -> list[str]:
    return [sys.executable, "-m", "backend", "tasks", "--model", tiny_dir, "--tasks", "niah_single_1", "--lengths",
            str(LENGTH), "--samples", str(samples), "--policy", "tova,snapkv", "--ratios", "0.5,0.75",
            "--settings", "agnostic,aware", "--out", str(out)]


def _environment(store: Path) -> dict:
    return {**os.environ, "KVLENS_STORE_DIR": str(store), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def test_specs_are_every_policy_at_every_ratio_and_full_is_the_reference():
    assert task_specs(["tova", "full", "snapkv:window=4"], [0.5, 0.75]) == [
        "tova:ratio=0.5", "tova:ratio=0.75", "snapkv:ratio=0.5,window=4", "snapkv:ratio=0.75,window=4"]
    jobs = task_jobs("m", ["niah_single_1", "ruler_vt"], [1024], 2, ["tova:ratio=0.5"], ["agnostic", "aware"])
    assert len(jobs) == 2 * 2 * 2 and {j["kind"] for j in jobs} == {"task"}
    assert jobs[0]["payload"] == {"task": "niah_single_1", "length": 1024, "sample": 0, "specs": ["tova:ratio=0.5"],
                                  "setting": "agnostic", "chat": True}
    with pytest.raises(ValueError, match="settings"):
        task_jobs("m", ["niah_single_1"], [1024], 1, [], ["sideways"])
    later = task_jobs("m", ["niah_single_1"], [1024], 2, ["tova:ratio=0.5"], first=3)  # added to samples 0-2
    assert [j["payload"]["sample"] for j in later] == [3, 4]


def test_intervals_are_wilsons_and_tasks_full_fails_stay_out_of_the_average():
    # Hand-worked: 3 of 4 at 95% (z = 1.95996): centre (0.75 + z^2/8) / (1 + z^2/4), half z/(1 + z^2/4) *
    # sqrt(0.75 * 0.25 / 4 + z^2/64) -> 0.3006 .. 0.9544.
    lo, hi = wilson(0.75, 4)
    assert lo == pytest.approx(0.3006, abs=1e-4) and hi == pytest.approx(0.9544, abs=1e-4)
    assert wilson(1.0, 5)[1] == 1.0 and wilson(0.0, 5)[0] == 0.0
    rows = []
    for task, full_scores, tova_scores in (("easy", [1, 1], [1, 0]), ("hard", [0, 0], [0, 0])):
        for sample in range(2):
            for policy, scores in (("full", full_scores), ("tova", tova_scores)):
                rows.append({"model": "m", "task": task, "length": 1024, "setting": "agnostic", "policy": policy,
                             "ratio": 0.0 if policy == "full" else 0.5, "sample": sample, "score": scores[sample]})
    summary = summarize(pd.DataFrame(rows)).set_index(["task", "policy"])
    assert summary.loc[("easy", "tova"), "score"] == 0.5 and summary.loc[("easy", "tova"), "full_score"] == 1.0
    assert summary.loc[("easy", "tova"), "full_solves"] and not summary.loc[("hard", "tova"), "full_solves"]
    mean = averaged(summary.reset_index()).set_index("policy")
    assert mean.loc["tova", "score"] == 0.5 and mean.loc["tova", "samples"] == 2  # "hard" left out


def test_the_command_says_what_the_samples_left_will_take_before_it_starts(tiny_dir, tmp_path):
    from backend import api
    from backend.cli import _expected_time
    from backend.experiments.grid import job_key

    specs = task_specs(["tova", "kvzip"], [0.5])
    jobs = task_jobs(tiny_dir, ["niah_single_1"], [LENGTH, 2 * LENGTH], 2, specs)
    args = argparse.Namespace(model=tiny_dir, device="cpu", dtype="float32", ray=None)
    checkpoint = tmp_path / "samples.jsonl"
    checkpoint.write_text(json.dumps({"key": job_key(jobs[0]), "rows": []}) + "\n")  # one sample done
    short, long = _expected_time(jobs, checkpoint, args).splitlines()
    forwards = api.sample_forwards(["full", *specs], LENGTH)
    # TOVA computes the half of the prompt past its budget, KVzip its second pass over the text
    assert forwards == (api.SAMPLE_FULL_FORWARDS + (0.5 + 1) * api.SAMPLE_PREFILL_FORWARDS
                        + 2 * api.SAMPLE_ROW_FORWARDS)
    assert short.startswith("Expected: about ") and short.endswith(" s).")
    assert f" in this process (1 sample, Full and 2 policies: about {forwards:.3g} plain forwards of {LENGTH} " \
           "tokens; a plain forward takes " in short
    assert f"(2 samples, Full and 2 policies: each about {forwards:.3g} plain forwards of {2 * LENGTH:,} tokens" in long
    # On Ray the workers load the model, not this process: the time stays in plain forwards.
    on_ray = _expected_time(jobs, checkpoint, argparse.Namespace(**{**vars(args), "ray": "local"}))
    assert on_ray.splitlines()[0] == (f"Expected: 1 sample, Full and 2 policies: about {forwards:.3g} plain "
                                      f"forwards of {LENGTH} tokens.")
    checkpoint.write_text("".join(json.dumps({"key": job_key(job), "rows": []}) + "\n" for job in jobs))
    assert _expected_time(jobs, checkpoint, args) == f"Every one of the 4 samples is in {checkpoint} already: " \
                                                     "nothing to compute."


@pytest.mark.slow
def test_the_command_writes_the_table_and_resumes_after_a_kill(tiny_dir, tmp_path):
    store = tmp_path / "store"
    out = tmp_path / "killed"
    process = subprocess.Popen(_command(tiny_dir, out), cwd=ROOT, env=_environment(store),
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    checkpoint = out / "samples.jsonl"
    deadline = time.monotonic() + 600
    while not (checkpoint.exists() and checkpoint.read_text().count("\n") >= 1) and process.poll() is None:
        assert time.monotonic() < deadline, "the first sample never finished"
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    finished = checkpoint.read_text().count("\n")
    assert 1 <= finished < 4  # killed partway
    again = subprocess.run(_command(tiny_dir, out), cwd=ROOT, env=_environment(store), capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = again.stderr.splitlines()
    progress = [line for line in lines if line.startswith("task samples:")]
    assert progress[0] == f"task samples: {finished + 1} of 4 done"  # only the missing samples ran
    # Before the first of them, what they are expected to take: only the missing ones, timed in this process.
    (expected,) = [line for line in lines if line.startswith("Expected: ")]
    assert lines.index(expected) < lines.index(progress[0])
    left = 4 - finished
    assert expected.startswith("Expected: about ") and " in this process (" in expected
    assert f"({left} sample{'s' if left > 1 else ''}, Full and 4 policies: " in expected
    table = pd.read_csv(out / "leaderboard.csv", keep_default_na=False, na_values=[""])
    assert list(table.columns) == COLUMNS
    assert len(table) == 2 * 2 * (1 + 4)  # samples x settings x (Full + 2 policies x 2 ratios)
    assert set(table["setting"]) == {"agnostic", "aware"} and table["score"].between(0, 1).all()
    assert table["run_id"].str.fullmatch(r"[0-9a-f]{32}").all()  # each row's trace opens in the app (?run=)
    # A ratio counts the context's tokens (before the question) in both settings: the same budgets either way.
    agnostic = table[(table["setting"] == "agnostic") & (table["spec"] == "tova:ratio=0.75")]
    aware = table[(table["setting"] == "aware") & (table["spec"] == "tova:ratio=0.75")]
    assert (agnostic["budget"].to_numpy() == (agnostic["context_tokens"] * 0.25).astype(int).to_numpy()).all()
    assert (agnostic["context_tokens"] < agnostic["tokens"]).all()
    assert aware["budget"].tolist() == agnostic["budget"].tolist()
    # A per-step policy reads the same tokens either way, so both settings give it one trace (one link).
    assert aware["run_id"].tolist() == agnostic["run_id"].tolist()
    assert aware["answer"].tolist() == agnostic["answer"].tolist()
    clean = subprocess.run(_command(tiny_dir, tmp_path / "clean"), cwd=ROOT, env=_environment(store),
                           capture_output=True, text=True, timeout=900)
    assert clean.returncode == 0, clean.stderr[-2000:]
    pd.testing.assert_frame_equal(table, pd.read_csv(tmp_path / "clean" / "leaderboard.csv", keep_default_na=False,
                                                     na_values=[""]))
    summary = pd.read_csv(out / "summary.csv")
    assert "average" in set(summary["task"]) or not summary["full_solves"].any()
    assert (out / "leaderboard.html").read_text().count("plotly-graph-div") >= 2  # per task and setting


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one local Ray at a time: each takes the machine's cores
def test_a_leaderboard_is_the_same_serially_and_on_a_local_ray(tiny_dir, tmp_path, monkeypatch):
    pytest.importorskip("ray")
    jobs = task_jobs(tiny_dir, ["niah_single_1"], [LENGTH], 2, task_specs(["tova", "knorm"], [0.5]), ["agnostic"])
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "serial-store"))
    serial = leaderboard_frame(run_grid(jobs, checkpoint=tmp_path / "serial.jsonl"))
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "ray-store"))  # empty: Ray computes every sample again
    on_ray = leaderboard_frame(run_grid(jobs, address="local", workers=2, checkpoint=tmp_path / "ray.jsonl"))
    assert len(serial) == 2 * 3
    pd.testing.assert_frame_equal(serial, on_ray)


def test_a_bad_ratio_or_setting_is_one_line(tiny_dir, tmp_path, capsys):
    from backend.cli import main

    assert main(["tasks", "--model", tiny_dir, "--ratios", "1.5", "--out", str(tmp_path / "a")]) == 2
    assert main(["tasks", "--model", tiny_dir, "--settings", "sideways", "--out", str(tmp_path / "b")]) == 2
    assert main(["tasks", "--model", tiny_dir, "--policy", "nosuch", "--out", str(tmp_path / "c")]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 3 and "ratios" in lines[0] and "settings" in lines[1] and "nosuch" in lines[2]
