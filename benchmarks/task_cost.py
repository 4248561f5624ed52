"""What a leaderboard sample costs: one RULER sample answered under every policy at every ratio (rows of one
batched run with Full, as ``python -m backend tasks`` runs it), against one plain forward of its prompt; and a
small grid's wall time serially and on a local Ray.

    python -m benchmarks.task_cost [--lengths 1024,4096] [--policies ...] [--ratios ...] [--pairs 1]
    python -m benchmarks.task_cost --grid [--samples 4] [--workers 2]

The sample's ratio is measured in pairs (plain forward, sample, plain forward, sample, ...; ``common.paired``),
nothing stored (every call computes). It includes the answers' decoding: every row decodes until every row has
stopped (EOS) or the task's token limit (RULER's needle: 128), so a row that rambles keeps the batch going.
The grid times the same jobs twice from empty stores: serially in this process, then on ``ray.init`` with one
actor per worker (each loads the model once).
"""
import argparse
import os
import tempfile
import time

import torch

from backend.experiments.leaderboard import SHIPPED_POLICIES, SHIPPED_RATIOS, task_jobs, task_specs
from backend.experiments.task_runs import answer, encode, lm_eval_request
from backend.experiments.tasks import load_task, tokenizer_source
from backend.limits import Limits

from .common import add_pairs_argument, model, paired


def sample_cost(lm, length: int, specs: list[str], pairs: int, task_name: str) -> None:
    task = load_task(task_name, length, tokenizer_source(lm))
    request = lm_eval_request(task, 0, lm, chat=True)
    ids = encode(lm, request.context)

    def plain():
        lm.model(torch.tensor([ids]))

    timing = paired(plain, lambda: answer(lm, request, ["full", *specs], "agnostic", None, Limits.for_machine()),
                    pairs, warmup=plain)
    answers = timing.last
    decoded = max(len(a.trace.generated_ids) for a in answers)
    rows = len(answers)
    print(f"| {task_name} | {len(ids)} | {rows} | {decoded} | {timing.baseline:.2f} | {timing.run:.1f} | "
          f"{timing.ratio:.1f}x ({timing.spread(1)}) | {timing.ratio / rows:.2f}x |", flush=True)


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
    parser.add_argument("--policies", default=",".join(SHIPPED_POLICIES))
    parser.add_argument("--ratios", default=",".join(f"{r:g}" for r in SHIPPED_RATIOS))
    parser.add_argument("--grid", action="store_true", help="time a small grid serially and on a local Ray instead")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    add_pairs_argument(parser, 1)
    args = parser.parse_args()
    lm = model()
    print(f"torch threads: {torch.get_num_threads()}")
    if args.grid:
        print("| grid | serial (s) | local Ray (s) | speed-up |\n|---|---|---|---|")
        grid_cost(lm, args.samples, args.workers)
        return
    specs = task_specs(args.policies.split(","), [float(r) for r in args.ratios.split(",")])
    print("| task | prompt tokens | rows (Full included) | tokens decoded | plain forward (s) | sample (s) | "
          "ratio to a plain forward (min-max) | per row |\n|---|---|---|---|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        sample_cost(lm, length, specs, args.pairs, args.task)


if __name__ == "__main__":
    main()
