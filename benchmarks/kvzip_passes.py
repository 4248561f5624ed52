"""What sharing KVzip's reconstruction passes saves: sample 0 of niah_single_1 answered query-agnostic by KVzip at
the leaderboard's four ratios (rows of one batched run with Full), each row making its own passes, then rows with the
same history sharing them (``reconstruction.reread``). Process CPU time, one torch thread, alternating.

    python -m benchmarks.kvzip_passes [LENGTH]      # default 1024
"""
import sys
import time

import torch

from backend.engine import reconstruction
from backend.engine.models import load_model
from backend.experiments.task_runs import answer
from backend.limits import Limits

from .task_cost import task_request

RATIOS = (0.25, 0.5, 0.75, 0.875)


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model()
    request = task_request(lm, "niah_single_1", int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
    specs = ["full", *(f"kvzip:ratio={r}" for r in RATIOS)]
    shared = reconstruction._Pass.reads_as

    def run(share: bool) -> tuple[float, list]:
        reconstruction._Pass.reads_as = shared if share else (lambda *args: False)
        try:
            start = time.process_time()
            answers = answer(lm, request, specs, "agnostic", None, Limits.for_machine())
            return time.process_time() - start, answers
        finally:
            reconstruction._Pass.reads_as = shared

    run(True)  # warm-up
    seconds = {False: [], True: []}
    for share in (False, True, False, True):
        took, answers = run(share)
        seconds[share].append(took)
        print(f"{'shared' if share else 'each row its own'}: {took:.1f} s; answers {[a.text for a in answers]}")
    own, together = (sum(seconds[s]) / 2 for s in (False, True))
    print(f"each row its own passes {own:.1f} s, shared {together:.1f} s: {own / together:.2f}x")


if __name__ == "__main__":
    main()
