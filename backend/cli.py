"""Command line (``python -m backend`` or, installed, ``kvlens``): ``run ...`` writes one trace per policy and a
summary.json; ``sweep ...`` writes perplexity vs budget; ``needle ...`` a needle grid; ``tasks ...`` the task
leaderboard (score against compression ratio); ``lm-eval ...`` is lm-evaluation-harness's command line with
KV Lens's ``kvlens`` model.

Requests go through the app's front door (api.py: the same limits and checks). Everything that
needs no model is checked first (the text file, the policies, the output directory), so a mistake is
reported in a second, not after the model has loaded and the run has finished.
"""
from __future__ import annotations

import argparse
import codecs
import json
import logging
import os
import stat
import sys
import tempfile
from pathlib import Path

import pandas as pd

from .analysis import metrics
from .engine.models import DEFAULT_MODEL, DEVICES, DTYPES, PACKAGED
from .policies import POLICIES, PluginError, SpecError, describe, load_plugins, parse_spec, policy_table
from .engine import DEFAULT_CHUNK
from . import api
from .api import RequestError, RunRequest, SweepRequest, check_run, check_sweep
from .limits import Limits, machine_memory
from .traces.store import TraceStore
from .experiments.sweep import (DEFAULT_BUDGETS, DEFAULT_POLICIES, MAX_ROWS, budget_jobs, parse_budgets, parse_ratios,
                                ratio_jobs, split_policies, summarize, write_tables)
from .experiments.leaderboard import SHIPPED_RATIOS, graded_policies
from .experiments.ruler_speeches import STANDINS, import_generators, task_folder
from .experiments.tasks import MAX_SAMPLES, RULER_OFFLINE, splits_essays
from .traces.trace import file_stem


# The command line's user owns the machine: any model it can load, limits that fit its memory (limits.py).
LIMITS = Limits.for_machine()


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


def read_text(path: str, limits=LIMITS) -> str:
    """The text of a regular UTF-8 file, at most what the limits let a request use: the first
    ``4 * limits.text_chars`` bytes (UTF-8 takes at most 4 per character; --max-tokens reads the start of a
    long file). Anything but a regular file (a device, a FIFO, a directory) is refused before reading."""
    cap = 4 * limits.text_chars
    try:
        # Non-blocking, so that opening a FIFO cannot wait for a writer; a regular file reads as usual.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise CliError(f"not a regular file: {path}")
            data = file.read(cap + 1)
    except FileNotFoundError:
        raise CliError(f"text file not found: {path}") from None
    except IsADirectoryError:
        raise CliError(f"not a regular file: {path}") from None
    except OSError as err:
        raise CliError(f"cannot read {path}: {err.strerror or err}") from None
    try:
        # Cut at the cap, a character may be cut in two: only a complete text must decode to the end.
        text = codecs.getincrementaldecoder("utf-8")().decode(data[:cap], final=len(data) <= cap)
    except UnicodeDecodeError:
        raise CliError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise CliError(f"{path} is empty")
    return text


def writable_dir(path: str) -> Path:
    """``path`` as an existing directory we can write, or CliError; checked before any model work."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".kvlens-write-test-"):
            pass
    except OSError as err:
        raise CliError(f"--out {out} is not a writable directory ({err.strerror or err})") from None
    return out


def open_store(no_cache: bool) -> TraceStore | None:
    if no_cache:
        return None
    try:
        store = TraceStore()
    except ValueError as err:  # e.g. a malformed KVLENS_STORE_MB
        raise CliError(str(err)) from None
    if not store.available:  # a broken or unwritable store only means "not cached"
        print(f"note: the trace store is unavailable ({store.disabled_reason}); runs are not cached", file=sys.stderr)
    return store


def progress_printer():
    def progress(frac: float, what: str) -> None:
        if sys.stderr.isatty():
            print(f"\r{what}: {frac:4.0%}", end="", file=sys.stderr, flush=True)
    return progress


def cmd_run(args: argparse.Namespace) -> int:
    text = read_text(args.text)
    request = RunRequest(prompt=text, specs=list(args.policy), mode=args.mode, max_new_tokens=args.max_new_tokens,
                         model=args.model, chat=args.chat, max_tokens=args.max_tokens, device=args.device,
                         dtype=args.dtype)
    if args.chunk < 1:
        raise CliError("--chunk must be >= 1")
    check_run(request, LIMITS)
    out = writable_dir(args.out)
    store = open_store(args.no_cache)
    run = api.run(request, store, progress_printer(), LIMITS, chunk=args.chunk)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    summary = {}
    for index, (spec, trace) in enumerate(zip(run.request.specs, run.traces)):
        path = trace.save(out, file_stem(index, spec))
        row = metrics.summary_row(trace, run.full)
        summary[spec] = {**row, "trace": path.name}
        if "extra_pass_tokens" in trace.meta:  # tokens a policy fed through the model besides the text (KVzip)
            summary[spec]["extra_pass_tokens"] = trace.meta["extra_pass_tokens"]
        print(f"{spec:32s} ppl {row['ppl']:9.3f}  kl_to_full {row['kl_to_full']:.4f}  "
              f"top1 {row['top1_agreement']:.3f}  {'(replayed from the store)' if run.replayed[index] else ''}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {len(run.traces)} traces and summary.json to {out}")
    return 0


def _documents(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(name, text) of every --text file and every shipped --corpus document asked for."""
    from .texts import CORPORA, corpus_files, corpus_text

    docs = [(Path(path).name, read_text(path)) for path in args.text or []]
    for item in args.corpus or []:
        name, _, count = item.partition(":")
        if name not in CORPORA:
            raise CliError(f"--corpus: unknown corpus {name!r}; shipped: {', '.join(CORPORA)}")
        if count and not (count.isdigit() and int(count) >= 1):
            raise CliError(f"--corpus {item}: the count after ':' must be an integer >= 1")
        files = corpus_files(name)[: int(count) if count else None]
        docs += [(f"{name}/{file}", corpus_text(name, file)) for file in files]
    if not docs:
        raise CliError("give at least one --text file or --corpus")
    return docs


def cmd_sweep(args: argparse.Namespace) -> int:
    try:
        if args.ratios is not None:
            jobs = ratio_jobs(split_policies(args.policies), parse_ratios(args.ratios))
        else:
            jobs = budget_jobs(split_policies(args.policies), parse_budgets(args.budgets))
    except SpecError as err:
        raise CliError(str(err)) from None
    except ValueError as err:
        raise CliError(f"{'--ratios' if args.ratios is not None else '--budgets'}: {err}") from None
    docs = _documents(args)
    models = args.model or [DEFAULT_MODEL]
    requests = [SweepRequest(prompt=text, jobs=jobs, model=model, max_tokens=args.max_tokens, max_rows=args.max_rows,
                             device=args.device, dtype=args.dtype)
                for model in models for _, text in docs]
    for request in requests:
        check_sweep(request, LIMITS)
    out = writable_dir(args.out)
    if len(requests) == 1 and args.ray is None:  # one text, one model: in this process, as the app runs it
        store = open_store(args.no_cache)
        df = api.sweep(requests[0], store, progress_printer(), LIMITS).table
        if sys.stderr.isatty():
            print(file=sys.stderr)
        df.insert(0, "document", docs[0][0])
        df.insert(0, "model", models[0])
    else:  # a grid of (model, document) jobs, serially or on Ray (grid.py)
        df = _sweep_grid(args, jobs, docs, models, out)
    summary = summarize(df)
    paths = write_tables(df.drop(columns=["model", "document"]) if len(requests) == 1 else df, out)
    from viz.sweep import sweep_figure  # the CLI is a front end, like app.py: figures come from viz/

    paths["html"] = out / "sweep.html"
    figure_rows = df if len(requests) == 1 else summary.rename(columns={"ppl_mean": "ppl"}).assign(tokens=0)
    sweep_figure(figure_rows).write_html(paths["html"], include_plotlyjs=True, full_html=True)
    paths["summary"] = out / "summary.csv"
    summary.to_csv(paths["summary"], index=False)
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        shown = df.drop(columns=["tokens", "model", "document"]) if len(requests) == 1 else summary
        print(shown.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    what = f"{int(df['tokens'].iloc[-1])} tokens" if len(requests) == 1 else \
        f"{len(docs)} documents x {len(models)} models"
    print(f"{what}; wrote {', '.join(p.name for p in paths.values())} to {out}")
    return 0


def _sweep_grid(args, jobs, docs, models, out: Path) -> pd.DataFrame:
    from .runs import ENGINE_VERSION

    grid = [_on_device({"kind": "sweep", "model": model, "engine": ENGINE_VERSION,
                        "payload": {"document": name, "text": text, "jobs": [list(j) for j in jobs],
                                    "max_tokens": args.max_tokens, "max_rows": args.max_rows}}, args)
            for model in models for name, text in docs]
    results = _run_grid(grid, args, out / "documents.jsonl", "sweep documents")
    df = pd.DataFrame([row for rows in results for row in rows])
    front = ["model", "document"]
    df = df[front + [c for c in df.columns if c not in front]]
    df["budget"] = df["budget"].astype("Int64")
    return df


def _numbers(text: str, kind, flag: str) -> list:
    try:
        values = [kind(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise CliError(f"{flag} must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise CliError(f"{flag} is empty")
    return values


def _check_longest(lengths: list[int], args: argparse.Namespace) -> None:
    """CliError where a length is past what the model reads (its config says, before any weight loads) or the
    limit here."""
    from .engine.models import ModelError, model_context

    try:
        context = model_context(args.model, args.device, args.dtype)
    except ModelError as err:
        raise CliError(str(err)) from None
    if max(lengths) > min(context, LIMITS.prompt_tokens):
        most = f"{args.model} reads at most {context:,}" if context <= LIMITS.prompt_tokens else \
            f"the limit here is {LIMITS.prompt_tokens:,}"
        raise CliError(f"--lengths: {most} tokens, got {max(lengths):,}")


def cmd_needle(args: argparse.Namespace) -> int:
    from .experiments.needle import needle_frame, needle_jobs

    lengths = _numbers(args.lengths, int, "--lengths")
    depths = _numbers(args.depths, float, "--depths")
    seeds = _numbers(args.seeds, int, "--seeds")
    if not 1 <= args.new_tokens <= LIMITS.new_tokens:
        raise CliError(f"--new-tokens must be 1 to {LIMITS.new_tokens}")
    if min(lengths) < 32 + args.new_tokens:
        raise CliError(f"--lengths must be at least {32 + args.new_tokens} tokens (prompt and answer)")
    _check_longest(lengths, args)
    if min(depths) < 0 or max(depths) > 1:
        raise CliError("--depths are fractions of the haystack, 0 to 1")
    try:  # the same jobs as the app's grid (needle.needle_jobs)
        jobs = needle_jobs(args.model, args.policy, lengths, depths, seeds, args.new_tokens)
        jobs = [_on_device(job, args) for job in jobs]
    except SpecError as err:
        raise CliError(str(err)) from None
    out = writable_dir(args.out)
    df = needle_frame(_run_grid(jobs, args, out / "cells.jsonl", "needle cells"))
    df.to_csv(out / "grid.csv", index=False)
    from viz.needle import needle_figure  # the CLI is a front end, like app.py: figures come from viz/

    needle_figure(df).write_html(out / "grid.html", include_plotlyjs=True, full_html=True)
    rates = df.groupby("spec", sort=False)["found"].mean()
    for spec, rate in rates.items():
        print(f"{spec:32s} found {rate:6.1%} of {len(lengths) * len(depths) * len(seeds)} cells")
    print(f"wrote grid.csv, grid.html and cells.jsonl (the checkpoint) to {out}")
    return 0


def cmd_tasks(args: argparse.Namespace) -> int:
    from .experiments.leaderboard import averaged, leaderboard_frame, summarize, task_jobs, task_specs
    from .experiments.task_runs import SETTINGS
    from .experiments.tasks import TaskUnavailable, check_tasks

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise CliError("--tasks is empty")
    lengths = _numbers(args.lengths, int, "--lengths")
    if min(lengths) < 64:
        raise CliError("--lengths are prompt lengths in tokens, 64 or more")
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    if not settings or any(s not in SETTINGS for s in settings):
        raise CliError(f"--settings must be among {', '.join(SETTINGS)}, got {args.settings!r}")
    if args.samples < 1:
        raise CliError("--samples must be at least 1")
    if args.first_sample < 0:
        raise CliError("--first-sample must be 0 or more")
    if args.first_sample + args.samples > MAX_SAMPLES:  # every job is made before the first runs
        raise CliError(f"--first-sample and --samples: a task has at most {MAX_SAMPLES} samples at a length (0 to "
                       f"{MAX_SAMPLES - 1}), got {args.first_sample} to {args.first_sample + args.samples - 1}")
    try:
        ratios = parse_ratios(args.ratios)
        specs = task_specs([p for item in args.policy or [",".join(graded_policies())] for p in split_policies(item)],
                           ratios)
    except SpecError as err:
        raise CliError(str(err)) from None
    except ValueError as err:
        raise CliError(f"--ratios: {err}") from None
    try:  # before any job loads the model or makes a sample: RULER's generators run on at any length asked
        check_tasks(tasks, lengths)
    except TaskUnavailable as err:
        raise CliError(str(err)) from None
    _check_longest(lengths, args)
    jobs = [_on_device(job, args) for job in task_jobs(args.model, tasks, lengths, args.samples, specs, settings,
                                                       chat=args.chat, first=args.first_sample)]
    out = writable_dir(args.out)
    print(_expected_time(jobs, out / "samples.jsonl", args), file=sys.stderr, flush=True)
    df = leaderboard_frame(_run_grid(jobs, args, out / "samples.jsonl", "task samples"))
    df.to_csv(out / "leaderboard.csv", index=False)
    summary = summarize(df)
    means = averaged(summary)
    pd.concat([summary, means], ignore_index=True).to_csv(out / "summary.csv", index=False)
    from viz.leaderboard import leaderboard_figure, leaderboard_table_html  # figures come from viz/, as the app's

    figures = [leaderboard_figure(part, task) for (_, _, _), part in summary.groupby(["model", "setting", "length"],
                                                                                      sort=False)
               for task in dict.fromkeys(part["task"])]
    figures += [leaderboard_figure(part, "average") for _, part in means.groupby(["model", "setting", "length"],
                                                                                 sort=False)]
    page = "".join(fig.to_html(full_html=False, include_plotlyjs="cdn" if i else True) for i, fig in enumerate(figures))
    (out / "leaderboard.html").write_text(f"<html><head><meta charset=\"utf-8\"><title>KV Lens leaderboard</title>"
                                          f"</head><body>{page}{leaderboard_table_html(summary)}</body></html>")
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        shown = means.drop(columns=["task"]) if len(means) else summary  # the averages, one a length
        print(shown.drop(columns=["full_solves"]).to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"{len(jobs)} samples; wrote leaderboard.csv, summary.csv, leaderboard.html and samples.jsonl (the "
          f"checkpoint) to {out}")
    return 0


def cmd_evidence(args: argparse.Namespace) -> int:
    """Why each leaderboard answer was right or wrong, from the stored traces (experiments/evidence_rows.py)."""
    from .experiments.evidence_rows import evidence_frame, evidence_summary, predicts

    path = Path(args.leaderboard)
    try:
        df = pd.read_csv(path, keep_default_na=False, na_values=[""])
    except (OSError, ValueError, pd.errors.ParserError) as err:
        raise CliError(f"--leaderboard {path}: {str(err).splitlines()[0]}") from None
    needed = {"model", "task", "length", "setting", "sample", "policy", "run_id", "references", "score"}
    if not needed <= set(df.columns):
        raise CliError(f"--leaderboard {path} is not a task leaderboard (python -m backend tasks writes one)")
    models = df["model"].unique()
    if len(models) != 1:
        raise CliError(f"--leaderboard {path}: one model per leaderboard, got {', '.join(map(str, models))}")
    tokenizer = api.get_model(str(models[0]), args.device, args.dtype).tokenizer  # RequestError: one line
    frame, missing = evidence_frame(df, TraceStore(), tokenizer)
    if frame.empty:
        raise CliError(f"none of the {len(df)} rows' traces are in the store here (KVLENS_STORE_DIR); run the "
                       f"leaderboard on this machine first")
    out = writable_dir(args.out)
    frame.to_csv(out / "evidence.csv", index=False)
    summary = evidence_summary(frame)
    summary.to_csv(out / "evidence_summary.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_rows", 500):
        print(summary.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print(f"holding the evidence (at least half of what Full read) and a right answer go together in "
          f"{predicts(frame):.0%} of {int((frame['policy'] != 'full').sum())} answers"
          f"{f'; {missing} rows not in the store' if missing else ''}; wrote evidence.csv and evidence_summary.csv "
          f"to {out}")
    return 0


def _expected_time(jobs: list[dict], checkpoint: Path, args: argparse.Namespace) -> str:
    """What the samples the checkpoint lacks are expected to take, as the Tasks tab's line says it: in seconds
    where they run in this process (the model loads now, as the first sample would load it, and one plain forward
    per length is timed), else in plain forwards."""
    from .experiments.grid import pending

    todo = pending(jobs, checkpoint)
    if not todo:
        return f"Every one of the {len(jobs)} samples is in {checkpoint} already: nothing to compute."
    lm = api.get_model(args.model, args.device, args.dtype) if args.ray is None else None
    lines = []
    for length in dict.fromkeys(job["payload"]["length"] for job in todo):
        at = [job for job in todo if job["payload"]["length"] == length]
        seconds = None if lm is None else api.time_plain_forward(lm, length)
        lines.append(api.expected_line(len(at), ["full", *at[0]["payload"]["specs"]], length, seconds,
                                       "in this process"))
    return "\n".join(lines)


def _run_grid(jobs: list[dict], args: argparse.Namespace, checkpoint: Path, what: str) -> list[list[dict]]:
    """The grid's rows (``experiments.grid.run_grid``: serially, or on Ray with ``--ray``), a failed job one line."""
    from .experiments.grid import GridError, run_grid, stderr_progress

    try:
        return run_grid(jobs, address=args.ray, workers=args.workers, checkpoint=checkpoint, no_cache=args.no_cache,
                        progress=stderr_progress(what))
    except GridError as err:
        raise CliError(str(err)) from None


def _on_device(job: dict, args: argparse.Namespace) -> dict:
    """A grid job that names where its model runs, when that is not the CPU in float32 (grid.Worker reads it)."""
    if (args.device, args.dtype) == ("cpu", "float32"):
        return job
    return {**job, "device": args.device, "dtype": args.dtype}


def cmd_policies(args: argparse.Namespace) -> int:
    if args.by_kind:
        from viz.policy_menu import kinds_table  # the README's table; viz draws, the registry only lists

        print(kinds_table(POLICIES))
    else:
        print(policy_table())
    return 0


MODEL_HELP = (f"a packaged model ({', '.join(PACKAGED)}; default {DEFAULT_MODEL}), a local model directory, a "
              f"local .gguf file, or a hub id (with internet)")


def _common(p: argparse.ArgumentParser, many_models: bool = False) -> None:
    p.add_argument("--out", required=True, help="output directory")
    if many_models:
        p.add_argument("--model", action="append", help=MODEL_HELP + "; repeat for several")
    else:
        p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--device", choices=DEVICES, default="cpu", help="where the model runs (auto: a GPU if any)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="the model's weights and activations")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="keep the first N tokens of a longer text (default: the whole text, which must fit the model's "
                        "context)")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute even if the trace store (KVLENS_STORE_DIR) holds this run")


def _ray_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                   help="run on Ray: alone, a local Ray on this machine; with an address (ray://host:10001 or "
                        "host:6379), that cluster. Without it, serially in this process")
    p.add_argument("--workers", type=int, default=None, help="Ray actors (default: one per CPU)")


def row_token_rule() -> str:
    """The row-tokens a run may use here, in words: the operator's number, or what the memory holds."""
    if LIMITS.row_tokens is not None:
        return f"{LIMITS.row_tokens:,} row-tokens"
    return (f"as many row-tokens as this machine's {machine_memory() / 2 ** 30:.0f} GiB hold at the model's price "
            f"(from its shapes: each token's keys and values, each row's logits over the vocabulary)")


def build_parser(prog: str = "python -m backend") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="KV Lens: run KV-cache policies on a real model.",
        epilog=f"Limits here (they fit this machine's memory; KVLENS_MAX_<NAME> changes one): "
               f"{row_token_rule()} a run, {LIMITS.policies} policies, {LIMITS.new_tokens} new tokens; Full is free")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run policies on a text and write traces",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="policies (NAME[:key=value,...]; budget = tokens each query reads, or ratio = the share "
                              "of the prompt's (prompt mode: the text's) tokens removed, kvpress's compression ratio):\n"
                              + describe())
    p.add_argument("--text", required=True, help="UTF-8 text file: the text to score, or the prompt")
    p.add_argument("--policy", action="append", required=True, metavar="SPEC",
                   help="e.g. tova:budget=64 or a2sf:budget=64,alpha=0.3; repeat for several")
    p.add_argument("--mode", choices=("prompt", "generate"), default="prompt")
    p.add_argument("--max-new-tokens", type=int, default=64, help=f"generate mode, 1 to {LIMITS.new_tokens}")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="generate mode: feed the text as is instead of as a chat user turn")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prompt tokens per forward call")
    _common(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "sweep", help="perplexity vs budget for several policies (TOVA Fig. 3)",
        description="Score a text teacher-forced under every policy at every budget; write sweep.csv, "
                    "sweep.json and sweep.html (perplexity vs budget, Full as the topline).")
    p.add_argument("--text", action="append", help="UTF-8 text file to score; repeat for several documents")
    p.add_argument("--corpus", action="append", metavar="NAME[:N]",
                   help="the shipped corpus NAME (inaugural, state_union), its first N documents or all")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help=f"comma-separated policies, parameters allowed except budget, e.g. "
                        f"window,sinks,tova:heads=head (default {DEFAULT_POLICIES})")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help=f"comma-separated budgets (default {DEFAULT_BUDGETS})")
    p.add_argument("--ratios", default=None,
                   help="comma-separated compression ratios instead of budgets, e.g. 0.25,0.5,0.75,0.875: the share "
                        "of the text's tokens each policy removes (kvpress's meaning; a row's budget is "
                        "int(tokens x (1 - ratio)))")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS,
                   help=f"policy/budget pairs per batched forward (default {MAX_ROWS}; lower it to save memory)")
    _ray_options(p)
    _common(p, many_models=True)
    p.set_defaults(func=cmd_sweep)
    p = sub.add_parser(
        "needle", help="needle-in-a-haystack grid: context length x needle depth, every policy",
        description="Hide a random 5-7 digit number at each depth of a haystack of the shipped public-domain "
                    "texts at each length, ask for it, and check the greedy answer under every policy. Writes "
                    "grid.csv, grid.html and cells.jsonl (finished cells: a re-run skips them).")
    p.add_argument("--lengths", default="1024,2048,4096,8192", help="context lengths in tokens (prompt + answer)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths, fractions of the haystack")
    p.add_argument("--seeds", default="0", help="haystack seeds (filler start and number), e.g. 0,1,2")
    p.add_argument("--policy", action="append", required=True, metavar="SPEC",
                   help="e.g. full or tova:budget=256; repeat for several")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy answer length")
    _ray_options(p)
    _common(p)
    p.set_defaults(func=cmd_needle)
    p = sub.add_parser(
        "tasks", help="the task leaderboard: lm-eval's RULER tasks, every policy at every compression ratio",
        description="Make each task's samples with lm-evaluation-harness at each length (the model's tokenizer), "
                    "answer each sample under every policy at every ratio as rows of one batched run with Full, "
                    "score the answers with lm-eval's metric, and write leaderboard.csv (a row per sample and "
                    "policy: score, answer, references, the run's link), summary.csv (means with 95%% intervals; "
                    "tasks Full fails are kept out of the averages), leaderboard.html (score against ratio) and "
                    "samples.jsonl (finished samples: a re-run skips them).")
    p.add_argument("--tasks", default=",".join(RULER_OFFLINE),
                   help=f"comma-separated lm-eval tasks (default: RULER's offline ones, {','.join(RULER_OFFLINE)}); "
                        f"offline, RULER's essay tasks have stand-ins over the shipped speeches, "
                        f"{','.join(STANDINS)}")
    p.add_argument("--lengths", default="1024",
                   help="prompt lengths in tokens, as RULER sizes its samples: 64 up to the model's context")
    p.add_argument("--samples", type=int, default=5,
                   help=f"samples per task and length (the first N; at most {MAX_SAMPLES}, as many as RULER makes)")
    p.add_argument("--first-sample", type=int, default=0, metavar="K",
                   help=f"start at sample K (samples K..K+N-1, below {MAX_SAMPLES}), to add samples to a leaderboard "
                        f"made before")
    p.add_argument("--policy", action="append", metavar="NAMES",
                   help=f"comma-separated policies with parameters but no budget; repeat to add (default: every "
                        f"policy that takes a ratio: {','.join(graded_policies())})")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in SHIPPED_RATIOS),
                   help="compression ratios: the share of the context's tokens each policy removes")
    p.add_argument("--settings", default="agnostic",
                   help="agnostic (the policies decide over the context before the question is read, as kvpress's "
                        "leaderboard), aware (the question is part of it), or both: agnostic,aware")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="feed lm-eval's prompt as is instead of in the model's chat template")
    _ray_options(p)
    _common(p)
    p.set_defaults(func=cmd_tasks)
    p = sub.add_parser(
        "evidence", help="why each answer of a task leaderboard was right or wrong: its evidence through the cache",
        description="For every row of a task leaderboard (python -m backend tasks) whose traces are in the store: "
                    "where the answer's references sit in the prompt, whether each policy's cache still held them "
                    "when the answer began (per layer and KV head), the answer's attention on them beside Full's, "
                    "and a one-line verdict; then, per policy and ratio, whether holding the evidence predicts the "
                    "score. Writes evidence.csv and evidence_summary.csv. Reads the store only.")
    p.add_argument("--leaderboard", required=True, help="a leaderboard.csv written by `tasks`")
    _common(p)
    p.set_defaults(func=cmd_evidence)
    p = sub.add_parser("policies", help="print the registered policies as a Markdown table")
    p.add_argument("--by-kind", action="store_true", help="by kind, with their papers (the README's table)")
    p.set_defaults(func=cmd_policies)
    sub.add_parser(
        "lm-eval", add_help=False,
        help="lm-evaluation-harness's own command line with KV Lens's model `kvlens` registered, e.g. --model kvlens "
             "--model_args policy=tova:budget=256 --tasks niah_single_1 --metadata max_seq_lengths=[1024] "
             f"(`{prog} lm-eval --help` lists the rest)")
    return parser


def cmd_lm_eval(argv: list[str], prog: str = "python -m backend") -> int:
    """lm-eval's command line (``lm_eval ...``) on ``argv``, with ``kvlens`` in its model registry: lm-eval
    imports no third-party model itself (experiments/lm_eval_model.py)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from .engine.models import ModelError
    from .experiments.lm_eval_model import ruler_tokenizer  # importing it registers kvlens

    own, sys.argv = sys.argv, [f"{prog} lm-eval", *argv]  # lm-eval parses sys.argv
    try:  # what lm-eval's own entry point (lm_eval.__main__.cli_evaluate) does, with one step between
        setup_logging()
        harness = HarnessCLI()
        args = harness.parse_args()
        if hasattr(args, "include_path"):  # run, ls, validate: the essay tasks' stand-ins are tasks they know
            own_tasks = str(task_folder())
            args.include_path = own_tasks if args.include_path is None else [args.include_path, own_tasks]
        tasks = getattr(args, "tasks", None)
        if tasks and not splits_essays(tasks):  # RULER's needle module without its look for NLTK's download
            import_generators(essays=False)
        if getattr(args, "model", None) == "kvlens":  # `run` (or no command) with kvlens
            model_args, metadata = args.model_args or {}, args.metadata or {}
            parse_spec(str(model_args.get("policy", "full")))  # a bad spec is one line before anything loads
            if "tokenizer" not in metadata:  # RULER sizes its samples with the metadata's tokenizer: the model's
                args.metadata = {**metadata, "tokenizer": ruler_tokenizer(
                    model_args.get("model", DEFAULT_MODEL), args.device, model_args.get("dtype", "float32"))}
        harness.execute(args)
    except (SpecError, ModelError) as err:  # kvlens's model arguments: one line, as every command says them
        raise CliError(str(err)) from None
    finally:
        sys.argv = own
    return 0


def main(argv: list[str] | None = None, prog: str = "python -m backend") -> int:
    """The command line on ``argv`` (``sys.argv[1:]`` when None), its help naming it ``prog``; the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        load_plugins()  # KVLENS_PLUGINS: the operator's policies join the registry before --help lists it
    except PluginError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["lm-eval"]:  # every argument after it is lm-eval's
            return cmd_lm_eval(argv[1:], prog)
        args = build_parser(prog).parse_args(argv)
        return args.func(args)
    except (CliError, RequestError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
