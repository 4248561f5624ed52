"""The task leaderboards' grades of docs/leaderboards.md and docs/leaderboards-by-task.md, made from the shipped summaries
(benchmarks.leaderboard_tables), and which policies the shipped samples tell apart, paired (leaderboard.paired_tests and
ordered_groups)."""
import re
from pathlib import Path

import pandas as pd
import pytest

from backend.experiments.leaderboard import averaged, holm, ordered_groups, paired_tests, summarize
from benchmarks.leaderboard_tables import cell_table, grade_table, graded_cells, groups_table, main

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
    assert grade_table(_summary(), "agnostic", 1024).splitlines() == [
        "At 1024 tokens, 3 samples a cell, over a (2), b (1).",
        "",
        "| policy | 0.5 | 0.75 |",
        "|---|---|---|",
        "| knorm | 0.50 (0.13-0.87) | 0.75 (0.26-0.96) |",
        "| tova | 0.50 (0.13-0.87) | 0.25 (0.04-0.74) |",
    ]
    assert grade_table(_summary(), "aware", 1024) == "" and grade_table(_summary(), "agnostic", 4096) == ""


def test_a_missing_file_is_one_line(tmp_path, capsys):
    assert main([str(tmp_path / "none.csv")]) == 2
    assert capsys.readouterr().err.strip() == f"leaderboard_tables: no such file: {tmp_path / 'none.csv'}"


def test_the_leaderboards_pages_hold_the_grades_of_the_shipped_leaderboards(capsys):
    """docs/leaderboards.md quotes the tool's averaged grades and groups on the shipped summaries, and
    docs/leaderboards-by-task.md its tables of every policy, task by task: a merged sample must update them (the
    pages' other tables are checked against the shipped samples by tests/test_docs.py)."""
    assert main([]) == 0
    printed = capsys.readouterr().out.strip()
    averaged = (ROOT / "docs" / "leaderboards.md").read_text(encoding="utf-8")
    by_task = (ROOT / "docs" / "leaderboards-by-task.md").read_text(encoding="utf-8")
    for model in re.split(r"(?m)^(?=\*\*[\w.-]+\*\*, query-)", printed):
        cells = re.search(r"(?m)^\S+ at \d+, every policy:", model)
        grades, tasks = (model, "") if cells is None else (model[:cells.start()], model[cells.start():])
        for table in filter(None, (t.strip() for t in grades.split("\n\n"))):
            assert table in averaged
        for table in filter(None, (t.strip() for t in tasks.split("\n\n"))):
            assert table in by_task


def _samples(scores: dict[str, list[float]], task: str = "a", full: float = 1.0) -> list[dict]:
    """One row a sample and policy (ratio 0.5), Full scoring ``full`` on every sample."""
    rows = []
    for sample in range(len(next(iter(scores.values())))):
        base = {"model": "m", "task": task, "length": 1024, "setting": "agnostic", "sample": sample}
        rows.append({**base, "policy": "full", "ratio": 0.0, "score": full})
        rows += [{**base, "policy": policy, "ratio": 0.5, "score": values[sample]} for policy, values in scores.items()]
    return rows


def test_holms_correction_by_hand():
    # Sorted 0.01, 0.03, 0.04 times 3, 2, 1: 0.03, 0.06, 0.04 -> never below the one before: 0.03, 0.06, 0.06.
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    # 0.5 * 2 = 1.0 first, so 0.9 * 1 rises to it.
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([]) == []


def test_paired_samples_tell_policies_apart_by_a_sign_test_over_the_tasks_full_solves():
    # Task "a", which Full solves, ten samples. TOVA against Knorm: above on 9, level on 1. H2O against Knorm: above
    # on 5, below on 1, level on 4. TOVA against H2O: above on 5, level on 5. Task "b", which Full fails, has Knorm
    # above both on every sample: it is left out. Two-sided sign tests: 9 of 9 -> 2 / 2^9; 5 of 6 -> (1 + 6 + 6 + 1)
    # / 2^6 = 0.219; 5 of 5 -> 2 / 2^5 = 0.0625.
    rows = _samples({"tova": [1] * 10, "h2o": [1] * 5 + [0] * 5, "knorm": [0] * 9 + [1]})
    rows += _samples({"tova": [0] * 10, "h2o": [0] * 10, "knorm": [1] * 10}, task="b", full=0.0)
    pairs = paired_tests(pd.DataFrame(rows)).set_index(["policy", "other"])
    # Graded order on "a": TOVA 1.0, H2O 0.5, Knorm 0.1.
    assert list(pairs.index) == [("tova", "h2o"), ("tova", "knorm"), ("h2o", "knorm")]
    assert tuple(pairs.loc[("tova", "knorm"), ["above", "below", "same"]]) == (9, 0, 1)
    assert tuple(pairs.loc[("h2o", "knorm"), ["above", "below", "same"]]) == (5, 1, 4)
    assert tuple(pairs.loc[("tova", "h2o"), ["above", "below", "same"]]) == (5, 0, 5)
    assert pairs.loc[("tova", "knorm"), "p"] == pytest.approx(2 / 2**9)
    assert pairs.loc[("h2o", "knorm"), "p"] == pytest.approx(2 * 7 / 2**6)
    assert pairs.loc[("tova", "h2o"), "p"] == pytest.approx(2 / 2**5)
    # Holm over the three: 0.0039 * 3 = 0.012 < 0.05, ordered; 0.0625 * 2 = 0.125 and 0.219 are not.
    assert list(pairs["ordered"]) == [False, True, False]
    assert ordered_groups(pairs.reset_index())[0]["groups"] == [["tova", "h2o"], ["knorm"]]


def test_a_pair_the_samples_order_against_the_grades_is_not_ordered():
    # Each task weighs the same in the grades, each sample in the test: on "a" (one sample) TOVA scores 1 and
    # Knorm 0; on "b" (eight samples) Knorm scores 0.25 above TOVA on each. TOVA's grade (1 + 0) / 2 = 0.5 is above
    # Knorm's (0 + 0.25) / 2 = 0.125, yet Knorm is above on 8 of 9 samples: p = 2 * 10 / 2^9 = 0.039, not ordered.
    rows = _samples({"tova": [1.0], "knorm": [0.0]}) + _samples({"tova": [0.0] * 8, "knorm": [0.25] * 8}, task="b")
    pair = paired_tests(pd.DataFrame(rows)).iloc[0]
    assert (pair["policy"], pair["above"], pair["below"]) == ("tova", 1, 8)
    assert pair["p"] == pytest.approx(20 / 2**9)
    assert not pair["ordered"]


def test_groups_start_at_the_first_policy_put_below_the_groups_first():
    # Order a, b, c, d: a is told apart from c and d, b from d, nothing else. The groups: a's takes b (a ~ b), c
    # starts one (a > c), and d joins c's (c ~ d), though b > d.
    told = {("a", "c"), ("a", "d"), ("b", "d")}
    order = ["a", "b", "c", "d"]
    pairs = pd.DataFrame([{"model": "m", "setting": "agnostic", "length": 1024, "ratio": 0.5, "policy": x, "other": y, "above": 0,
                           "below": 0, "same": 0, "p": 1.0, "ordered": (x, y) in told}
                          for i, x in enumerate(order) for y in order[i + 1:]])
    [row] = ordered_groups(pairs)
    assert row["groups"] == [["a", "b"], ["c", "d"]]
    assert (row["pairs"], row["pairs_ordered"]) == (6, 3)


def test_the_groups_table_is_markdown_per_ratio():
    rows = _samples({"tova": [1] * 9, "knorm": [0] * 9})
    lines = groups_table(pd.DataFrame(rows), "agnostic").splitlines()
    assert lines[-3:] == ["| ratio | pairs told apart | groups, best first |", "|---|---|---|",
                          "| 0.5 | 1 of 1 | tova > knorm |"]
    assert groups_table(pd.DataFrame(rows), "aware") == ""
    both = pd.DataFrame(rows + [{**row, "length": 4096} for row in rows])  # each length's ratios named apart
    assert groups_table(both, "agnostic").splitlines()[-2:] == ["| 1024 · 0.5 | 1 of 1 | tova > knorm |",
                                                               "| 4096 · 0.5 | 1 of 1 | tova > knorm |"]
    few = _samples({"tova": [1] * 3, "knorm": [0] * 3})  # 3 of 3: p = 2 / 2^3 = 0.25, nothing told apart
    assert groups_table(pd.DataFrame(few), "agnostic") == "Told apart on the same samples: none of the 1 pairs, at any ratio."


def test_a_policy_graded_on_some_tasks_only_stays_out_of_the_average_and_is_graded_where_every_policy_is():
    # Tasks "a" (ten samples) and "b" (two), both solved; H2O is graded on "a" only. The average is TOVA's and Knorm's
    # over both tasks: TOVA (1 + 0) / 2 = 0.5 over 12 samples. On "a" alone every policy has a table and groups: TOVA
    # above Knorm on 9 of 10 (2 / 2^9 = 0.0039 < 0.05 / 3), H2O level with TOVA on 5 and above Knorm on 4 of 5.
    rows = _samples({"tova": [1] * 10, "h2o": [1] * 5 + [0] * 5, "knorm": [0] * 9 + [1]})
    rows += _samples({"tova": [0, 0], "knorm": [1, 1]}, task="b")
    samples = pd.DataFrame(rows)
    summary = summarize(samples)
    df = pd.concat([summary, averaged(summary)], ignore_index=True)
    mean = averaged(summary).set_index("policy")
    assert set(mean.index) == {"full", "tova", "knorm"}
    assert (mean.loc["tova", "score"], mean.loc["tova", "samples"]) == (0.5, 12)
    table = grade_table(df, "agnostic", 1024).splitlines()
    assert table[0] == "At 1024 tokens, 12 samples a cell, over a (10), b (2)."
    assert table[-1] == "Graded on a only at 1024, so not averaged there: h2o."
    assert graded_cells(df, "agnostic") == [("a", 1024), ("b", 1024)]
    assert cell_table(df, "agnostic", "a", 1024).splitlines()[0] == "a at 1024, every policy: 10 samples a cell, Full 1.00."
    assert [line.split(" |")[0] for line in cell_table(df, "agnostic", "a", 1024).splitlines()[4:]] == [
        "| tova", "| h2o", "| knorm"]
    # The average's pairs leave H2O out; the cell's have it.
    pairs = paired_tests(samples)
    assert len(pairs) == 1 and {pairs["policy"][0], pairs["other"][0]} == {"tova", "knorm"}
    [row] = ordered_groups(paired_tests(samples, cell=("a", 1024)))
    assert row["groups"] == [["tova", "h2o"], ["knorm"]]
    # A task Full fails has no table of its own.
    assert graded_cells(_summary(), "agnostic") == [("a", 1024), ("b", 1024)]


def test_each_length_has_its_own_average_of_the_policies_graded_on_all_its_tasks():
    """As RULER reports its grades: a mean over the tasks at one length. H2O, on both tasks at 1024 and on none at
    4096, is in the 1024 average; the 4096 average is TOVA's alone, and its pairs and groups are its own."""
    rows = _samples({"tova": [1] * 10, "h2o": [1] * 5 + [0] * 5, "knorm": [0] * 10})
    rows += _samples({"tova": [0, 0], "h2o": [1, 1], "knorm": [0, 0]}, task="b")
    rows += [{**row, "length": 4096} for row in _samples({"tova": [1, 0, 0]})]
    samples = pd.DataFrame(rows)
    summary = summarize(samples)
    mean = averaged(summary).set_index(["length", "policy"])["score"]
    # 1024: TOVA (1 + 0) / 2, H2O (0.5 + 1) / 2, Knorm 0; 4096: TOVA 1 / 3. Full scores 1 at both.
    assert mean.to_dict() == {(1024, "full"): 1.0, (1024, "tova"): 0.5, (1024, "h2o"): 0.75, (1024, "knorm"): 0.0,
                              (4096, "full"): 1.0, (4096, "tova"): pytest.approx(1 / 3)}
    df = pd.concat([summary, averaged(summary)], ignore_index=True)
    assert grade_table(df, "agnostic", 4096).splitlines()[0] == "At 4096 tokens, 3 samples a cell, over a (3)."
    assert graded_cells(df, "agnostic") == [("a", 1024), ("b", 1024), ("a", 4096)]
    pairs = paired_tests(samples)
    assert set(pairs["length"]) == {1024}  # one policy at 4096: no pair
    assert {frozenset(pair) for pair in zip(pairs["policy"], pairs["other"])} == {
        frozenset(pair) for pair in (("tova", "h2o"), ("tova", "knorm"), ("h2o", "knorm"))}
    [row] = ordered_groups(pairs)
    assert (row["length"], row["ratio"]) == (1024, 0.5)
    assert groups_table(samples, "agnostic", length=4096) == ""
    # TOVA above Knorm on 10 samples and below on none: 2 / 2^10 with Holm's 3 under 5%.
    assert groups_table(samples, "agnostic", length=1024).splitlines()[-1].startswith("| 0.5 | ")


def test_a_leaderboard_grades_every_registered_policy_that_takes_a_ratio():
    from backend.experiments.leaderboard import graded_policies
    from backend.policies import POLICIES, parse_spec

    graded = graded_policies()
    assert "full" not in graded and {"kivi", "gear", "window", "tova", "oracle"} <= set(graded)
    for name in POLICIES:
        if name not in graded:  # Full alone holds every token with no ratio to give it
            with pytest.raises(ValueError):
                parse_spec(f"{name}:ratio=0.5")
    for name in graded:
        parse_spec(f"{name}:ratio=0.875", 1000)
