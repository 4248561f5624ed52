"""The eviction walk alone: one layer of one row, random queries and keys, no model.

    python -m benchmarks.walk [--policies sinks,h2o,tova,a2sf] [--budget 256] [--tokens 2048] [--chunk 256]

Feeds ``--tokens`` queries in blocks of ``--chunk`` to one ``RowLayerState`` (3 KV heads of 3 query heads,
head size 64: the default model's shape) and reports CPU time per token (one torch thread, best of 6), so
it can be compared across engine versions on a busy machine. At 8k tokens a run costs about
30 layers x 8192 tokens x this figure per eviction row.
"""
from __future__ import annotations

import argparse
import time

import torch

from backend.engine.attention import RowLayerState
from backend.policies import parse_spec


def per_token(spec: str, tokens: int, chunk: int, repeat: int = 6) -> float:
    generator = torch.Generator().manual_seed(0)
    heads, group, dim = 3, 3, 64
    k, v = torch.randn(heads, tokens, dim, generator=generator), torch.randn(heads, tokens, dim, generator=generator)
    q = torch.randn(heads, group, tokens, dim, generator=generator)
    best = float("inf")
    for _ in range(repeat):
        state = RowLayerState(parse_spec(spec), heads)
        start = time.process_time()
        for first in range(0, tokens, chunk):
            n = min(chunk, tokens - first)
            state.attend(q[:, :, first:first + n], k[:, :first + n], v[:, :first + n], first, dim ** -0.5, None)
        best = min(best, time.process_time() - start)
    return best / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", default="sinks,h2o,tova,a2sf")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(1)
    total = 0.0
    print("| policy | CPU us per token and layer |\n|---|---:|")
    for name in args.policies.split(","):
        cost = per_token(f"{name}:budget={args.budget}", args.tokens, args.chunk)
        total += cost
        print(f"| {name} | {cost * 1e6:.0f} |")
    print(f"| all | {total * 1e6:.0f} |")


if __name__ == "__main__":
    main()
