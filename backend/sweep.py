"""Perplexity vs budget: every policy at every budget on one text (TOVA Sec. 5.1, Fig. 3 and Table 2).

Each (policy, budget) pair is one row of the runner's batched forward (``runner.run``, prompt mode,
nothing recorded); as many pairs as ``max_rows`` allows share one call, and Full (row 0 of every call)
gives the topline. ``python -m backend sweep ...`` writes the table as CSV and JSON and a plotly figure.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from . import metrics
from .models import DEFAULT_MODEL, ModelError, load_model
from .policies import SpecError, parse_spec
from .runner import Progress
from .service import run_policies
from .store import TraceStore

DEFAULT_POLICIES = "window,sinks,h2o,tova"
DEFAULT_BUDGETS = "16,32,64,128"
MAX_ROWS = 32  # policy rows per runner call (Full's row comes on top); bounds memory on long texts
COLUMNS = ["policy", "budget", "spec", "ppl", "kl_to_full", "top1_agreement", "tokens"]


def budget_spec(name: str, budget: int) -> str:
    """``tova`` -> ``tova:budget=64``; ``tova:heads=head`` -> ``tova:budget=64,heads=head``."""
    base, _, params = name.strip().partition(":")
    keys = [item.partition("=")[0].strip() for item in params.split(",") if item.strip()]
    if "budget" in keys:
        raise SpecError(f"{name}: leave budget out of the policy, the sweep sets it (--budgets)")
    return f"{base.strip()}:budget={budget}" + (f",{params.strip()}" if keys else "")


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


def sweep(lm, text_ids: Sequence[int], policy_names: Sequence[str], budgets: Sequence[int],
          progress: Progress | None = None, max_rows: int = MAX_ROWS, store: TraceStore | None = None
          ) -> pd.DataFrame:
    """Perplexity (and KL to Full, top-1 agreement) of every policy at every budget on ``text_ids``.

    ``policy_names`` are registry names, optionally with parameters other than the budget
    (``tova:heads=head``); ``full`` among them is ignored, Full is always the topline row
    (``policy="full"``, ``budget`` empty). Rows come in the order policies x budgets. Raises SpecError
    for a bad policy or a policy/budget pair its parameters do not allow (before running anything).
    With a ``store`` every trace is stored (and replayed when present), so the app's budget slider and a
    second sweep only replay.
    """
    ids = [int(i) for i in text_ids]
    if len(ids) < 2:
        raise ValueError("the text must have at least 2 tokens")
    if not budgets or min(budgets) < 1:
        raise ValueError(f"budgets must be integers >= 1, got {list(budgets)}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    jobs = [(name.strip(), int(b), budget_spec(name, b)) for name in policy_names
            if name.strip().partition(":")[0].strip().lower() != "full" for b in budgets]
    policies = [parse_spec(spec) for _, _, spec in jobs]  # all errors before the first forward
    batches = [range(i, min(i + max_rows, len(jobs))) for i in range(0, len(jobs), max_rows)] or [range(0)]

    from tqdm.auto import tqdm

    rows: list[dict] = []
    full_row = None
    total = max(len(jobs), 1) * len(ids)
    with tqdm(total=total, unit="tok", desc="sweep", disable=None, file=sys.stderr) as bar:
        done = 0  # row-tokens finished before the current call
        for number, batch in enumerate(batches):
            width = max(len(batch), 1) * len(ids)

            def report(frac: float, what: str, done=done, width=width, number=number) -> None:
                bar.n = min(total, int(done + frac * width))
                bar.refresh()
                if progress:
                    progress(bar.n / total, f"sweep {number + 1}/{len(batches)}: {what}")

            result = run_policies(lm, [jobs[i][2] for i in batch], [policies[i] for i in batch], ids, "prompt",
                                  store=store, progress=report, record_layers=())
            traces, full = result.traces, result.full
            if full_row is None:
                full_row = {"policy": "full", "budget": None, "spec": "full", **metrics.summary_row(full, full),
                            "tokens": len(ids)}
            for i, trace in zip(batch, traces):
                name, budget, spec = jobs[i]
                rows.append({"policy": name, "budget": budget, "spec": spec, **metrics.summary_row(trace, full),
                             "tokens": len(ids)})
            done += width
            bar.n = min(total, done)
            bar.refresh()
    frame = pd.DataFrame(rows + [full_row], columns=COLUMNS)
    frame["budget"] = frame["budget"].astype("Int64")
    return frame


def write_sweep(df: pd.DataFrame, out_dir) -> dict[str, Path]:
    """Write ``sweep.csv``, ``sweep.json`` (one record per row) and ``sweep.html`` (plotly, works offline)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "sweep.csv", "json": out / "sweep.json", "html": out / "sweep.html"}
    df.to_csv(paths["csv"], index=False)
    df.to_json(paths["json"], orient="records", indent=1)
    from viz.sweep import sweep_figure  # plotting lives in viz/

    sweep_figure(df).write_html(paths["html"], include_plotlyjs=True, full_html=True)
    return paths


# --- Command line ----------------------------------------------------------------------------------------

def cmd_sweep(args: argparse.Namespace) -> int:
    from .cli import CliError, encode, read_text  # here, not at import: cli.py imports this module

    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as err:
        raise CliError(f"--budgets: {err}") from None
    names = split_policies(args.policies)
    if not names:
        raise CliError("--policies: give at least one policy, e.g. window,sinks,h2o,tova")
    try:
        for name in names:
            for budget in budgets:
                parse_spec(budget_spec(name, budget))
    except SpecError as err:
        raise CliError(str(err)) from None
    if args.max_tokens < 2:
        raise CliError("--max-tokens must be >= 2")
    if args.max_rows < 1:
        raise CliError("--max-rows must be >= 1")
    text = read_text(args.text)
    try:
        lm = load_model(args.model)
    except ModelError as err:
        raise CliError(str(err)) from None
    ids = encode(lm, text, "prompt", False, args.max_tokens)
    try:
        store = None if args.no_cache else TraceStore()
    except ValueError as err:
        raise CliError(str(err)) from None
    df = sweep(lm, ids, names, budgets, max_rows=args.max_rows, store=store)
    paths = write_sweep(df, args.out)
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(df.drop(columns=["tokens"]).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"{len(ids)} tokens; wrote {', '.join(p.name for p in paths.values())} to {args.out}")
    return 0


def add_sweep_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``sweep`` on the CLI's subparsers (``python -m backend sweep ...``)."""
    from .models import ALLOWED_MODELS

    p = subparsers.add_parser(
        "sweep", help="perplexity vs budget for several policies (TOVA Fig. 3)",
        description="Score a text teacher-forced under every policy at every budget; write sweep.csv, "
                    "sweep.json and sweep.html (perplexity vs budget, Full as the topline).")
    p.add_argument("--text", required=True, help="UTF-8 text file to score")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated policies, parameters allowed except budget, e.g. "
                        f"window,sinks,tova:heads=head (default {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated budgets (default {DEFAULT_BUDGETS})")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-tokens", type=int, default=1024, help="truncate longer texts to this many tokens")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"one of: {', '.join(ALLOWED_MODELS)}")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS,
                   help=f"policy/budget pairs per batched forward (default {MAX_ROWS}; lower it to save memory)")
    p.add_argument("--no-cache", action="store_true", help="recompute even if the trace store holds these runs")
    p.set_defaults(func=cmd_sweep)
    return p
