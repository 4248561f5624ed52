"""The needle tables of docs/long-texts.md, made from a needle table by benchmarks.needle_tables."""
from pathlib import Path

import pandas as pd

from benchmarks.needle_tables import depth_table, found_table, main


def _grid():
    rows = [("full", None, "full", 1024, 0.0, True), ("full", None, "full", 1024, 1.0, True),
            ("full", None, "full", 2048, 1.0, False),
            ("sparq", 128, "sparq:budget=128", 1024, 0.0, False), ("sparq", 128, "sparq:budget=128", 1024, 1.0, True),
            ("sparq", 128, "sparq:budget=128", 2048, 0.5, True),
            ("sparq", 128, "sparq:budget=128,prefill=dense", 1024, 0.0, True)]
    return pd.DataFrame(rows, columns=["policy", "budget", "spec", "length", "depth", "found"])


def test_found_counts_only_the_depths_run():
    assert found_table(_grid()).splitlines() == [
        "| policy | 1024 tokens | 2048 tokens | all |",
        "|---|---:|---:|---:|",
        "| Full | 2/2 | 0/1 | 2/3 |",
        "| SparQ 128 | 1/2 | 1/1 | 2/3 |",
        "| SparQ 128 (prefill=dense) | 1/1 | 0/0 | 1/1 |",
    ]


def test_depth_patterns_mark_unrun_cells_apart_from_misses():
    assert depth_table(_grid(), policies=["sparq"]).splitlines()[2:] == [
        "| SparQ 128 | `.---Y` | `--Y--` |", "| SparQ 128 (prefill=dense) | `Y----` | `-----` |"]


def test_the_long_texts_page_holds_the_tables_of_the_shipped_grid(capsys):
    """docs/long-texts.md quotes the tool's output on the shipped table: a re-run grid must update both."""
    assert main(["--policies", "full,sinks,h2o,tova,a2sf,snapkv,sparq,reattention,quest"]) == 0
    printed = capsys.readouterr().out.strip()
    page = (Path(__file__).resolve().parents[1] / "docs" / "long-texts.md").read_text(encoding="utf-8")
    for table in printed.split("\n\n"):
        assert table in page


def test_a_missing_table_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "none.csv")]) == 2
    err = capsys.readouterr().err
    assert err == f"needle_tables: no such file: {tmp_path / 'none.csv'}\n"
    (tmp_path / "bad.csv").write_text("policy,depth\nfull,0\n")
    assert main([str(tmp_path / "bad.csv")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("needle_tables: bad.csv lacks the columns") and err.count("\n") == 1
