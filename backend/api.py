"""The front door: the app, the CLI, the sweep, the needle grid, the app's needle tab and its task samples all
come in here, with one validation and the limits of whoever asks (``limits.Limits``: the Space's by default,
the machine's from the command line). Without any UI code it checks a request, runs it through the store
(``runs.replay_or_compute``), gives it a share link, reopens it later, and exports it.

Checks come cheapest first: ``check_run`` / ``check_sweep`` / ``check_needle`` / ``check_needle_cell`` /
``check_sample`` look only at the request (sizes, Unicode, policy specs, model name) and never load the model, so
a bad request costs microseconds and can be refused outside the model slot; ``run`` / ``sweep`` / ``needle_grid``
then load the model, tokenize, check the token counts and the cost (tokens x rows, ``limits.Limits``), and run.

A share link ``?run=<id>`` names a small JSON manifest (the request and the store keys of its traces).
The id is random, so nobody can test whether someone else ran a guessed prompt; the traces themselves
stay content-addressed, so the same request replays from the store whoever makes it.
"""
from __future__ import annotations

import dataclasses
import gc
import io
import json
import re
import secrets
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from .engine.allocator import give_back
from .engine.models import (DEFAULT_MODEL, DEVICES, DTYPES, LoadedModel, ModelError, check_fits, default_record_layers,
                            loaded_model, shared_model)
from .experiments.grid import GridError, run_grid
from .experiments.needle import NEW_TOKENS, needle_frame, needle_jobs
from .experiments.sweep import MAX_ROWS, SweepResult, sweep as sweep_budgets
from .limits import UNBOUNDED_TOKENS, Limits, RowPrice, counted, longest_fitting, most_fitting, row_cost, rows_cost
from .policies import Policy, SpecError, parse_spec
from .analysis.evidence import Evidence
from .policies import Full
from .runs import Run, link_key, put_link, replay_or_compute, trace_key
from .traces.store import TraceStore, load_trace
from .traces.trace import Trace, file_stem

if TYPE_CHECKING:
    from .engine.runner import Progress

LIMITS = Limits.from_env()  # the Space's: what a request meets unless its caller passes others
MODES = ("generate", "prompt")
RUN_ID = re.compile(r"[0-9a-f]{32}")

# A visitor's task sample (the app's Tasks tab): RULER's offline tasks at 1k tokens, a few policies, the first samples.
TASK_LENGTHS = (1024,)
TASK_SAMPLES = 10  # sample numbers 0..9 of each task
TASK_POLICIES = 3  # besides Full

# A visitor's needle grid (the app's Long context tab): Full and a few policies, short haystacks, one seed.
NEEDLE_POLICIES = 3  # policies besides Full
NEEDLE_LENGTHS = (512, 1024)  # tokens, prompt and answer
NEEDLE_DEPTHS = (0.0, 0.5, 1.0)
NEEDLE_SEED = 0


class RequestError(ValueError):
    """The request cannot run; the message (one line) is shown to the user as is."""


def get_model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32") -> LoadedModel:
    """The loaded model (once per process), or RequestError (the request's checks said who may name it)."""
    try:
        return shared_model(name, device, dtype)
    except ModelError as err:
        raise RequestError(str(err)) from None
    except OSError as err:  # a hub model without internet, for example
        raise RequestError(f"could not load {name}: {str(err).splitlines()[0]}") from None


def move_model(name: str = DEFAULT_MODEL, device: str = "cuda") -> LoadedModel:
    """This process's ``name`` (``get_model``'s, loaded on the CPU) moved onto ``device`` in place: where a ZeroGPU
    Space moves its model, inside the call that holds the GPU. Its fingerprint then names the device, as
    ``load_model``'s does, so the traces computed there are stored apart from the CPU's."""
    lm = get_model(name)
    if device != "cpu" and lm.model.device.type != device:
        lm.model.to(device)
        lm.fingerprint += f"@{device}"
    return lm


@dataclass
class RunRequest:
    prompt: str
    specs: list[str]
    mode: str = "generate"
    max_new_tokens: int = 48
    model: str = DEFAULT_MODEL
    chat: bool = True
    max_tokens: int | None = None  # keep the first max_tokens tokens (<= the limit); None refuses longer texts
    device: str = "cpu"  # cpu, cuda or auto (the command line's choice; the Space runs on its own)
    dtype: str = "float32"
    # Strings in the text that hold the answer (a task sample's references, or what a user types): the views mark
    # their tokens (analysis/evidence.py), before ``evidence_end`` tokens when set (the context's end).
    evidence: list[str] = field(default_factory=list)
    evidence_end: int | None = None


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
    device: str = "cpu"
    dtype: str = "float32"
    record: bool = False  # record the app's layers too, so a run at one of the budgets replays
    max_rows: int = MAX_ROWS


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
        most = "" if limits.prompt_tokens >= UNBOUNDED_TOKENS else f" and at most {limits.prompt_tokens:,}"
        raise RequestError(f"Max tokens must be an integer, 2 or more{most}.")
    if len(request.prompt) > limits.text_chars and cap is None:
        raise RequestError(f"The prompt is {len(request.prompt):,} characters long; the limit here is "
                           f"{limits.text_chars:,} characters and {limits.prompt_tokens_in_words()}.")
    _check_unicode(request.prompt, "The prompt")
    if request.mode not in MODES:
        raise RequestError(f"Unknown mode {str(request.mode)[:40]!r}; choose generate or prompt.")
    new = request.max_new_tokens
    if isinstance(new, bool) or not isinstance(new, (int, float)) or new != new or int(new) != new \
            or not 1 <= new <= limits.new_tokens:
        raise RequestError(f"Max new tokens must be a whole number from 1 to {limits.new_tokens}.")
    request.max_new_tokens = int(new)
    _check_model_name(request.model, limits)
    if request.device not in DEVICES or request.dtype not in DTYPES:
        raise RequestError(f"Device must be one of {', '.join(DEVICES)} and dtype one of {', '.join(DTYPES)}.")
    if limits.models is not None and (request.device, request.dtype) != ("cpu", "float32"):
        raise RequestError("This server runs its models on its CPU in float32.")


def _check_model_name(model, limits: Limits) -> None:
    if not isinstance(model, str) or not model.strip():
        raise RequestError("Name a model.")
    if limits.models is not None and model not in limits.models:
        raise RequestError(f"unknown model {str(model)[:80]!r}; offered here: {', '.join(limits.models)}")


def _parse(specs: list[str]) -> list[Policy]:
    policies = []
    for spec in specs:
        _check_unicode(spec, "A policy spec")
        try:
            policies.append(parse_spec(spec))
        except SpecError as err:
            raise RequestError(f"Policy: {err}") from None
    return policies


def _at_context(specs: list[str], context: int) -> list[Policy]:
    """The policies of checked specs once the text is read: a ratio becomes its budget on the ``context`` tokens
    the policies compress (the prompt in generate mode, the text in prompt mode)."""
    return [parse_spec(spec, context) for spec in specs]


def _check_specs(specs, limits: Limits) -> tuple[list[str], list[Policy]]:
    """The stripped specs and their policies: a list of strings, at most ``limits.policies``, each once."""
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, str) for s in specs):
        raise RequestError("Policies must be a list of specs such as tova:budget=64.")
    specs = [s.strip() for s in specs if s.strip()]
    if not specs:
        raise RequestError("Pick at least one policy.")
    most = f"At most {limits.policies} policies side by side besides Full"
    if len(specs) > 2 * limits.policies + 1:  # bounds the parsing; the count after it is exact
        raise RequestError(f"{most}, got {len(specs)}.")
    policies = _parse(specs)
    if len(counted(policies)) > limits.policies:  # an explicit Full is the reference row, computed anyway
        raise RequestError(f"{most}, got {len(counted(policies))}.")
    seen: dict[Policy, str] = {}
    for spec, policy in zip(specs, policies):
        if policy in seen:  # equal parameters: one trace, so one column of the summary
            raise RequestError(f"Policy {spec!r} is the same as {seen[policy]!r}; list each policy once.")
        seen[policy] = spec
    return specs, policies


MAX_EVIDENCE = 8  # strings a run may name as its evidence
MAX_EVIDENCE_CHARS = 200


def check_run(request: RunRequest, limits: Limits = LIMITS) -> list[Policy]:
    """The parsed policies of a run request, or RequestError; cheap (never loads the model)."""
    _check_text(request, limits)
    request.specs, policies = _check_specs(request.specs, limits)
    request.evidence = check_evidence(request.evidence)
    return policies


def check_evidence(evidence) -> list[str]:
    """The evidence strings a request names (blank ones dropped), or RequestError."""
    if isinstance(evidence, str):
        evidence = [evidence]
    if not isinstance(evidence, (list, tuple)) or not all(isinstance(e, str) for e in evidence):
        raise RequestError("Evidence is a list of strings from the text.")
    evidence = [e.strip() for e in evidence if e.strip()]
    if len(evidence) > MAX_EVIDENCE or any(len(e) > MAX_EVIDENCE_CHARS for e in evidence):
        raise RequestError(f"Name at most {MAX_EVIDENCE} evidence strings of at most {MAX_EVIDENCE_CHARS} "
                           f"characters each.")
    return evidence



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
    _check_policies_fit(lm, policies)
    ids = _encode(lm, request, limits)
    _check_prompt_tokens(len(ids), limits)
    return ids


def _check_policies_fit(lm: LoadedModel, policies: list[Policy]) -> None:
    for policy in policies:
        try:
            policy.check_model(head_dim=lm.head_dim, n_layers=lm.n_layers)
            check_fits(lm, policy)
        except ValueError as err:
            raise RequestError(f"Policy: {err}") from None


def _encode(lm: LoadedModel, request, limits: Limits) -> list[int]:
    """The request's token ids as the model reads them: a chat turn in generate mode where the model chats,
    cut to ``max_tokens`` when the request asks."""
    # Truncating: the first text_chars characters hold far more than max_tokens tokens of real text.
    text = request.prompt if request.max_tokens is None else request.prompt[:limits.text_chars]
    ids = lm.encode(text, chat=request.chat and request.mode == "generate")
    if request.max_tokens is not None:
        ids = ids[:request.max_tokens]
    return list(ids)


def _check_prompt_tokens(n: int, limits: Limits) -> None:
    if n > limits.prompt_tokens:
        raise RequestError(f"The prompt is {n} tokens long; the limit here is {limits.prompt_tokens}.")
    if n < 2:
        raise RequestError("The text needs at least 2 tokens.")


def _length(n_prompt: int, request) -> int:
    """Tokens every row reads: the prompt and, in generate mode, the new tokens."""
    return n_prompt + (request.max_new_tokens if request.mode == "generate" else 0)


def _check_context(lm: LoadedModel, length: int) -> None:
    if length > lm.context:
        raise RequestError(f"The text and the new tokens come to {length} tokens; the model reads at most "
                           f"{lm.context}.")


def _check_cost(lm: LoadedModel, policies: list[Policy], ids: list[int], request, limits: Limits, what: str,
                sweep: bool = False) -> None:
    length = _length(len(ids), request)
    _check_context(lm, length)
    _check_row_tokens(policies, length, _row_token_limit(lm, limits, length, sweep), what,
                      "use fewer policies, fewer new tokens or a shorter text")


def _row_token_limit(lm: LoadedModel | None, limits: Limits, length: int, sweep: bool = False) -> int:
    """The row-tokens a request may use on ``lm`` (its price, from its shapes, bounds the command line's)."""
    return limits.row_token_limit(None if lm is None else RowPrice.of(lm.model.config), length, sweep)


def _check_row_tokens(policies: Sequence[Policy], length: int, limit: int, what: str, advice: str) -> None:
    """What ``policies`` cost at ``length`` tokens (``limits.rows_cost``: Full is free) against ``limit``."""
    rows = counted(policies)
    cost = rows_cost(policies, length)
    if cost > limit:
        quadratic = [p for p in rows if p.reads_every_key]
        why = (f" ({', '.join(dict.fromkeys(p.name for p in quadratic))} read every key for every query: at "
               f"{length} tokens each counts {row_cost(quadratic[0], length) // length}x)"
               if quadratic and row_cost(quadratic[0], length) > length else "")
        raise RequestError(f"{what}: {len(rows)} policies x {length} tokens come to {cost:,} row-tokens, more "
                           f"than the {limit:,} row-tokens one request may use here{why}; {advice}.")


# --- What a run costs, before it runs ---------------------------------------------------------------------

CHARS_PER_TOKEN = 4  # until the model is loaded; English prose reads at ~5 a token, code and other scripts at fewer


@dataclass(frozen=True)
class Cost:
    """What a run request costs against the row-token limit (``cost``), and ``line`` saying it."""

    tokens: int  # the prompt as the model reads it (a chat turn in generate mode where the model chats)
    length: int  # tokens every row reads: the prompt and, in generate mode, the new tokens
    rows: int  # policies that count (Full is free)
    row_tokens: int
    limit: int
    fits: bool
    exact: bool  # False: the tokens are estimated from the characters, the model not being loaded yet
    line: str  # plain text (it may quote a spec): escape it before it becomes HTML


def cost(request: RunRequest, limits: Limits = LIMITS, tokens: int | None = None) -> Cost:
    """What ``run`` would charge ``request`` (the same rule: ``limits.rows_cost`` over the same tokens), or
    RequestError for what the run's checks refuse before they count. Never loads a model: with the model
    loaded the count is exact (a 190 KB prompt tokenizes in a fraction of a second), else estimated, unless
    ``tokens`` gives the prompt's count from a run of this very request (a stored one)."""
    policies = check_run(request, limits)
    lm = loaded_model(request.model, request.device, request.dtype)
    if lm is None and tokens is not None:
        n = tokens
        _check_prompt_tokens(n, limits)
    elif lm is None:
        n = max(2, -(-len(request.prompt) // CHARS_PER_TOKEN))
        n = n if request.max_tokens is None else min(n, request.max_tokens)
        if n > limits.prompt_tokens:
            raise RequestError(f"The prompt is about {n:,} tokens long; the limit here is {limits.prompt_tokens:,}.")
    else:
        _check_policies_fit(lm, policies)
        n = len(_encode(lm, request, limits))
        _check_prompt_tokens(n, limits)
    length = _length(n, request)
    if lm is not None:
        _check_context(lm, length)
    spent, limit = rows_cost(policies, length), _row_token_limit(lm, limits, length)
    exact = lm is not None or tokens is not None
    line = _cost_line(policies, request, n, length, spent, limit, limits, lm, exact)
    return Cost(tokens=n, length=length, rows=len(counted(policies)), row_tokens=spent, limit=limit,
                fits=spent <= limit, exact=exact, line=line)


def _cost_line(policies: list[Policy], request: RunRequest, n: int, length: int, spent: int, limit: int,
               limits: Limits, lm: LoadedModel | None, exact: bool) -> str:
    """E.g. "Cost: 3 policies x 8,058 tokens = 24,174 of 32,768 row-tokens.", and what fits when it does not."""
    rows = counted(policies)
    about = "" if exact else "about "
    estimated = "" if exact else " (estimated from the characters until the model is loaded)"
    if not rows:
        return f"Cost: Full alone is free (0 of {limit:,} row-tokens)."
    generate = request.mode == "generate"
    count = f"{len(rows)} {'policy' if len(rows) == 1 else 'policies'}"
    read = f"{about}{length:,} tokens"
    if generate:
        turn = " as a chat turn" if lm is not None and request.chat and lm.chats else ""
        read += f" ({about}{n:,} prompt{turn} + {request.max_new_tokens:,} new)"
    heavier = {p.name: row_cost(p, length) / length for p in rows if row_cost(p, length) != length}
    why = "; ".join(f"{name} counts {factor:.3g}x" for name, factor in heavier.items())
    notes = (f" ({why})" if why else "") + estimated + ("; Full is free" if len(rows) < len(policies) else "")
    line = f"Cost: {count} x {read} = {about}{spent:,}"
    if spent <= limit:
        return f"{line} of {limit:,} row-tokens{notes}."
    fits = []
    most = most_fitting(policies, length, limit)
    if most:
        fits.append(f"{most} of these {len(rows)} policies")
    new = request.max_new_tokens if generate else 0
    longest = min(longest_fitting(policies, limit), lm.context if lm is not None else length) - new
    if longest >= 2:
        fits.append(f"{'a prompt' if generate else 'a text'} of up to {about}{min(longest, limits.prompt_tokens):,} "
                    f"tokens")
    advice = f"What fits: {', or '.join(fits)}." if fits else "Pick fewer new tokens or fewer policies."
    return f"{line} row-tokens, over the {limit:,} allowed here{notes}. {advice}"


def release_memory() -> None:
    """Give freed memory back to the system between runs (glibc keeps freed arenas otherwise)."""
    gc.collect()
    give_back()


def run(request: RunRequest, store: TraceStore | None, progress: Progress | None = None,
        limits: Limits = LIMITS, chunk: int | None = None) -> Run:
    """Run (or replay) a request through the store and give it a share link; ``Run.stored`` says whether the
    store holds the run and its link (False without a store, or one that cannot write)."""
    policies = check_run(request, limits)
    lm = get_model(request.model, request.device, request.dtype)
    ids = _tokens(lm, request, policies, limits)
    policies = _at_context(request.specs, len(ids))
    _check_cost(lm, policies, ids, request, limits, "This run")
    extra = {} if chunk is None else {"chunk": chunk}
    try:
        result = replay_or_compute(lm, request.specs, policies, ids, request.mode, request.max_new_tokens, store,
                                   record_layers=default_record_layers(lm), progress=progress, **extra)
    finally:
        release_memory()
    run_id = secrets.token_hex(16)
    stored = False
    if store is not None and result.stored:  # a link to traces the store does not hold would be dead
        stored = put_link(store, run_id, request.__dict__, result.keys, result.full_key)
    return dataclasses.replace(result, run_id=run_id, request=request, stored=stored)


def trace_keys(request: RunRequest, limits: Limits = LIMITS) -> tuple[list[str], str]:
    """The store keys ``run`` would put the request's traces under (one per spec, then Full's): the model loads to
    tokenize, nothing runs. What tells a shipped run (``shipped_runs``) from a stale one."""
    policies = check_run(request, limits)
    lm = get_model(request.model, request.device, request.dtype)
    ids = _tokens(lm, request, policies, limits)
    record = default_record_layers(lm)
    keys = [trace_key(lm, ids, p, request.mode, request.max_new_tokens, record)
            for p in _at_context(request.specs, len(ids))]
    return keys, trace_key(lm, ids, Full(), request.mode, request.max_new_tokens, record)


def sweep(request: SweepRequest, store: TraceStore | None, progress: Progress | None = None,
          limits: Limits = LIMITS) -> SweepResult:
    """The sweep's table (``experiments.sweep``), every trace through the store, and whether the store kept them."""
    policies = check_sweep(request, limits)
    lm = get_model(request.model, request.device, request.dtype)
    ids = _tokens(lm, request, policies, limits)
    _check_cost(lm, policies, ids, request, limits, "This sweep", sweep=True)
    record = default_record_layers(lm) if request.record else ()
    try:
        return sweep_budgets(lm, ids, request.jobs, progress, request.max_rows, store, request.mode, request.max_new_tokens,
                     record)
    finally:
        release_memory()


# --- Share links and export -----------------------------------------------------------------------------

def reopen(run_id: str, store: TraceStore) -> Run:
    """A stored run by its share id, or RequestError (bad id, unknown or evicted run)."""
    if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
        raise RequestError("That link does not name a run.")
    data = store.get(link_key(run_id))
    if data is None:
        raise RequestError("That run is no longer stored here; run it again.")
    try:
        manifest = json.loads(data.decode("utf-8"))
        request = RunRequest(**manifest["request"])
        keys, full_key = list(manifest["keys"]), manifest["full_key"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise RequestError("That link does not name a run.") from None
    traces = [_stored_trace(store, key).with_spec(spec) for key, spec in zip(keys, request.specs)]
    full = _stored_trace(store, full_key)
    return Run(traces=traces, full=full, keys=keys, full_key=full_key, replayed=[True] * len(traces),
               stored=True, run_id=run_id, request=request, tokens=full.meta["n_prompt"])


def _stored_trace(store: TraceStore, key: str) -> Trace:
    trace = load_trace(store, key)
    if trace is None:
        raise RequestError("Part of that run is no longer stored here; run it again.")
    return trace


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


def register_lm_eval_model() -> None:
    """KV Lens's lm-evaluation-harness model, ``kvlens``, in lm-eval's registry: now if lm-eval is imported, else
    as it is, without importing it (``experiments/lm_eval_registration.py``)."""
    from .experiments.lm_eval_registration import register_on_lm_eval_import

    register_on_lm_eval_import()


# --- One task sample -------------------------------------------------------------------------------------

@dataclass
class SampleRequest:
    """Sample ``sample`` of lm-eval's ``task`` at ``length`` tokens under ``specs`` (budgets or ratios), in
    ``setting`` (``agnostic``: the policies decide over the context before the question; ``aware``)."""

    task: str
    sample: int
    specs: list[str]
    setting: str = "agnostic"
    length: int = TASK_LENGTHS[0]
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "float32"


@dataclass
class SampleResult:
    run: Run  # the sample's run (a share link, the usual views), Full's row included
    table: pd.DataFrame  # per policy, Full first: spec, budget, score, answer
    references: list[str]
    question: str
    evidence: Evidence | None = None  # where the references sit in the context
    why: pd.DataFrame | None = None  # per policy, Full first: evidence held, attention on it, verdict


def check_sample(request: SampleRequest, limits: Limits = LIMITS) -> list[Policy]:
    """The request's policies, or RequestError; cheap (never loads the model or the task). The Space's limits
    allow RULER's offline tasks at ``TASK_LENGTHS``, samples 0..``TASK_SAMPLES`` - 1 and ``TASK_POLICIES``
    policies; the command line's, any lm-eval task, length and sample."""
    from .experiments.task_runs import SETTINGS
    from .experiments.tasks import OFFLINE

    space = limits.models is not None
    if not isinstance(request.task, str) or (space and request.task not in OFFLINE):
        raise RequestError(f"Pick one of the tasks offered here: {', '.join(OFFLINE)}.")
    if request.setting not in SETTINGS:
        raise RequestError(f"The setting is one of {', '.join(SETTINGS)}.")
    sample, length = request.sample, request.length
    if not isinstance(sample, int) or isinstance(sample, bool) or not 0 <= sample < (TASK_SAMPLES if space else 10 ** 6):
        raise RequestError(f"Samples here are numbered 0 to {TASK_SAMPLES - 1}.")
    if not isinstance(length, int) or isinstance(length, bool) or (space and length not in TASK_LENGTHS) \
            or not 64 <= length <= limits.prompt_tokens:
        raise RequestError(f"Task lengths here are {' or '.join(map(str, TASK_LENGTHS))} tokens; the command line "
                           "runs longer ones.")
    specs, policies = _check_specs(["full", *[s for s in request.specs if isinstance(s, str)]]
                                   if isinstance(request.specs, (list, tuple)) else request.specs, limits)
    if space and len(counted(policies)) > TASK_POLICIES:
        raise RequestError(f"Pick at most {TASK_POLICIES} policies besides Full.")
    _check_model_name(request.model, limits)
    _check_row_tokens(policies, length, _row_token_limit(None, limits, length), f"A {length}-token sample",
                      "pick fewer policies")
    return policies


# What a task sample takes, in plain forwards of its prompt: Full's row (its prefill and the answer's decoding), then
# each counted row. A row pays for the prompt it computes itself: the row-tokens the Run line prices it at
# (``limits.row_cost``: a KVzip row twice, a row that reads every key more past SELECTION_UNIT) less the prompt it
# takes from Full's prefill (``Policy.first_departure``: all of it for a compression row, up to its budget for an
# eviction or selection row); and every row pays its decoding, scoring and recording. Fitted to
# ``benchmarks/task_cost.py`` on the default model at 1k tokens (docs/tasks.md, "What a sample is expected to take").
# A row that rambles to the token limit keeps the batch decoding, which no count of rows foresees.
SAMPLE_FULL_FORWARDS = 1.0
SAMPLE_PREFILL_FORWARDS = 1.0  # a row's own prefill, per prompt length it computes
SAMPLE_ROW_FORWARDS = 1.3  # a row's decoding, its policy's own work, scoring and recording
_FORWARD_SECONDS: dict[tuple, float] = {}  # (model fingerprint, device, tokens) -> a plain forward's seconds here


def own_prefill(policy: Policy, length: int) -> float:
    """The prompt a row of ``policy`` computes itself, in prompts of ``length`` tokens: what the Run line prices it at
    less what it takes from Full's prefill (up to its first departure)."""
    return (row_cost(policy, length) - min(max(policy.first_departure(length), 0), length)) / length


def sample_forwards(specs: Sequence[str], length: int) -> float:
    """A task sample's expected time in plain forwards of its ``length``-token prompt, under ``specs`` (a ratio
    resolved on the prompt's tokens: the context it counts is a little shorter)."""
    rows = counted([parse_spec(spec, context=length) for spec in specs])
    return (SAMPLE_FULL_FORWARDS + SAMPLE_PREFILL_FORWARDS * sum(own_prefill(p, length) for p in rows)
            + SAMPLE_ROW_FORWARDS * len(rows))


def time_plain_forward(lm: LoadedModel, length: int) -> float:
    """Seconds one plain forward of ``length`` tokens takes on ``lm`` here (after a short one that warms it up),
    remembered for ``forward_seconds``. It runs the model: call it where a job would, never from a preview."""
    import torch

    key = (lm.fingerprint, str(lm.model.device), length)
    if key not in _FORWARD_SECONDS:
        with torch.inference_mode():
            lm.model(torch.zeros((1, min(length, 16)), dtype=torch.long, device=lm.model.device))
            started = time.perf_counter()
            lm.model(torch.zeros((1, length), dtype=torch.long, device=lm.model.device))
            if lm.model.device.type == "cuda":
                torch.cuda.synchronize()
            _FORWARD_SECONDS[key] = time.perf_counter() - started
    return _FORWARD_SECONDS[key]


def forward_seconds(lm: LoadedModel | None, length: int) -> float | None:
    """A plain forward's seconds at ``length`` tokens as ``time_plain_forward`` timed it (at the nearest length
    timed, scaled by the tokens), or None where none was timed on ``lm``."""
    if lm is None:
        return None
    timed = {n: s for (fingerprint, device, n), s in _FORWARD_SECONDS.items()
             if fingerprint == lm.fingerprint and device == str(lm.model.device)}
    if not timed:
        return None
    nearest = min(timed, key=lambda n: abs(n - length))
    return timed[nearest] * length / nearest


def duration_text(seconds: float) -> str:
    """E.g. "40 s", "3 min", "1 h 10 min": as a person reads an estimate."""
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60} min"


def expected_line(samples: int, specs: Sequence[str], length: int, seconds: float | None,
                  where: str = "here") -> str:
    """The time ``samples`` task samples under ``specs`` (Full among them or not) are expected to take: in plain
    forwards of their ``length``-token prompts, and in seconds where a plain forward took ``seconds``."""
    rows = counted([parse_spec(spec) for spec in specs])
    forwards = sample_forwards(specs, length)
    each = f"{'each ' if samples > 1 else ''}about {forwards:.3g} plain forwards of {length:,} tokens"
    what = (f"{samples:,} {'sample' if samples == 1 else 'samples'}, Full and {len(rows)} "
            f"{'policy' if len(rows) == 1 else 'policies'}: {each}")
    if seconds is None:
        return f"Expected: {what}."
    return (f"Expected: about {duration_text(samples * forwards * seconds)} {where} ({what}; a plain forward "
            f"takes {seconds:.2g} s).")


def sample_cost_line(request: SampleRequest, limits: Limits = LIMITS) -> str:
    """The line before a task sample runs: what it is expected to take on this machine (in seconds once a plain
    forward of the model was timed here, else in plain forwards), or RequestError as ``check_sample``. Never
    loads or runs the model."""
    check_sample(request, limits)
    lm = loaded_model(request.model, request.device, request.dtype)
    return expected_line(1, ["full", *request.specs], request.length, forward_seconds(lm, request.length))


def task_sample(request: SampleRequest, store: TraceStore | None, limits: Limits = LIMITS) -> SampleResult:
    """Answer one task sample under every policy (one batched run with Full, recorded as an app run is, through
    the store, with a share link) and score each answer with lm-eval's metric."""
    from .experiments.evidence_rows import explain
    from .experiments.task_runs import answer, counted_tokens, encode, lm_eval_request, question
    from .experiments.tasks import TaskUnavailable, load_task, score, tokenizer_source

    check_sample(request, limits)
    lm = get_model(request.model, request.device, request.dtype)
    specs = ["full", *[s.strip() for s in request.specs if s.strip() and parse_spec(s).name != "full"]]
    try:
        task = load_task(request.task, request.length, tokenizer_source(lm))
        if request.sample >= len(task.test_docs()):
            raise RequestError(f"{request.task} has {len(task.test_docs())} samples at {request.length} tokens.")
        asked = lm_eval_request(task, request.sample, lm, chat=True)
        _check_context(lm, len(lm.encode(asked.context)) + asked.max_new_tokens)
        answers = answer(lm, asked, specs, request.setting, store, limits, default_record_layers(lm))
    except TaskUnavailable as err:
        raise RequestError(str(err)) from None
    except ValueError as err:  # the prompt holds no question to tell the context by, a cost over the limit
        raise RequestError(str(err).splitlines()[0]) from None
    finally:
        release_memory()
    full, rows = answers[0], answers[1:]
    ran = Run(traces=[a.trace.with_spec(a.spec) for a in rows], full=full.trace, keys=[a.key for a in rows],
              full_key=full.key, replayed=[False] * len(rows), stored=all(a.stored for a in answers),
              tokens=full.trace.meta["n_prompt"])
    run_id = secrets.token_hex(16)
    references = [str(r) for r in asked.doc["outputs"]]
    context_end = counted_tokens(lm, asked, encode(lm, asked.context), request.setting)
    prompt = RunRequest(prompt=asked.context, specs=specs[1:], mode="generate", max_new_tokens=asked.max_new_tokens,
                        model=request.model, chat=False, device=request.device, dtype=request.dtype,
                        evidence=references, evidence_end=context_end)
    stored = store is not None and ran.stored and put_link(store, run_id, prompt.__dict__, ran.keys, ran.full_key)
    table = pd.DataFrame([{"spec": a.spec, "budget": getattr(a.policy, "budget", None),
                           "score": float(score(task, asked.doc, a.text)), "answer": a.text} for a in answers])
    table["budget"] = table["budget"].astype("Int64")
    # Why each answer was right or wrong: the references followed through every trace (the store's, not re-run).
    evidence, why = explain(lm.tokenizer, [(a.spec, a.trace, s) for a, s in zip(rows, table["score"][1:])],
                            full.trace, references, context_end)
    why = pd.DataFrame(why)
    why.insert(1, "score", table["score"].to_numpy())
    return SampleResult(run=dataclasses.replace(ran, run_id=run_id, request=prompt, stored=stored), table=table,
                        references=references, question=question(asked.doc), evidence=evidence, why=why)


# --- A visitor's needle grid -------------------------------------------------------------------------

def longest_text(model: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32",
                 limits: Limits = LIMITS) -> int:
    """The most tokens a text (prompt and answer) may have on ``model`` here: its context, read from its config
    (no weights load), or the limit, whichever is less; RequestError where the model cannot be found."""
    from .engine.models import model_context

    try:
        return min(model_context(model, device, dtype), limits.prompt_tokens)
    except ModelError as err:
        raise RequestError(str(err)) from None


def needle_request(spec: str, length, depth, model: str = DEFAULT_MODEL, limits: Limits = LIMITS) -> RunRequest:
    """One needle-grid cell as a run of its own (``spec`` beside Full, the app's layers recorded) whose evidence is
    the needle's number, or RequestError: what a click on a grid's cell opens."""
    from .experiments.needle import Cell, haystack

    check_needle_cell(spec, length, depth, model, limits)
    lm = get_model(model)
    cell = Cell(int(length), float(depth))
    text, _ = haystack(lm, cell)
    request = RunRequest(prompt=text, specs=[spec], mode="generate", max_new_tokens=NEW_TOKENS, model=model,
                         chat=True, evidence=[cell.number()])
    check_run(request, limits)
    return request


def check_needle_cell(spec: str, length, depth, model: str = DEFAULT_MODEL, limits: Limits = LIMITS) -> None:
    """RequestError unless one cell of a visitor's needle grid may run as a run of its own; cheap (never loads the
    model), so the app checks a click on a cell before the job queues."""
    check_needle([spec], [length], model, limits)
    if depth not in NEEDLE_DEPTHS:
        raise RequestError(f"Depths here are {', '.join(map(str, NEEDLE_DEPTHS))}.")


def check_needle(specs: Sequence[str], lengths: Sequence, model: str, limits: Limits = LIMITS) -> list[dict]:
    """The jobs of a visitor's needle grid (Full first, then ``specs``, at ``lengths`` x ``NEEDLE_DEPTHS``, one
    seed), or RequestError; cheap (never loads the model), so the app checks it before the job queues.
    Every cell must fit the limits of one run."""
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, str) for s in specs):
        raise RequestError("Policies must be a list of specs such as tova:budget=64.")
    specs = [s.strip() for s in specs if s.strip() and s.strip() != "full"]
    if not 1 <= len(specs) <= NEEDLE_POLICIES:
        raise RequestError(f"Pick 1 to {NEEDLE_POLICIES} policies besides Full (Full is always drawn), "
                           f"got {len(specs)}.")
    if not isinstance(lengths, (list, tuple)) or not lengths:
        raise RequestError(f"Pick at least one length: {' or '.join(map(str, NEEDLE_LENGTHS))} tokens.")
    chosen = []
    for length in lengths:
        try:
            value = int(length)
        except (TypeError, ValueError):
            value = None
        if value not in NEEDLE_LENGTHS or str(length).strip() != str(value):
            raise RequestError(f"Lengths here are {' or '.join(map(str, NEEDLE_LENGTHS))} tokens; "
                               f"the command line runs longer grids.")
        if value > limits.prompt_tokens:
            raise RequestError(f"A {value}-token haystack is longer than the {limits.prompt_tokens} tokens "
                               f"allowed here.")
        if value not in chosen:
            chosen.append(value)
    specs, policies = _check_specs(["full", *specs], limits)
    _check_model_name(model, limits)
    for length in chosen:
        _check_row_tokens(policies, length, _row_token_limit(None, limits, length), f"A {length}-token cell",
                          "pick fewer policies or a shorter length")
    return needle_jobs(model, specs, chosen, NEEDLE_DEPTHS, (NEEDLE_SEED,), NEW_TOKENS)


def needle_grid(jobs: list[dict], progress: Callable[[float, str], None] | None = None,
                no_cache: bool = False) -> pd.DataFrame:
    """Run ``check_needle``'s jobs serially in this process (``run_grid``, no address, no checkpoint); the
    grid's table. A failing cell is a RequestError naming it."""
    if progress:
        progress(0.0, f"needle cells: 0 of {len(jobs)} done")

    def step(done: int, total: int) -> None:
        if progress:
            progress(done / total, f"needle cells: {done} of {total} done")

    try:
        results = run_grid(jobs, address=None, no_cache=no_cache, progress=step)
    except GridError as err:
        raise RequestError(str(err).splitlines()[0]) from None
    finally:
        release_memory()
    return needle_frame(results)
