"""Every view of viz/panels.py on a run of 8192 tokens, built without the model: seconds and bytes per view.

    python -m benchmarks.views_8k [--tokens 8192]

Goal: each view renders in at most 2 s and at most 5 MB of plotly JSON (or
HTML) for 30 layers x 3 KV heads, Full + sinks, h2o, tova, a2sf at budget 256 + an oracle selection.
The traces are synthetic but shaped like real ones: eviction steps from a cache of ``budget`` slots
that drops one token per step, oracle spans from a top-``budget`` set that swaps a few tokens per step,
top-k attention rows as the app records them (k = 7 at 8k: sink, the last few tokens, the rest scattered) and
512 sampled keys.
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np

from backend.traces.recorded import TopAttention, choose_top_k, key_positions
from backend.traces.spans import ReadSpans
from backend.traces.trace import FORMAT_VERSION, Trace

N_LAYERS, N_HEADS, HEAD_DIM = 30, 3, 64
RECORDED = [0, 15, 29]
BUDGET = 256
TOP_K = choose_top_k(8192, len(RECORDED), N_HEADS)
WORDS = [" the", " cache", " keeps", " a", " token", ",", ".", "\n", " of", " attention", " <b>bold</b>", " &",
         " model", " reads", " every", " query", " sink", " and", " its", " budget"]


def _meta(n: int, spec: str, kind: str, budget: int | None) -> dict:
    policy = spec.partition(":")[0]
    return {"format_version": FORMAT_VERSION, "spec": spec, "policy": policy,
            "params": {} if budget is None else {"budget": budget, "heads": "head"}, "kind": kind, "mode": "prompt",
            "model": "synthetic", "model_fingerprint": "synthetic", "n_layers": N_LAYERS, "n_kv_heads": N_HEADS,
            "n_heads": 3 * N_HEADS, "n_prompt": n, "score_start": 0,
            "token_texts": [WORDS[i % len(WORDS)] for i in range(n)], "recorded_layers": RECORDED,
            "rope_attention_scaling": 1.0}


def _evictions(n: int, budget: int, rng, protect_sinks: int = 0, recent: int = 0) -> np.ndarray:
    """int32 [L, H, T]: a cache of ``budget`` slots per (layer, head) that, from the step it fills, drops one
    token per step (never the first ``protect_sinks`` tokens nor the ``recent`` newest) for the next one."""
    groups = N_LAYERS * N_HEADS
    evicted = np.full((groups, n), -1, np.int32)
    cache = np.tile(np.arange(budget), (groups, 1))
    rows = np.arange(groups)
    for t in range(budget - 1, n - 1):
        slot = rng.integers(0, budget, groups)
        for _ in range(budget):  # step to the next slot until it holds a token that may go
            token = cache[rows, slot]
            protected = (token < protect_sinks) | (token > t - recent)
            if not protected.any():
                break
            slot = np.where(protected, (slot + 1) % budget, slot)
        evicted[rows, cache[rows, slot]] = t + 1
        cache[rows, slot] = t + 1
    return evicted.reshape(N_LAYERS, N_HEADS, n)


def _window(n: int, budget: int, sinks: int = 4) -> np.ndarray:
    """Sinks + window: token j >= sinks leaves when it falls out of the last budget - sinks tokens."""
    j = np.arange(n)
    gone = np.where((j >= sinks) & (j + budget - sinks < n), j + budget - sinks, -1).astype(np.int32)
    return np.broadcast_to(gone, (N_LAYERS, N_HEADS, n)).copy()


def _oracle_spans(n: int, budget: int, rng, swaps: int = 3) -> ReadSpans:
    """Top-``budget`` selections that read the newest token and swap up to ``swaps`` older ones per step."""
    groups = N_LAYERS * N_HEADS
    members = np.full((groups, budget), -1, np.int64)
    opened = np.zeros((groups, budget), np.int64)
    inside = np.zeros((groups, n), bool)
    rows = np.arange(groups)[:, None]
    closed = []  # [pos, start, end, group] blocks
    stride = np.arange(swaps + 1) * 61  # distinct slots of one group (61 is prime to the budget's powers of two)
    for t in range(n):
        if t < budget:  # the set grows: the newest token takes a free slot
            slot, new, ok = np.full((groups, 1), t), np.full((groups, 1), t), np.ones((groups, 1), bool)
        else:  # the newest token and `swaps` random older ones replace members (never the previous newest)
            slot = (rng.integers(0, budget, (groups, 1)) + stride) % budget
            new = np.concatenate([np.full((groups, 1), t), rng.integers(0, t, (groups, swaps))], axis=1)
            ok = (members[rows, slot] != t - 1) & ~inside[rows, new]
            ok[:, 0] = True  # the newest token always comes in (it may push out the previous newest)
            ok[:, 2:] &= new[:, 2:] != new[:, 1:2]  # one token never takes two slots
            ok[:, 3:] &= new[:, 3:] != new[:, 2:3]
        g, s, p = np.broadcast_to(rows, ok.shape)[ok], slot[ok], new[ok]
        old = members[g, s]
        real = old >= 0
        closed.append(np.stack([old[real], opened[g, s][real], np.full(real.sum(), t), g[real]]))
        inside[g[real], old[real]] = False
        members[g, s], opened[g, s] = p, t
        inside[g, p] = True
    g, s = np.nonzero(members >= 0)
    closed.append(np.stack([members[g, s], opened[g, s], np.full(len(g), n), g]))
    spans = np.concatenate(closed, axis=1)
    spans = spans[:, np.lexsort((spans[1], spans[0], spans[3]))]
    bounds = np.searchsorted(spans[3], np.arange(groups + 1))
    per_layer = [[tuple(spans[:3, bounds[layer * N_HEADS + h]: bounds[layer * N_HEADS + h + 1]])
                  for h in range(N_HEADS)] for layer in range(N_LAYERS)]
    return ReadSpans.join(per_layer, n)


def _attention(n: int, rng) -> TopAttention:
    """Top-k rows: the sink, the token itself and the 2 before it, the rest scattered; weights sum to ~0.9."""
    t = np.arange(n)[:, None]
    shape = (len(RECORDED), N_HEADS, n)
    pos = np.empty((*shape, TOP_K), np.int64)
    pos[..., 0] = 0
    pos[..., 1:4] = np.maximum(t - np.arange(3), 0)
    pos[..., 4:] = (rng.random((*shape, TOP_K - 4)) * (t + 1)).astype(np.int64)
    pos.sort(-1)
    pos[..., 1:][pos[..., 1:] == pos[..., :-1]] = -1  # a row holds a position once
    val = np.where(pos >= 0, rng.random(pos.shape) ** 3, 0.0)
    val = 0.9 * val / val.sum(-1, keepdims=True)
    return TopAttention(pos=pos.astype(np.int32), val=val.astype(np.float16))


def _trace(n: int, spec: str, kind: str, budget: int | None, rng, evicted_at=None, spans=None) -> Trace:
    s = n - 1
    positions = key_positions(n)
    return Trace(meta=_meta(n, spec, kind, budget), tokens=np.arange(n, dtype=np.int32) % 101,
                 scored_ids=np.arange(n, dtype=np.int32) % 101, logprobs=-rng.random(s, dtype=np.float32) * 4,
                 top1_ids=rng.integers(0, 3, s).astype(np.int32), kl_to_full=rng.random(s, dtype=np.float32) * 0.1,
                 evicted_at=evicted_at, spans=spans, attention=_attention(n, rng),
                 keys=rng.standard_normal((len(RECORDED), N_HEADS, len(positions), HEAD_DIM)).astype(np.float16),
                 key_positions=positions,
                 rope_inv_freq=(1.0 / 10000 ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)).astype(np.float32))


def synthetic_run(n: int = 8192, budget: int = BUDGET, seed: int = 0) -> SimpleNamespace:
    """A run (what viz/panels.py reads of ``backend.api.Run``) of Full, sinks, h2o, tova, a2sf and oracle."""
    rng = np.random.default_rng(seed)
    b = f"budget={budget}"
    full = _trace(n, "full", "full", None, rng)
    traces = [full,
              _trace(n, f"sinks:{b}", "eviction", budget, rng, evicted_at=_window(n, budget)),
              _trace(n, f"h2o:{b}", "eviction", budget, rng, evicted_at=_evictions(n, budget, rng, recent=budget // 2)),
              _trace(n, f"tova:{b}", "eviction", budget, rng, evicted_at=_evictions(n, budget, rng, protect_sinks=1)),
              _trace(n, f"a2sf:{b},alpha=0.1", "eviction", budget, rng, evicted_at=_evictions(n, budget, rng, 4, 16)),
              _trace(n, f"oracle:{b}", "selection", budget, rng, spans=_oracle_spans(n, budget, rng))]
    return SimpleNamespace(run_id="synthetic-8k", traces=traces, full=full)


def views(n: int) -> dict:
    """name -> a call of one view of viz/panels.py with the app's selectors."""
    from viz import panels

    last, middle = n - 1, n // 2
    embeddings = {}  # as the app keeps them per run: the second t-SNE view reuses the first's embedding

    def tsne(run):
        keys = panels.tsne_keys(run, "tova", "15", "1")
        if keys.memo_key not in embeddings:
            embeddings[keys.memo_key] = panels.tsne_embedding(keys)
        return panels.tsne_map(keys, embeddings[keys.memo_key])

    return {
        "summary table": lambda run: panels.summary_table(run),
        "masks, all layers, all heads (binned)": lambda run: panels.heatmaps(run, "all", "all"),
        "masks, layer 15, head 1 + attention (binned)": lambda run: panels.heatmaps(run, "15", "1"),
        "masks, layer 3, all heads (binned)": lambda run: panels.heatmaps(run, "3", "all"),
        "masks zoom 256, all layers, all heads": lambda run: panels.heatmaps(run, "all", "all", (middle, 0, 256)),
        "masks zoom 256, layer 15, head 1 + attention":
            lambda run: panels.heatmaps(run, "15", "1", (middle, middle - 128, 256)),
        "kept tokens, all layers, all heads": lambda run: panels.kept_tokens(run, middle, "all", "all"),
        "kept tokens, layer 15, head 1": lambda run: panels.kept_tokens(run, last, "15", "1"),
        "A2S vs A2SF (both figures)": lambda run: panels.score_curves(run, "15", "1", 0.3, middle),
        "divergence + continuations": lambda run: panels.divergence(run),
        "retention (3 figures + POS table)": lambda run: panels.retention(run),
        "t-SNE (first time: embedding)": tsne,
        "t-SNE (again: cached embedding)": tsne,
        "export figures.html (plotly.js inlined)": lambda run: panels.figures_html(run, "all", "all", middle, 0.3),
    }


def payload_bytes(result) -> int:
    """What travels to the page: plotly JSON of each figure, HTML strings, a table as JSON."""
    items = result if isinstance(result, tuple) else (result,)
    total = 0
    for item in items:
        if hasattr(item, "to_json") and hasattr(item, "data"):  # a plotly figure
            total += len(item.to_json())
        elif isinstance(item, str):
            total += len(item.encode())
        elif hasattr(item, "to_json"):  # a DataFrame
            total += len(item.to_json())
    return total


def _warm_up() -> None:
    """What a serving process has done before its first view: imports and plotly's validator caches."""
    small = synthetic_run(300)
    for view in views(300).values():
        view(small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    args = parser.parse_args()
    start = time.perf_counter()
    run = synthetic_run(args.tokens)
    spans = run.traces[-1].spans
    print(f"{args.tokens} tokens, {N_LAYERS} layers x {N_HEADS} KV heads, {len(run.traces)} traces "
          f"(oracle: {len(spans.pos) / (N_LAYERS * N_HEADS):.0f} spans per head); built in "
          f"{time.perf_counter() - start:.1f} s\n")
    start = time.perf_counter()
    _warm_up()
    print(f"one-time imports (plotly validators, NLTK tagger, scikit-learn): {time.perf_counter() - start:.1f} s\n")
    print(f"{'view':<50} {'seconds':>8} {'MB':>7}")
    for name, view in views(args.tokens).items():
        start = time.perf_counter()
        result = view(run)
        seconds = time.perf_counter() - start
        print(f"{name:<50} {seconds:8.2f} {payload_bytes(result) / 1e6:7.2f}")


if __name__ == "__main__":
    main()
