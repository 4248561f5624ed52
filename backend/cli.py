"""Command line: ``python -m backend run ...`` writes one trace per policy and a summary.json."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import metrics
from .models import ALLOWED_MODELS, DEFAULT_MODEL, ModelError, load_model
from .policies import SpecError, describe, parse_spec
from .runner import DEFAULT_CHUNK
from .service import run_policies
from .store import TraceStore
from .sweep import add_sweep_parser
from .trace import file_stem


class CliError(Exception):
    """Bad input: printed as one line, exit status 2."""


def read_text(path: str) -> str:
    try:
        text = Path(path).read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CliError(f"text file not found: {path}") from None
    except IsADirectoryError:
        raise CliError(f"not a file: {path}") from None
    except UnicodeDecodeError:
        raise CliError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise CliError(f"{path} is empty")
    return text


def encode(lm, text: str, mode: str, chat: bool, max_tokens: int) -> list[int]:
    ids = lm.encode(text, chat=chat and mode == "generate")
    if len(ids) > max_tokens:
        print(f"note: text truncated from {len(ids)} to {max_tokens} tokens (--max-tokens)", file=sys.stderr)
        ids = ids[:max_tokens]
    if mode == "prompt" and len(ids) < 2:
        raise CliError("the text must have at least 2 tokens to be scored")
    return list(ids)


def cmd_run(args: argparse.Namespace) -> int:
    try:
        policies = [parse_spec(spec) for spec in args.policy]
    except SpecError as err:
        raise CliError(str(err)) from None
    if args.max_new_tokens < 1:
        raise CliError("--max-new-tokens must be >= 1")
    if args.max_tokens < 2 or args.chunk < 1:
        raise CliError("--max-tokens must be >= 2 and --chunk >= 1")
    text = read_text(args.text)
    try:
        lm = load_model(args.model)
    except ModelError as err:
        raise CliError(str(err)) from None
    ids = encode(lm, text, args.mode, args.chat, args.max_tokens)

    def progress(frac: float, what: str) -> None:
        if sys.stderr.isatty():
            print(f"\r{what}: {frac:4.0%}", end="", file=sys.stderr, flush=True)

    specs = list(args.policy)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out} exists and is not a directory")
    try:
        store = None if args.no_cache else TraceStore()
    except ValueError as err:  # e.g. a malformed KVLENS_STORE_MB
        raise CliError(str(err)) from None
    result = run_policies(lm, specs, policies, ids, args.mode, args.max_new_tokens, store, chunk=args.chunk,
                          progress=progress)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    traces, full = result.traces, result.full
    summary = {}
    for index, (spec, trace) in enumerate(zip(specs, traces)):
        path = trace.save(out, file_stem(index, spec))
        row = metrics.summary_row(trace, full)
        summary[spec] = {**row, "trace": path.name}
        print(f"{spec:32s} ppl {row['ppl']:9.3f}  kl_to_full {row['kl_to_full']:.4f}  "
              f"top1 {row['top1_agreement']:.3f}  {'(replayed from the store)' if result.replayed[index] else ''}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"wrote {len(traces)} traces and summary.json to {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m backend", description="KV Lens: run KV-cache policies on a real model.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run policies on a text and write traces",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="policies (NAME[:key=value,...]; budget = tokens each query reads):\n" + describe())
    p.add_argument("--text", required=True, help="UTF-8 text file: the text to score, or the prompt")
    p.add_argument("--policy", action="append", required=True, metavar="SPEC",
                   help="e.g. tova:budget=64 or a2sf:budget=64,alpha=0.3; repeat for several")
    p.add_argument("--mode", choices=("prompt", "generate"), default="prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"one of: {', '.join(ALLOWED_MODELS)}")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="generate mode: feed the text as is instead of as a chat user turn")
    p.add_argument("--max-tokens", type=int, default=1024, help="truncate longer texts to this many tokens")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prompt tokens per forward call")
    p.add_argument("--no-cache", action="store_true",
                   help="recompute even if the trace store (KVLENS_STORE_DIR) holds this run")
    p.set_defaults(func=cmd_run)
    add_sweep_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
