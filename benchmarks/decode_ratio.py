"""Decode path (a policy deciding at every generated token) / plain ``generate()`` on the same tokens.

    python -m benchmarks.decode_ratio [--new 64] [--budget 64]

Goal: <= 1.2x for eviction policies.
"""
import argparse

import torch

from backend.policies import parse_spec
from backend.engine.runner import generate

from .common import best_of, model

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--policies", default="full,window,sinks,h2o,tova,a2sf,oracle", help="comma-separated")
    args = parser.parse_args()
    lm = model()
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    x = torch.tensor([ids])
    produced = lm.model.generate(x, max_new_tokens=args.new, do_sample=False).shape[1] - len(ids)
    plain = best_of(lambda: lm.model.generate(x, max_new_tokens=args.new, do_sample=False), args.repeat)
    print(f"prompt {len(ids)} tokens; plain generate(): {produced} new tokens in {plain:.3f} s")
    print("| policy | instrumented (s) | new tokens | ratio to generate() |\n|---|---|---|---|")
    for name in args.policies.split(","):
        policy = parse_spec(name if name == "full" else f"{name}:budget={args.budget}")
        out = []
        t = best_of(lambda: out.append(generate(lm, ids, [policy], args.new, reference=False)[1][0]), args.repeat)
        n = len(out[-1])
        # Per generated token, in case a policy stops at EOS earlier than plain generate().
        print(f"| {name} | {t:.3f} | {n} | {(t / n) / (plain / produced):.2f}x |")


if __name__ == "__main__":
    main()
