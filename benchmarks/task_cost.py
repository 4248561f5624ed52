"""What a leaderboard sample costs: one RULER sample answered under every policy at every ratio (rows of one
batched run with Full, as ``python -m backend tasks`` runs it), against one plain forward of its prompt; and a
small grid's wall time serially and on a local Ray.

    python -m benchmarks.task_cost [--lengths 1024,4096] [--policies ...] [--ratios ...] [--pairs 1]
    python -m benchmarks.task_cost --lengths 1024 --profile          # one sample's time by part
    python -m benchmarks.task_cost --lengths 1024 --max-rows 80      # the sample in fewer, larger runs
    python -m benchmarks.task_cost --grid [--samples 4] [--workers 2]
    python -m benchmarks.task_cost --lengths 4096 --save-request R.json      # the sample's prompt, for a GPU
    python -m benchmarks.task_cost --request R.json --model DIR --device cuda [--dtype bfloat16] [--json F]

The sample's ratio is measured in pairs (plain forward, sample, plain forward, sample, ...; ``common.paired``),
nothing stored (every call computes). It includes the answers' decoding: every row decodes until every row has
stopped (EOS) or the task's token limit (RULER's needle: 128), so a row that rambles keeps the batch going.
The grid times the same jobs twice from empty stores: serially in this process, then on ``ray.init`` with one
actor per worker (each loads the model once).

Where lm-eval cannot run (a GPU machine with no network and no lm-eval), ``--save-request`` writes the sample's
request as lm-eval builds it (prompt, stop strings, new tokens, sample) and ``--request`` answers that one; with
``--model`` a directory of random weights in the model's shape (``benchmarks/random_model.py``) it times the
same rows, though a random model's answers never stop early (every row decodes the task's whole limit). The rows
then go in groups of ``MAX_ROWS`` (the runs ``answer`` makes), each timed; ``--seconds`` stops between groups.
"""
import argparse
import collections
import dataclasses
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from backend.experiments.leaderboard import SHIPPED_RATIOS, task_jobs, task_specs
from backend.experiments import task_runs
from backend.experiments.task_runs import TaskRequest, answer, encode, lm_eval_request
from backend.experiments.tasks import load_task, tokenizer_source
from backend.engine.attention import PolicyCache
from backend.limits import Limits

from backend.engine.models import DEFAULT_MODEL

from .common import add_pairs_argument, best_of, model, paired

# The sample the cost figures are measured on (docs/performance.md): 19 policies of every kind at four ratios and
# Full, 77 rows. It stays fixed, so that figures taken as the engine changes compare; the leaderboards grade more.
BENCHMARK_POLICIES = ("sinks", "streamingllm", "h2o", "tova", "a2sf", "snapkv", "pyramidkv", "adakv", "knorm",
                      "expected_attention", "kvzip", "rkv", "keyformer", "scissorhands", "random", "quest", "sparq",
                      "reattention", "oracle")


def task_request(lm, task_name: str, length: int) -> TaskRequest:
    """Sample 0 of the task at ``length`` tokens, as lm-eval builds it for ``lm`` (chat template applied)."""
    return lm_eval_request(load_task(task_name, length, tokenizer_source(lm)), 0, lm, chat=True)


def sample_cost(lm, request: TaskRequest, specs: list[str], pairs: int, task_name: str) -> None:
    ids = encode(lm, request.context)

    def plain():
        lm.model(torch.tensor([ids], device=lm.model.device))
        if lm.model.device.type == "cuda":
            torch.cuda.synchronize()

    timing = paired(plain, lambda: answer(lm, request, ["full", *specs], "agnostic", None, Limits.for_machine()),
                    pairs, warmup=plain)
    answers = timing.last
    decoded = max(len(a.trace.generated_ids) for a in answers)
    rows = len(answers)
    print(f"| {task_name} | {len(ids)} | {rows} | {decoded} | {timing.baseline:.2f} | {timing.run:.1f} | "
          f"{timing.ratio:.1f}x ({timing.spread(1)}) | {timing.ratio / rows:.2f}x |", flush=True)


class Stopwatch:
    """Wall time spent inside some functions while a sample runs, by phase: each is wrapped in place, and the
    attention (every row's policy walk, and Full's SDPA) is told apart from the rest of the model by the phase
    it runs in."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.phase = "prefill"
        self.undo: list = []

    def wrap(self, owner, name: str, label) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            key = label(args, kwargs) if callable(label) else label
            outer, start = self.phase, time.perf_counter()
            if key in PHASES:
                self.phase = key
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[key if key in PHASES else f"{self.phase}: {key}"] += time.perf_counter() - start
                self.phase = outer

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


PHASES = ("prefill", "decode", "scoring")


class ByPolicy:
    """Wall time in each row's own attention and walk, by phase and policy: ``RowLayerState``'s entry points
    wrapped in place (a call inside another is counted once, in the outer)."""

    ENTRIES = ("attend", "follow", "run_attending")

    def __init__(self, watch: Stopwatch):
        from backend.engine.attention import RowLayerState

        self.watch, self.owner = watch, RowLayerState
        self.seconds: collections.Counter = collections.Counter()
        self.inside = False
        self.undo = [(name, getattr(RowLayerState, name)) for name in self.ENTRIES]
        for name, original in self.undo:
            setattr(RowLayerState, name, self._timed(original))

    def _timed(self, original):
        def timed(state, *args, **kwargs):
            if self.inside:
                return original(state, *args, **kwargs)
            self.inside, start = True, time.perf_counter()
            try:
                return original(state, *args, **kwargs)
            finally:
                self.inside = False
                self.seconds[(self.watch.phase, state.policy.name)] += time.perf_counter() - start
        return timed

    def close(self) -> None:
        for name, original in self.undo:
            setattr(self.owner, name, original)


def profile_sample(lm, request: TaskRequest, specs: list[str], task_name: str) -> None:
    """One sample's wall time by phase (``--profile``), through a store of its own: prefill (the prompt read by
    every row), decode (the answers), scoring (every row teacher-forced on Full's answer), each split into the
    attention (policy walks, Full's SDPA) and the rest of the model; recording (traces built from the cache)
    and the store (keys, files)."""
    from backend import runs
    from backend.engine import runner
    from backend.engine.attention import PolicyCache
    from backend.traces.store import TraceStore

    ids = encode(lm, request.context)
    plain = best_of(lambda: lm.model(torch.tensor([ids], device=lm.model.device)), repeat=1)
    with tempfile.TemporaryDirectory() as directory, Stopwatch() as watch:
        watch.wrap(runner, "_teacher_force", lambda args, kwargs: "scoring" if args[3] else "prefill")
        watch.wrap(runner, "_decode", "decode")
        watch.wrap(PolicyCache, "attend", "attention")
        watch.wrap(runner, "_generate_and_score", "engine")
        watch.wrap(runs, "compute_traces", "traces")
        by_policy = ByPolicy(watch)
        start = time.perf_counter()
        try:
            answers = answer(lm, request, ["full", *specs], "agnostic", TraceStore(Path(directory)),
                             Limits.for_machine())
        finally:
            by_policy.close()
        total = time.perf_counter() - start
    seconds = watch.seconds
    parts = {}
    for phase in PHASES:
        attention = sum(v for k, v in seconds.items() if k.startswith(phase) and k.endswith(": attention"))
        parts[f"{phase}: attention and policy walks"] = attention
        parts[f"{phase}: the rest of the model"] = seconds[phase] - attention
    engine = sum(v for k, v in seconds.items() if k.endswith("engine"))
    traces = sum(v for k, v in seconds.items() if k.endswith("traces"))
    parts["recording (traces from the cache)"] = traces - engine
    parts["store (keys, files)"] = total - traces
    parts["other"] = engine - sum(seconds[phase] for phase in PHASES)
    print(f"{task_name}, {len(ids)} prompt tokens, {len(answers)} rows, "
          f"{max(len(a.trace.generated_ids) for a in answers)} tokens decoded at most; plain forward {plain:.2f} s\n")
    print("| part | seconds | share | plain forwards |\n|---|---|---|---|")
    for name, value in parts.items():
        print(f"| {name} | {value:.1f} | {value / total:.0%} | {value / plain:.1f} |")
    print(f"| **the sample** | {total:.1f} | 100% | {total / plain:.1f} |", flush=True)
    rows = collections.Counter(a.policy.name for a in answers)
    print("\nEach policy's own attention and walk, all its rows (the engine's loop and the device walk of rows "
          "together are outside):\n\n| policy | rows | prefill (s) | decode (s) | scoring (s) | plain forwards "
          "per row |\n|---|---|---|---|---|---|")
    names = sorted({name for _, name in by_policy.seconds}, key=lambda n: -sum(
        by_policy.seconds[(phase, n)] for phase in PHASES))
    for name in names:
        spent = [by_policy.seconds[(phase, name)] for phase in PHASES]
        per_row = "(in every run)" if name == "full" else f"{sum(spent) / plain / rows[name]:.2f}"
        print(f"| {name} | {rows[name]} | " + " | ".join(f"{v:.1f}" for v in spent) + f" | {per_row} |")
    lengths = sorted(len(a.trace.generated_ids) for a in answers)
    print(f"\nAnswers' lengths in tokens (limit {request.max_new_tokens}): median {lengths[len(lengths) // 2]}, "
          f"{sum(n <= 16 for n in lengths)} of {len(lengths)} rows at 16 or fewer, "
          f"{sum(n >= request.max_new_tokens for n in lengths)} at the limit", flush=True)


def grouped_cost(lm, request: TaskRequest, specs: list[str], seconds: float, json_out: str | None) -> None:
    """The sample's rows in the groups ``answer`` runs them in, each timed; stops between groups past ``seconds``."""
    ids = encode(lm, request.context)
    for _ in range(2):  # the second call is timed
        plain = time.perf_counter()
        lm.model(torch.tensor([ids], device=lm.model.device))
        if lm.model.device.type == "cuda":
            torch.cuda.synchronize()
        plain = time.perf_counter() - plain
    answer(lm, request, ["full", *specs[:1]], "agnostic", None, Limits.for_machine())  # warm-up: kernels, imports
    start, groups = time.perf_counter(), []
    for lo in range(0, len(specs), task_runs.MAX_ROWS):
        group = specs[lo:lo + task_runs.MAX_ROWS]
        began = time.perf_counter()
        answers = answer(lm, request, ["full", *group], "agnostic", None, Limits.for_machine())
        groups.append({"rows": len(group) + 1, "seconds": time.perf_counter() - began,
                       "decoded": max(len(a.trace.generated_ids) for a in answers)})
        print(f"| {len(ids)} | {len(group) + 1} | {groups[-1]['decoded']} | {groups[-1]['seconds']:.1f} |", flush=True)
        if time.perf_counter() - start > seconds:
            break
    done = sum(g["rows"] - 1 for g in groups)
    total = time.perf_counter() - start
    print(f"{done} of {len(specs)} policy rows in {total:.1f} s (plain forward {plain:.3f} s); the whole sample at "
          f"this rate: {total * len(specs) / done:.0f} s", flush=True)
    if json_out:
        with open(json_out, "a") as out:
            out.write(json.dumps({"device": str(lm.model.device), "dtype": str(lm.model.dtype), "tokens": len(ids),
                                  "policy_rows": len(specs), "rows_done": done, "seconds": total,
                                  "plain_forward_s": plain, "groups": groups}) + "\n")


def grid_cost(lm, samples: int, workers: int) -> None:
    from backend.experiments.grid import run_grid

    specs = task_specs(["tova", "snapkv", "knorm", "streamingllm"], [0.5, 0.875])
    jobs = task_jobs(lm.name, ["niah_single_1"], [1024], samples, specs)
    times = {}
    for where in (None, "local"):
        with tempfile.TemporaryDirectory() as store:
            os.environ["KVLENS_STORE_DIR"] = store
            start = time.perf_counter()
            run_grid(jobs, address=where, workers=workers)
            times[where or "serial"] = time.perf_counter() - start
    print(f"| {len(jobs)} samples x {len(specs) + 1} rows (niah_single_1, 1024) | {times['serial']:.0f} | "
          f"{times['local']:.0f} ({workers} actors) | {times['serial'] / times['local']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,4096")
    parser.add_argument("--task", default="niah_single_1")
    parser.add_argument("--policies", default=",".join(BENCHMARK_POLICIES),
                        help="default: the 19 policies every figure of the sample's cost is measured with")
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in SHIPPED_RATIOS))
    parser.add_argument("--grid", action="store_true", help="time a small grid serially and on a local Ray instead")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="a packaged model or a model directory")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--save-request", help="write sample 0's request at the first length here (JSON) and stop")
    parser.add_argument("--request", help="answer this saved request (no lm-eval), its rows timed group by group")
    parser.add_argument("--seconds", type=float, default=float("inf"), help="with --request: stop between groups "
                        "past this many seconds")
    parser.add_argument("--json", help="with --request: append the figures here (JSON lines)")
    parser.add_argument("--profile", action="store_true", help="one sample at the first length, its time by part")
    parser.add_argument("--max-rows", type=int, default=task_runs.MAX_ROWS,
                        help=f"rows a batched run holds at most (task_runs.MAX_ROWS, {task_runs.MAX_ROWS})")
    parser.add_argument("--walk-every-layer", action="store_true", help="a policy that decides alike in every "
                        "layer walks each block in every layer (PolicyCache.replay off), to time what the replay saves")
    add_pairs_argument(parser, 1)
    args = parser.parse_args()
    PolicyCache.replay = not args.walk_every_layer
    if args.max_rows < 1:
        parser.error(f"--max-rows must be >= 1, got {args.max_rows}")
    task_runs.MAX_ROWS = args.max_rows  # the runs ``answer`` makes in this process (not in --grid's Ray workers)
    lm = model(args.model, args.device, args.dtype)
    print(f"torch threads: {torch.get_num_threads()}; {args.model} on {args.device} in {args.dtype}")
    if args.grid:
        print("| grid | serial (s) | local Ray (s) | speed-up |\n|---|---|---|---|")
        grid_cost(lm, args.samples, args.workers)
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.save_request:
        request = task_request(lm, args.task, lengths[0])
        with open(args.save_request, "w") as out:
            json.dump(dataclasses.asdict(request), out)
        return
    specs = task_specs(args.policies.split(","), [float(r) for r in args.ratios.split(",")])
    if args.request:
        with open(args.request) as saved:
            fields = json.load(saved)
        request = TaskRequest(**{**fields, "until": tuple(fields["until"])})
        print("| prompt tokens | rows (Full included) | tokens decoded | seconds |\n|---|---|---|---|")
        grouped_cost(lm, request, specs, args.seconds, args.json)
        return
    if args.profile:
        profile_sample(lm, task_request(lm, args.task, lengths[0]), specs, args.task)
        return
    print("| task | prompt tokens | rows (Full included) | tokens decoded | plain forward (s) | sample (s) | "
          "ratio to a plain forward (min-max) | per row |\n|---|---|---|---|---|---|---|---|")
    for length in lengths:
        sample_cost(lm, task_request(lm, args.task, length), specs, args.pairs, args.task)

if __name__ == "__main__":
    main()
