"""Perplexity-vs-budget sweep on the tiny model: the table, the files, and the command line."""
import json
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from backend.engine import models
from backend.analysis import metrics


from backend.experiments import sweep as sweep_module
from backend.cli import CliError, build_parser
from backend.engine.models import DEFAULT_MODEL
from backend.policies import SpecError, parse_spec
from backend.engine.runner import compute_traces
from backend.api import RequestError
from backend.experiments.sweep import (budget_jobs, budget_spec, parse_budgets, parse_ratios, ratio_jobs, split_policies,
                                      sweep, write_tables)
from tests.conftest import TinyTokenizer, make_tiny
from viz.sweep import sweep_figure

IDS = torch.randint(0, 101, (24,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(scope="module")
def lm():
    return make_tiny()


@pytest.fixture(scope="module")
def table(lm):
    return sweep(lm, IDS, budget_jobs(["window", "sinks:sinks=2", "tova", "full"], [6, 12, 64])).table


def test_budget_spec_adds_the_budget_and_keeps_other_parameters():
    assert budget_spec("tova", 64) == "tova:budget=64"
    assert budget_spec("tova:heads=head,sinks=1", 8) == "tova:budget=8,heads=head,sinks=1"
    with pytest.raises(SpecError, match="leave budget and ratio out"):
        budget_spec("tova:budget=4", 8)
    assert budget_spec("tova:heads=head", 0.5, "ratio") == "tova:ratio=0.5,heads=head"


def test_split_policies_keeps_parameters_with_their_policy():
    assert split_policies("window, tova:heads=head,sinks=2,h2o") == ["window", "tova:heads=head,sinks=2", "h2o"]
    assert split_policies(" ,") == []


def test_parse_budgets_wants_positive_integers():
    assert parse_budgets("16, 32,64") == [16, 32, 64]
    for bad in ("16,x", "0,4", ""):
        with pytest.raises(ValueError):
            parse_budgets(bad)


def test_sweep_has_a_row_per_policy_and_budget_and_fulls_topline(lm, table):
    assert list(table.columns) == ["policy", "budget", "spec", "ppl", "kl_to_full", "top1_agreement", "tokens"]
    assert table["spec"].tolist() == ["window:budget=6", "window:budget=12", "window:budget=64",
                                      "sinks:budget=6,sinks=2", "sinks:budget=12,sinks=2", "sinks:budget=64,sinks=2",
                                      "tova:budget=6", "tova:budget=12", "tova:budget=64", "full"]
    full = table[table["policy"] == "full"].iloc[0]
    assert pd.isna(full["budget"]) and full["kl_to_full"] == 0 and full["top1_agreement"] == 1
    _, reference = compute_traces(lm, ["full"], [parse_spec("full")], IDS, record_layers=())
    assert full["ppl"] == pytest.approx(metrics.perplexity(reference))
    # A budget of at least the text length drops nothing: every policy is Full there.
    at_64 = table[table["budget"] == 64]
    assert at_64["ppl"].tolist() == pytest.approx([full["ppl"]] * 3)
    # A small budget loses something.
    assert (table[table["budget"] == 6]["kl_to_full"] > 0).all()


def test_sweep_rows_equal_running_each_policy_alone(lm, table):
    traces, _ = compute_traces(lm, ["tova:budget=6"], [parse_spec("tova:budget=6")], IDS, record_layers=())
    row = table[table["spec"] == "tova:budget=6"].iloc[0]
    assert row["ppl"] == pytest.approx(metrics.perplexity(traces[0]), rel=1e-9)


def test_splitting_into_smaller_batches_gives_the_same_table(lm, table):
    calls = []
    small = sweep(lm, IDS, budget_jobs(["window", "sinks:sinks=2", "tova"], [6, 12, 64]), max_rows=4,
                  progress=lambda frac, what: calls.append((frac, what))).table
    pd.testing.assert_frame_equal(small, table)
    assert {what.split(":")[0] for _, what in calls} == {"sweep 1/3", "sweep 2/3", "sweep 3/3"}
    assert calls[-1][0] == pytest.approx(1.0) and all(0 <= f <= 1 for f, _ in calls)


def test_sweep_checks_every_spec_before_running(lm):
    with pytest.raises(SpecError, match="sinks"):
        sweep(lm, IDS, budget_jobs(["window", "sinks"], [4, 8]))  # sinks=4 needs budget > 4
    with pytest.raises(SpecError, match="unknown policy"):
        sweep(lm, IDS, budget_jobs(["lru"], [8]))


def test_write_tables_writes_csv_and_json_and_the_figure_draws_them(table, tmp_path):
    paths = write_tables(table, tmp_path / "out")
    assert sorted(p.name for p in paths.values()) == ["sweep.csv", "sweep.json"]
    csv = pd.read_csv(paths["csv"])
    assert csv["spec"].tolist() == table["spec"].tolist()
    assert csv["ppl"].tolist() == pytest.approx(table["ppl"].tolist())
    records = json.loads(paths["json"].read_text())
    assert records[-1]["policy"] == "full" and records[-1]["budget"] is None
    assert records[0] == {**records[0], "policy": "window", "budget": 6}
    fig = sweep_figure(table)
    assert [t.name for t in fig.data] == ["window", "sinks:sinks=2", "tova"]
    assert fig.layout.xaxis.type == "log" and list(fig.layout.xaxis.tickvals) == [6, 12, 64]


# --- Command line --------------------------------------------------------------------------------------

def parse(*argv):
    return build_parser().parse_args(["sweep", *argv])


@pytest.mark.parametrize("args, message", [
    (["--budgets", "8,x"], "--budgets: budgets must be comma-separated integers"),
    (["--budgets", "0"], "--budgets: budgets must be integers >= 1"),
    (["--policies", ","], "needs at least one policy other than full"),
    (["--policies", "full"], "needs at least one policy other than full"),
    (["--policies", "lru"], "unknown policy 'lru'"),
    (["--policies", "tova:budget=8"], "leave budget and ratio out"),
    (["--policies", "tova:ratio=0.5"], "leave budget and ratio out"),
    (["--ratios", "0.5,1"], "--ratios: ratios must be at least 0 and below 1"),
    (["--ratios", "half"], "--ratios: ratios must be comma-separated numbers"),
    (["--policies", "sinks", "--budgets", "4"], "sinks: need 0 <= sinks < budget"),
    (["--max-tokens", "1"], "Max tokens must be an integer, 2 or more."),
    (["--max-rows", "0"], "Rows per forward must be an integer >= 1"),
])
def test_bad_sweep_arguments_are_one_line_cli_errors(text_file, tmp_path, args, message):
    ns = parse("--text", str(text_file), "--out", str(tmp_path / "o"), *args)
    with pytest.raises((CliError, RequestError), match=message.replace("(", r"\(")):
        ns.func(ns)
    assert not (tmp_path / "o").exists()


def test_missing_text_and_unknown_model_are_cli_errors(text_file, tmp_path):
    ns = parse("--text", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "o"))
    with pytest.raises(CliError, match="text file not found"):
        ns.func(ns)
    ns = parse("--text", str(text_file), "--out", str(tmp_path / "o"), "--model", "gpt-5")
    with pytest.raises(RequestError, match="gpt-5: no such model, model directory or file"):
        ns.func(ns)


class CharTokenizer(TinyTokenizer):
    chat_template = None

    def __call__(self, text):
        return SimpleNamespace(input_ids=[ord(c) % 101 for c in text])


def test_a_sweep_over_ratios_gives_each_row_the_budget_its_ratio_leaves_on_the_text(lm):
    # 24 tokens: ratio 0.5 leaves 12, 0.75 leaves 6, 0.875 leaves int(3.0) = 3.
    assert parse_ratios("0.5, 0.75,0.875") == [0.5, 0.75, 0.875]
    jobs = ratio_jobs(["tova", "full"], [0.5, 0.75, 0.875])
    assert [spec for _, _, spec in jobs] == ["tova:ratio=0.5", "tova:ratio=0.75", "tova:ratio=0.875"]
    frame = sweep(lm, IDS, jobs).table
    assert frame["budget"].tolist()[:3] == [12, 6, 3] and frame["spec"].tolist()[:3] == [s for _, _, s in jobs]
    by_budget = sweep(lm, IDS, budget_jobs(["tova"], [12, 6, 3])).table
    assert frame["ppl"].tolist() == by_budget["ppl"].tolist()  # the same rows as those budgets


def test_sweep_command_writes_the_files(text_file, tmp_path, monkeypatch, capsys):
    tiny = make_tiny()
    tiny.tokenizer = CharTokenizer()
    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, tiny)
    ns = parse("--text", str(text_file), "--out", str(tmp_path / "o"), "--policies", "window,tova:heads=head",
               "--budgets", "8,16", "--max-tokens", "30")
    assert ns.func(ns) == 0
    out = capsys.readouterr().out
    assert "tova:budget=16,heads=head" in out and "30 tokens; wrote sweep.csv, sweep.json, sweep.html" in out
    csv = pd.read_csv(tmp_path / "o" / "sweep.csv")
    assert csv["policy"].tolist() == ["window", "window", "tova:heads=head", "tova:heads=head", "full"]
    assert (csv["tokens"] == 30).all()
    html = (tmp_path / "o" / "sweep.html").read_text()
    assert "plotly" in html.lower() and '"name":"tova:heads=head"' in html and "Full " in html


def test_sweep_stores_every_budget_so_the_app_replays(tmp_path):
    from backend.policies import parse_spec
    from backend.runs import replay_or_compute
    from backend.traces.store import TraceStore

    lm = make_tiny()
    ids = list(range(3, 40))
    store = TraceStore(tmp_path / "store")
    assert sweep_module.sweep(lm, ids, budget_jobs(["tova", "window"], [4, 8]), store=store).stored
    specs = ["tova:budget=4", "tova:budget=8", "window:budget=4", "window:budget=8"]
    result = replay_or_compute(lm, specs, [parse_spec(s) for s in specs], ids, "prompt", store=store, record_layers=())
    assert result.replayed == [True] * 4
