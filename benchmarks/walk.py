"""The eviction walk alone: one layer of one row, random queries and keys, no model.

    python -m benchmarks.walk [--policies sinks,h2o,tova,a2sf] [--budget 256] [--tokens 2048] [--chunk 256]
    python -m benchmarks.walk --device cuda [--shape 1,4,256] [--warps 1,2,4,8]

Feeds ``--tokens`` queries in blocks of ``--chunk`` to one ``RowLayerState`` (``--shape``: KV heads, query heads
per KV head, head size; default 3,3,64, the default model's) and reports the time per token (best of 6): on the
CPU the process's CPU time with one torch thread, so it can be compared across engine versions on a busy machine;
on a GPU the wall time with the device's work waited for, the walk in one Triton launch per block with each of
``--warps`` (the launch's warps; kernels/eviction_walk_triton.py). At 8k tokens a run costs about layers x 8192
tokens x this figure per eviction row.
"""
from __future__ import annotations

import argparse
import time

import torch

from backend.engine.attention import RowLayerState
from backend.policies import parse_spec
from kernels import eviction_walk_triton


def per_token(spec: str, tokens: int, chunk: int, shape=(3, 3, 64), device: str = "cpu", repeat: int = 6) -> float:
    generator = torch.Generator().manual_seed(0)
    heads, group, dim = shape
    k, v = (torch.randn(heads, tokens, dim, generator=generator).to(device) for _ in range(2))
    q = torch.randn(heads, group, tokens, dim, generator=generator).to(device)
    cuda = device == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    best = float("inf")
    for _ in range(repeat):
        state = RowLayerState(parse_spec(spec), heads)
        start = clock()
        for first in range(0, tokens, chunk):
            n = min(chunk, tokens - first)
            state.attend(q[:, :, first:first + n], k[:, :first + n], v[:, :first + n], first, dim ** -0.5, None)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, clock() - start)
    return best / tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", default="sinks,h2o,tova,a2sf")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--shape", default="3,3,64", help="KV heads, query heads per KV head, head size")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--warps", default="4", help="with --device cuda: the walk launch's warps, each timed")
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    torch.set_num_threads(1)
    warps = [int(w) for w in args.warps.split(",")] if args.device == "cuda" else [None]
    unit = "GPU wall" if args.device == "cuda" else "CPU"
    print(f"shape {shape}, budget {args.budget}, {args.tokens} tokens in blocks of {args.chunk}")
    print(f"| policy | warps | {unit} us per token and layer |\n|---|---:|---:|")
    for name in args.policies.split(","):
        for w in warps:
            if w is not None:
                eviction_walk_triton.NUM_WARPS = w
            cost = per_token(f"{name}:budget={args.budget}", args.tokens, args.chunk, shape, args.device, args.repeat)
            print(f"| {name} | {w or '-'} | {cost * 1e6:.1f} |", flush=True)


if __name__ == "__main__":
    main()
