"""The front door: the app, the CLI and the sweep all come in here, with one set of limits and one
validation. Without any UI code it checks a request, runs it through the store, gives it a share link,
reopens it later, and exports it.

Checks come cheapest first: ``check_run`` / ``check_sweep`` look only at the request (sizes, Unicode,
policy specs, model name) and never load the model, so a bad request costs microseconds and can be
refused outside the model slot; ``execute`` / ``execute_sweep`` then load the model, tokenize, check
the token counts and the cost (tokens x rows, ``limits.Limits``), and run.

A share link ``?run=<id>`` names a small JSON manifest (the request and the store keys of its traces).
The id is random, so nobody can test whether someone else ran a guessed prompt; the traces themselves
stay content-addressed, so the same request replays from the store whoever makes it.
"""
from __future__ import annotations

import gc
import io
import json
import re
import secrets
import threading
import zipfile
from dataclasses import dataclass, field

import pandas as pd

from .allocator import give_back
from .limits import Limits, row_cost
from .models import ALLOWED_MODELS, DEFAULT_MODEL, LoadedModel, ModelError, load_model
from .policies import Policy, SpecError, parse_spec
from .runner import Progress, default_record_layers
from .service import RunResult, run_policies
from .store import TraceStore, run_key
from .sweep import MAX_ROWS, sweep
from .trace import Trace, file_stem

LIMITS = Limits.from_env()
MODES = ("generate", "prompt")
RUN_ID = re.compile(r"[0-9a-f]{32}")

_models: dict[str, LoadedModel] = {}
_model_lock = threading.Lock()


class RequestError(ValueError):
    """The request cannot run; the message (one line) is shown to the user as is."""


def get_model(name: str = DEFAULT_MODEL) -> LoadedModel:
    """Each allow-listed model is loaded once per process (the load itself checks the allow-list)."""
    with _model_lock:
        if name not in _models:
            try:
                _models[name] = load_model(name)
            except ModelError as err:
                raise RequestError(str(err)) from None
            except OSError as err:  # a hub model without internet, for example
                raise RequestError(f"could not load {name}: {str(err).splitlines()[0]}") from None
        return _models[name]


@dataclass
class RunRequest:
    prompt: str
    specs: list[str]
    mode: str = "generate"
    max_new_tokens: int = 48
    model: str = DEFAULT_MODEL
    chat: bool = True
    max_tokens: int | None = None  # keep the first max_tokens tokens (<= the limit); None refuses longer texts


@dataclass
class SweepRequest:
    """Every (label, budget, spec) job on one text; Full is the topline."""

    prompt: str
    jobs: list[tuple[str, int, str]]
    mode: str = "prompt"
    max_new_tokens: int = 48
    model: str = DEFAULT_MODEL
    chat: bool = False
    max_tokens: int | None = None
    record: bool = False  # record the app's layers too, so a run at one of the budgets replays
    max_rows: int = MAX_ROWS


@dataclass
class Run:
    run_id: str
    request: RunRequest
    result: RunResult
    extra: dict = field(default_factory=dict)

    @property
    def traces(self) -> list[Trace]:
        return self.result.traces

    @property
    def full(self) -> Trace:
        return self.result.full


# --- Cheap checks: the request alone, no model ------------------------------------------------------------

def _check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # a lone surrogate, e.g. "\ud800" in an API call's JSON
        raise RequestError(f"{what} contains a character that is not valid Unicode at position {err.start}.") from None


def _check_text(request, limits: Limits) -> None:
    if not isinstance(request.prompt, str) or not request.prompt.strip():
        raise RequestError("Type a prompt (or pick an example) first.")
    cap = request.max_tokens
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or not 2 <= cap <= limits.prompt_tokens):
        raise RequestError(f"Max tokens must be an integer from 2 to {limits.prompt_tokens}.")
    if len(request.prompt) > limits.text_chars and cap is None:
        raise RequestError(f"The prompt is {len(request.prompt):,} characters long; the limit here is "
                           f"{limits.text_chars:,} characters ({limits.prompt_tokens} tokens).")
    _check_unicode(request.prompt, "The prompt")
    if request.mode not in MODES:
        raise RequestError(f"Unknown mode {str(request.mode)[:40]!r}; choose generate or prompt.")
    new = request.max_new_tokens
    if isinstance(new, bool) or not isinstance(new, (int, float)) or new != new or int(new) != new \
            or not 1 <= new <= limits.new_tokens:
        raise RequestError(f"Max new tokens must be a whole number from 1 to {limits.new_tokens}.")
    request.max_new_tokens = int(new)
    if request.model not in ALLOWED_MODELS:
        raise RequestError(f"unknown model {str(request.model)[:80]!r}; allowed: {', '.join(ALLOWED_MODELS)}")


def _parse(specs: list[str]) -> list[Policy]:
    policies = []
    for spec in specs:
        _check_unicode(spec, "A policy spec")
        try:
            policies.append(parse_spec(spec))
        except SpecError as err:
            raise RequestError(f"Policy: {err}") from None
    return policies


def check_run(request: RunRequest, limits: Limits = LIMITS) -> list[Policy]:
    """The parsed policies of a run request, or RequestError; cheap (never loads the model)."""
    _check_text(request, limits)
    if not isinstance(request.specs, list) or not all(isinstance(s, str) for s in request.specs):
        raise RequestError("Policies must be a list of specs such as tova:budget=64.")
    request.specs = [s.strip() for s in request.specs if s.strip()]
    if not request.specs:
        raise RequestError("Pick at least one policy.")
    if len(request.specs) > limits.policies:
        raise RequestError(f"At most {limits.policies} policies side by side, got {len(request.specs)}.")
    policies = _parse(request.specs)
    seen: dict[Policy, str] = {}
    for spec, policy in zip(request.specs, policies):
        if policy in seen:  # equal parameters: one trace, so one column of the summary
            raise RequestError(f"Policy {spec!r} is the same as {seen[policy]!r}; list each policy once.")
        seen[policy] = spec
    return policies


def check_sweep(request: SweepRequest, limits: Limits = LIMITS) -> list[Policy]:
    """The parsed policies of a sweep's jobs, or RequestError; cheap (never loads the model)."""
    _check_text(request, limits)
    if not request.jobs:
        raise RequestError("A sweep needs at least one policy other than full, and one budget.")
    if not isinstance(request.max_rows, int) or request.max_rows < 1:
        raise RequestError("Rows per forward must be an integer >= 1.")
    return _parse([spec for _, _, spec in request.jobs])


# --- Model-side checks and running ----------------------------------------------------------------------

def _tokens(lm: LoadedModel, request, policies: list[Policy], limits: Limits) -> list[int]:
    """Token ids of the request's text, after the checks that need the model."""
    for policy in policies:
        try:
            policy.check_model(head_dim=lm.head_dim, n_layers=lm.n_layers)
        except ValueError as err:
            raise RequestError(f"Policy: {err}") from None
    # Truncating: the first text_chars characters hold far more than max_tokens tokens of real text.
    text = request.prompt if request.max_tokens is None else request.prompt[:limits.text_chars]
    ids = lm.encode(text, chat=request.chat and request.mode == "generate")
    if request.max_tokens is not None:
        ids = ids[:request.max_tokens]
    if len(ids) > limits.prompt_tokens:
        raise RequestError(f"The prompt is {len(ids)} tokens long; the limit here is {limits.prompt_tokens}.")
    if len(ids) < 2:
        raise RequestError("The text needs at least 2 tokens.")
    return list(ids)


def _check_cost(lm: LoadedModel, policies: list[Policy], ids: list[int], request, limit: int, what: str) -> None:
    length = len(ids) + (request.max_new_tokens if request.mode == "generate" else 0)
    if length > lm.context:
        raise RequestError(f"The text and the new tokens come to {length} tokens; the model reads at most "
                           f"{lm.context}.")
    cost = sum(row_cost(p, length) for p in policies)
    if cost > limit:
        quadratic = [p for p in policies if p.reads_every_key]
        why = (f" ({', '.join(dict.fromkeys(p.name for p in quadratic))} read every key for every query: at "
               f"{length} tokens each counts {row_cost(quadratic[0], length) // length}x)"
               if quadratic and row_cost(quadratic[0], length) > length else "")
        raise RequestError(f"{what}: {len(policies)} policies x {length} tokens come to {cost:,} row-tokens, more "
                           f"than the {limit:,} row-tokens one request may use here{why}; use fewer policies, fewer "
                           f"new tokens or a shorter text.")


def release_memory() -> None:
    """Give freed memory back to the system between runs (glibc keeps freed arenas otherwise)."""
    gc.collect()
    give_back()


def execute(request: RunRequest, store: TraceStore | None, progress: Progress | None = None,
            limits: Limits = LIMITS, chunk: int | None = None) -> Run:
    """Run (or replay) a request through the store and give it a share link."""
    policies = check_run(request, limits)
    lm = get_model(request.model)
    ids = _tokens(lm, request, policies, limits)
    _check_cost(lm, policies, ids, request, limits.row_tokens, "This run")
    extra = {} if chunk is None else {"chunk": chunk}
    try:
        result = run_policies(lm, request.specs, policies, ids, request.mode, request.max_new_tokens, store,
                              record_layers=default_record_layers(lm), progress=progress, **extra)
    finally:
        release_memory()
    run_id = secrets.token_hex(16)
    if store is not None:
        manifest = {"request": request.__dict__, "keys": result.keys, "full_key": result.full_key}
        store.put(_manifest_key(run_id), json.dumps(manifest).encode())
    return Run(run_id=run_id, request=request, result=result, extra={"tokens": len(ids)})


def execute_sweep(request: SweepRequest, store: TraceStore | None, progress: Progress | None = None,
                  limits: Limits = LIMITS) -> pd.DataFrame:
    """The sweep's table (sweep.sweep), every trace through the store."""
    policies = check_sweep(request, limits)
    lm = get_model(request.model)
    ids = _tokens(lm, request, policies, limits)
    _check_cost(lm, policies, ids, request, limits.sweep_row_tokens, "This sweep")
    record = default_record_layers(lm) if request.record else ()
    try:
        return sweep(lm, ids, request.jobs, progress, request.max_rows, store, request.mode, request.max_new_tokens,
                     record)
    finally:
        release_memory()


# --- Share links and export -----------------------------------------------------------------------------

def _manifest_key(run_id: str) -> str:
    # Keyed apart from every trace key, so a trace key used as a link is simply not a run.
    return run_key(kind="share-link", run_id=run_id)


def reopen(run_id: str, store: TraceStore) -> Run:
    """A stored run by its share id, or RequestError (bad id, unknown or evicted run)."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise RequestError("That link does not name a run.")
    data = store.get(_manifest_key(run_id))
    if data is None:
        raise RequestError("That run is no longer stored here; run it again.")
    try:
        manifest = json.loads(data.decode("utf-8"))
        request = RunRequest(**manifest["request"])
        keys, full_key = list(manifest["keys"]), manifest["full_key"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise RequestError("That link does not name a run.") from None
    traces = []
    for key, spec in zip(keys, request.specs):
        trace = _stored_trace(store, key)
        trace.meta = {**trace.meta, "spec": spec}
        traces.append(trace)
    result = RunResult(traces=traces, full=_stored_trace(store, full_key), replayed=[True] * len(traces),
                       keys=keys, full_key=full_key)
    return Run(run_id=run_id, request=request, result=result)


def _stored_trace(store: TraceStore, key: str) -> Trace:
    blob = store.get(key) if isinstance(key, str) else None
    try:
        if blob is not None:
            return Trace.from_bytes(blob)
    except (ValueError, KeyError, OSError):
        pass
    raise RequestError("Part of that run is no longer stored here; run it again.")


def export_zip(run: Run, extra_files: dict[str, str | bytes] | None = None) -> bytes:
    """Every trace of the run (npz + json), a manifest and any ``extra_files`` (e.g. figures), as one zip."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name, content in (extra_files or {}).items():
            z.writestr(name, content)
        z.writestr("run.json", json.dumps({"run_id": run.run_id, "request": run.request.__dict__}, indent=1))
        for index, trace in enumerate([*run.traces, run.full]):
            stem = file_stem(index, trace.spec)
            z.writestr(f"{stem}.npz", trace.npz_bytes())
            z.writestr(f"{stem}.json", json.dumps(trace.meta, indent=1))
    return buf.getvalue()
