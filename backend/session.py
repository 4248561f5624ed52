"""What the web app asks of the backend, without any UI code: validate a request, run it through the
store, remember it as a shareable run id, reopen it later, and export it.

A run id is the store key of a small JSON manifest (prompt, settings, and the store keys of its
traces); a deep link ``?run=<id>`` reopens the run from the store without touching the model.
"""
from __future__ import annotations

import io
import json
import re
import threading
import zipfile
from dataclasses import dataclass, field

from .models import ALLOWED_MODELS, DEFAULT_MODEL, LoadedModel, ModelError, load_model
from .policies import SpecError, parse_spec
from .runner import Progress, default_record_layers
from .service import RunResult, run_policies
from .store import TraceStore, run_key
from .trace import Trace, file_stem

MAX_PROMPT_TOKENS = 1024
MAX_NEW_TOKENS = 256
MAX_POLICIES = 8
RUN_ID = re.compile(r"^[0-9a-f]{64}$")

_models: dict[str, LoadedModel] = {}
_model_lock = threading.Lock()


class RequestError(ValueError):
    """The request cannot run; the message is shown to the user as is."""


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


def validate(request: RunRequest, max_policies: int = MAX_POLICIES) -> list:
    """Parsed policies, or RequestError with a message for the user."""
    if not request.prompt or not request.prompt.strip():
        raise RequestError("Type a prompt (or pick an example) first.")
    if request.mode not in ("generate", "prompt"):
        raise RequestError(f"Unknown mode {request.mode!r}.")
    if not 1 <= int(request.max_new_tokens) <= MAX_NEW_TOKENS:
        raise RequestError(f"Max new tokens must be between 1 and {MAX_NEW_TOKENS}.")
    specs = [s.strip() for s in request.specs if s and s.strip()]
    if not specs:
        raise RequestError("Pick at least one policy.")
    if len(specs) > max_policies:
        raise RequestError(f"At most {max_policies} policies side by side, got {len(specs)}.")
    try:
        return [parse_spec(s) for s in specs]
    except SpecError as err:
        raise RequestError(f"Policy: {err}") from None


def execute(request: RunRequest, store: TraceStore, progress: Progress | None = None,
            max_policies: int = MAX_POLICIES) -> Run:
    """Run (or replay) a request through the store and remember it under a run id."""
    policies = validate(request, max_policies)
    request.specs = [s.strip() for s in request.specs if s and s.strip()]
    lm = get_model(request.model)
    ids = lm.encode(request.prompt, chat=request.chat and request.mode == "generate")
    if len(ids) > MAX_PROMPT_TOKENS:
        raise RequestError(f"The prompt is {len(ids)} tokens long; the limit here is {MAX_PROMPT_TOKENS}.")
    if len(ids) < 2:
        raise RequestError("The prompt needs at least 2 tokens.")
    record = default_record_layers(lm)
    result = run_policies(lm, request.specs, policies, ids, request.mode, int(request.max_new_tokens), store,
                          record_layers=record, progress=progress)
    manifest = {"request": request.__dict__, "keys": result.keys, "full_key": result.full_key}
    run_id = run_key(kind="run-manifest", **{k: v for k, v in manifest.items()})
    store.put(run_id, json.dumps(manifest).encode())
    return Run(run_id=run_id, request=request, result=result)


def reopen(run_id: str, store: TraceStore) -> Run:
    """A stored run by id, or RequestError (bad id, unknown or evicted run)."""
    if not RUN_ID.match(run_id or ""):
        raise RequestError("That link does not name a run.")
    data = store.get(run_id)
    if data is None:
        raise RequestError("That run is no longer stored here; run it again.")
    manifest = json.loads(data.decode())
    traces = []
    for key, spec in zip(manifest["keys"], manifest["request"]["specs"]):
        blob = store.get(key)
        if blob is None:
            raise RequestError("Part of that run is no longer stored here; run it again.")
        trace = Trace.from_bytes(blob)
        trace.meta = {**trace.meta, "spec": spec}
        traces.append(trace)
    full_blob = store.get(manifest["full_key"])
    if full_blob is None:
        raise RequestError("Part of that run is no longer stored here; run it again.")
    result = RunResult(traces=traces, full=Trace.from_bytes(full_blob), replayed=[True] * len(traces),
                       keys=manifest["keys"], full_key=manifest["full_key"])
    return Run(run_id=run_id, request=RunRequest(**manifest["request"]), result=result)


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
