"""How a run scales with the text: several eviction policies plus Full in one prompt-mode run,
at each length, against one plain SDPA forward of the same text measured in the same process.

    python -m benchmarks.scaling [--lengths 1024,2048,4096,8192] [--policies sinks,h2o,tova,a2sf] [--budget 256]
                                 [--record] [--chunk 256] [--model gemma3-270m] [--plain-head last]

Each length runs in its own child process, so its peak RSS is its own. Reported per length: the run's wall
time, the plain forward's, their ratio (and per row), the child's peak RSS and the bytes of the traces as
stored. The text is the shipped inaugural addresses, concatenated. Goals at 8k: the whole run
at most 5x one plain forward, peak RSS at most 6 GB.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import subprocess
import sys
import time

import torch

from backend.policies import parse_spec
from backend.engine.runner import DEFAULT_CHUNK, compute_traces, default_record_layers
from backend.texts import corpus_files, corpus_text

from backend.engine.models import DEFAULT_MODEL

from .common import model


def long_text() -> str:
    return "\n\n".join(corpus_text("inaugural", name) for name in corpus_files("inaugural"))


def _recorded_bytes(trace) -> int:
    """Bytes of a trace's recorded data (attention rows and keys), as stored."""
    arrays = trace.arrays()
    return sum(arrays[k].nbytes for k in ("attn_pos", "attn_val", "keys", "key_positions") if k in arrays)


def _bare_bytes(trace) -> int:
    """Bytes of a trace as stored, without its recorded data (the per-trace goal)."""
    bare = copy.copy(trace)
    bare.attention = bare.keys = bare.key_positions = None
    return len(bare.to_bytes())


def plain_forward(model, ids: list[int], head: str) -> None:
    """One plain forward of ``ids``, its logits computed as ``head`` says (see ``measure``)."""
    if head != "chunked":
        model(torch.tensor([ids]), logits_to_keep={"all": 0, "last": 1}[head])
        return
    hidden = model.model(torch.tensor([ids])).last_hidden_state
    for start in range(0, len(ids), 64):
        model.lm_head(hidden[:, start:start + 64])


def measure(length: int, policies: list[str], budget: int, record: bool, chunk: int, name: str,
            plain_head: str = "all") -> dict:
    """One length, in this process: plain forward, then the instrumented run.

    The plain forward computes the logits of every position at once (`plain_head="all"`), or 64 positions at a
    time ("chunked": the same work, for a vocabulary whose logits at every position would not fit in memory),
    or of the last position only ("last", as generate()'s prefill does)."""
    lm = model(name)
    ids = lm.tokenizer(long_text()).input_ids[:length]
    specs = [f"{name}:budget={budget}" for name in policies]
    with torch.inference_mode():
        plain_forward(lm.model, ids[:64], plain_head)  # warm-up
        plain = float("inf")
        for _ in range(2):  # the better of two
            start = time.perf_counter()
            plain_forward(lm.model, ids, plain_head)
            plain = min(plain, time.perf_counter() - start)
    start = time.perf_counter()
    traces, full = compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, mode="prompt", chunk=chunk,
                       record_layers=default_record_layers(lm) if record else ())
    wall = time.perf_counter() - start
    trace_bytes = {t.spec: len(t.to_bytes()) for t in [*traces, full]}
    bare = max(_bare_bytes(t) for t in traces)
    config = lm.model.config
    return {"bare_trace_max": bare, "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "tokens": len(ids), "rows": len(specs) + 1, "plain_s": plain, "run_s": wall,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "trace_bytes": trace_bytes,
            "recorded_bytes": sum(_recorded_bytes(t) for t in [*traces, full])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--policies", default="sinks,h2o,tova,a2sf")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--record", action="store_true", help="also record the app's layers (attention, keys)")
    parser.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="prompt tokens per forward call")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a packaged model, a model directory or a .gguf")
    parser.add_argument("--plain-head", choices=("all", "chunked", "last"), default="all",
                        help="the plain forward's logits: every position's at once, or 64 at a time, or the last "
                             "one's (as generate's prefill)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: measure one length, print JSON
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.one:
        print(json.dumps(measure(args.one, policies, args.budget, args.record, args.chunk, args.model,
                                 args.plain_head)))
        return
    print(f"{args.model}: {', '.join(policies)} + Full at budget {args.budget}, prompt mode, plain forward with "
          f"{args.plain_head} logits"
          f"{', recording the app layers' if args.record else ''} (torch threads: {torch.get_num_threads()})")
    print("| T | run | plain forward | ratio | per row | peak RSS | Full trace | each policy trace "
          "| largest policy trace, unrecorded (goal) | recorded (run) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        child = [sys.executable, "-m", "benchmarks.scaling", "--one", str(length), "--policies", args.policies,
                 "--budget", str(args.budget), "--chunk", str(args.chunk), "--model", args.model,
                 "--plain-head", args.plain_head] + \
            (["--record"] if args.record else [])
        result = subprocess.run(child, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"| {length} | failed: {result.stderr.strip().splitlines()[-1] if result.stderr else result.returncode} |")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        ratio = r["run_s"] / r["plain_s"]
        goal = 4 * r["layers"] * r["kv_heads"] * r["tokens"] + 2 * 2**20  # 4 B per layer, KV head, token + 2 MB
        sizes = r["trace_bytes"]
        others = [v for k, v in sizes.items() if k != "full"]
        print(f"| {r['tokens']} | {r['run_s']:.1f} s | {r['plain_s']:.2f} s | {ratio:.1f}x | {ratio / r['rows']:.2f}x "
              f"| {r['peak_rss_mb'] / 1024:.2f} GB | {sizes['full'] / 2**20:.1f} MB "
              f"| {sum(others) / len(others) / 2**20:.1f} MB | {r['bare_trace_max'] / 2**20:.2f} MB "
              f"({goal / 2**20:.1f} MB) | {r['recorded_bytes'] / 2**20:.1f} MB |", flush=True)


if __name__ == "__main__":
    main()
