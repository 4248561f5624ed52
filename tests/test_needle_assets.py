"""The merge that builds the shipped needle table from several runs' grid.csv files."""
import json

import pandas as pd
import pytest

from benchmarks.needle_assets import main, merge
from backend.experiments.shipped import ASSETS, NEEDLE_COLUMNS, NEEDLE_FILE


def _row(spec, length, depth, answer="12345", found=True):
    policy, _, budget = spec.partition(":budget=")
    return {"model": "m", "policy": policy, "budget": float(budget) if budget else None, "spec": spec,
            "length": length, "depth": depth, "found": found, "answer": answer, "number": "12345",
            "tokens": length - 20, "seed": 0}


def test_full_is_kept_once_and_rows_sort_by_policy_budget_length_depth():
    eviction = pd.DataFrame([_row("full", 2048, 0.5), _row("tova:budget=256", 2048, 0.5),
                             _row("tova:budget=128", 2048, 0.5), _row("full", 1024, 0.5),
                             _row("tova:budget=128", 1024, 0.5)])
    selection = pd.DataFrame([_row("full", 1024, 0.5), _row("sparq:budget=128", 1024, 0.5)])
    merged = merge([eviction, selection])
    assert list(merged.columns) == NEEDLE_COLUMNS
    assert list(zip(merged["spec"], merged["length"])) == [
        ("full", 1024), ("full", 2048), ("tova:budget=128", 1024), ("tova:budget=128", 2048),
        ("tova:budget=256", 2048), ("sparq:budget=128", 1024)]


def test_a_full_row_that_answers_differently_in_two_runs_is_refused(tmp_path, capsys):
    one = tmp_path / "one.csv"
    two = tmp_path / "two.csv"
    pd.DataFrame([_row("full", 1024, 0.5)]).to_csv(one, index=False)
    pd.DataFrame([_row("full", 1024, 0.5, answer="54321", found=False)]).to_csv(two, index=False)
    with pytest.raises(ValueError, match="Full answers differently"):
        merge([pd.read_csv(one), pd.read_csv(two)])
    assert main([str(one), str(two), "--out", str(tmp_path / "out.csv")]) == 2
    assert capsys.readouterr().err.startswith("needle_assets: Full answers differently")
    assert not (tmp_path / "out.csv").exists()


def test_the_shipped_table_is_already_merged(tmp_path):
    """Re-merging the shipped table alone writes it back byte for byte: it is sorted and has no duplicates."""
    shipped = ASSETS / NEEDLE_FILE
    assert main([str(shipped), "--out", str(tmp_path / "again.csv")]) == 0
    assert (tmp_path / "again.csv").read_bytes() == shipped.read_bytes()


def test_a_checkpoint_merges_as_its_grid_csv_does(tmp_path):
    """cells.jsonl (the checkpoint, every cell a folder ran) gives the same table as grid.csv."""
    rows = [_row("full", 1024, 0.5), _row("tova:budget=128", 1024, 0.5, answer="no", found=False)]
    for row in rows:
        row["budget"] = None if row["budget"] is None else int(row["budget"])  # as the checkpoint holds it
    (tmp_path / "cells.jsonl").write_text(json.dumps({"key": "k", "rows": rows}) + "\n")
    pd.DataFrame(rows).to_csv(tmp_path / "grid.csv", index=False)
    assert main([str(tmp_path / "cells.jsonl"), "--out", str(tmp_path / "a.csv")]) == 0
    assert main([str(tmp_path / "grid.csv"), "--out", str(tmp_path / "b.csv")]) == 0
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()
    assert "tova,128.0,tova:budget=128" in (tmp_path / "a.csv").read_text()
