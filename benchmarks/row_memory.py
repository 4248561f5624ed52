"""Peak memory of one policy's row: Full alone, then Full plus each policy, on a needle haystack,
each in its own child process so its peak RSS is its own.

    python -m benchmarks.row_memory [--length 2048] [--specs sparq:budget=256,reattention:budget=256]

A generate-mode run (16 new tokens, nothing recorded), as a needle cell runs it. Reported per run: the peak
RSS (``ru_maxrss``) above the process's size once the model is loaded, and the wall time. One torch
thread, so runs on a shared machine compare.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = """
import json, os, resource, sys, time
import torch
torch.set_num_threads(1)
from backend.engine.models import load_model
from backend.experiments.needle import Cell, haystack
from backend.policies import parse_spec
from backend.engine.runner import compute_traces
length, specs = int(sys.argv[1]), [s for s in sys.argv[2].split(",") if s]
lm = load_model()
ids = haystack(lm, Cell(length, 0.5))[1]
base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
start = time.perf_counter()
with torch.inference_mode():
    compute_traces(lm, specs, [parse_spec(s) for s in specs], ids, "generate", 16, record_layers=())
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"above_model_gb": (peak - base) / 1e9, "seconds": seconds}))
"""


def measure(length: int, spec: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(length), spec], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--specs", default="sparq:budget=256,reattention:budget=256,quest:budget=256")
    args = parser.parse_args()
    print("| row (+ Full) | peak RSS above the model | wall |\n|---|---:|---:|")
    for spec in ["", *args.specs.split(",")]:
        result = measure(args.length, spec)
        print(f"| {spec or 'Full alone'} | {result['above_model_gb']:.2f} GB | {result['seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
