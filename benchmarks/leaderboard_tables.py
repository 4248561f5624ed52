"""The task leaderboards' grades in ``docs/leaderboards.md`` (averaged) and ``docs/leaderboards-by-task.md`` (every
policy, task by task), printed as Markdown from the shipped summaries (``assets/leaderboards/<model>.csv``, or the files
given):

    python -m benchmarks.leaderboard_tables [--setting agnostic] [FILE ...]

Per model and length, as RULER reports its grades: the tasks the average is over (those Full solves there and the
policies ran on, each weighing the same; the tasks Full fails are left out) with their samples, then per policy the
mean score at each ratio with Wilson's 95% interval over all their samples, policies by their mean over the ratios,
best first. The app's Tasks tab draws the same rows ("average at 1,024 tokens", ...). Then, where the per-sample
rows are shipped beside the summary (``samples/<model>.csv``), which policies the samples tell apart, paired
(``leaderboard.paired_tests``), as groups at each ratio (``leaderboard.ordered_groups``). A policy graded on some of a length's tasks only (its
samples on the others still to come) stays out of that length's average, which would not compare with the others'.
Then each task and length Full solves gets a table and groups of its own, every policy graded there in them.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.leaderboard import ordered_groups, paired_tests, partly_graded
from backend.experiments.shipped import (ShippedFileError, leaderboard_files, read_leaderboard,
                                         read_leaderboard_samples, samples_file)

GROUPS_HEADING = (
    "Told apart on the same samples: every policy answers the same samples, so each pair is compared sample by "
    "sample (a sign test over the samples they score differently, Holm's correction over the ratio's pairs, 5%). "
    "In the grades' order at each ratio, `>` starts a new group at the first policy the samples put below the "
    "group's first:")


def averaged_tasks(df: pd.DataFrame, setting: str, length: int) -> str:
    """``niah_single_1 (10), ...``: the tasks in the average at ``length`` (Full solves them there and the policies
    ran on them), with the samples the policies ran on."""
    rows = df[(df["policy"] != "full") & (df["task"] != "average") & (df["setting"] == setting) & df["full_solves"]
              & (df["length"] == length)]
    samples = rows.groupby("task")["samples"].max().astype(int)
    return ", ".join(f"{task} ({n})" for task, n in samples.items())


def average_lengths(df: pd.DataFrame, setting: str) -> list[int]:
    """The lengths with an average in ``setting`` (a task Full solves there), shortest first."""
    rows = df[(df["task"] == "average") & (df["setting"] == setting) & (df["policy"] != "full")]
    return sorted(int(n) for n in rows["length"].unique())


def _grades(rows: pd.DataFrame) -> list[str]:
    """Summary rows of one view (the average, or one task at one length) as a Markdown table: per policy the score
    at each ratio as ``0.88 (0.71-0.96)``, policies by their mean over the ratios, best first."""
    ratios = sorted(rows["ratio"].unique())
    cells = rows.set_index(["policy", "ratio"])
    order = rows.groupby("policy", sort=False)["score"].mean().sort_values(ascending=False, kind="stable").index
    lines = ["| policy | " + " | ".join(f"{r:g}" for r in ratios) + " |", "|---|" + "---|" * len(ratios)]
    for policy in order:
        values = []
        for ratio in ratios:
            if (policy, ratio) not in cells.index:
                values.append("-")
                continue
            cell = cells.loc[(policy, ratio)]
            values.append(f"{cell['score']:.2f} ({cell['lo']:.2f}-{cell['hi']:.2f})")
        lines.append(f"| {policy} | " + " | ".join(values) + " |")
    return lines


def _count(rows: pd.DataFrame) -> str:
    samples = sorted(rows["samples"].astype(int).unique())
    if len(samples) > 1:
        return f"{samples[0]}-{samples[-1]} samples"
    return "1 sample" if samples[0] == 1 else f"{samples[0]} samples"


def grade_table(df: pd.DataFrame, setting: str, length: int) -> str:
    """Per policy, the score averaged over the tasks at ``length`` at each ratio as ``0.88 (0.71-0.96)``, then the
    policies left out of that average (``leaderboard.partly_graded``) with where they are graded; empty when the
    setting has no average there."""
    rows = df[(df["task"] == "average") & (df["setting"] == setting) & (df["policy"] != "full")
              & (df["length"] == length)]
    if rows.empty:
        return ""
    lines = [f"At {length} tokens, {_count(rows)} a cell, over " + averaged_tasks(df, setting, length) + ".", "",
             *_grades(rows)]
    partly = partly_graded(df[(df["task"] != "average") & (df["setting"] == setting) & (df["length"] == length)])
    if partly:
        lines += ["", *(f"Graded on {', '.join(task for task, _ in cells)} only at {length}, so not averaged there: "
                        f"{', '.join(policies)}." for cells, policies in partly.items())]
    return "\n".join(lines)


def graded_cells(df: pd.DataFrame, setting: str) -> list[tuple[str, int]]:
    """Every task and length Full solves with a policy graded there, shortest length first: each has a table of its
    own with every policy graded on it."""
    rows = df[(df["task"] != "average") & (df["setting"] == setting) & df["full_solves"] & (df["policy"] != "full")]
    return sorted({(str(task), int(length)) for task, length in zip(rows["task"], rows["length"])},
                  key=lambda cell: (cell[1], cell[0]))


def cell_table(df: pd.DataFrame, setting: str, task: str, length: int) -> str:
    """Every policy's grade on one task at one length, as ``grade_table`` grades the average."""
    rows = df[(df["task"] == task) & (df["length"] == length) & (df["setting"] == setting) & (df["policy"] != "full")]
    full = float(rows["full_score"].iloc[0])
    return "\n".join([f"{task} at {length}, every policy: {_count(rows)} a cell, Full {full:.2f}.", "",
                      *_grades(rows)])


def groups_table(samples: pd.DataFrame, setting: str, cell: tuple[str, int] | None = None,
                 length: int | None = None) -> str:
    """Per ratio, how many pairs of policies the samples tell apart and the policies as groups, best first, on the
    average's tasks at ``length`` (default: at each length, its ratios named "1024 · 0.5" where there are several)
    or on ``cell``'s samples alone; empty when the setting has no policy rows on a task Full solves."""
    groups = [row for row in ordered_groups(paired_tests(samples, setting, cell=cell))
              if length is None or row["length"] == length]
    if not groups:
        return ""
    if not any(row["pairs_ordered"] for row in groups):
        return f"Told apart on the same samples: none of the {groups[0]['pairs']} pairs, at any ratio."
    lines = ["| ratio | pairs told apart | groups, best first |", "|---|---|---|"]
    several = len({row["length"] for row in groups}) > 1
    for row in groups:
        ranked = " > ".join(", ".join(group) for group in row["groups"]) if row["pairs_ordered"] else "none told apart"
        where = f"{row['length']} · {row['ratio']:g}" if several else f"{row['ratio']:g}"
        lines.append(f"| {where} | {row['pairs_ordered']} of {row['pairs']} | {ranked} |")
    return "\n".join([GROUPS_HEADING, "", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", help="shipped leaderboards (default: every one in assets/leaderboards)")
    parser.add_argument("--setting", default="agnostic", choices=["agnostic", "aware"])
    args = parser.parse_args(argv)
    paths = [Path(p) for p in args.files] or leaderboard_files()
    for path in paths:
        if not path.is_file():
            print(f"leaderboard_tables: no such file: {path}", file=sys.stderr)
            return 2
    for path in paths:
        try:
            df = read_leaderboard(path)
        except ShippedFileError as err:
            print(f"leaderboard_tables: {err}", file=sys.stderr)
            return 2
        lengths = average_lengths(df, args.setting)
        print(f"**{path.stem}**, query-{args.setting}" + (", the average over the tasks Full solves at each length."
                                                          if lengths else ": no rows in this setting.") + "\n")
        samples_path = samples_file(path)
        try:
            samples = read_leaderboard_samples(samples_path) if lengths and samples_path.is_file() else None
        except ShippedFileError as err:
            print(f"leaderboard_tables: {err}", file=sys.stderr)
            return 2
        for length in lengths:
            print(grade_table(df, args.setting, length) + "\n")
            groups = groups_table(samples, args.setting, length=length) if samples is not None else ""
            if groups:
                print(groups + "\n")
        for task, length in graded_cells(df, args.setting) if lengths else []:
            print(cell_table(df, args.setting, task, length) + "\n")
            groups = groups_table(samples, args.setting, (task, length)) if samples is not None else ""
            if groups:
                print(groups + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
