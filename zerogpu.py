"""The app's model calls on a Hugging Face ZeroGPU Space; anywhere else they stay as they are.

A ZeroGPU Space (the ``spaces`` package installed, and ``SPACES_ZERO_GPU`` set by Hugging Face, as ``spaces``
reads it) lends a GPU per call: ``spaces.GPU`` runs the decorated function in a forked worker that holds the
GPU for at most the seconds the call asks, its arguments and its result pickled across. ``gpu`` wraps each
app function that runs the model for that:

* in the app's process, the call's ``Demand`` (its model, and the row-tokens of its rows, Full's included)
  gives the seconds to ask (``seconds``), and the model is loaded here, on the CPU, so the worker's fork
  inherits it and loading is never GPU time;
* in the worker, the model moves onto the GPU (``api.move_model``), the function runs, and a RequestError
  comes back as a value, raised again in the app's process with its one line (``spaces`` would put a generic
  message in its place).

Where ``spaces`` is not installed the functions are left as they are; where it is installed off ZeroGPU (a CPU
Space, a laptop) ``spaces.GPU`` hands each one back unchanged. ``spaces`` must come before anything initialises
CUDA, and in the app's process nothing does: the model stays on the CPU there.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

from backend import api
from backend.api import RequestError
from backend.limits import rows_cost
from backend.policies import Policy, SpecError, parse_spec
from backend.traces.store import TraceStore

DEVICE = "cuda"
# An anonymous visitor's ZeroGPU quota is 2 minutes a day, and a call asking more than the visitor has left is
# refused: no call here asks more.
MAX_S = 120
START_S = 15  # every call: the worker's fork, CUDA's start and the model's move onto the GPU
# Assumed, not yet measured on ZeroGPU's GPU: twice the 2-vCPU Space's ~250 row-tokens a second at 8k tokens
# (docs/performance.md). Too high a guess aborts long calls; too low only asks for more time than they use.
ROW_TOKENS_PER_S = 500
TASK_S = 30  # a task sample also makes lm-eval's samples inside the call


@dataclass(frozen=True)
class Demand:
    """What one model call needs: its model, the row-tokens of its rows (Full's included: the limits let Full
    run free, but the GPU computes it), and seconds of work that belong to no row."""

    model: str
    row_tokens: int
    extra_s: int = 0


def seconds(demand: Demand) -> int:
    """The GPU seconds a call asks for, or RequestError (one line) when it would need more than ``MAX_S``."""
    needed = math.ceil(START_S + demand.extra_s + demand.row_tokens / ROW_TOKENS_PER_S)
    if needed > MAX_S:
        raise RequestError(f"This request would take about {needed} s of GPU time, more than the {MAX_S} s one "
                           "GPU call may take here; use fewer policies or a shorter text.")
    return needed


def _policies(specs, context: int) -> list[Policy]:
    try:
        return [parse_spec(spec, context) for spec in specs]
    except SpecError as err:
        raise RequestError(f"Policy: {err}") from None


def run_demand(request: api.RunRequest, progress=None) -> Demand:
    cost = api.cost(request)
    return Demand(request.model, cost.row_tokens + cost.length)


def sweep_demand(request: api.SweepRequest, progress=None) -> Demand:
    """Every job's row and Full's row in each batch of ``max_rows``, at the text's length."""
    text = api.cost(api.RunRequest(prompt=request.prompt, specs=["full"], mode=request.mode,
                                   max_new_tokens=request.max_new_tokens, model=request.model, chat=request.chat,
                                   max_tokens=request.max_tokens))
    policies = _policies([spec for _, _, spec in request.jobs], text.tokens)
    batches = -(-len(request.jobs) // max(1, request.max_rows))
    return Demand(request.model, rows_cost(policies, text.length) + batches * text.length)


def needle_demand(jobs: list[dict], progress=None) -> Demand:
    """Every cell's rows and Full's, at the cell's length."""
    work = 0
    for job in jobs:
        length = job["payload"]["cell"]["length"]
        work += rows_cost(_policies(job["payload"]["specs"], length), length) + length
    return Demand(jobs[0]["model"], work)


def sample_demand(request: api.SampleRequest, progress=None) -> Demand:
    policies = _policies(request.specs, request.length)
    return Demand(request.model, rows_cost(policies, request.length) + request.length, TASK_S)


@dataclass(frozen=True)
class _Ran:
    value: object


@dataclass(frozen=True)
class _Refused:
    message: str


def _spaces():
    """The ``spaces`` package, or None where it is not installed."""
    try:
        import spaces
    except ImportError:
        return None
    return spaces


def active() -> bool:
    """Whether this process serves a ZeroGPU Space."""
    spaces = _spaces()
    return spaces is not None and bool(spaces.config.Config.zero_gpu)


def gpu(demand: Callable[..., Demand]):
    """Decorator of an app function that runs the model: on a ZeroGPU Space it runs through ``spaces.GPU`` for
    the seconds ``demand`` (called with the same arguments) asks; see the module docstring."""

    def decorate(fn):
        spaces = _spaces()
        if spaces is None:
            return fn
        if not active():
            return spaces.GPU(fn)  # spaces hands it back as it is

        @spaces.GPU(duration=lambda asked, model, *args, **kwargs: asked)
        def on_gpu(asked: int, model: str, *args, **kwargs):
            api.move_model(model, DEVICE)
            try:
                return _Ran(fn(*args, **kwargs))
            except RequestError as err:
                return _Refused(str(err))

        @functools.wraps(fn)
        def call(*args, **kwargs):
            need = demand(*args, **kwargs)
            asked = seconds(need)
            api.get_model(need.model)
            outcome = on_gpu(asked, need.model, *args, **kwargs)
            if isinstance(outcome, _Refused):
                raise RequestError(outcome.message)
            return outcome.value

        return call

    return decorate


_OPENED_IN = os.getpid()
_worker_stores: dict[int, TraceStore] = {}


def own_store(store: TraceStore) -> TraceStore:
    """``store`` in the process that opened it; in a GPU worker forked from it, the same directory opened again
    (a store must not cross a fork: ``backend/traces/store.py``)."""
    pid = os.getpid()
    if pid == _OPENED_IN:
        return store
    if pid not in _worker_stores:
        _worker_stores[pid] = TraceStore(store.directory, store.size_limit)
    return _worker_stores[pid]
