"""KV Lens in a notebook: ``import kvlens`` where KV Lens is installed (``pip install -e .``; the tutorial is
docs/examples/tutorial.ipynb).

The public face of the front door (``backend/api.py``), with the command line's limits (``Limits.for_machine``):
``run`` checks and runs a text under policies and returns a ``NotebookRun``, whose views are the app's own
(``viz.panels``: plotly figures and HTML, drawn inline by Jupyter) and whose traces are numpy arrays; ``sweep``
and ``needle`` run small grids. A policy class defined in the notebook and ``@register``-ed runs like a built-in
one. A request the checks refuse raises ``KVLensError`` (a ``RequestError``) with the command line's one-line
message, and Jupyter shows that line, ``error: ...``, without a traceback. Importing it registers KV Lens's
lm-evaluation-harness model, so ``lm_eval.simple_evaluate(model="kvlens", ...)`` finds it, without importing
lm-eval (``api.register_lm_eval_model``).

Like ``app.py`` and ``backend/cli.py`` this is a front end: it computes nothing itself (tests/test_layout.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from backend import api, texts
from backend.api import RequestError
from backend.limits import Limits
from backend.policies import (CacheView, CompressionPolicy, EvictionPolicy, PluginError, Policy,
                              SelectionPolicy, SpecError, load_plugins, parse_spec, register)
from backend.traces.store import TraceStore
from backend.traces.trace import Trace
from viz import panels
from viz.needle import needle_figure, needle_table_html

__all__ = ("CacheView", "CompressionPolicy", "EvictionPolicy", "KVLensError", "NotebookRun", "Policy",
           "SelectionPolicy", "example", "needle", "register", "reopen", "run", "sweep")

ROOT = Path(__file__).resolve().parent
DEFAULT_MODEL = api.DEFAULT_MODEL
LIMITS = Limits.for_machine()  # the command line's: the notebook's user owns the machine, as its user does


class KVLensError(RequestError):
    """A request the checks refuse; the message is the command line's one line, and Jupyter shows it as the
    command line prints it, without a traceback."""

    def _render_traceback_(self) -> list[str]:  # IPython's hook for an exception that draws itself
        return [f"error: {self}"]


def _refused(err: Exception) -> KVLensError:
    return KVLensError(str(err).splitlines()[0] if str(err) else type(err).__name__)


api.register_lm_eval_model()

try:  # KVLENS_PLUGINS: the operator's policies join the registry, as the command line's do
    load_plugins()
except PluginError as err:
    raise _refused(err) from None


_store: TraceStore | None = None


def _opened_store() -> TraceStore:
    """The disk store the command line uses, opened once (an unusable one only means "not cached")."""
    global _store
    if _store is None:
        try:
            _store = TraceStore()
        except ValueError as err:  # a malformed KVLENS_STORE_MB
            raise _refused(err) from None
    return _store


def _cached(specs: Sequence[str], cache: bool) -> bool:
    """``cache``, unless a policy is the session's own: a class defined in the notebook may change from one run to
    the next under the same name and version, which the store's keys could not tell apart."""
    for spec in specs:
        try:
            if type(parse_spec(spec)).__module__ == "__main__":
                return False
        except SpecError:
            pass  # the front door refuses it in its own words
    return cache


def _store_for(specs: Sequence[str], cache: bool) -> TraceStore | None:
    return _opened_store() if _cached(specs, cache) else None


def _sized(specs: Sequence[str] | str, budget: int | None, ratio: float | None) -> list[str]:
    """The specs as a list, each policy but Full given ``budget`` or ``ratio`` where it names neither."""
    if isinstance(specs, str):
        specs = [specs]
    if not isinstance(specs, (list, tuple)) or not all(isinstance(s, str) for s in specs):
        raise KVLensError("Policies must be a list of specs such as tova:budget=64.")
    if budget is not None and ratio is not None:
        raise KVLensError("Give a budget or a ratio, not both.")
    if budget is None and ratio is None:
        return list(specs)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise KVLensError(f"The budget must be an integer >= 1, got {budget!r}.")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1):
        raise KVLensError(f"The ratio must be at least 0 and below 1 (the share of the context removed), got {ratio!r}.")
    size = f"budget={budget}" if ratio is None else f"ratio={float(ratio):g}"
    sized = []
    for spec in specs:
        name, _, params = spec.strip().partition(":")
        keys = {item.partition("=")[0].strip() for item in params.split(",") if item.strip()}
        if name.strip().lower() == "full" or keys & {"budget", "ratio"}:
            sized.append(spec)
        else:
            sized.append(f"{name.strip()}:{size}" + (f",{params.strip()}" if params.strip() else ""))
    return sized


def example(name: str = "needle") -> str:
    """The text of one of the app's examples (``assets/examples``: ``needle``, ``story``, ...)."""
    found = texts.examples(ROOT / "assets" / "examples")
    label = name.replace("_", " ")
    if label not in found:
        shown = ", ".join(label.replace(" ", "_") for label in found)
        raise KVLensError(f"no example {name!r}; the examples are {shown}")
    return found[label]


class Html(str):
    """An HTML string that Jupyter draws (IPython's ``_repr_html_`` convention) and that still reads as a str."""

    def _repr_html_(self) -> str:
        return str(self)


def run(text: str, policies: Sequence[str] | str, *, budget: int | None = None, ratio: float | None = None,
        mode: str = "prompt", max_new_tokens: int = 64, model: str = DEFAULT_MODEL, chat: bool = True,
        max_tokens: int | None = None, device: str = "cpu", dtype: str = "float32", cache: bool = True,
        evidence: Sequence[str] | str = (), progress: Callable[[float, str], None] | None = None) -> "NotebookRun":
    """Run ``text`` under ``policies`` (specs such as ``tova:budget=64`` or ``snapkv:ratio=0.5``; ``budget`` or
    ``ratio`` sizes those that name neither), Full always computed beside them as the reference.

    ``mode``: ``prompt`` scores the text teacher-forced; ``generate`` lets each policy write ``max_new_tokens``
    tokens after the prompt (a chat turn where the model chats and ``chat`` is on). ``max_tokens`` keeps the first
    tokens of a longer text. ``cache``: replay and keep traces in the command line's store. ``evidence``: strings
    of the text that hold the answer, marked in the views as the app's evidence box marks them."""
    specs = _sized(policies, budget, ratio)
    request = api.RunRequest(prompt=text, specs=specs, mode=mode, max_new_tokens=max_new_tokens, model=model,
                             chat=chat, max_tokens=max_tokens, device=device, dtype=dtype, evidence=evidence)
    try:
        api.check_run(request, LIMITS)  # the store is chosen by the checked specs
        return NotebookRun(api.run(request, _store_for(request.specs, cache), progress, LIMITS))
    except RequestError as err:
        raise _refused(err) from None


def reopen(run_id: str) -> "NotebookRun":
    """A run kept in the store, by its id (``NotebookRun.run_id``; the app's share links use the same ids)."""
    try:
        return NotebookRun(api.reopen(run_id, _opened_store()))
    except RequestError as err:
        raise _refused(err) from None


class NotebookRun:
    """One run: its views (figures and HTML, as the app draws them) and its traces as numpy arrays.

    A ``spec`` names a trace: a policy's spec as the run was asked (or its index among them), or ``"full"``.
    Layer and head selectors are an index or ``"all"``; ``step`` is a query's position (default: the last)."""

    def __init__(self, ran: api.Run):
        self.run = ran

    # --- What ran ---------------------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def specs(self) -> list[str]:
        return [t.spec for t in self.run.traces]

    def trace(self, spec: str | int) -> Trace:
        """The ``Trace`` of one policy (docs/trace-format.md), or Full's."""
        if isinstance(spec, int) and not isinstance(spec, bool) and 0 <= spec < len(self.run.traces):
            return self.run.traces[spec]
        if spec == "full":
            return self.run.full
        for trace in self.run.traces:
            if trace.spec == spec:
                return trace
        raise KVLensError(f"{str(spec)[:80]!r} is not in this run; its policies are {', '.join(self.specs)} "
                          f"(and full)")

    def summary(self) -> pd.DataFrame:
        """Per policy: perplexity, KL and top-1 agreement with Full, retention, and in generate mode its answer."""
        return panels.summary_table(self.run)

    def _repr_html_(self) -> str:
        n = len(self.specs)
        title = f"<p><b>KV Lens run</b> {self.run_id[:12]}: {n} {'policy' if n == 1 else 'policies'} and Full, " \
                f"{len(self.run.full.tokens)} tokens ({self.run.full.meta['mode']} mode)</p>"
        return title + self.summary().to_html(index=False, escape=True)

    # --- Traces as arrays -------------------------------------------------------------------------------

    def arrays(self, spec: str | int) -> dict[str, np.ndarray]:
        """Every array the trace stores, by its name in docs/trace-format.md (``evicted_at``, the spans of a
        selection policy, ``logprobs``, ``kl_to_full``, the recorded attention, ``stat_*``, ...)."""
        return self.trace(spec).arrays()

    def reads(self, spec: str | int, layer: int, steps: slice = slice(None),
              positions: slice = slice(None)) -> np.ndarray:
        """bool [KV heads, steps, positions]: ``[h, i, j]`` is True when query ``i`` read token ``j`` in ``layer``
        (the whole text by default: ask for a window on long texts)."""
        trace = self.trace(spec)
        self._check_layer(trace, layer)
        return trace.reads(int(layer), steps, positions)

    def attention(self, spec: str | int, layer: int, head: int, steps: slice = slice(None),
                  positions: slice = slice(None)) -> np.ndarray:
        """float32 [steps, positions]: the attention of each query over what it read in a recorded layer (the
        mean of the KV head's query heads; past the stored top entries of a row, 0)."""
        trace = self.trace(spec)
        recorded = trace.meta["recorded_layers"]
        if trace.attention is None or layer not in recorded:
            raise KVLensError(f"layer {layer!r} was not recorded; the recorded layers are "
                              f"{', '.join(map(str, recorded)) or 'none'}")
        if not isinstance(head, int) or not 0 <= head < trace.meta["n_kv_heads"]:
            raise KVLensError(f"head must be 0 to {trace.meta['n_kv_heads'] - 1}, got {head!r}")
        return trace.attention.rows(recorded.index(layer), head, steps, positions)

    def scores(self, spec: str | int) -> pd.DataFrame:
        """What scores the policy, per scored position: the next token, its log-probability under the policy, the
        KL divergence from Full's next-token distribution, and whether the policy's top choice is Full's. The
        rows metrics count start at ``counted`` (Full's continuation, in generate mode, whose prompt positions
        before it are not scored: NaN)."""
        trace, full = self.trace(spec), self.run.full
        ids = trace.scored_ids[1:]
        start = trace.meta["score_start"]
        # Every policy is scored on Full's tokens (the text, or the prompt and Full's continuation).
        names = full.meta["token_texts"][1:len(ids) + 1]
        return pd.DataFrame({"position": np.arange(1, len(ids) + 1), "token_id": ids, "token": names,
                             "logprob": trace.logprobs, "kl_to_full": trace.kl_to_full,
                             "top1_is_full": trace.top1_ids == full.top1_ids,
                             "counted": np.arange(len(ids)) >= start})

    @staticmethod
    def _check_layer(trace: Trace, layer) -> None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) \
                or not 0 <= layer < trace.meta["n_layers"]:
            raise KVLensError(f"layer must be 0 to {trace.meta['n_layers'] - 1}, got {layer!r}")

    # --- Views ------------------------------------------------------------------------------------------

    def _selectors(self, layer, head) -> tuple[str, str]:
        meta = self.run.full.meta
        layer, head = str(layer), str(head)
        if layer not in panels.layer_choices(meta["n_layers"]):
            raise KVLensError(f"layer must be 'all' or 0 to {meta['n_layers'] - 1}, got {layer!r}")
        if head not in panels.head_choices(meta["n_kv_heads"]):
            raise KVLensError(f"head must be 'all' or 0 to {meta['n_kv_heads'] - 1}, got {head!r}")
        return layer, head

    def _step(self, step) -> int:
        try:
            return panels.clamp_step(self.run, step)
        except (TypeError, ValueError):
            raise KVLensError(f"step must be a whole number, got {step!r}") from None

    def masks(self, layer="all", head="all", zoom: tuple[int, int, int] | None = None, step=None) -> go.Figure:
        """What each query read, one panel per policy (binned on long texts); ``zoom=(first step, first position,
        size)`` shows a window at one token per cell (size 64, 128 or 256); ``step`` marks a row."""
        layer, head = self._selectors(layer, head)
        window = None if zoom is None else panels.zoom_window(self.run, True, *zoom)
        return panels.heatmaps(self.run, layer, head, window, None if step is None else self._step(step))

    def kept_tokens(self, step=None, layer="all", head="all") -> Html:
        """Each policy's text at ``step``, the tokens its query read highlighted."""
        layer, head = self._selectors(layer, head)
        return Html(panels.kept_tokens(self.run, self._step(step), layer, head))

    def step_row(self, step=None, layer="all", head="all") -> go.Figure:
        """The masks' row at ``step``: what its query reads under each policy."""
        layer, head = self._selectors(layer, head)
        return panels.step_row(self.run, self._step(step), layer, head)

    def curves(self, layer="all", head="all", alpha: float = 0.3, step=None) -> tuple[go.Figure, go.Figure]:
        """Under Full attention: A2S and A2SF at ``step``, and over the steps for the tokens A2SF ranks highest."""
        layer, head = self._selectors(layer, head)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise KVLensError(f"alpha must be from 0 to 1, got {alpha!r}")
        return panels.score_curves(self.run, layer, head, float(alpha), self._step(step))

    def cache_reach(self, step=None) -> tuple[go.Figure, go.Figure]:
        """What the query at ``step`` reads in every layer and KV head, and the share read by distance back."""
        return panels.cache_reach(self.run, self._step(step))

    def retention(self) -> tuple[go.Figure, go.Figure, go.Figure]:
        """Token 0's retention and the non-recent share per layer, and the mean lifetime by position."""
        return panels.retention_figures(self.run)

    def pos_lifetimes(self) -> pd.DataFrame:
        """Mean steps kept per part of speech and eviction policy (NLTK's tagger, shipped)."""
        return panels.pos_lifetime_table(self.run)

    def divergence(self) -> tuple[go.Figure, Html]:
        """KL divergence and top-1 agreement with Full per step, and the continuations side by side."""
        figure, notes = panels.divergence(self.run)
        return figure, Html(notes)

    def tsne(self, policy: str, layer="all", head="all") -> go.Figure:
        """Keys before and after RoPE of one policy (by name, e.g. ``tova``), embedded in 2-D (seconds)."""
        layer, head = self._selectors(layer, head)
        try:
            return panels.tsne(self.run, policy, layer, head)
        except ValueError as err:
            raise _refused(err) from None

    def html(self, layer="all", head="all", step=None, alpha: float = 0.3) -> str:
        """Every figure in one offline HTML page (what the app's export holds as figures.html)."""
        layer, head = self._selectors(layer, head)
        return panels.figures_html(self.run, layer, head, self._step(step), float(alpha))

    def export(self) -> bytes:
        """Every trace (npz + json) and the run's manifest, as the app's zip."""
        return api.export_zip(self.run)


def _numbers(values, kind, what: str, low: float, high: float, below_high: bool = False) -> list:
    """``values`` as a list of ``kind`` within [low, high] (or [low, high)), or KVLensError naming ``what``."""
    if isinstance(values, (int, float)) and not isinstance(values, bool):
        values = [values]
    if not isinstance(values, (list, tuple)) or not values:
        raise KVLensError(f"{what} must be a list of numbers")
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (kind is int and value != int(value)):
            raise KVLensError(f"{what} must be {'whole ' if kind is int else ''}numbers, got {value!r}")
        if not low <= value <= high or (below_high and value == high):
            raise KVLensError(f"{what} must be {kind(low)} to {'below ' if below_high else ''}{kind(high)}, "
                              f"got {value!r}")
        out.append(kind(value))
    return out


class Sweep:
    """A sweep's table (a row per policy and budget, Full's last) and its figure."""

    def __init__(self, table: pd.DataFrame):
        self.table = table

    def figure(self) -> go.Figure:
        """Perplexity against budget, a line per policy, Full as the topline."""
        return panels.sweep_figure(self.table)

    def _repr_html_(self) -> str:
        return self.table.to_html(index=False)


def sweep(text: str, policies: Sequence[str] | str, *, budgets: Sequence[int] | None = None,
          ratios: Sequence[float] | None = None, mode: str = "prompt", max_new_tokens: int = 48,
          model: str = DEFAULT_MODEL, chat: bool = False, max_tokens: int | None = None, device: str = "cpu",
          dtype: str = "float32", cache: bool = True, progress: Callable[[float, str], None] | None = None) -> Sweep:
    """Score ``text`` under every policy (specs without a budget or ratio) at every one of ``budgets`` (or
    compression ``ratios``), as ``python -m backend sweep`` does."""
    names = _sized(policies, None, None)
    if (budgets is None) == (ratios is None):
        raise KVLensError("Give budgets or ratios (one of them).")
    sizes = _numbers(budgets, int, "budgets", 1, LIMITS.prompt_tokens) if ratios is None else \
        _numbers(ratios, float, "ratios", 0, 1, below_high=True)
    key = "budget" if ratios is None else "ratio"
    jobs = []
    for name in names:
        base, _, params = name.strip().partition(":")
        if base.strip().lower() == "full":
            continue
        if {item.partition("=")[0].strip() for item in params.split(",") if item.strip()} & {"budget", "ratio"}:
            raise KVLensError(f"{name}: leave budget and ratio out of the policy; the sweep sets them")
        for size in sizes:
            jobs.append((name.strip(), size if ratios is None else None,
                         f"{base.strip()}:{key}={size:g}" + (f",{params.strip()}" if params.strip() else "")))
    request = api.SweepRequest(prompt=text, jobs=jobs, mode=mode, max_new_tokens=max_new_tokens, model=model,
                               chat=chat, max_tokens=max_tokens, device=device, dtype=dtype)
    try:
        if not jobs:
            raise RequestError("A sweep needs at least one policy other than full, and one budget.")
        api.check_sweep(request, LIMITS)
        return Sweep(api.sweep(request, _store_for([spec for _, _, spec in jobs], cache), progress, LIMITS).table)
    except RequestError as err:
        raise _refused(err) from None


class NeedleGrid:
    """A needle grid's table (a row per cell and policy: the answer and whether it holds the number) and figure."""

    def __init__(self, table: pd.DataFrame):
        self.table = table

    def figure(self, title: str = "Needle in a haystack") -> go.Figure:
        """Found or not, per context length and needle depth, a panel per policy."""
        return needle_figure(self.table, title)

    def _repr_html_(self) -> str:
        return needle_table_html(self.table)


def needle(policies: Sequence[str] | str, *, lengths: Sequence[int] = (1024,),
           depths: Sequence[float] = (0.0, 0.5, 1.0), seeds: Sequence[int] = (0,), budget: int | None = None,
           ratio: float | None = None, new_tokens: int = 16, model: str = DEFAULT_MODEL, cache: bool = True,
           progress: Callable[[float, str], None] | None = None) -> NeedleGrid:
    """Hide a number in haystacks of ``lengths`` tokens (prompt and answer) made from the shipped texts, at each
    of ``depths`` (0 = first, 1 = last), ask for it, and check each policy's greedy answer, as ``python -m
    backend needle`` does; Full is always one of the policies."""
    specs = _sized(policies, budget, ratio)
    specs = specs if any(s.strip().lower() == "full" for s in specs) else ["full", *specs]
    new_tokens = _numbers(new_tokens, int, "new_tokens", 1, LIMITS.new_tokens)[0]
    lengths = _numbers(lengths, int, "lengths", -math.inf, math.inf)  # whole numbers, bounded below
    if min(lengths) < 32 + new_tokens:
        raise KVLensError(f"lengths must be at least {32 + new_tokens} tokens (prompt and answer), got {min(lengths)}")
    try:  # a haystack past the model's context could not be read (its config says, before any weight loads)
        longest = api.longest_text(model, limits=LIMITS)
    except RequestError as err:
        raise _refused(err) from None
    if max(lengths) > longest:
        raise KVLensError(f"lengths must be at most {longest} tokens on {model}, got {max(lengths)}")
    depths = _numbers(depths, float, "depths", 0, 1)
    seeds = _numbers(seeds, int, "seeds", 0, 2 ** 31 - 1)
    try:
        jobs = api.needle_jobs(model, specs, lengths, depths, seeds, new_tokens)
    except SpecError as err:
        raise KVLensError(f"Policy: {err}") from None
    try:
        return NeedleGrid(api.needle_grid(jobs, progress, no_cache=not _cached(specs, cache)))
    except RequestError as err:
        raise _refused(err) from None
