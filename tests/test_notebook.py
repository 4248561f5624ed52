"""The notebook API (kvlens.py) and its tutorial: the tutorial runs top to bottom in a fresh kernel, as a reader
runs it; the API's refusals are the command line's one-line messages; a policy defined in a notebook runs."""
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat
import numpy as np
import pytest

import kvlens
from backend import api
from backend.api import RequestError
from backend.policies import POLICIES, CompressionPolicy

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "docs" / "examples" / "tutorial.ipynb"


def test_the_tutorial_ships_without_outputs():
    notebook = nbformat.read(TUTORIAL, as_version=4)
    nbformat.validate(notebook)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.outputs == [] and cell.execution_count is None for cell in code)


def _kernel_of_this_python(folder: Path) -> str:
    """A kernelspec that starts this very interpreter (the venv's), whatever other kernels the machine has."""
    spec = folder / "kernels" / "kvlens-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "KV Lens (tests)", "language": "python"}))
    return spec.name


@pytest.mark.slow
def test_the_tutorial_runs_every_cell(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path))
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "store"))
    notebook = nbformat.read(TUTORIAL, as_version=4)
    # From the notebook's own folder, as Jupyter starts it; a failing cell raises CellExecutionError.
    NotebookClient(notebook, kernel_name=_kernel_of_this_python(tmp_path), timeout=900,
                   resources={"metadata": {"path": str(TUTORIAL.parent)}}).execute()
    outputs = {i: cell.outputs for i, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    assert not any(o.output_type == "error" for cells in outputs.values() for o in cells)
    shown = json.dumps([o for cells in outputs.values() for o in cells])
    assert "application/vnd.plotly.v1+json" in shown  # the figures render inline
    assert "error: Policy: tova: budget must be an integer" in shown  # the one-line refusal
    assert "question_reads:budget=40" in shown and "317" in shown


@pytest.mark.parametrize("call, message", [
    (lambda: kvlens.run("a text", ["lru"]), "Policy: unknown policy 'lru'"),
    (lambda: kvlens.run("  ", ["tova"]), "Type a prompt (or pick an example) first."),
    (lambda: kvlens.run("a text", ["tova"], budget=8, ratio=0.5), "Give a budget or a ratio, not both."),
    (lambda: kvlens.run("a text", ["tova"], mode="decode"), "Unknown mode 'decode'"),
    (lambda: kvlens.run("a text", "tova", budget=0), "The budget must be an integer >= 1"),
    (lambda: kvlens.sweep("a text", ["tova:budget=8"], budgets=[8]), "tova:budget=8: leave budget and ratio out"),
    (lambda: kvlens.sweep("a text", ["tova"]), "Give budgets or ratios"),
    (lambda: kvlens.needle(["tova"], budget=8, lengths=[16]),
     "lengths must be at least 48 tokens (prompt and answer), got 16"),
    (lambda: kvlens.needle(["tova"], budget=8, lengths=[512, 100_000]),
     "lengths must be at most 8192 tokens on smollm2-135m-instruct, got 100000"),
    (lambda: kvlens.needle(["tova"], budget=8, lengths=[512.5]), "lengths must be whole numbers, got 512.5"),
    (lambda: kvlens.needle(["nope"], lengths=[64]), "Policy: unknown policy 'nope'"),
    (lambda: kvlens.example("nothing"), "no example 'nothing'"),
])
def test_refusals_are_one_line_request_errors(call, message):
    with pytest.raises(RequestError) as caught:
        call()
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)
    assert caught.value._render_traceback_() == [f"error: {caught.value}"]  # what Jupyter shows, as the CLI


def test_the_api_says_what_the_command_line_says(tmp_path, text_file):
    """The same request refused by both front ends: the CLI prints ``error: <message>`` with kvlens's message."""
    argv = ["run", "--text", str(text_file), "--policy", "tova:budget=4,heads=nobody", "--out", str(tmp_path)]
    printed = subprocess.run([sys.executable, "-m", "backend", *argv], cwd=ROOT, capture_output=True, text=True)
    with pytest.raises(RequestError) as caught:
        kvlens.run(text_file.read_text(), ["tova:budget=4,heads=nobody"])
    assert printed.returncode == 2 and printed.stderr.strip() == f"error: {caught.value}"


@pytest.fixture
def notebook_policy():
    """A policy class as a notebook cell defines it: in ``__main__``, registered, gone again after the test."""
    cell = '''
@register
@dataclass(frozen=True)
class Latest(CompressionPolicy):
    """Keep the latest tokens: the score is the position."""

    name = "nb_latest"

    def score(self, view):
        return np.broadcast_to(np.arange(view.kept.shape[-1], dtype=float), view.kept.shape)
'''
    namespace = {"__name__": "__main__", "register": kvlens.register, "dataclass": dataclass, "np": np,
                 "CompressionPolicy": CompressionPolicy}
    exec(compile(cell, "<notebook cell>", "exec"), namespace)
    yield namespace["Latest"]
    POLICIES.pop("nb_latest", None)


def test_a_policy_defined_in_the_notebook_runs_uncached(tiny_session, notebook_policy, monkeypatch):
    monkeypatch.setattr(kvlens, "_store", tiny_session)
    shown = kvlens.run("the cat sat on the mat and the dog sat on the log", ["nb_latest", "tova"], budget=6,
                       mode="generate", max_new_tokens=4)
    assert shown.specs == ["nb_latest:budget=6", "tova:budget=6"]
    assert shown.trace("nb_latest:budget=6").meta["policy"] == "nb_latest"
    # The class may change between runs under one name and version: nothing of it is stored or replayed.
    assert not shown.run.stored and shown.run.run_id and not any(shown.run.replayed)
    again = kvlens.run("the cat sat on the mat and the dog sat on the log", ["tova"], budget=6)
    assert again.run.stored  # built-in policies keep the store


def test_a_run_gives_views_and_arrays(tiny_session, monkeypatch):
    monkeypatch.setattr(kvlens, "_store", tiny_session)
    shown = kvlens.run("the cat sat on the mat and the dog sat on the log", ["tova", "oracle"], budget=6)
    n = len(shown.trace("full").tokens)
    assert "<table" in shown._repr_html_() and "tova:budget=6" in shown._repr_html_()
    assert shown.masks().data and shown.masks(layer=1, head=0, step=5).data
    assert shown.kept_tokens(step=5)._repr_html_().startswith("<") and len(shown.curves()) == 2
    assert len(shown.cache_reach()) == 2 and len(shown.retention()) == 3 and shown.step_row().data
    figure, notes = shown.divergence()
    assert figure.data and isinstance(notes._repr_html_(), str)
    evicted_at = shown.arrays("tova:budget=6")["evicted_at"]
    assert evicted_at.shape == (2, 2, n)  # the tiny model: 2 layers, 2 KV heads
    reads = shown.reads("tova:budget=6", 1)
    assert reads.shape == (2, n, n) and reads[:, -1].sum(axis=1).tolist() == [6, 6]  # the budget's 6 tokens
    assert shown.reads("oracle:budget=6", 0, slice(n - 1, n))[:, 0].sum(axis=1).tolist() == [6, 6]  # its spans
    assert np.array_equal(shown.reads(1, 0), shown.trace("oracle:budget=6").reads(0))
    weights = shown.attention("full", shown.trace("full").meta["recorded_layers"][0], 0)
    assert weights.shape == (n, n) and np.allclose(weights.sum(axis=1), 1, atol=1e-2)
    scores = shown.scores("tova:budget=6")
    assert len(scores) == n - 1 and {"logprob", "kl_to_full", "top1_is_full"} <= set(scores.columns)
    for bad in (lambda: shown.trace("h2o"), lambda: shown.reads("tova:budget=6", 9), lambda: shown.masks(layer=7),
                lambda: shown.attention("tova:budget=6", 5, 0), lambda: shown.tsne("h2o")):
        with pytest.raises(kvlens.KVLensError):
            bad()
    assert kvlens.reopen(shown.run_id).specs == shown.specs


def test_budget_and_ratio_size_the_policies_that_name_neither():
    assert kvlens._sized(["full", "tova", "h2o:heads=layer", "sinks:budget=8"], 32, None) == \
        ["full", "tova:budget=32", "h2o:budget=32,heads=layer", "sinks:budget=8"]
    assert kvlens._sized("snapkv", None, 0.5) == ["snapkv:ratio=0.5"]


def test_a_sweep_and_a_needle_grid_run_through_the_front_door(tiny_session, monkeypatch):
    monkeypatch.setattr(kvlens, "_store", tiny_session)
    swept = kvlens.sweep("the cat sat on the mat and the dog sat on the log", ["tova", "sinks"], budgets=[6, 8])
    assert swept.table["spec"].tolist() == ["tova:budget=6", "tova:budget=8", "sinks:budget=6", "sinks:budget=8",
                                            "full"]
    assert len(swept.figure().data) == 2 and "<table" in swept._repr_html_()
    calls = []
    monkeypatch.setattr(api, "needle_grid", lambda jobs, progress, no_cache: calls.append((jobs, no_cache)) or
                        api.needle_frame([]))
    grid = kvlens.needle(["tova"], budget=16, lengths=[64], depths=[0.0, 1.0])
    jobs, no_cache = calls[0]
    assert [job["payload"]["specs"] for job in jobs] == [["full", "tova:budget=16"]] * 2 and not no_cache
    assert grid.table.empty


def test_a_run_names_its_evidence_as_the_app_does_and_the_views_mark_it(default_loaded, tmp_path, monkeypatch):
    from backend.traces.store import TraceStore

    monkeypatch.setattr(kvlens, "_store", TraceStore(tmp_path / "store"))
    text = "The door code is 48151. Keep it to yourself, and open the door with it tonight."
    marked = kvlens.run(text, "tova", budget=8, evidence=["48151"])
    plain = kvlens.run(text, "tova", budget=8)
    assert marked.run.request.evidence == ["48151"] and plain.run.request.evidence == []
    underlined = re.compile(r'class="kvl-tok [^"]*kvl-evidence')  # a token's classes, not the page's style
    assert underlined.search(marked.kept_tokens(step=4)) and not underlined.search(plain.kept_tokens(step=4))
    assert len(marked.masks().layout.shapes) > len(plain.masks().layout.shapes)  # its columns banded
    assert kvlens.reopen(marked.run_id).run.request.evidence == ["48151"]
    with pytest.raises(kvlens.KVLensError, match="^Evidence is a list of strings from the text.$"):
        kvlens.run(text, "tova", budget=8, evidence=[48151])
