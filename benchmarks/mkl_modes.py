"""A plain forward of the default model under MKL's reproducible modes, each in a process of its own (MKL reads
``MKL_CBWR`` as it starts), on one thread:

    python -m benchmarks.mkl_modes [--tokens 1024] [--modes AUTO AUTO,STRICT AVX2,STRICT]

``import backend`` sets ``AUTO,STRICT`` (a row's product the same in any batch, docs/architecture.md); this says what
the mode costs against MKL's default (``AUTO``) and its AVX2 kernels. Prints seconds per forward, the best of three.
"""
import argparse
import os
import subprocess
import sys

ONE_MODE = """import sys, time, torch
torch.set_num_threads(1)
from backend import api
lm = api.get_model()
ids = torch.randint(0, 1000, (1, int(sys.argv[1])))
with torch.inference_mode():
    lm.model(ids)
    times = []
    for _ in range(3):
        start = time.perf_counter(); lm.model(ids); times.append(time.perf_counter() - start)
print(min(times))"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", default=["AUTO", "AUTO,STRICT", "AVX2,STRICT"])
    args = parser.parse_args()
    for mode in args.modes:
        out = subprocess.run([sys.executable, "-c", ONE_MODE, str(args.tokens)], capture_output=True, text=True,
                             check=True, env={**os.environ, "MKL_CBWR": mode, "OMP_NUM_THREADS": "1"})
        print(f"MKL_CBWR={mode}: a plain forward of {args.tokens} tokens, {float(out.stdout.split()[-1]):.2f} s")


if __name__ == "__main__":
    main()
