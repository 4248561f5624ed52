"""The task leaderboards' grades in ``docs/results.md``, printed as Markdown from the shipped summaries
(``assets/leaderboards/<model>.csv``, or the files given):

    python -m benchmarks.leaderboard_tables [--setting agnostic] [FILE ...]

Per model: the tasks and lengths the average is over (those Full solves and the policies ran on, each weighing
the same; the tasks Full fails are left out) with their samples, then per policy the mean score at each ratio
with Wilson's 95% interval over all their samples, policies by their mean over the ratios, best first. The app's
Tasks tab draws the same rows ("average").
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.shipped import ShippedFileError, leaderboard_files, read_leaderboard


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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
