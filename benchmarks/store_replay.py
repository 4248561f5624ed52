"""Replay time of the trace store: get 4 stored traces back and np.load them.

    python -m benchmarks.store_replay [--repeat N]

Writes 4 trace-like .npz byte strings (shapes as in docs/trace-format.md for a
30-layer, 3-KV-head model on 512 tokens) into a fresh temporary store, then
times, per round: open a TraceStore, get_or_compute all 4 (all replayed from
disk), and np.load every array of each. Prints the first, median and worst
round, for plausible eviction data, for incompressible (uniformly random)
data, and for selection traces with a random packed mask (MBs each). Goal: < 0.3 s. Exit status 1 if over the goal.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time

import numpy as np

from backend.traces.store import TraceStore, get_or_compute, run_key

GOAL_S = 0.3
LAYERS, KV_HEADS, T, N_PROMPT = 30, 3, 512, 384


def make_trace(seed: int, incompressible: bool = False, selection: bool = False) -> bytes:
    """An eviction trace of the documented layout, with plausible values (or
    uniformly random ones, which compress worst); with ``selection``, a
    selection trace whose packed [L, H_kv, T, T/8] mask is random bits."""
    rng = np.random.default_rng(seed)
    budget = 64
    tokens = rng.integers(0, 49152, T, dtype=np.int32)
    # Each token is read for a while, then dropped (or kept: -1).
    life = rng.geometric(1 / 40, size=(LAYERS, KV_HEADS, T))
    evicted_at = np.arange(T, dtype=np.int64)[None, None, :] + life
    evicted_at[evicted_at > T] = -1
    evicted_at[:, :, :4] = -1  # sinks
    evicted_at[:, :, -budget:] = np.where(rng.random((LAYERS, KV_HEADS, budget)) < 0.9, -1, T)
    if incompressible:
        evicted_at = rng.integers(-1, T + 1, size=(LAYERS, KV_HEADS, T))
    arrays = {"evicted_at": evicted_at.astype(np.int32)}
    if selection:
        arrays = {"selected": rng.integers(0, 256, size=(LAYERS, KV_HEADS, T, T // 8), dtype=np.uint8)}
    s = T
    meta = {
        "format_version": 1,
        "policy": "tova",
        "params": {"budget": budget, "heads": "kv"},
        "spec": f"tova:budget={budget}",
        "kind": "selection" if selection else "eviction",
        "mode": "generate",
        "model": "HuggingFaceTB/SmolLM2-360M-Instruct",
        "model_fingerprint": "sha256:" + "0" * 64,
        "n_layers": LAYERS,
        "n_kv_heads": KV_HEADS,
        "n_heads": 15,
        "n_prompt": N_PROMPT,
        "score_start": N_PROMPT - 1,
        "token_texts": [f" tok{int(t)}" for t in tokens],
    }
    buf = io.BytesIO()
    np.savez_compressed(
        buf,
        tokens=tokens,
        **arrays,
        scored_ids=tokens.copy(),
        logprobs=(-np.abs(rng.standard_normal(s - 1)) * 3).astype(np.float32),
        top1_ids=rng.integers(0, 49152, s - 1, dtype=np.int32),
        kl_to_full=np.abs(rng.standard_normal(s - 1) * 0.1).astype(np.float32),
        generated_ids=tokens[N_PROMPT:].copy(),
        meta_json=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
    )
    return buf.getvalue()


def replay_once(directory: str, keys: list[str]) -> float:
    start = time.perf_counter()
    with TraceStore(directory) as store:
        for key in keys:
            data, replayed = get_or_compute(store, key, lambda: b"")
            assert replayed, "expected a replay"
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
            json.loads(arrays["meta_json"].tobytes())
    return time.perf_counter() - start


def scenario(label: str, repeat: int, **kind) -> float:
    with tempfile.TemporaryDirectory(prefix="kvlens-store-bench-") as directory:
        traces = [make_trace(seed, **kind) for seed in range(4)]
        keys = [run_key(bench="store_replay", seed=seed, **kind) for seed in range(4)]
        with TraceStore(directory) as store:
            for key, data in zip(keys, traces):
                store.put(key, data)
        times = [replay_once(directory, keys) for _ in range(max(1, repeat))]
    median, worst = statistics.median(times), max(times)
    sizes = "+".join(f"{len(t) / 1024:.0f}" for t in traces)
    print(
        f"{label:>15}: 4 traces, {sizes} KB: replay (open store, get 4, np.load all arrays) "
        f"first {times[0] * 1e3:.1f} ms, median {median * 1e3:.1f} ms, worst {worst * 1e3:.1f} ms "
        f"over {len(times)} rounds"
    )
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20, help="timed rounds per scenario (default 20)")
    args = ap.parse_args(argv)
    print(f"evicted_at int32 [{LAYERS},{KV_HEADS},{T}] plus per-token arrays and metadata JSON, np.savez_compressed")
    worst = max(
        scenario("plausible", args.repeat),
        scenario("incompressible", args.repeat, incompressible=True),
        scenario("selection", args.repeat, selection=True),
    )
    ok = worst < GOAL_S
    print(f"worst replay {worst * 1e3:.1f} ms; goal < {GOAL_S * 1e3:.0f} ms: {'ok' if ok else 'OVER GOAL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
