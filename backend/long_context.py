"""The app's "Long context" tab without Gradio: the needle grids and sweeps computed offline, and the small
needle grid a visitor may run.

* **Shipped results** live in ``assets/long_context/``: ``needle_grid.csv`` (the columns of ``python -m
  backend needle``'s ``grid.csv``) and ``sweep_summary.csv`` (mean perplexity over documents with its 95%
  interval per (model, policy, budget); Full has an empty budget). They are read with pandas only, checked
  column by column, and any fault (missing, unreadable, malformed) is one ``ShippedFileError`` line.
* **A visitor's grid** is a few cells of the same jobs the CLI builds (``needle.needle_jobs``), run serially
  in the app's process by ``grid.run_grid``. It is bounded before it queues: at most ``VISITOR_POLICIES``
  policies (Full, the reference, comes free: it is every run's row 0), lengths from ``VISITOR_LENGTHS``,
  depths ``VISITOR_DEPTHS``, one seed, and every cell within the app's limits (``limits.Limits``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from .limits import Limits, row_cost
from .needle import COLUMNS, NEW_TOKENS, needle_frame, needle_jobs
from .session import LIMITS, RequestError, RunRequest, check_run, release_memory
from .sweep import SUMMARY_COLUMNS

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "long_context"
NEEDLE_FILE = "needle_grid.csv"
SWEEP_FILE = "sweep_summary.csv"
NEEDLE_COLUMNS = ["model", *COLUMNS]
SWEEP_COLUMNS = SUMMARY_COLUMNS  # the columns of ``python -m backend sweep``'s summary.csv
MAX_FILE_BYTES = 4 * 2**20  # the shipped tables are a few kB; nothing reads a huge file

VISITOR_POLICIES = 3  # policies besides Full
VISITOR_LENGTHS = (512, 1024)  # tokens, prompt and answer
VISITOR_DEPTHS = (0.0, 0.5, 1.0)
VISITOR_SEED = 0


class ShippedFileError(ValueError):
    """A shipped result file is missing or malformed; the message (one line) is shown in the tab."""


def _read_csv(path: Path, columns: list[str]) -> pd.DataFrame:
    name = path.name
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ShippedFileError(f"{name} is larger than {MAX_FILE_BYTES // 2**20} MB.")
        df = pd.read_csv(path, encoding="utf-8", keep_default_na=False, na_values=[""])
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


# --- A visitor's grid ----------------------------------------------------------------------------------

def visitor_jobs(specs: Sequence[str], lengths: Sequence, model: str, limits: Limits = LIMITS) -> list[dict]:
    """The jobs of a visitor's grid (Full first, then ``specs``, at ``lengths`` x ``VISITOR_DEPTHS``, one
    seed), or RequestError; cheap (never loads the model), so the app checks it before the job queues."""
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, str) for s in specs):
        raise RequestError("Policies must be a list of specs such as tova:budget=64.")
    specs = [s.strip() for s in specs if s.strip() and s.strip() != "full"]
    if not 1 <= len(specs) <= VISITOR_POLICIES:
        raise RequestError(f"Pick 1 to {VISITOR_POLICIES} policies besides Full (Full is always drawn), "
                           f"got {len(specs)}.")
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise RequestError(f"Pick at least one length: {' or '.join(map(str, VISITOR_LENGTHS))} tokens.")
    chosen = []
    for length in lengths:
        try:
            value = int(length)
        except (TypeError, ValueError):
            value = None
        if value not in VISITOR_LENGTHS or str(length).strip() != str(value):
            raise RequestError(f"Lengths here are {' or '.join(map(str, VISITOR_LENGTHS))} tokens; "
                               f"the command line runs longer grids.")
        if value > limits.prompt_tokens:
            raise RequestError(f"A {value}-token haystack is longer than the {limits.prompt_tokens} tokens "
                               f"allowed here.")
        if value not in chosen:
            chosen.append(value)
    request = RunRequest(prompt="needle", specs=["full", *specs], mode="generate", max_new_tokens=NEW_TOKENS,
                         model=model)
    policies = check_run(request, limits)  # spec syntax, duplicates, the model's allow-list, Unicode
    for length in chosen:
        cost = sum(row_cost(p, length) for p in policies if p.name != "full")
        if cost > limits.row_tokens:
            raise RequestError(f"{len(specs)} policies x {length} tokens come to {cost:,} row-tokens, more than "
                               f"the {limits.row_tokens:,} one run may use here; pick fewer policies or a shorter "
                               f"length.")
    return needle_jobs(model, request.specs, chosen, VISITOR_DEPTHS, (VISITOR_SEED,), NEW_TOKENS)


def run_visitor_grid(jobs: list[dict], progress: Callable[[float, str], None] | None = None,
                     no_cache: bool = False) -> pd.DataFrame:
    """Run the jobs serially in this process (``run_grid``, no address, no checkpoint); the grid's table.
    A failing cell is a RequestError naming it."""
    from .grid import GridError, run_grid

    if progress:
        progress(0.0, f"needle cells: 0 of {len(jobs)} done")

    def step(done: int, total: int) -> None:
        if progress:
            progress(done / total, f"needle cells: {done} of {total} done")

    try:
        results = run_grid(jobs, address=None, no_cache=no_cache, progress=step)
    except GridError as err:
        raise RequestError(str(err).splitlines()[0]) from None
    finally:
        release_memory()
    return needle_frame(results)
