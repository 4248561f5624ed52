"""The task leaderboards' grades of docs/results.md, made from the shipped summaries (benchmarks.leaderboard_tables)."""
from pathlib import Path

import pandas as pd

from backend.experiments.leaderboard import averaged, summarize
from benchmarks.leaderboard_tables import grade_table, main

ROOT = Path(__file__).resolve().parents[1]


def _summary() -> pd.DataFrame:
    """Two tasks Full solves ("a": 2 samples, "b": 1) and one it fails ("c"); TOVA and Knorm at ratios 0.5 and 0.75."""
    scores = {("a", 0): {"tova": (1, 1), "knorm": (0, 1)}, ("a", 1): {"tova": (1, 0), "knorm": (0, 0)},
              ("b", 0): {"tova": (0, 0), "knorm": (1, 1)}, ("c", 0): {"tova": (1, 1), "knorm": (1, 1)}}
    rows = []
    for (task, sample), policies in scores.items():
        base = {"model": "m", "task": task, "length": 1024, "setting": "agnostic", "sample": sample}
        rows.append({**base, "policy": "full", "ratio": 0.0, "score": 0.0 if task == "c" else 1.0})
        for policy, (at_half, at_three_quarters) in policies.items():
            rows.append({**base, "policy": policy, "ratio": 0.5, "score": at_half})
            rows.append({**base, "policy": policy, "ratio": 0.75, "score": at_three_quarters})
    summary = summarize(pd.DataFrame(rows))
    return pd.concat([summary, averaged(summary)], ignore_index=True)


def test_grades_average_the_tasks_full_solves_with_wilsons_interval():
    # By hand, each task weighing the same and "c" left out: TOVA at 0.5 (1 + 0) / 2 = 0.5, at 0.75 (0.5 + 0) / 2 =
    # 0.25; Knorm at 0.5 (0 + 1) / 2 = 0.5, at 0.75 (0.5 + 1) / 2 = 0.75. Wilson over 3 samples (z = 1.96): centre
    # (p + z^2/6) / (1 + z^2/3), half z / (1 + z^2/3) * sqrt(p(1-p)/3 + z^2/36): 0.5 -> 0.500 -+ 0.375 = 0.13-0.87,
    # 0.25 -> 0.390 -+ 0.354 = 0.04-0.74, 0.75 -> 0.610 -+ 0.354 = 0.26-0.96. Knorm's mean over the ratios (0.625) is
    # above TOVA's (0.375): it comes first.
    assert grade_table(_summary(), "agnostic").splitlines() == [
        "3 samples a cell, over a at 1024 (2), b at 1024 (1).",
        "",
        "| policy | 0.5 | 0.75 |",
        "|---|---|---|",
        "| knorm | 0.50 (0.13-0.87) | 0.75 (0.26-0.96) |",
        "| tova | 0.50 (0.13-0.87) | 0.25 (0.04-0.74) |",
    ]
    assert grade_table(_summary(), "aware") == ""


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "none.csv")]) == 2
    assert capsys.readouterr().err.strip() == f"leaderboard_tables: no such file: {tmp_path / 'none.csv'}"


def test_results_md_holds_the_grades_of_the_shipped_leaderboards(capsys):
    """docs/results.md quotes the tool's output on the shipped summaries: a merged sample must update both."""
    assert main([]) == 0
    printed = capsys.readouterr().out.strip()
    results = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    for table in printed.split("\n\n"):
        assert table in results
