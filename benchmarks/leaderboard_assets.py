"""Merge task leaderboards (``python -m backend tasks``'s ``leaderboard.csv``, a row per sample and policy) of one
model into the shipped files the app's "Tasks" tab draws: ``assets/leaderboards/<model>.csv`` (the summary:
per task, length, setting, policy and ratio the mean score with Wilson's interval and Full's, then the
averages over the tasks Full solves at each length) and ``assets/leaderboards/samples/<model>.csv`` (every
sample's row).

    python -m benchmarks.leaderboard_assets out/smol-niah/leaderboard.csv out/smol-full/leaderboard.csv \
        --out assets/leaderboards

A (task, length, setting, sample, spec) in several inputs is kept from the first; Full's answer to a sample
must be the same in every input (else the runs would not be comparable). The rows are written sorted by sample,
policy (Full, then the registry's order, then any other by name) and ratio, so that a re-run which
changes no answer leaves the shipped files as they were.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.leaderboard import COLUMNS, TEXT_COLUMNS, averaged, graded_policies, summarize

SAMPLE = ["model", "task", "length", "setting", "sample"]


def read_leaderboard(path) -> pd.DataFrame:
    """A ``leaderboard.csv``; its answers stay text, so that a run whose answers are all numbers compares equal to
    the shipped file's in the check of Full's answers."""
    return pd.read_csv(path, keep_default_na=False, na_values=[""], dtype=TEXT_COLUMNS)


def merge(frames: list[pd.DataFrame]) -> pd.DataFrame:
    df = pd.concat([f[COLUMNS] for f in frames], ignore_index=True)
    full = df[df["policy"] == "full"].groupby(["model", "task", "length", "sample"])["answer"].nunique()
    if (full > 1).any():
        raise ValueError(f"Full answers differently in two runs of the sample {full[full > 1].index[0]}")
    kept = df.drop_duplicates(subset=[*SAMPLE, "spec"], keep="first")
    order = {policy: rank for rank, policy in enumerate(("full", *graded_policies()))}
    kept = kept.assign(_rank=kept["policy"].map(order).fillna(len(order)))
    return (kept.sort_values([*SAMPLE, "_rank", "policy", "ratio", "spec"], kind="stable")
            .drop(columns="_rank").reset_index(drop=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="leaderboard.csv files of one model")
    parser.add_argument("--out", default="assets/leaderboards")
    args = parser.parse_args()
    df = merge([read_leaderboard(path) for path in args.inputs])
    models = df["model"].unique()
    if len(models) != 1:
        print(f"error: one model per shipped leaderboard, got {', '.join(models)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    (out / "samples").mkdir(parents=True, exist_ok=True)
    summary = summarize(df)
    pd.concat([summary, averaged(summary)], ignore_index=True).to_csv(out / f"{models[0]}.csv", index=False,
                                                                     float_format="%.4f")
    df.to_csv(out / "samples" / f"{models[0]}.csv", index=False)
    print(f"{len(df)} rows, {len(summary)} summary rows -> {out / (models[0] + '.csv')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
