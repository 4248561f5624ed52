"""The eviction walk alone: one layer, random queries and keys, no model.

    python -m benchmarks.walk [--policies sinks,h2o,tova,a2sf] [--budget 256] [--tokens 2048] [--chunk 256]
    python -m benchmarks.walk --device cuda [--shape 1,4,256] [--warps auto,4,8,16] [--rows 1,4]

Feeds ``--tokens`` queries in blocks of ``--chunk`` to ``--rows`` batch rows of one layer (``--shape``: KV heads,
query heads per KV head, head size; default 3,3,64, the default model's), each under the policy, and reports the
time per token (best of ``--repeat``): on the CPU the process's CPU time with one torch thread, so it can be
compared across engine versions on a busy machine; on a GPU the wall time with the device's work waited for, the
rows' walks in one Triton launch per block (``walk_rows``) with each of ``--warps`` (auto: the kernel's choice by
its tile; kernels/eviction_walk_triton.py), and beside it the launch alone (CUDA events around each launch). At 8k
tokens a run costs about layers x 8192 tokens x this figure per eviction row (per ``--rows`` rows on a GPU).
"""
from __future__ import annotations

import argparse
import time

import torch

from backend.engine.attention import RowLayerState, walk_rows
from backend.policies import parse_spec
from kernels import eviction_walk_triton


class LaunchTimer:
    """The GPU time of every walk launch, from CUDA events (each waited for: this adds host syncs)."""

    def __init__(self):
        self.seconds, self.inner = 0.0, eviction_walk_triton.walk_rows

    def __call__(self, *args):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.inner(*args)
        end.record()
        end.synchronize()
        self.seconds += start.elapsed_time(end) / 1e3


def per_token(spec: str, tokens: int, chunk: int, shape=(3, 3, 64), device: str = "cpu", repeat: int = 6,
              rows: int = 1) -> tuple[float, float | None]:
    """Seconds per token of the walk (best of ``repeat``) and, on a GPU, of its launches alone."""
    generator = torch.Generator().manual_seed(0)
    heads, group, dim = shape
    k, v = (torch.randn(heads, tokens, dim, generator=generator).to(device) for _ in range(2))
    q = torch.randn(heads, group, tokens, dim, generator=generator).to(device)
    cuda = device == "cuda"
    clock = time.perf_counter if cuda else time.process_time
    best, best_launch = float("inf"), None
    for run in range(repeat + 2 * cuda):  # on a GPU: one untimed, the timed ones, then the launches alone
        states = [RowLayerState(parse_spec(spec), heads) for _ in range(rows)]
        timer = LaunchTimer() if cuda and run == repeat + 1 else None
        if timer is not None:
            eviction_walk_triton.walk_rows = timer
        start = clock()
        try:
            for first in range(0, tokens, chunk):
                n = min(chunk, tokens - first)
                block = q[:, :, first:first + n], k[:, :first + n], v[:, :first + n], first, dim ** -0.5
                if states[0].walks_on_device(q.device):  # every row of the layer at once, as PolicyCache.attend
                    for state in states:
                        state.begin(first + n, None, None)
                    gathered = [state.gather(*block) for state in states]
                    walked = walk_rows(states, [g[2] for g in gathered], [g[0] for g in gathered], first)
                    for state, (columns, values, _), (probs, attn_rows) in zip(states, gathered, walked):
                        state.read(probs, attn_rows, columns, values)
                else:
                    for state in states:
                        state.attend(*block, None)
            if cuda:
                torch.cuda.synchronize()
        finally:
            if timer is not None:
                eviction_walk_triton.walk_rows = timer.inner
        if timer is not None:
            best_launch = timer.seconds / tokens
        elif run or not cuda:
            best = min(best, clock() - start)
    return best / tokens, best_launch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--policies", default="sinks,h2o,tova,a2sf")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--shape", default="3,3,64", help="KV heads, query heads per KV head, head size")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--warps", default="auto", help="with --device cuda: the walk launch's warps, each timed")
    parser.add_argument("--rows", default="1", help="batch rows of the layer, each timed (one launch walks them all)")
    parser.add_argument("--repeat", type=int, default=6)
    args = parser.parse_args()
    shape = tuple(int(x) for x in args.shape.split(","))
    torch.set_num_threads(1)
    warps = ([None if w == "auto" else int(w) for w in args.warps.split(",")] if args.device == "cuda"
             else ["-"])
    unit = "GPU wall" if args.device == "cuda" else "CPU"
    print(f"shape {shape}, budget {args.budget}, {args.tokens} tokens in blocks of {args.chunk}")
    print(f"| policy | rows | warps | {unit} us per token and layer | the launches alone |\n|---|---:|---:|---:|---:|")
    for name in args.policies.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for w in warps:
                if w != "-":
                    eviction_walk_triton.NUM_WARPS = w
                cost, launch = per_token(f"{name}:budget={args.budget}", args.tokens, args.chunk, shape, args.device,
                                         args.repeat, rows)
                alone = "-" if launch is None else f"{launch * 1e6:.1f}"
                print(f"| {name} | {rows} | {w or 'auto'} | {cost * 1e6:.1f} | {alone} |", flush=True)


if __name__ == "__main__":
    main()
