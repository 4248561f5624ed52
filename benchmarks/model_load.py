"""What a packaged model's first and later loads take, one torch thread: each model converted into an empty model
cache (timed with the imports of transformers' model classes it makes), then, in another process, loaded twice and
the second load timed (the converted weights read, every import already made).

    python -m benchmarks.model_load [--each-read-parses]

``--each-read-parses`` converts without ``models._gguf_read_once``: every read transformers makes of the GGUF parses
it again, and the tensor-name map is built again for every module, as gguf-py alone would.
"""
import argparse
import os
import subprocess
import sys
import tempfile

from backend.engine.models import DEFAULT_MODEL

MODELS = (DEFAULT_MODEL, "gemma3-270m")

LOAD = """
import contextlib, sys, time
import torch
torch.set_num_threads(1)
from backend.engine import models
if sys.argv[2] == "each":
    models._gguf_read_once = contextlib.nullcontext
for _ in range(1 if sys.argv[3] == "first" else 2):
    start = time.perf_counter()
    models.load_model(sys.argv[1])
print(f"{time.perf_counter() - start:.1f}")
"""


def timed_load(name: str, cache: str, each_read_parses: bool, which: str) -> float:
    env = {**os.environ, "KVLENS_MODEL_CACHE": cache, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    parses = "each" if each_read_parses else "once"
    result = subprocess.run([sys.executable, "-c", LOAD, name, parses, which], env=env, capture_output=True, text=True,
                            check=True)
    return float(result.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--each-read-parses", action="store_true")
    args = parser.parse_args()
    print("| model | first load (converts) | a later load |\n|---|---:|---:|")
    for name in MODELS:
        with tempfile.TemporaryDirectory() as cache:
            first = timed_load(name, cache, args.each_read_parses, "first")
            later = timed_load(name, cache, args.each_read_parses, "later")
        print(f"| {name} | {first:.1f} s | {later:.1f} s |", flush=True)


if __name__ == "__main__":
    main()
