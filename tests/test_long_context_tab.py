"""The app's "Long context" tab without a browser: the shipped needle grid and sweep, their faults, and the
small bounded needle grid a visitor runs (the same jobs as ``python -m backend needle``)."""
from dataclasses import replace

import pandas as pd
import pytest

import app
from backend.engine import models
from backend import api, cli
from backend.experiments import shipped
from backend.limits import Limits
from backend.engine.models import DEFAULT_MODEL
from backend.experiments.needle import needle_jobs
from backend.api import RequestError
from tests.conftest import TinyTokenizer, make_tiny
from viz.needle import needle_figure, needle_table_html
from viz.sweep import sweep_ci_figure


def test_shipped_needle_grid_draws_one_heatmap_per_policy_and_the_sweep_its_lines():
    needle, sweep, note = app.shipped_long_context()
    grid = pd.read_csv(shipped.ASSETS / shipped.NEEDLE_FILE)
    assert note == ""
    assert [trace.type for trace in needle.data] == ["heatmap"] * grid["spec"].nunique()
    assert [trace.name for trace in needle.data] == list(dict.fromkeys(grid["spec"]))
    summary = pd.read_csv(shipped.ASSETS / shipped.SWEEP_FILE)
    assert {trace.name for trace in sweep.data if trace.showlegend is not False} == set(summary["policy"]) - {"full"}
    assert any("Full" in (shape.text or "") for shape in sweep.layout.annotations)  # the topline


def test_needle_cells_are_found_rates_length_across_depth_down():
    df = pd.DataFrame({"model": "m", "spec": ["tova:budget=8"] * 4, "length": [512, 512, 1024, 1024],
                       "depth": [0.0, 1.0, 0.0, 1.0], "found": [True, False, True, True],
                       "answer": ["12345", "no", "12345", "12345"], "number": "12345"})
    heatmap = needle_figure(df).data[0]
    assert list(heatmap.x) == ["512", "1024"] and list(heatmap.y) == ["0%", "100%"]
    assert heatmap.z.tolist() == [[1.0, 1.0], [0.0, 1.0]]


def test_sweep_ci_figure_draws_the_interval_as_error_bars():
    summary = pd.DataFrame({"model": "m", "policy": ["tova", "tova", "full"], "budget": [16, 32, None],
                            "spec": ["tova:budget=16", "tova:budget=32", "full"], "documents": 3,
                            "ppl_mean": [30.0, 25.0, 20.0], "ppl_lo": [27.0, 24.0, 19.0], "ppl_hi": [34.0, 26.5, 21.0]})
    fig = sweep_ci_figure(summary)
    line, band = fig.data
    assert list(line.y) == [30.0, 25.0]
    assert list(line.error_y.array) == [4.0, 1.5] and list(line.error_y.arrayminus) == [3.0, 1.0]
    assert sorted(band.y) == [19.0, 19.0, 21.0, 21.0] and band.fill == "toself"  # Full's interval
    assert len(fig.layout.shapes) == 1  # Full's dashed line


def test_answers_reach_the_page_escaped():
    df = pd.DataFrame({"model": "m", "spec": ["tova:budget=8"], "length": [512], "depth": [0.5], "found": [False],
                       "answer": ["<img src=x onerror=alert(1)>"], "number": ["12345"]})
    table = needle_table_html(df)
    assert "<img" not in table and "&lt;img src=x onerror=alert(1)&gt;" in table
    assert "<img" not in str(needle_figure(df).data[0].customdata)  # plotly's hover renders some HTML


BAD_FILES = [
    # (file, content, message)
    ("needle_grid.csv", None, "needle_grid.csv is not shipped here"),
    ("needle_grid.csv", "", "needle_grid.csv is empty"),
    ("needle_grid.csv", "model,policy,spec\nm,tova,tova\n", "lacks the columns budget, length, depth"),
    ("needle_grid.csv", "model,policy,budget,spec,length,depth,found,answer,number,tokens,seed\n",
     "needle_grid.csv has no rows"),
    ("needle_grid.csv", "model,policy,budget,spec,length,depth,found,answer,number,tokens,seed\n"
                        "m,tova,8,tova:budget=8,<b>512</b>,0,True,1,1,500,0\n", "length must be a number"),
    ("needle_grid.csv", "model,policy,budget,spec,length,depth,found,answer,number,tokens,seed\n"
                        "m,tova,8,tova:budget=8,512,0,maybe,1,1,500,0\n", "found must be True or False"),
    ("needle_grid.csv", "model,policy,budget,spec,length,depth,found,answer,number,tokens,seed\n"
                        "m,tova,8,tova:budget=8,512,1.5,True,1,1,500,0\n", "depths must be 0 to 1"),
    ("needle_grid.csv", b"\xff\xfe\x00garbage", "is not a readable CSV table"),
    ("sweep_summary.csv", None, "sweep_summary.csv is not shipped here"),
    ("sweep_summary.csv", "model,policy,budget,spec,documents,ppl_mean,ppl_lo,ppl_hi,kl_mean\n"
                          "m,tova,8,tova:budget=8,1,abc,,,\n", "ppl_mean must be a number"),
    ("sweep_summary.csv", "policy,budget,ppl\ntova,8,3\n", "lacks the columns model, spec, documents"),
]


@pytest.mark.parametrize("name, content, message", BAD_FILES, ids=[f"{b[0]}: {b[2]}" for b in BAD_FILES])
def test_a_missing_or_malformed_file_is_a_message_in_the_tab(tmp_path, name, content, message):
    for good in (shipped.NEEDLE_FILE, shipped.SWEEP_FILE):
        (tmp_path / good).write_bytes((shipped.ASSETS / good).read_bytes())
    (tmp_path / name).unlink()
    if content is not None:
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    needle, sweep, note = app.shipped_long_context(tmp_path)
    assert message in note and len(note.splitlines()) == 1
    assert "<b>" not in note  # the file's content reaches the page escaped
    assert (needle is None) == (name == shipped.NEEDLE_FILE)
    assert (sweep is None) == (name == shipped.SWEEP_FILE)


VISITOR_REFUSALS = [
    # (names, budget, lengths, model, message)
    (["window", "sinks", "h2o", "tova"], 64, [512], DEFAULT_MODEL, "Pick 1 to 3 policies"),
    ([], 64, [512], DEFAULT_MODEL, "Pick 1 to 3 policies"),
    (["full"], 64, [512], DEFAULT_MODEL, "Pick 1 to 3 policies"),
    (["tova"], 64, [2048], DEFAULT_MODEL, "Lengths here are 512 or 1024"),
    (["tova"], 64, ["512<script>"], DEFAULT_MODEL, "Lengths here are 512 or 1024"),
    (["tova"], 64, [512.5], DEFAULT_MODEL, "Lengths here are 512 or 1024"),
    (["tova"], 64, [], DEFAULT_MODEL, "Pick at least one length"),
    (["tova"], 64, "512", DEFAULT_MODEL, "Pick at least one length"),
    (["tova"], 64, [512], "../../etc/passwd", "unknown model"),
    (["lru"], 64, [512], DEFAULT_MODEL, "out of range"),
    (["tova"], "many", [512], DEFAULT_MODEL, "out of range"),
]


@pytest.mark.parametrize("names, budget, lengths, model, message", VISITOR_REFUSALS,
                         ids=[r[-1] + f" {i}" for i, r in enumerate(VISITOR_REFUSALS)])
def test_the_visitor_grid_refuses_what_is_over_its_bounds_before_it_queues(monkeypatch, names, budget, lengths, model,
                                                                          message):
    monkeypatch.setattr(api, "get_model", lambda *a: pytest.fail("a cheap check must not load the model"))
    with pytest.raises(RequestError, match=message):
        app.needle_jobs(names, budget, lengths, model)
    verdicts = app.check_needle(names, budget, lengths, model)  # the validator: shown under the policies
    assert not verdicts[0]["is_valid"] and message in verdicts[0]["message"]
    assert all(v["is_valid"] for v in verdicts[1:])


def test_the_visitor_grid_follows_the_operators_limits():
    with pytest.raises(RequestError, match="longer than the 600 tokens allowed here"):
        api.check_needle(["tova:budget=64"], [1024], DEFAULT_MODEL, Limits(prompt_tokens=600))
    with pytest.raises(RequestError, match="more than the 1,000 row-tokens one request may use"):
        api.check_needle(["tova:budget=64", "h2o:budget=64"], [512], DEFAULT_MODEL, Limits(row_tokens=1000))
    most = api.check_needle(["window:budget=64", "tova:budget=64", "sparq:budget=64"], [512, 1024, 512],
                                     DEFAULT_MODEL)
    assert len(most) == 3 * 2 and most[0]["payload"]["specs"][0] == "full"  # 3 depths x 2 lengths, Full first


def test_the_app_and_the_cli_build_the_same_jobs(tmp_path, monkeypatch):
    specs = app.specs_from_controls(["sinks", "tova"], 64, 4, 0.1, "paper default", "")
    mine = app.needle_jobs(["sinks", "tova"], 64, [512, 1024], DEFAULT_MODEL)
    assert mine == needle_jobs(DEFAULT_MODEL, ["full", *specs], [512, 1024], [0, 0.5, 1], [0], 16)
    seen = []

    def fake_grid(jobs, **options):
        seen.extend(jobs)
        return [[{"model": job["model"], "policy": spec.partition(":")[0], "budget": None, "spec": spec,
                  **job["payload"]["cell"], "found": False, "answer": "", "number": "1", "tokens": 1}
                 for spec in job["payload"]["specs"]] for job in jobs]

    monkeypatch.setattr("backend.experiments.grid.run_grid", fake_grid)  # the command line's grid
    monkeypatch.setattr("backend.api.run_grid", fake_grid)  # the app's
    policies = [arg for spec in ["full", *specs] for arg in ("--policy", spec)]
    assert cli.main(["needle", "--lengths", "512,1024", "--depths", "0,0.5,1", *policies, "--out", str(tmp_path)]) == 0
    assert seen == mine
    assert list(pd.read_csv(tmp_path / "grid.csv").columns) == shipped.NEEDLE_COLUMNS


class AnswerTokenizer(TinyTokenizer):
    """The tiny tokenizer, decoding as a real one is called (``skip_special_tokens``)."""

    def decode(self, ids, skip_special_tokens=False):
        return super().decode(ids)


def test_a_visitor_grid_runs_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    tiny = make_tiny()
    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, replace(tiny, tokenizer=AnswerTokenizer()))
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "store"))  # the grid's worker opens the default store
    seen = []
    figure, table, status, cells = app.on_needle(["tova", "sinks"], 16, [512], DEFAULT_MODEL,
                                          progress=lambda frac, desc: seen.append((frac, desc)))
    assert [trace.name for trace in figure.data] == ["full", "tova:budget=16", "sinks:budget=16"]
    assert seen[0][0] == 0 and seen[-1] == (1.0, "needle cells: 3 of 3 done")
    assert table.count("<tr>") == 1 + 3 * 3  # the header, then 3 depths x 3 policies
    assert "&lt;" in table and "<1" not in table  # the tiny tokenizer answers "<17><4>...": escaped
    assert status.startswith("3 cells in") and "tova:budget=16 0%" in status
    # A click on a cell's row opens that cell as a run of its own, the needle's number named as its evidence.
    assert list(cells.columns) == app.NEEDLE_CELL_COLUMNS and len(cells) == 9
    from backend.experiments.needle import Cell
    from backend.traces.store import TraceStore

    monkeypatch.setattr(app, "STORE", TraceStore(tmp_path / "app-store"))

    class Click:
        index = (int(cells.index[(cells["spec"] == "tova:budget=16") & (cells["depth"] == 0.5)][0]), 0)

    run_id, cell_status, *_ = app.on_needle_cell(cells, DEFAULT_MODEL, Click(), progress=lambda *a, **k: None)
    assert cell_status.startswith("Needle cell 512 tokens, depth 0.5: Full and tova:budget=16")
    assert app.load_run(run_id).run.request.evidence == [Cell(512, 0.5).number()]
