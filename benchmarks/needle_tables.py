"""The needle tables of ``docs/long-texts.md``, printed as Markdown from a needle table (the shipped
``assets/long_context/needle_grid.csv`` by default, or any run's ``grid.csv``):

    python -m benchmarks.needle_tables [--policies full,sparq,reattention,quest]

* **found**: per policy spec, the needles found out of the depths run at each length, and over all lengths;
* **depths**: per policy spec and length, one character per depth in the order given (``Y`` found, ``.``
  missed, ``-`` not run), so unrun cells stay visible instead of counting as misses. One seed per cell, as
  the shipped table holds (the found counts would add several seeds up; the patterns would show the last).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from backend.experiments.shipped import ShippedFileError, read_needle_grid
from backend.policies import POLICIES

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def label(spec: str) -> str:
    """``sparq:budget=128,prefill=dense`` -> ``SparQ 128 (prefill=dense)``: the class name, the budget, the rest."""
    policy, _, params = spec.partition(":")
    name = POLICIES[policy].__name__ if policy in POLICIES else policy
    items = [item for item in params.split(",") if item]
    budget = [item.partition("=")[2] for item in items if item.startswith("budget=")]
    others = [item for item in items if not item.startswith("budget=")]
    return " ".join([name, *budget]) + (f" ({', '.join(others)})" if others else "")


def _rows(df: pd.DataFrame, policies: list[str] | None):
    """(label, that spec's rows) in the table's order, restricted to ``policies`` when given."""
    for spec, rows in df.groupby("spec", sort=False):
        if policies is None or rows["policy"].iloc[0] in policies:
            yield label(spec), rows


def found_table(df: pd.DataFrame, policies: list[str] | None = None) -> str:
    lengths = sorted(df["length"].unique())
    lines = ["| policy | " + " | ".join(f"{int(n)} tokens" for n in lengths) + " | all |",
             "|---|" + "---:|" * (len(lengths) + 1)]
    for name, rows in _rows(df, policies):
        cells = []
        for n in lengths:
            at = rows[rows["length"] == n]
            cells.append(f"{int(at['found'].sum())}/{len(at)}")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {int(rows['found'].sum())}/{len(rows)} |")
    return "\n".join(lines)


def depth_table(df: pd.DataFrame, policies: list[str] | None = None, depths=DEPTHS) -> str:
    lengths = sorted(df["length"].unique())
    lines = ["| policy | " + " | ".join(str(int(n)) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    for name, rows in _rows(df, policies):
        cells = []
        for n in lengths:
            at = rows[rows["length"] == n]
            found = {float(d): bool(f) for d, f in zip(at["depth"], at["found"])}
            cells.append("`" + "".join("-" if d not in found else "Y" if found[d] else "." for d in depths) + "`")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", nargs="?", help="a needle table (default: the shipped one)")
    parser.add_argument("--policies", help="comma-separated policy names to show, in the table's order")
    args = parser.parse_args(argv)
    if args.grid and not Path(args.grid).is_file():
        print(f"needle_tables: no such file: {args.grid}", file=sys.stderr)
        return 2
    try:
        df = read_needle_grid(args.grid)
    except ShippedFileError as err:
        print(f"needle_tables: {err}", file=sys.stderr)
        return 2
    policies = args.policies.split(",") if args.policies else None
    print(found_table(df, policies) + "\n\n" + depth_table(df, policies))
    return 0


if __name__ == "__main__":
    sys.exit(main())
