"""The task leaderboards' grades in ``docs/leaderboards.md`` (averaged) and ``docs/leaderboards-by-task.md`` (every
policy, task by task), printed as Markdown from the shipped summaries (``assets/leaderboards/<model>.csv``, or the files
given):

    python -m benchmarks.leaderboard_tables [--setting agnostic] [FILE ...]

Per model: the tasks and lengths the average is over (those Full solves and the policies ran on, each weighing
the same; the tasks Full fails are left out) with their samples, then per policy the mean score at each ratio
with Wilson's 95% interval over all their samples, policies by their mean over the ratios, best first. The app's
Tasks tab draws the same rows ("average"). Then, where the per-sample rows are shipped beside the summary
(``samples/<model>.csv``), which policies the samples tell apart, paired (``leaderboard.paired_tests``), as
groups at each ratio (``leaderboard.ordered_groups``). A policy graded on some of the tasks only (its samples on
the others still to come) stays out of the average, which would not compare with the others'; each task and
length every policy is graded on then gets a table and groups of its own, every policy in them.
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


def averaged_tasks(df: pd.DataFrame, setting: str) -> str:
    """``niah_single_1 at 1024 (5), ...``: the tasks and lengths in the average (Full solves them and the policies
    ran on them), with the samples the policies ran on."""
    rows = df[(df["policy"] != "full") & (df["task"] != "average") & (df["setting"] == setting) & df["full_solves"]]
    samples = rows.groupby(["length", "task"])["samples"].max().astype(int)
    return ", ".join(f"{task} at {length} ({n})" for (length, task), n in samples.items())


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
    return f"{samples[0]} samples" if len(samples) == 1 else f"{samples[0]}-{samples[-1]} samples"


def grade_table(df: pd.DataFrame, setting: str) -> str:
    """Per policy, the averaged score at each ratio as ``0.88 (0.71-0.96)``, then the policies left out of the
    average (``leaderboard.partly_graded``) with where they are graded; empty when the setting has none."""
    rows = df[(df["task"] == "average") & (df["setting"] == setting) & (df["policy"] != "full")]
    if rows.empty:
        return ""
    lines = [f"{_count(rows)} a cell, over " + averaged_tasks(df, setting) + ".", "", *_grades(rows)]
    partly = partly_graded(df[(df["task"] != "average") & (df["setting"] == setting)])
    if partly:
        lines += ["", *(f"Graded on {', '.join(f'{task} at {length}' for task, length in cells)} only, so not "
                        f"averaged: {', '.join(policies)}." for cells, policies in partly.items())]
    return "\n".join(lines)


def common_cells(df: pd.DataFrame, setting: str) -> list[tuple[str, int]]:
    """The tasks and lengths Full solves on which every policy of the leaderboard is graded, where some policies
    are graded on fewer than the average's: each then has a table of its own with every policy."""
    rows = df[(df["task"] != "average") & (df["setting"] == setting) & df["full_solves"] & (df["policy"] != "full")]
    if not partly_graded(rows):
        return []
    cells = [frozenset(zip(part["task"], part["length"])) for _, part in rows.groupby("policy", sort=False)]
    return sorted(frozenset.intersection(*cells), key=lambda cell: (cell[1], cell[0])) if cells else []


def cell_table(df: pd.DataFrame, setting: str, task: str, length: int) -> str:
    """Every policy's grade on one task at one length, as ``grade_table`` grades the average."""
    rows = df[(df["task"] == task) & (df["length"] == length) & (df["setting"] == setting) & (df["policy"] != "full")]
    full = float(rows["full_score"].iloc[0])
    return "\n".join([f"{task} at {length}, every policy: {_count(rows)} a cell, Full {full:.2f}.", "",
                      *_grades(rows)])


def groups_table(samples: pd.DataFrame, setting: str, cell: tuple[str, int] | None = None) -> str:
    """Per ratio, how many pairs of policies the samples tell apart and the policies as groups, best first, on the
    average's tasks or on ``cell``'s samples alone; empty when the setting has no policy rows on a task Full
    solves."""
    groups = ordered_groups(paired_tests(samples, setting, cell=cell))
    if not groups:
        return ""
    lines = ["| ratio | pairs told apart | groups, best first |", "|---|---|---|"]
    for row in groups:
        ranked = " > ".join(", ".join(group) for group in row["groups"]) if row["pairs_ordered"] else "none told apart"
        lines.append(f"| {row['ratio']:g} | {row['pairs_ordered']} of {row['pairs']} | {ranked} |")
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
        table = grade_table(df, args.setting)
        print(f"**{path.stem}**, query-{args.setting}: " + (table if table else "no rows in this setting.") + "\n")
        samples_path = samples_file(path)
        if table and samples_path.is_file():
            try:
                groups = groups_table(read_leaderboard_samples(samples_path), args.setting)
            except ShippedFileError as err:
                print(f"leaderboard_tables: {err}", file=sys.stderr)
                return 2
            if groups:
                print(groups + "\n")
        for task, length in common_cells(df, args.setting) if table else []:
            print(cell_table(df, args.setting, task, length) + "\n")
            if samples_path.is_file():
                groups = groups_table(read_leaderboard_samples(samples_path), args.setting, (task, length))
                if groups:
                    print(groups + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
