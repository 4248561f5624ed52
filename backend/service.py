"""The one entry point the CLI and the app call: run policies on a text, replaying what the store holds.

Each policy's trace is stored under a key of everything that determines it (model and weights,
token ids, policy and parameters, mode, generation settings, recorded layers, trace-format version).
Policies missing from the store are computed together in one batched run (runner.py) and stored;
the rest are replayed.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .models import LoadedModel
from .policies import Full, Policy
from .runner import DEFAULT_CHUNK, Progress, default_record_layers, run
from .store import TraceStore, run_key
from .trace import Trace

# Bump when the engine's decisions or outputs change for every policy (a policy's own changes bump its
# ``version``): either puts the old traces out of reach, so changed code never replays stale traces.
ENGINE_VERSION = 3


@dataclass
class RunResult:
    traces: list[Trace]  # one per requested spec, in order
    full: Trace  # the Full reference every metric compares against
    replayed: list[bool]  # per spec: served from the store
    keys: list[str]  # per spec: store key (a deep link can name a run by these)
    full_key: str


def trace_key(lm: LoadedModel, ids: Sequence[int], policy: Policy, mode: str, max_new_tokens: int,
              record_layers: Sequence[int]) -> str:
    # "scoring": Full's continuation is scored from the generation's own prompt state (runner.py); traces
    # stored before that scored it on a second pass over the whole text.
    generation = {"max_new_tokens": max_new_tokens, "greedy": True, "scoring": "forked"} if mode == "generate" else {}
    return run_key(model=lm.name, model_fingerprint=lm.fingerprint, token_ids=[int(i) for i in ids],
                   policy=policy.name, params=policy.params(), mode=mode, generation=generation,
                   record_layers=[int(layer) for layer in record_layers], engine_version=ENGINE_VERSION,
                   policy_version=type(policy).version)


def run_policies(lm: LoadedModel, specs: Sequence[str], policies: Sequence[Policy], ids: Sequence[int],
                 mode: str = "prompt", max_new_tokens: int = 64, store: TraceStore | None = None,
                 record_layers: Sequence[int] | None = None, chunk: int = DEFAULT_CHUNK,
                 progress: Progress | None = None) -> RunResult:
    """Traces for ``specs`` (parsed as ``policies``) on ``ids``; ``store=None`` always recomputes."""
    record = default_record_layers(lm) if record_layers is None else tuple(record_layers)
    keys = [trace_key(lm, ids, p, mode, max_new_tokens, record) for p in policies]
    full_key = trace_key(lm, ids, Full(), mode, max_new_tokens, record)

    def load(key: str) -> Trace | None:
        data = store.get(key) if store is not None else None
        if data is None:
            return None
        try:
            return Trace.from_bytes(data)
        except (ValueError, KeyError, OSError):  # unreadable despite a good checksum: recompute
            return None

    found = {key: load(key) for key in {*keys, full_key}}
    missing = [i for i, key in enumerate(keys) if found[key] is None]
    if missing or found[full_key] is None:
        new, full = run(lm, [specs[i] for i in missing], [policies[i] for i in missing], ids, mode,
                        max_new_tokens, chunk, progress, record)
        for i, trace in zip(missing, new):
            found[keys[i]] = trace
        found[full_key] = full
        if store is not None:
            for key in {keys[i] for i in missing} | {full_key}:
                store.put(key, found[key].to_bytes())
    traces = []
    for spec, key in zip(specs, keys):
        trace = found[key]
        traces.append(Trace(**{**trace.__dict__, "meta": {**trace.meta, "spec": spec}}))
    return RunResult(traces=traces, full=found[full_key], replayed=[i not in missing for i in range(len(specs))],
                     keys=keys, full_key=full_key)
