"""The task leaderboards' grades in ``docs/leaderboards.md``, printed as Markdown from the shipped summaries
(``assets/leaderboards/<model>.csv``, or the files given):

    python -m benchmarks.leaderboard_tables [--setting agnostic] [FILE ...]

Per model: the tasks and lengths the average is over (those Full solves and the policies ran on, each weighing
the same; the tasks Full fails are left out) with their samples, then per policy the mean score at each ratio
with Wilson's 95% interval over all their samples, policies by their mean over the ratios, best first. The app's
Tasks tab draws the same rows ("average"). Then, where the per-sample rows are shipped beside the summary
(``samples/<model>.csv``), which policies the samples tell apart, paired (``leaderboard.paired_tests``), as
groups at each ratio (``leaderboard.ordered_groups``).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.leaderboard import ordered_groups, paired_tests
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


def grade_table(df: pd.DataFrame, setting: str) -> str:
    """Per policy, the averaged score at each ratio as ``0.88 (0.71-0.96)``; empty when the setting has none."""
    rows = df[(df["task"] == "average") & (df["setting"] == setting) & (df["policy"] != "full")]
    if rows.empty:
        return ""
    ratios = sorted(rows["ratio"].unique())
    samples = sorted(rows["samples"].astype(int).unique())
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
    count = f"{samples[0]} samples" if len(samples) == 1 else f"{samples[0]}-{samples[-1]} samples"
    return "\n".join([f"{count} a cell, over " + averaged_tasks(df, setting) + ".", "", *lines])


def groups_table(samples: pd.DataFrame, setting: str) -> str:
    """Per ratio, how many pairs of policies the samples tell apart and the policies as groups, best first; empty
    when the setting has no policy rows on a task Full solves."""
    groups = ordered_groups(paired_tests(samples, setting))
    if not groups:
        return ""
    lines = ["| ratio | pairs told apart | groups, best first |", "|---|---|---|"]
    for row in groups:
        ranked = " > ".join(", ".join(group) for group in row["groups"])
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
