"""Perplexity vs budget: every policy at every budget on one text (TOVA Sec. 5.1, Fig. 3 and Table 2).

Each (policy, budget) pair is one row of the runner's batched forward (``runner.compute_traces``; by default prompt
mode, nothing recorded); as many pairs as ``max_rows`` allows share one call, and Full (row 0 of every
call) gives the topline. Computation only: requests come through ``api.py`` (limits, validation),
and ``python -m backend sweep`` (cli.py) writes the table and its figure.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd

from ..analysis import metrics
from ..policies import SpecError, parse_spec
from ..runs import replay_or_compute
from ..traces.store import TraceStore

if TYPE_CHECKING:
    from ..engine.runner import Progress

DEFAULT_POLICIES = "window,sinks,h2o,tova"
DEFAULT_BUDGETS = "16,32,64,128"
SWEEP_BUDGETS = (8, 16, 24, 32, 48, 64, 96, 128)  # the app's sweep: stored, so its budget slider then replays
MAX_ROWS = 32  # policy rows per runner call (Full's row comes on top); bounds memory on long texts
COLUMNS = ["policy", "budget", "spec", "ppl", "kl_to_full", "top1_agreement", "tokens"]


def budget_spec(name: str, budget: int, key: str = "budget") -> str:
    """``tova`` -> ``tova:budget=64``; ``tova:heads=head`` -> ``tova:budget=64,heads=head`` (``key="ratio"``:
    ``tova:ratio=0.5,heads=head``, a compression ratio)."""
    base, _, params = name.strip().partition(":")
    keys = [item.partition("=")[0].strip() for item in params.split(",") if item.strip()]
    if "budget" in keys or "ratio" in keys:
        raise SpecError(f"{name}: leave budget and ratio out of the policy, the sweep sets them (--budgets, --ratios)")
    return f"{base.strip()}:{key}={budget}" + (f",{params.strip()}" if keys else "")


def split_policies(text: str) -> list[str]:
    """``window,tova:heads=head,sinks=2,h2o`` -> ``[window, tova:heads=head,sinks=2, h2o]``: a
    comma-separated piece with ``=`` but no ``:`` is one more parameter of the policy before it."""
    names: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        if "=" in piece and ":" not in piece and names:
            names[-1] += "," + piece
        else:
            names.append(piece)
    return names


def parse_budgets(text: str) -> list[int]:
    """``16,32,64`` -> [16, 32, 64]; ValueError with a one-line reason otherwise."""
    pieces = [p.strip() for p in text.split(",") if p.strip()]
    try:
        budgets = [int(p) for p in pieces]
    except ValueError:
        raise ValueError(f"budgets must be comma-separated integers, got {text!r}") from None
    if not budgets or min(budgets) < 1:
        raise ValueError(f"budgets must be integers >= 1, got {text!r}")
    return budgets


def parse_ratios(text: str) -> list[float]:
    """``0.25,0.5,0.875`` -> [0.25, 0.5, 0.875]; ValueError with a one-line reason otherwise."""
    try:
        ratios = [float(p) for p in (p.strip() for p in text.split(",")) if p]
    except ValueError:
        raise ValueError(f"ratios must be comma-separated numbers, got {text!r}") from None
    if not ratios or not all(0.0 <= r < 1.0 for r in ratios):
        raise ValueError(f"ratios must be at least 0 and below 1 (the share of the context removed), got {text!r}")
    return ratios


def ratio_jobs(policy_names: Sequence[str], ratios: Sequence[float]) -> list[tuple[str, None, str]]:
    """``budget_jobs`` with compression ratios: (policy label, None, spec with ``ratio=R``); the sweep gives each
    row the budget its ratio leaves on the text (``policies.ratio_budget``)."""
    return [(name.strip(), None, budget_spec(name, float(r), "ratio")) for name in policy_names
            if name.strip().partition(":")[0].strip().lower() != "full" for r in ratios]


def budget_jobs(policy_names: Sequence[str], budgets: Sequence[int]) -> list[tuple[str, int, str]]:
    """(policy label, budget, spec) for every policy at every budget, in the order policies x budgets;
    ``full`` is left out (it is every sweep's topline). Raises SpecError as ``budget_spec`` does."""
    return [(name.strip(), int(b), budget_spec(name, b)) for name in policy_names
            if name.strip().partition(":")[0].strip().lower() != "full" for b in budgets]


@dataclass
class SweepResult:
    table: pd.DataFrame  # one row per job, in their order, then Full's (the COLUMNS)
    stored: bool  # the store holds every trace (False without a store, or with one that could not write)


def sweep(lm, text_ids: Sequence[int], jobs: Sequence[tuple[str, int, str]], progress: Progress | None = None,
          max_rows: int = MAX_ROWS, store: TraceStore | None = None, mode: str = "prompt", max_new_tokens: int = 64,
          record_layers: Sequence[int] = ()) -> SweepResult:
    """Perplexity (and KL to Full, top-1 agreement) of every job on ``text_ids``, and whether the store kept them.

    ``jobs`` are (policy label, budget, spec) triples (``budget_jobs`` makes them from names and budgets,
    ``ratio_jobs`` from names and compression ratios, a row's budget then being what its ratio leaves on this
    text); Full is always the topline row (``policy="full"``, ``budget`` empty). Rows come in the order of the
    jobs. Raises SpecError for a bad spec before running anything. With a ``store`` every trace is stored
    (and replayed when present); the app records its usual layers, so its budget slider then replays.
    """
    ids = [int(i) for i in text_ids]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    policies = [parse_spec(spec, len(ids)) for _, _, spec in jobs]  # all errors before the first forward
    batches = [range(i, min(i + max_rows, len(jobs))) for i in range(0, len(jobs), max_rows)] or [range(0)]

    rows: list[dict] = []
    full_row, stored = None, store is not None
    total = max(len(jobs), 1) * len(ids)
    done = 0  # row-tokens finished before the current call
    for number, batch in enumerate(batches):
        width = max(len(batch), 1) * len(ids)

        def report(frac: float, what: str, done=done, width=width, number=number) -> None:
            if progress:
                progress(min(1.0, (done + frac * width) / total), f"sweep {number + 1}/{len(batches)}: {what}")

        result = replay_or_compute(lm, [jobs[i][2] for i in batch], [policies[i] for i in batch], ids, mode,
                              max_new_tokens, store=store, progress=report, record_layers=record_layers)
        traces, full, stored = result.traces, result.full, stored and result.stored
        if full_row is None:
            full_row = {"policy": "full", "budget": None, "spec": "full", **metrics.summary_row(full, full),
                        "tokens": len(full.scored_ids)}
        for i, trace in zip(batch, traces):
            name, budget, spec = jobs[i]
            rows.append({"policy": name, "budget": policies[i].budget if budget is None else budget, "spec": spec, **metrics.summary_row(trace, full),
                         "tokens": len(trace.scored_ids)})
        done += width
    frame = pd.DataFrame(rows + [full_row], columns=COLUMNS)
    frame["budget"] = frame["budget"].astype("Int64")
    return SweepResult(frame, stored)


SUMMARY_COLUMNS = ["model", "policy", "budget", "spec", "documents", "ppl_mean", "ppl_lo", "ppl_hi", "kl_mean"]


def summarize(df: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per (model, policy, budget): the mean perplexity over documents and its ``confidence`` interval
    (Student's t over the documents' perplexities; NaN bounds from a single document), and the mean KL."""
    from scipy import stats

    df = df.assign(model=df["model"] if "model" in df else "")
    rows = []
    for (model, spec), part in df.groupby(["model", "spec"], sort=False):
        ppl = part["ppl"].to_numpy(dtype=float)
        mean, n = float(ppl.mean()), len(ppl)
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1) * ppl.std(ddof=1) / n ** 0.5) if n > 1 else float("nan")
        rows.append({"model": model, "policy": part["policy"].iloc[0], "budget": part["budget"].iloc[0],
                     "spec": spec, "documents": n, "ppl_mean": mean, "ppl_lo": mean - half, "ppl_hi": mean + half,
                     "kl_mean": float(part["kl_to_full"].mean())})
    summary = pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
    summary["budget"] = summary["budget"].astype("Int64")
    return summary


def write_tables(df: pd.DataFrame, out_dir) -> dict[str, Path]:
    """Write ``sweep.csv`` and ``sweep.json`` (one record per row) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "sweep.csv", "json": out / "sweep.json"}
    df.to_csv(paths["csv"], index=False)
    df.to_json(paths["json"], orient="records", indent=1)
    return paths
