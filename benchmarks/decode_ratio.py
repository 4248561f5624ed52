"""Decode path (a policy deciding at every generated token) / plain ``generate()`` on the same tokens.

    python -m benchmarks.decode_ratio [--new 64] [--budget 64] [--pairs 3]

How the ratio is measured: for each policy, after one untimed call of each, plain ``generate()`` and the
instrumented decode are timed in ``--pairs`` pairs, A B A B ... (generate, decode, generate, decode, ...);
each pair gives decode / generate per generated token (a policy may stop at EOS earlier), and a row reports
the median of its per-pair ratios with their min-max, so a load that comes and goes on the machine slows
both halves of a pair instead of one side of the ratio. The times shown are medians (plain ``generate()``'s
over every row's pairs). ``runner.generate`` has no store: every call computes. ``--repeat`` is the former
name of ``--pairs``.

Goal: <= 1.2x for eviction policies.
"""
import argparse
import statistics

import torch

from backend.policies import parse_spec
from backend.engine.runner import generate

from .common import add_pairs_argument, model, paired

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64)
    add_pairs_argument(parser, 3, "--repeat")
    parser.add_argument("--policies", default="full,window,sinks,h2o,tova,a2sf,oracle", help="comma-separated")
    args = parser.parse_args()
    lm = model()
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    x = torch.tensor([ids])
    produced = lm.model.generate(x, max_new_tokens=args.new, do_sample=False).shape[1] - len(ids)

    def plain():
        lm.model.generate(x, max_new_tokens=args.new, do_sample=False)

    rows = []
    for name in args.policies.split(","):
        policy = parse_spec(name if name == "full" else f"{name}:budget={args.budget}")
        p = paired(plain, lambda: generate(lm, ids, [policy], args.new, reference=False)[1][0], args.pairs)
        n = len(p.last)
        # Per generated token, in case a policy stops at EOS earlier than plain generate() (greedy: n is the same
        # in every pair).
        p.scale = produced / n
        rows.append((name, p, n))
    plain_s = statistics.median(t for _, p, _ in rows for t in p.baseline_s)
    print(f"prompt {len(ids)} tokens; plain generate(): {produced} new tokens in {plain_s:.3f} s ({args.pairs} pairs "
          f"generate, decode, ... per policy: median times, median of the per-pair ratios)")
    print("| policy | instrumented (s) | new tokens | ratio to generate() | ratio min-max |\n|---|---|---|---|---|")
    for name, p, n in rows:
        print(f"| {name} | {p.run:.3f} | {n} | {p.ratio:.2f}x | {p.spread()} |")


if __name__ == "__main__":
    main()
