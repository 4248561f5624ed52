"""The step between a request and the engine: each policy's trace from the store when it holds one, else
computed, the missing policies together in one batched run (``engine.runner.compute_traces``), and stored.

Each trace is stored under a key of everything that determines it (model and weights, token ids, policy and
parameters, mode, generation settings, recorded layers, engine and policy versions), so the same request
replays whoever makes it, and changed code never replays a stale trace.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .engine import DEFAULT_CHUNK
from .engine.models import default_record_layers
from .policies import Full, Policy
from .traces.store import TraceStore, load_trace, run_key
from .traces.trace import Trace

if TYPE_CHECKING:  # the engine's runner is imported where a run is made: a refused request goes without it
    from .engine.models import LoadedModel
    from .engine.runner import Progress

# Bump when the engine's decisions or outputs change for every policy (a policy's own changes bump its
# ``version``): either puts the old traces out of reach.
ENGINE_VERSION = 6


@dataclass
class Run:
    """One request's traces: one per asked policy, in order, and Full's, the reference every metric reads.

    ``run_id`` (the share link's id) and ``request`` are set by the front door (``backend.api``)."""

    traces: list[Trace]
    full: Trace
    keys: list[str]  # per policy: its store key
    full_key: str
    replayed: list[bool]  # per policy: read back from the store rather than computed
    stored: bool = False  # every trace (and, from the front door, the share link) is in the store
    run_id: str = ""
    request: object = None
    tokens: int = field(default=0)  # the text's length in tokens (the prompt's in generate mode)


def link_key(run_id: str) -> str:
    """The store key of a share link's manifest, keyed apart from every trace key (a trace key used as a link is
    simply not a run)."""
    return run_key(kind="share-link", run_id=run_id)


def put_link(store: TraceStore, run_id: str, request: dict, keys: Sequence[str], full_key: str) -> bool:
    """Store a share link ``run_id``: the request (``api.RunRequest``'s fields) and the store keys of its traces,
    one per spec, and Full's. False when the store could not write."""
    manifest = {"request": request, "keys": list(keys), "full_key": full_key}
    return bool(store.put(link_key(run_id), json.dumps(manifest).encode()))


def trace_key(lm: LoadedModel, ids: Sequence[int], policy: Policy, mode: str, max_new_tokens: int,
              record_layers: Sequence[int], context_end: int | None = None) -> str:
    # "scoring": Full's continuation is scored from the generation's own prompt state (engine/runner.py).
    generation = {"max_new_tokens": max_new_tokens, "greedy": True, "scoring": "forked"} if mode == "generate" else {}
    if context_end is not None and context_end != len(ids) and policy.reads_prompt_end:
        generation["context_end"] = int(context_end)  # a per-step policy's trace is the same either way
    return run_key(model=lm.name, model_fingerprint=lm.fingerprint, token_ids=[int(i) for i in ids],
                   policy=policy.name, params=policy.params(), mode=mode, generation=generation,
                   record_layers=[int(layer) for layer in record_layers], engine_version=ENGINE_VERSION,
                   policy_version=type(policy).version)


def compute_traces(*args, **kwargs) -> tuple[list[Trace], Trace]:
    """``engine.runner.compute_traces``, its module imported at the first run this process computes."""
    from .engine import runner

    return runner.compute_traces(*args, **kwargs)


def replay_or_compute(lm: LoadedModel, specs: Sequence[str], policies: Sequence[Policy], ids: Sequence[int],
                      mode: str = "prompt", max_new_tokens: int = 64, store: TraceStore | None = None,
                      record_layers: Sequence[int] | None = None, chunk: int = DEFAULT_CHUNK,
                      progress: Progress | None = None, context_end: int | None = None) -> Run:
    """Traces for ``specs`` (parsed as ``policies``) on ``ids``; ``store=None`` always computes.
    ``context_end``: a query-agnostic run (``engine.runner.compute_traces``)."""
    record = default_record_layers(lm) if record_layers is None else tuple(record_layers)
    keys = [trace_key(lm, ids, p, mode, max_new_tokens, record, context_end) for p in policies]
    full_key = trace_key(lm, ids, Full(), mode, max_new_tokens, record)
    found = {key: load_trace(store, key) for key in {*keys, full_key}}
    missing = [i for i, key in enumerate(keys) if found[key] is None]
    stored = store is not None
    if missing or found[full_key] is None:
        new, full = compute_traces(lm, [specs[i] for i in missing], [policies[i] for i in missing], ids, mode,
                                   max_new_tokens, chunk, progress, record, context_end)
        for i, trace in zip(missing, new):
            found[keys[i]] = trace
        found[full_key] = full
        if store is not None:  # a store that cannot write (read-only, full) runs on: the run is not stored
            results = [store.put(key, found[key].to_bytes()) for key in {keys[i] for i in missing} | {full_key}]
            stored = all(results)
    traces = [found[key].with_spec(spec) for spec, key in zip(specs, keys)]
    return Run(traces=traces, full=found[full_key], keys=keys, full_key=full_key,
               replayed=[i not in missing for i in range(len(specs))], stored=stored, tokens=len(ids))
