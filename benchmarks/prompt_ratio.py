"""Prompt path (teacher-forced, policy decisions at every token) / one plain forward of the same text.

    python -m benchmarks.prompt_ratio [--tokens 512] [--budget 64]

Goal: <= 3x for a 512-token text at budget 64.
"""
import argparse

import torch

from backend.policies import parse_spec
from backend.engine.runner import score_text

from .common import best_of, inaugural, model

POLICIES = "window,sinks,h2o,tova,a2sf,oracle"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default=POLICIES, help="comma-separated, e.g. sparq,reattention")
    args = parser.parse_args()
    lm = model()
    ids = lm.tokenizer(inaugural()).input_ids[: args.tokens]
    plain = best_of(lambda: lm.model(torch.tensor([ids])), args.repeat)
    print(f"plain forward of {len(ids)} tokens: {plain:.3f} s  (torch threads: {torch.get_num_threads()})")
    print("| policy | prompt path (s) | ratio to plain forward |\n|---|---|---|")
    names = args.policies.split(",")
    policies = [parse_spec(f"{name}:budget={args.budget}") for name in names]
    for name, policy in zip(names, policies):
        t = best_of(lambda: score_text(lm, ids, [policy], reference=False), args.repeat)
        print(f"| {name} | {t:.3f} | {t / plain:.2f}x |")
    t = best_of(lambda: score_text(lm, ids, policies), args.repeat)
    print(f"| all {len(policies)} + Full reference, one batch | {t:.3f} | {t / plain:.2f}x "
          f"({t / plain / (len(policies) + 1):.2f}x per row) |")


if __name__ == "__main__":
    main()
