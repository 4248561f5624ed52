"""Every view of viz/panels.py on a long run, built without the model: seconds and bytes per view.

    python -m benchmarks.views_8k [--tokens 8192] [--shape default|gemma]

Goal: each view renders in at most 2 s and at most 5 MB of plotly JSON (or HTML) at 8192 tokens of
30 layers x 3 KV heads (``default``), and in at most 3 s at 32,768 tokens shaped like Gemma 3 270M
(``gemma``: 18 layers, 1 KV head of 256 dimensions, a 512-token sliding window in 5 of every 6 layers).
The run holds Full + sinks, h2o, tova, a2sf at budget 256 + an oracle selection, and names a word that one token in
twenty is as its evidence (the views mark it; "why" follows it through every trace). The traces are synthetic
but shaped like real ones: eviction steps from a cache of ``budget`` slots that drops one token per step,
oracle spans from a top-``budget`` set that swaps a few tokens per step (cut at a local layer's window, as
the engine records them), top-k attention rows as the app records them (k = 7 at 8k: sink, the last few tokens, the rest
scattered) and 512 sampled keys.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
from types import MappingProxyType, SimpleNamespace

import numpy as np

from backend.traces.recorded import TopAttention, choose_top_k, key_positions
from backend.traces.spans import ReadSpans
from backend.traces.trace import FORMAT_VERSION, Trace



@dataclasses.dataclass(frozen=True)
class Shape:
    """A model's shape as the traces show it: layers, KV heads, key size and each layer's sliding window."""

    name: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: tuple[int | None, ...] | None = None

    @property
    def recorded(self) -> list[int]:
        """The layers whose attention and keys a run records: first, middle, last."""
        return [0, self.n_layers // 2, self.n_layers - 1]

    def window(self, layer: int) -> int | None:
        return None if self.windows is None else self.windows[layer]


SHAPES = MappingProxyType({
    "default": Shape("30 layers x 3 KV heads", 30, 3, 64),
    # Gemma 3: layers 5, 11, 17 are global, the others slide over the last 512 tokens.
    "gemma": Shape("Gemma 3 270M: 18 layers x 1 KV head, window 512 in 15", 18, 1, 256,
                   tuple(None if layer % 6 == 5 else 512 for layer in range(18))),
})
DEFAULT = SHAPES["default"]
BUDGET = 256
EVIDENCE = "budget"  # one of WORDS: about one token in twenty
WORDS = [" the", " cache", " keeps", " a", " token", ",", ".", "\n", " of", " attention", " <b>bold</b>", " &",
         " model", " reads", " every", " query", " sink", " and", " its", " budget"]


def _meta(n: int, spec: str, kind: str, budget: int | None, shape: Shape) -> dict:
    policy = spec.partition(":")[0]
    windows = {} if shape.windows is None else {"layer_windows": list(shape.windows)}
    return {"format_version": FORMAT_VERSION, "spec": spec, "policy": policy,
            "params": {} if budget is None else {"budget": budget, "heads": "head"}, "kind": kind, "mode": "prompt",
            "model": "synthetic", "model_fingerprint": "synthetic", "n_layers": shape.n_layers,
            "n_kv_heads": shape.n_kv_heads, "n_heads": 3 * shape.n_kv_heads, "n_prompt": n, "score_start": 0,
            "token_texts": [WORDS[i % len(WORDS)] for i in range(n)], "recorded_layers": shape.recorded,
            "rope_attention_scaling": 1.0, **windows}


def _evictions(n: int, budget: int, rng, shape: Shape, protect_sinks: int = 0, recent: int = 0) -> np.ndarray:
    """int32 [L, H, T]: a cache of ``budget`` slots per (layer, head) that, from the step it fills, drops one
    token per step (never the first ``protect_sinks`` tokens nor the ``recent`` newest) for the next one."""
    groups = shape.n_layers * shape.n_kv_heads
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
    return evicted.reshape(shape.n_layers, shape.n_kv_heads, n)


def _window(n: int, budget: int, shape: Shape, sinks: int = 4) -> np.ndarray:
    """Sinks + window: token j >= sinks leaves when it falls out of the last budget - sinks tokens."""
    j = np.arange(n)
    gone = np.where((j >= sinks) & (j + budget - sinks < n), j + budget - sinks, -1).astype(np.int32)
    return np.broadcast_to(gone, (shape.n_layers, shape.n_kv_heads, n)).copy()


def _oracle_spans(n: int, budget: int, rng, shape: Shape, swaps: int = 3) -> ReadSpans:
    """Top-``budget`` selections that read the newest token and swap up to ``swaps`` older ones per step."""
    groups = shape.n_layers * shape.n_kv_heads
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
    heads = shape.n_kv_heads
    per_layer = [[_within_window(spans[:3, bounds[layer * heads + h]: bounds[layer * heads + h + 1]],
                                 shape.window(layer)) for h in range(heads)] for layer in range(shape.n_layers)]
    return ReadSpans.join(per_layer, n)


def _within_window(spans: np.ndarray, window: int | None) -> tuple[np.ndarray, ...]:
    """A head's (pos, start, end) cut where a sliding-window layer stops seeing the token."""
    pos, start, end = spans
    if window is None:
        return pos, start, end
    end = np.minimum(end, pos + window)
    keep = start < end
    return pos[keep], start[keep], end[keep]


def _attention(n: int, rng, model: Shape) -> TopAttention:
    """Top-k rows as the app records them: the sink, the token itself and the 2 before it, the rest scattered;
    weights sum to ~0.9."""
    top_k = choose_top_k(n, len(model.recorded), model.n_kv_heads)
    t = np.arange(n)[:, None]
    shape = (len(model.recorded), model.n_kv_heads, n)
    pos = np.empty((*shape, top_k), np.int64)
    pos[..., 0] = 0
    pos[..., 1:4] = np.maximum(t - np.arange(3), 0)
    pos[..., 4:] = (rng.random((*shape, top_k - 4)) * (t + 1)).astype(np.int64)
    pos.sort(-1)
    pos[..., 1:][pos[..., 1:] == pos[..., :-1]] = -1  # a row holds a position once
    val = np.where(pos >= 0, rng.random(pos.shape) ** 3, 0.0)
    val = 0.9 * val / val.sum(-1, keepdims=True)
    return TopAttention(pos=pos.astype(np.int32), val=val.astype(np.float16))


def _trace(n: int, spec: str, kind: str, budget: int | None, rng, shape: Shape, evicted_at=None,
           spans=None) -> Trace:
    s = n - 1
    positions = key_positions(n)
    head_dim = shape.head_dim
    return Trace(meta=_meta(n, spec, kind, budget, shape), tokens=np.arange(n, dtype=np.int32) % 101,
                 scored_ids=np.arange(n, dtype=np.int32) % 101, logprobs=-rng.random(s, dtype=np.float32) * 4,
                 top1_ids=rng.integers(0, 3, s).astype(np.int32), kl_to_full=rng.random(s, dtype=np.float32) * 0.1,
                 evicted_at=evicted_at, spans=spans, attention=_attention(n, rng, shape),
                 keys=rng.standard_normal((len(shape.recorded), shape.n_kv_heads, len(positions), head_dim)).astype(
                     np.float16),
                 key_positions=positions,
                 rope_inv_freq=(1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32))


def synthetic_run(n: int = 8192, budget: int = BUDGET, seed: int = 0, shape: Shape = DEFAULT) -> SimpleNamespace:
    """A run (what viz/panels.py reads of ``backend.api.Run``) of Full, sinks, h2o, tova, a2sf and oracle."""
    rng = np.random.default_rng(seed)
    b = f"budget={budget}"

    def trace(spec, kind, **arrays):
        return _trace(n, spec, kind, None if kind == "full" else budget, rng, shape, **arrays)

    full = trace("full", "full")
    traces = [full,
              trace(f"sinks:{b}", "eviction", evicted_at=_window(n, budget, shape)),
              trace(f"h2o:{b}", "eviction", evicted_at=_evictions(n, budget, rng, shape, recent=budget // 2)),
              trace(f"tova:{b}", "eviction", evicted_at=_evictions(n, budget, rng, shape, protect_sinks=1)),
              trace(f"a2sf:{b},alpha=0.1", "eviction", evicted_at=_evictions(n, budget, rng, shape, 4, 16)),
              trace(f"oracle:{b}", "selection", spans=_oracle_spans(n, budget, rng, shape))]
    # The evidence a task sample names: a word the text repeats (CWE's case, the most marks), marked in the views.
    request = SimpleNamespace(evidence=[EVIDENCE], evidence_end=None)
    return SimpleNamespace(run_id=f"synthetic-{n}", traces=traces, full=full, request=request)


def views(n: int, shape: Shape = DEFAULT) -> dict:
    """name -> a call of one view of viz/panels.py with the app's selectors."""
    from viz import panels

    last, middle = n - 1, n // 2
    layer, head = str(shape.recorded[1]), str(min(1, shape.n_kv_heads - 1))  # a recorded layer: weights shown
    embeddings = {}  # as the app keeps them per run: the second t-SNE view reuses the first's embedding

    def tsne(run):
        keys = panels.tsne_keys(run, "tova", layer, head)
        if keys.memo_key not in embeddings:
            embeddings[keys.memo_key] = panels.tsne_embedding(keys)
        return panels.tsne_map(keys, embeddings[keys.memo_key])

    return {
        "summary table": lambda run: panels.summary_table(run),
        "masks, all layers, all heads (binned)": lambda run: panels.heatmaps(run, "all", "all"),
        f"masks, layer {layer}, head {head} + attention (binned)": lambda run: panels.heatmaps(run, layer, head),
        "masks, layer 3, all heads (binned)": lambda run: panels.heatmaps(run, "3", "all"),
        "masks zoom 256, all layers, all heads": lambda run: panels.heatmaps(run, "all", "all", (middle, 0, 256)),
        f"masks zoom 256, layer {layer}, head {head} + attention":
            lambda run: panels.heatmaps(run, layer, head, (middle, middle - 128, 256)),
        "kept tokens, all layers, all heads": lambda run: panels.kept_tokens(run, middle, "all", "all"),
        f"kept tokens, layer {layer}, head {head}": lambda run: panels.kept_tokens(run, last, layer, head),
        "A2S vs A2SF (both figures)": lambda run: panels.score_curves(run, layer, head, 0.3, middle),
        "cache reach at the last step + by distance": lambda run: panels.cache_reach(run, last),
        "divergence + continuations": lambda run: panels.divergence(run),
        "retention (3 figures + POS table)": lambda run: panels.retention(run),
        "t-SNE (first time: embedding)": tsne,
        "t-SNE (again: cached embedding)": tsne,
        "export figures.html (plotly.js inlined)": lambda run: panels.figures_html(run, "all", "all", middle, 0.3),
        "why: the evidence through every trace + verdicts": why,
    }


def why(run) -> str:
    """The task sample's "why" table: its evidence located, then followed through every trace at the last step."""
    from backend.analysis.evidence import follow, run_evidence, verdict

    evidence = run_evidence(run.full, run.request.evidence)
    full = follow(run.full, evidence)
    return "\n".join(verdict(t.spec, follow(t, evidence), full, evidence) for t in run.traces)


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


def _warm_up(shape: Shape) -> None:
    """What a serving process has done before its first view: imports and plotly's validator caches."""
    small = synthetic_run(300, shape=shape)
    for view in views(300, shape).values():
        view(small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--shape", choices=list(SHAPES), default="default")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    start = time.perf_counter()
    run = synthetic_run(args.tokens, shape=shape)
    spans = run.traces[-1].spans
    print(f"{args.tokens} tokens, {shape.name}, {len(run.traces)} traces "
          f"(oracle: {len(spans.pos) / (shape.n_layers * shape.n_kv_heads):.0f} spans per head); built in "
          f"{time.perf_counter() - start:.1f} s\n")
    start = time.perf_counter()
    _warm_up(shape)
    print(f"one-time imports (plotly validators, NLTK tagger, scikit-learn): {time.perf_counter() - start:.1f} s\n")
    # CPU seconds too: on a shared machine the wall clock also counts the time other processes ran.
    print(f"{'view':<50} {'seconds':>8} {'CPU s':>7} {'MB':>7}")
    for name, view in views(args.tokens, shape).items():
        start, cpu = time.perf_counter(), time.process_time()
        result = view(run)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"{name:<50} {seconds:8.2f} {cpu:7.2f} {payload_bytes(result) / 1e6:7.2f}")


if __name__ == "__main__":
    main()
