"""Prompt path (teacher-forced, policy decisions at every token) / one plain forward of the same text.

    python -m benchmarks.prompt_ratio [--tokens 512] [--budget 64] [--pairs 3]

How the ratio is measured: for each row, after one untimed call of each, the plain forward and the prompt
path are timed in ``--pairs`` pairs, A B A B ... (plain, path, plain, path, ...); each pair gives path / plain,
and a row reports the median of its per-pair ratios with their min-max, so a load that comes and goes on the
machine slows both halves of a pair instead of one side of the ratio. The times shown are medians (the plain
forward's over every row's pairs). ``score_text`` has no store: every call computes. ``--repeat`` is the
former name of ``--pairs``.

Goal: <= 3x for a 512-token text at budget 64.
"""
import argparse
import statistics

import torch

from backend.policies import parse_spec
from backend.engine.runner import score_text

from .common import add_pairs_argument, inaugural, model, paired

POLICIES = "window,sinks,h2o,tova,a2sf,oracle"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    add_pairs_argument(parser, 3, "--repeat")
    parser.add_argument("--policies", default=POLICIES, help="comma-separated, e.g. sparq,reattention")
    args = parser.parse_args()
    lm = model()
    ids = lm.tokenizer(inaugural()).input_ids[: args.tokens]

    def plain():
        lm.model(torch.tensor([ids]))

    names = args.policies.split(",")
    policies = [parse_spec(f"{name}:budget={args.budget}") for name in names]
    rows = [(name, paired(plain, lambda: score_text(lm, ids, [policy], reference=False), args.pairs))
            for name, policy in zip(names, policies)]
    together = paired(plain, lambda: score_text(lm, ids, policies), args.pairs)
    base = statistics.median(t for _, p in [*rows, (None, together)] for t in p.baseline_s)
    print(f"plain forward of {len(ids)} tokens: {base:.3f} s  (torch threads: {torch.get_num_threads()}; "
          f"{args.pairs} pairs plain, path, ... per row: median times, median of the per-pair ratios)")
    print("| policy | prompt path (s) | ratio to plain forward | ratio min-max |\n|---|---|---|---|")
    for name, p in rows:
        print(f"| {name} | {p.run:.3f} | {p.ratio:.2f}x | {p.spread()} |")
    print(f"| all {len(policies)} + Full reference, one batch | {together.run:.3f} | {together.ratio:.2f}x "
          f"({together.ratio / (len(policies) + 1):.2f}x per row) | {together.spread()} |")


if __name__ == "__main__":
    main()
