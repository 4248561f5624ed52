"""How a run scales with the text: several eviction policies plus Full in one prompt-mode run,
at each length, against one plain SDPA forward of the same text measured in the same process.

    python -m benchmarks.scaling [--lengths 1024,2048,4096,8192] [--policies sinks,h2o,tova,a2sf] [--budget 256]
                                 [--record] [--chunk 256] [--model gemma3-270m] [--plain-head last] [--pairs 3]

Each length runs in its own child process, so its peak RSS is its own. How the ratio is measured: in that
process, after an untimed warm-up (a plain forward of 64 tokens and a run over the first ``2 * chunk`` tokens),
the plain forward and the run are timed in ``--pairs`` pairs, A B A B ... (plain, run, plain, run, ...); each
pair gives run / plain, and the ratio reported is the median of those per-pair ratios, with their min-max as
the spread. So a load that comes and goes on the machine slows both halves of a pair instead of one side of
the ratio. Each run computes afresh (``compute_traces`` has no store); its traces are dropped before the next
pair. Reported per length: the median run time, the median plain forward's, the ratio and its spread (and the
ratio per row), the child's peak RSS and the bytes of the last run's traces as stored. The text is the shipped
inaugural addresses, concatenated. Goals at 8k: the whole run at most 5x one plain forward, peak RSS at most
6 GB.

On a GPU (``--device cuda``, with ``--dtype``): every timed call waits for the GPU's queued work, and each length
also reports the peak GPU memory of the plain forward and of the run (``torch.cuda.max_memory_allocated``), and the
host synchronisations per prompt block: a run over the first ``budget + 8 * chunk`` tokens (the policies evict
from the budget on) under ``torch.cuda.set_sync_debug_mode("warn")``, counting the warnings, with the lines of
KV Lens that caused most of them. A model directory of random weights in a real model's shape
(``benchmarks/random_model.py``) times a model whose weights cannot travel.
"""
from __future__ import annotations

import argparse
import copy
import collections
import cProfile
import io
import json
import pstats
import resource
import subprocess
import sys
import warnings

import torch

from backend.policies import parse_spec
from backend.engine.runner import DEFAULT_CHUNK, compute_traces, default_record_layers
from backend.texts import corpus_files, corpus_text

from backend.engine.models import DEFAULT_MODEL

from .common import DEFAULT_PAIRS, add_pairs_argument, model, paired


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
    tokens = torch.tensor([ids], device=model.device)
    if head != "chunked":
        model(tokens, logits_to_keep={"all": 0, "last": 1}[head])
        return
    hidden = model.model(tokens).last_hidden_state
    for start in range(0, len(ids), 64):
        model.lm_head(hidden[:, start:start + 64])


def host_syncs(fn) -> tuple[int, list[tuple[str, int]]]:
    """How many times ``fn`` made the host wait for the GPU (``torch.cuda.set_sync_debug_mode``'s warnings), and
    the five KV Lens lines (file:line of the innermost frame in this repository) that caused most of them."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = collections.Counter(f"{w.filename.rsplit('/', 2)[-2]}/{w.filename.rsplit('/', 1)[-1]}:{w.lineno}"
                                for w in syncs)
    return len(syncs), where.most_common(5)


def measure(length: int, policies: list[str], budget: int, record: bool, chunk: int, name: str,
            plain_head: str = "all", pairs: int = DEFAULT_PAIRS, device: str = "cpu", dtype: str = "float32",
            profile: bool = False) -> dict:
    """One length, in this process: ``pairs`` pairs of (plain forward, instrumented run), A B A B ...

    The plain forward computes the logits of every position at once (`plain_head="all"`), or 64 positions at a
    time ("chunked": the same work, for a vocabulary whose logits at every position would not fit in memory),
    or of the last position only ("last", as generate()'s prefill does). ``profile``: one more run under cProfile, its
    25 costliest functions (own time) in the result's "profile"."""
    lm = model(name, device, dtype)
    ids = lm.tokenizer(long_text()).input_ids[:length]
    if len(ids) < length:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {length}")
    specs = [f"{name}:budget={budget}" for name in policies]
    layers = default_record_layers(lm) if record else ()

    def run(tokens=ids):
        return compute_traces(lm, specs, [parse_spec(s) for s in specs], tokens, mode="prompt", chunk=chunk,
                              record_layers=layers)

    def warmup():  # imports, the compiled walk, first allocations: not the measure
        with torch.inference_mode():
            plain_forward(lm.model, ids[:64], plain_head)
        # Past the budget, so that a GPU compiles the walk for every width of held columns it will meet.
        run(ids[:budget + 2 * chunk])

    def plain():
        with torch.inference_mode():
            plain_forward(lm.model, ids, plain_head)

    cuda = torch.device(device).type == "cuda"
    peaks = {"plain": 0, "run": 0}

    def timed(fn, name):  # waits for the GPU's work; notes the call's peak GPU memory
        if not cuda:
            return fn

        def call():
            torch.cuda.reset_peak_memory_stats()
            result = fn()
            torch.cuda.synchronize()
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
            return result
        return call

    timing = paired(timed(plain, "plain"), timed(run, "run"), pairs, warmup=warmup)
    traces, full = timing.last
    gpu = {}
    if cuda:
        prefix = ids[:budget + 8 * chunk]
        syncs, where = host_syncs(lambda: run(prefix))
        gpu = {"plain_peak_gb": peaks["plain"] / 2**30, "run_peak_gb": peaks["run"] / 2**30, "syncs": syncs,
               "sync_blocks": -(-len(prefix) // chunk), "sync_tokens": len(prefix), "sync_sites": where}
    if profile:  # where one more run spends its time, the host's view (a GPU's work is waited for at syncs)
        profiler = cProfile.Profile()
        profiler.runcall(timed(run, "run"))
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        gpu["profile"] = text.getvalue()
    trace_bytes = {t.spec: len(t.to_bytes()) for t in [*traces, full]}
    bare = max(_bare_bytes(t) for t in traces)
    config = lm.model.config
    return {"bare_trace_max": bare, "layers": config.num_hidden_layers, "kv_heads": config.num_key_value_heads,
            "tokens": len(ids), "rows": len(specs) + 1, **timing.as_dict(), "plain_s": timing.baseline,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "trace_bytes": trace_bytes,
            "recorded_bytes": sum(_recorded_bytes(t) for t in [*traces, full]), **gpu}


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
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--json", help="also append each length's raw figures to this file (JSON lines)")
    parser.add_argument("--profile", action="store_true",
                        help="after each length, one more run under cProfile: its 25 costliest functions")
    add_pairs_argument(parser)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: measure one length, print JSON
    args = parser.parse_args()
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.one:
        print(json.dumps(measure(args.one, policies, args.budget, args.record, args.chunk, args.model,
                                 args.plain_head, args.pairs, args.device, args.dtype, args.profile)))
        return
    print(f"{args.model}: {', '.join(policies)} + Full at budget {args.budget}, prompt mode, plain forward with "
          f"{args.plain_head} logits"
          f"{', recording the app layers' if args.record else ''} (torch threads: {torch.get_num_threads()}); "
          f"{args.pairs} pairs plain, run, ... per length: median times, median of the per-pair ratios (min-max)")
    gpu = args.device == "cuda"
    if gpu:
        print("| T | run | plain forward | ratio | ratio min-max | per row | GPU peak, plain forward | GPU peak, run "
              "| host syncs per block | per block, layer and row | where most came from |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    else:
        print("| T | run | plain forward | ratio | ratio min-max | per row | peak RSS | Full trace | each policy trace "
              "| largest policy trace, unrecorded (goal) | recorded (run) |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for length in (int(x) for x in args.lengths.split(",")):
        child = [sys.executable, "-m", "benchmarks.scaling", "--one", str(length), "--policies", args.policies,
                 "--budget", str(args.budget), "--chunk", str(args.chunk), "--model", args.model,
                 "--plain-head", args.plain_head, "--pairs", str(args.pairs), "--device", args.device,
                 "--dtype", args.dtype] + \
            (["--record"] if args.record else []) + (["--profile"] if args.profile else [])
        result = subprocess.run(child, capture_output=True, text=True)
        if result.returncode != 0:
            print(f"| {length} | failed: {result.stderr.strip().splitlines()[-1] if result.stderr else result.returncode} |")
            continue
        r = json.loads(result.stdout.strip().splitlines()[-1])
        if args.json:
            with open(args.json, "a") as out:
                out.write(json.dumps({"model": args.model, "policies": policies, "budget": args.budget,
                                      "device": args.device, "dtype": args.dtype, **r}) + "\n")
        if "profile" in r:
            print(r.pop("profile"), file=sys.stderr)
        ratio = r["ratio"]  # the median of the per-pair ratios
        timing = (f"| {r['tokens']} | {r['run_s']:.1f} s | {r['plain_s']:.2f} s | {ratio:.1f}x "
                  f"| {r['ratio_min']:.1f}-{r['ratio_max']:.1f}x | {ratio / r['rows']:.2f}x ")
        if gpu:
            per_block = r["syncs"] / r["sync_blocks"]
            sites = ", ".join(f"{site} ({n})" for site, n in r["sync_sites"][:3])
            print(timing + f"| {r['plain_peak_gb']:.2f} GB | {r['run_peak_gb']:.2f} GB | {per_block:.0f} "
                  f"| {per_block / r['layers'] / r['rows']:.1f} | {sites} |", flush=True)
            continue
        goal = 4 * r["layers"] * r["kv_heads"] * r["tokens"] + 2 * 2**20  # 4 B per layer, KV head, token + 2 MB
        sizes = r["trace_bytes"]
        others = [v for k, v in sizes.items() if k != "full"]
        print(timing + f"| {r['peak_rss_mb'] / 1024:.2f} GB | {sizes['full'] / 2**20:.1f} MB "
              f"| {sum(others) / len(others) / 2**20:.1f} MB | {r['bare_trace_max'] / 2**20:.2f} MB "
              f"({goal / 2**20:.1f} MB) | {r['recorded_bytes'] / 2**20:.1f} MB |", flush=True)

if __name__ == "__main__":
    main()
