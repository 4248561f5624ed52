"""The needle tables of ``docs/results.md``, printed as Markdown from a needle table (the shipped
``assets/long_context/needle_grid.csv`` by default, or any run's ``grid.csv``):

    python -m benchmarks.needle_tables [--policies full,sparq,reattention,quest]

* **found**: per policy spec, the needles found out of the depths run at each length, and over all lengths;
* **depths**: per policy spec and length, one character per depth in the order given (``Y`` found, ``.``
  missed, ``-`` not run), so unrun cells stay visible instead of counting as misses.
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from backend.long_context import ShippedFileError, read_needle_grid
from backend.policies import POLICIES

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def label(policy: str, budget) -> str:
    name = POLICIES[policy].__name__ if policy in POLICIES else policy
    return name if pd.isna(budget) else f"{name} {int(budget)}"


def _rows(df: pd.DataFrame, policies: list[str] | None):
    """(label, that spec's rows) in the table's order, restricted to ``policies`` when given."""
    for (policy, budget), rows in df.groupby(["policy", "budget"], sort=False, dropna=False):
        if policies is None or policy in policies:
            yield label(policy, budget), rows


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
