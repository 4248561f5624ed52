"""The small tensor products every row does in every layer at every decoding step, each the way the engine does it
against the plain way, in the default model's shapes (3 KV heads of 3 query heads, 64 components).

    python -m benchmarks.step_products [--repeat 300]

- Scores and read-out (``policies.base.over_group``): a KV head's query heads against its held keys, then the
  weights against its values. Broadcasting ``q [H, G, n, d] @ keys [H, 1, d, C]`` copies the keys G times before
  the product; ``over_group`` stacks the group's queries instead.
- The held keys (``engine.attention.held_rows``): ``key[heads, columns]`` by advanced indexing against one
  ``index_select`` over the rows of the cache buffer.

Each is timed in microseconds a call (median of ``--repeat`` after a warm-up), one torch thread; ``equal`` says
whether the two give the same bits (the read-out and the held keys always do; the scores of a single query do
not, and neither way is the one a block of queries computes).
"""
from __future__ import annotations

import argparse

import torch

from backend.engine.attention import held_rows
from backend.policies.base import over_group

from .common import best_of

HEADS, GROUP, DIM = 3, 3, 64


def micros(fn, repeat: int) -> float:
    return best_of(fn, repeat) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print("| product | queries | held | plain (us) | engine (us) | equal |\n|---|---|---|---|---|---|")
    for n, held in [(1, 216), (1, 865), (256, 512)]:
        q = torch.randn(HEADS, GROUP, n, DIM)
        keys, values = torch.randn(HEADS, held, DIM), torch.randn(HEADS, held, DIM)
        weights = torch.softmax(torch.randn(HEADS, GROUP, n, held), -1)
        cases = {"scores": (lambda: q @ keys[:, None].transpose(-1, -2),
                            lambda: over_group(q, keys[:, None].transpose(-1, -2))),
                 "read-out": (lambda: weights @ values[:, None], lambda: over_group(weights, values[:, None]))}
        for name, (plain, engine) in cases.items():
            print(f"| {name} | {n} | {held} | {micros(plain, args.repeat):.0f} | {micros(engine, args.repeat):.0f} | "
                  f"{torch.equal(plain(), engine())} |")
    buffer = torch.randn(1, HEADS, 1200, DIM)  # a cache layer's buffer, with room to spare
    for held in (108, 432, 649):
        key = buffer[0, :, :900]
        at = torch.stack([torch.randperm(900)[:held].sort().values for _ in range(HEADS)])
        heads = torch.arange(HEADS)[:, None]
        plain, engine = (lambda: key[heads, at]), (lambda: held_rows(key, at))
        print(f"| held keys | 1 | {held} of 900 | {micros(plain, args.repeat):.0f} | {micros(engine, args.repeat):.0f} | "
              f"{torch.equal(plain(), engine())} |")


if __name__ == "__main__":
    main()
