"""The needle grid and the long-text sweep computed offline, as they ship in ``assets/long_context/``, and the
task leaderboards in ``assets/leaderboards/`` (one ``summary.csv`` of ``python -m backend tasks`` per model).

``needle_grid.csv`` has the columns of ``python -m backend needle``'s ``grid.csv``; ``sweep_summary.csv`` the
mean perplexity over documents with its 95% interval per (model, policy, budget), Full with an empty budget.
They are read with pandas only, checked column by column, and any fault (missing, unreadable, malformed) is
one ``ShippedFileError`` line. (A visitor's own small grid goes through the front door, ``backend.api``.)
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from .leaderboard import SUMMARY_COLUMNS as LEADERBOARD_COLUMNS, TEXT_COLUMNS
from .needle import COLUMNS
from .sweep import SUMMARY_COLUMNS

ASSETS = Path(__file__).resolve().parents[2] / "assets" / "long_context"
LEADERBOARDS = ASSETS.parent / "leaderboards"
NEEDLE_FILE = "needle_grid.csv"
SWEEP_FILE = "sweep_summary.csv"
NEEDLE_COLUMNS = ["model", *COLUMNS]
SWEEP_COLUMNS = SUMMARY_COLUMNS  # the columns of ``python -m backend sweep``'s summary.csv
MAX_FILE_BYTES = 4 * 2**20  # the shipped tables are a few kB; nothing reads a huge file


class ShippedFileError(ValueError):
    """A shipped result file is missing or malformed; the message (one line) is shown in the tab."""


def _read_csv(path: Path, columns: list[str]) -> pd.DataFrame:
    name = path.name
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ShippedFileError(f"{name} is larger than {MAX_FILE_BYTES // 2**20} MB.")
        df = pd.read_csv(path, encoding="utf-8", keep_default_na=False, na_values=[""], dtype=TEXT_COLUMNS)
    except FileNotFoundError:
        raise ShippedFileError(f"{name} is not shipped here (expected in assets/long_context/).") from None
    except pd.errors.EmptyDataError:
        raise ShippedFileError(f"{name} is empty.") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as err:
        raise ShippedFileError(f"{name} is not a readable CSV table ({str(err).splitlines()[0][:120]}).") from None
    except OSError as err:
        raise ShippedFileError(f"cannot read {name} ({err.strerror or err}).") from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise ShippedFileError(f"{name} lacks the column{'s' if len(missing) > 1 else ''} {', '.join(missing)}.")
    if df.empty:
        raise ShippedFileError(f"{name} has no rows.")
    return df[columns]


def _numbers(df: pd.DataFrame, name: str, column: str, blank_ok: bool = False) -> pd.Series:
    values = pd.to_numeric(df[column], errors="coerce")
    bad = values.isna() & (df[column].notna() if blank_ok else True)
    if bad.any():
        row = int(bad.to_numpy().argmax())
        held = str(df[column].iloc[row])[:40]
        raise ShippedFileError(f"{name}: {column} must be a number, row {row + 1} holds {held!r}.")
    return values


def read_needle_grid(path: Path | None = None) -> pd.DataFrame:
    """``needle_grid.csv`` as a table with ``grid.csv``'s columns and types, or ShippedFileError."""
    path = Path(path) if path is not None else ASSETS / NEEDLE_FILE
    df = _read_csv(path, NEEDLE_COLUMNS)
    for column in ("length", "depth", "tokens", "seed"):
        df[column] = _numbers(df, path.name, column)
    df["budget"] = _numbers(df, path.name, "budget", blank_ok=True).astype("Int64")
    if not df["depth"].between(0, 1).all() or (df["length"] <= 0).any():
        raise ShippedFileError(f"{path.name}: depths must be 0 to 1 and lengths positive.")
    found = df["found"].map(lambda v: {True: True, False: False, "True": True, "False": False}.get(v))
    if found.isna().any():
        raise ShippedFileError(f"{path.name}: found must be True or False.")
    df["found"] = found.astype(bool)
    for column in ("model", "policy", "spec", "answer", "number"):
        df[column] = df[column].fillna("").astype(str)
    df["length"] = df["length"].astype(int)
    return df


def read_sweep_summary(path: Path | None = None) -> pd.DataFrame:
    """``sweep_summary.csv`` as a table (budget Int64, empty for Full; interval bounds may be blank), or
    ShippedFileError."""
    path = Path(path) if path is not None else ASSETS / SWEEP_FILE
    df = _read_csv(path, SWEEP_COLUMNS)
    for column in ("documents", "ppl_mean"):
        df[column] = _numbers(df, path.name, column)
    for column in ("ppl_lo", "ppl_hi", "kl_mean"):
        df[column] = _numbers(df, path.name, column, blank_ok=True)
    df["budget"] = _numbers(df, path.name, "budget", blank_ok=True).astype("Int64")
    for column in ("model", "policy", "spec"):
        df[column] = df[column].fillna("").astype(str)
    if (df["ppl_mean"] <= 0).any():
        raise ShippedFileError(f"{path.name}: ppl_mean must be positive.")
    return df


def leaderboard_files(folder: Path | None = None) -> list[Path]:
    """The shipped leaderboards (``<model>.csv``), by name."""
    folder = Path(folder) if folder is not None else LEADERBOARDS
    return sorted(folder.glob("*.csv")) if folder.is_dir() else []


def read_leaderboard(path: Path) -> pd.DataFrame:
    """A shipped leaderboard (``python -m backend tasks``'s summary.csv: per task, length, setting, policy and ratio
    the mean score with its interval and Full's, then the averages as task ``average``), or ShippedFileError."""
    path = Path(path)
    df = _read_csv(path, LEADERBOARD_COLUMNS)
    for column in ("length", "ratio", "samples", "score", "full_score"):
        df[column] = _numbers(df, path.name, column)
    for column in ("lo", "hi"):
        df[column] = _numbers(df, path.name, column, blank_ok=True)
    if not (df["score"].between(0, 1).all() and df["full_score"].between(0, 1).all()):
        raise ShippedFileError(f"{path.name}: scores must be 0 to 1.")
    solves = df["full_solves"].map(lambda v: {True: True, False: False, "True": True, "False": False}.get(v))
    if solves.isna().any():
        raise ShippedFileError(f"{path.name}: full_solves must be True or False.")
    df["full_solves"] = solves.astype(bool)
    for column in ("model", "task", "setting", "policy"):
        df[column] = df[column].fillna("").astype(str)
    df["length"] = df["length"].astype(int)
    return df


SAMPLE_COLUMNS = ["model", "task", "length", "policy", "ratio", "setting", "sample", "score", "answer", "spec"]


def samples_file(leaderboard: Path) -> Path:
    """Where the rows per sample behind a shipped leaderboard (``<model>.csv``) lie: ``samples/<model>.csv``."""
    return Path(leaderboard).parent / "samples" / Path(leaderboard).name


def read_leaderboard_samples(path: Path) -> pd.DataFrame:
    """A shipped leaderboard's rows per sample (``samples/<model>.csv``: each policy's answer to each sample and its
    score), or ShippedFileError."""
    path = Path(path)
    df = _read_csv(path, SAMPLE_COLUMNS)
    for column in ("length", "ratio", "sample", "score"):
        df[column] = _numbers(df, path.name, column)
    if not df["score"].between(0, 1).all():
        raise ShippedFileError(f"{path.name}: scores must be 0 to 1.")
    for column in ("model", "task", "setting", "policy", "answer", "spec"):
        df[column] = df[column].fillna("").astype(str)
    df["length"], df["sample"] = df["length"].astype(int), df["sample"].astype(int)
    return df

