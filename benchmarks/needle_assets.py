"""Merge needle grids (``python -m backend needle``'s ``grid.csv``, or its checkpoint ``cells.jsonl``, which
holds every cell the folder ever ran) into the shipped ``assets/long_context/needle_grid.csv``, which the
app's "Long context" tab draws.

    python -m benchmarks.needle_assets assets/long_context/needle_grid.csv out/needle-eviction-8k/cells.jsonl \
        out/needle-selection/cells.jsonl --out assets/long_context/needle_grid.csv

Runs that share cells each carry their own Full row: it is kept once, and a Full answer that differs between
runs of the same cell is an error (the runs would not be comparable). A (spec, cell) in several inputs is
kept from the first. Rows are sorted by policy (Full first, then in order of first appearance), budget,
spec (``sparq:budget=128`` before ``sparq:budget=128,prefill=dense``), length, depth and seed, so re-merging
the same runs writes the same bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.shipped import NEEDLE_COLUMNS

CELL = ["model", "length", "depth", "seed"]


def merge(frames: list[pd.DataFrame]) -> pd.DataFrame:
    df = pd.concat([f[NEEDLE_COLUMNS] for f in frames], ignore_index=True)
    full = df[df["policy"] == "full"]
    answers = full.groupby(CELL)["answer"].nunique()
    if (answers > 1).any():
        cell = answers[answers > 1].index[0]
        raise ValueError(f"Full answers differently in two runs of the cell {dict(zip(CELL, cell))}")
    df = df.drop_duplicates(subset=["spec", *CELL], keep="first")
    order = {name: i for i, name in enumerate(["full", *df["policy"].drop_duplicates()])}
    df = df.assign(_order=df["policy"].map(order), _budget=df["budget"].fillna(-1))
    df = df.sort_values(["_order", "_budget", "spec", "length", "depth", "seed"], kind="stable")
    return df.drop(columns=["_order", "_budget"]).reset_index(drop=True)


def read_grid(path: str) -> pd.DataFrame:
    """A ``grid.csv``, or the rows of every cell in a ``cells.jsonl`` checkpoint (JSON, never pickled)."""
    if Path(path).suffix != ".jsonl":
        return pd.read_csv(path)
    with open(path, encoding="utf-8") as lines:
        rows = [row for line in lines if line.strip() for row in json.loads(line)["rows"]]
    df = pd.DataFrame(rows, columns=NEEDLE_COLUMNS)
    df["budget"] = df["budget"].astype(float)  # as grid.csv reads back: Full's budget is empty
    return df


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grids", nargs="+", help="grid.csv or cells.jsonl files (or the shipped table), first wins")
    parser.add_argument("--out", required=True, help="the merged CSV to write")
    args = parser.parse_args(argv)
    try:
        merged = merge([read_grid(path) for path in args.grids])
    except (OSError, ValueError, KeyError) as err:
        print(f"needle_assets: {err}", file=sys.stderr)
        return 2
    merged.to_csv(args.out, index=False)
    print(f"wrote {len(merged)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
