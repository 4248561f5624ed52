"""KV Lens web app: Gradio wiring only. Runs go through backend.api; figures come from viz.panels, which
holds no state: the app keeps the runs it shows and their slow views' results (``RECENT_RUNS``).

A public Space must survive its visitors: requests are checked before they queue for the model
(``validator=``, outside the model slot, on every event that runs it: ``model_job``), one visitor holds at most
one model job (backend.guard), uploads are closed and request bodies bounded, every message shown is escaped,
exports are deleted after download, and the trace store is a cache that may be missing without anything failing.
"""
from __future__ import annotations

import atexit
import dataclasses
import html
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from functools import cached_property, lru_cache
from pathlib import Path
from types import MappingProxyType

from backend.environment import SettingError, check_environment, runs_per_address

try:  # every KVLENS_* setting, and the operator's plugins, before anything reads them (and before
    # Gradio's import, 3 s, so a malformed one stops the start at once)
    check_environment()
except SettingError as err:
    sys.exit(f"error: {err}")

import gradio as gr  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pydantic  # noqa: E402
from gradio.route_utils import FnIndexInferError  # noqa: E402
from gradio.utils import get_upload_folder as gradio_upload_folder  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.datastructures import MutableHeaders  # noqa: E402
from starlette.middleware.gzip import GZipMiddleware  # noqa: E402
from starlette.responses import PlainTextResponse  # noqa: E402

from backend import api, texts  # noqa: E402
from backend.api import LIMITS, RequestError  # noqa: E402
from backend.experiments import shipped  # noqa: E402
from backend.experiments.leaderboard import ordered_groups, paired_tests, partly_graded  # noqa: E402
from backend.experiments.sweep import SWEEP_BUDGETS  # noqa: E402
from backend.experiments.task_runs import SETTINGS  # noqa: E402
from backend.experiments.tasks import OFFLINE  # noqa: E402
from backend.experiments import shipped_runs  # noqa: E402
from backend.experiments.lessons import FIRST, LESSONS, SHOWCASE  # noqa: E402
from backend.guard import Admission, RequestGuard  # noqa: E402
from backend.policies import POLICIES  # noqa: E402
from backend.runs import Run  # noqa: E402
from backend.traces.store import TraceStore  # noqa: E402
from viz import panels  # noqa: E402
from viz.leaderboard import leaderboard_heatmap, leaderboard_table_html, ordered_groups_html  # noqa: E402
from viz.first_paint import first_paint_html  # noqa: E402
from viz.policy_menu import KINDS, SETS, by_kind, hover_script  # noqa: E402
from viz.status_timer import status_timer_script  # noqa: E402
from viz.needle import found_rates, needle_figure, needle_table_html  # noqa: E402
from viz.style import markdown_text  # noqa: E402
from viz.sweep import sweep_ci_figure  # noqa: E402
from viz.tasks import sample_status_html, sample_table_html, why_html  # noqa: E402
import zerogpu  # noqa: E402

ROOT = Path(__file__).resolve().parent
EXAMPLES = texts.examples(ROOT / "assets" / "examples")  # the needle example first, then short to long
FIRST_EXAMPLE = next(name for name in ("needle", "story", *EXAMPLES) if name in EXAMPLES)
POLICY_CHOICES = list(POLICIES)  # the operator's plugins (KVLENS_PLUGINS) joined the registry above
DEFAULT_POLICIES = ["sinks", "tova", "a2sf", "reattention"]
DEFAULT_BUDGET = 40
MAX_BUDGET = 2048  # a quarter of an 8k text; the slider's number box takes any multiple of 4 below it
STORE = TraceStore()  # never raises: a broken store is set aside, an unusable one means "not cached"
QUEUE_SIZE = 64  # model jobs waiting or running; Admission enforces it (Gradio checks its cap before the validator)
QUEUE_POLL_S, PROGRESS_POLL_S = 0.02, 0.1  # how often an idle queue looks for work (Gradio's: 1 ms and 10 ms)
ADMISSION = Admission(per_session=1, per_address=runs_per_address(), queue=QUEUE_SIZE)
TICKET = "kvlens_ticket"  # where a job's admission ticket rides from its validator to its run
# Export zips are written inside Gradio's cache, so Gradio serves them as they are (no second copy) and deletes
# them on its schedule (delete_cache); this process's folder goes at exit, and those of processes gone at start-up.
EXPORTS = Path(gradio_upload_folder()) / f"kvlens-exports-{os.getpid()}"
EXPORT_TTL_S = 600
MAX_BODY = 4 * LIMITS.text_chars + 64 * 1024  # the longest allowed prompt as UTF-8, plus the other inputs
NOTES = {name: (ROOT / "assets" / "notes" / f"{name}.md").read_text() for name in
         ("intro", "masks", "reach", "kept", "forms", "curves", "tsne", "divergence", "retention", "sweep",
          "long_context", "tasks", "play")}
NEEDLE_DEFAULT_POLICIES = ["sinks", "tova", "reattention"]
NEEDLE_DEFAULT_BUDGET = 64
TASK_DEFAULT_POLICIES = ["tova", "snapkv", "kvzip"]
TASK_RATIOS = (0.25, 0.875, 0.125)  # the ratio slider: lowest, highest, step
TASK_DEFAULT_RATIO = 0.5
SETTING_LABELS = {"agnostic": "query-agnostic", "aware": "query-aware"}
PLAY_TICK_S = 0.5  # seconds between Play's frames; a frame takes ~0.1-0.2 s at 8k tokens
PLAY, PAUSE = "▶ Play", "‖ Pause"
# The run's views: each tab's id, and the order of render_views' outputs. Only the view in sight is drawn.
VIEW_OUTPUTS = ("kept", "masks", "reach", "forms", "curves", "tsne", "divergence", "retention")
VIEW_ORDER = ("heatmap", "reach", "reach_distance", "kept", "curves", "curves_steps", "step_row", "held_forms")
ALL_VIEWS = "all"
FIRST_VIEW = "kept"  # an HTML view: the page's first screen draws no plotly figure
POLICY_KINDS = by_kind(POLICIES)
OWN_PICK = "Your own pick (below)"
# The string an example's answer lies in, marked in the views: as the shipped runs over the examples name it.
EXAMPLE_EVIDENCE = MappingProxyType({run.text: run.evidence for run in SHOWCASE.values()
                                     if run.evidence and run.text in EXAMPLES})
DESCRIPTION = ("KV Lens shows what KV-cache eviction, compression and selection policies keep inside a real "
               "language model: each policy's answer beside the full cache's, and what every query read.")
SUMMARY_PLACEHOLDER = "<p>Run the policies to see each one's answer beside Full's, and what its query read.</p>"
# The runs that ship with the app (assets/runs/): in the store, so their links reopen and their requests replay.
shipped_runs.seed(STORE)


def shipped_run_ids() -> dict[str, str]:
    """Each shipped run's name -> its share id (a malformed manifest is left out)."""
    found = {}
    for name in shipped_runs.names():
        try:
            found[name] = shipped_runs.manifest(name).run_id
        except shipped_runs.ShippedRunError:
            continue
    return found


SHIPPED_RUN_IDS = MappingProxyType(shipped_run_ids())
SHIPPED_NAMES = MappingProxyType({run_id: name for name, run_id in SHIPPED_RUN_IDS.items()})
FIRST_RUN_ID = SHIPPED_RUN_IDS.get(FIRST)


@dataclasses.dataclass(eq=False)
class ShownRun:
    """A run the page shows, and the results of its views too slow to compute twice."""

    run: Run
    # TsneKeys.memo_key -> the keys before and after RoPE in 2-D
    embeddings: dict[tuple[str, int, int], tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)

    @cached_property
    def non_recent_shares(self) -> dict[str, np.ndarray]:
        """Shown by both the summary table and the retention view."""
        return panels.non_recent_shares(self.run)

    @cached_property
    def pos_lifetimes(self) -> pd.DataFrame:
        """Tagging 8k tokens takes seconds; the retention view asks again on every revisit."""
        return panels.pos_lifetime_table(self.run)

    def tsne_embedding(self, keys: panels.TsneKeys) -> tuple[np.ndarray, np.ndarray]:
        """About 2 s at 512 keys: asking again for the same policy, layer and head is instant."""
        if keys.memo_key not in self.embeddings:
            self.embeddings[keys.memo_key] = panels.tsne_embedding(keys)
        return self.embeddings[keys.memo_key]


class RecentRuns:
    """The few runs shown last, by run id; the store holds them all and replays an older one in milliseconds."""

    def __init__(self, keep: int):
        self.keep = keep
        self._shown: OrderedDict[str, ShownRun] = OrderedDict()
        self._lock = threading.Lock()  # page loads (unqueued) and views may remember runs at the same time

    def remember(self, run: Run) -> ShownRun:
        shown_run = ShownRun(run)
        with self._lock:
            self._shown[run.run_id] = shown_run
            self._shown.move_to_end(run.run_id)
            while len(self._shown) > self.keep:
                self._shown.popitem(last=False)
        return shown_run

    def get(self, run_id: str, load: Callable[[], Run]) -> ShownRun:
        """The run shown under ``run_id``, ``load``ed and remembered when it is not among the recent ones."""
        with self._lock:
            shown_run = self._shown.get(run_id)
        return self.remember(load()) if shown_run is None else shown_run

    def clear(self) -> None:
        with self._lock:
            self._shown.clear()


RECENT_RUNS = RecentRuns(keep=4)  # a run at the limits holds ~100 MB of traces


def specs_from_controls(names, budget, sinks, alpha, heads, custom):
    """The policy specs the controls describe, plus any typed by hand (one per line).

    Each checked policy at the slider's budget (``for_budget``: ReAttention shrinks its parts to fit), with
    the sinks, alpha and heads controls applied where the policy has that parameter."""
    specs = []
    for name in names or []:
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}")
        policy = POLICIES[name].for_budget(int(budget))
        has = {f.name for f in dataclasses.fields(policy)}
        changes = {}
        if name in ("sinks", "streamingllm"):  # the same sinks, so the two differ only in positions
            changes["sinks"] = int(min(sinks, budget - 1))
        if "alpha" in has:
            changes["alpha"] = round(float(alpha), 3)
        if "heads" in has and heads != "paper default":
            changes["heads"] = heads
        specs.append(dataclasses.replace(policy, **changes).spec())
    specs += [line.strip() for line in (custom or "").splitlines() if line.strip()]
    return specs


def example_text(sample):
    """The text of the example clicked (its label, as the list of examples holds it)."""
    label = sample[0] if isinstance(sample, (list, tuple)) and sample else sample
    return EXAMPLES.get(label, gr.skip()) if isinstance(label, str) else gr.skip()


def shown(err: Exception) -> gr.Error:
    """A message for the page: one line, escaped (it may quote what the visitor typed)."""
    return gr.Error(markdown_text(str(err)), print_exception=False)


def reopen(run_id) -> Run:
    """A run by its id: from the store, or a shipped run from its files (a store that cannot hold them)."""
    try:
        return api.reopen(run_id, STORE)
    except RequestError:
        if run_id not in SHIPPED_NAMES:
            raise
    try:
        return shipped_runs.load(SHIPPED_NAMES[run_id], request_type=api.RunRequest)
    except shipped_runs.ShippedRunError as err:
        raise RequestError(str(err)) from None


def load_run(run_id) -> ShownRun:
    try:
        return RECENT_RUNS.get(run_id, lambda: reopen(run_id))
    except RequestError as err:  # e.g. the run was evicted from the store since
        raise shown(err) from None


def render_run(run_id, view=ALL_VIEWS):
    """The views that depend on the run alone: the summary and the share line always, the divergence and retention
    views when ``view`` is theirs (or ``ALL_VIEWS``); the others are left as they are."""
    if not run_id:
        return [SUMMARY_PLACEHOLDER] + [None] * 7
    shown_run = load_run(run_id)
    run, shares = shown_run.run, shown_run.non_recent_shares
    divergence = panels.divergence(run) if view in ("divergence", ALL_VIEWS) else [gr.skip()] * 2
    retention = (panels.retention(run, shares, shown_run.pos_lifetimes) if view in ("retention", ALL_VIEWS)
                 else [gr.skip()] * 4)
    return [panels.summary_html(run, shares), *divergence, *retention, panels.share_markdown(run)]


def render_heatmap(run_id, layer, head, zoom=False, first_step=0, first_pos=0, size=panels.ZOOM_SIZES[1],
                   step=None):
    """The masks: the whole text (binned when long), or a window of it at one token per cell; a line marks
    the step's row."""
    if not run_id:
        return None
    run = load_run(run_id).run
    step = None if step is None else panels.clamp_step(run, step)
    return panels.heatmaps(run, layer, head, panels.zoom_window(run, zoom, first_step, first_pos, size), step)


def render_views(run_id, layer, head, step, alpha, zoom=False, first_step=0, first_pos=0, size=panels.ZOOM_SIZES[1],
                 view=ALL_VIEWS):
    """The views that follow the layer, head and step selectors: the one in sight (``view``; all of them for
    ``ALL_VIEWS``), the others left as they are until they open (t-SNE is computed on demand)."""
    if not run_id:
        return [None] * 8
    run = load_run(run_id).run
    step = panels.clamp_step(run, step)
    wanted = set(VIEW_OUTPUTS) if view == ALL_VIEWS else {view}
    drawn = {
        "masks": lambda: {"heatmap": render_heatmap(run_id, layer, head, zoom, first_step, first_pos, size, step),
                          "step_row": panels.step_row(run, step, layer, head)},
        "reach": lambda: dict(zip(("reach", "reach_distance"), panels.cache_reach(run, step))),
        "kept": lambda: {"kept": panels.kept_tokens(run, step, layer, head)},
        "curves": lambda: dict(zip(("curves", "curves_steps"), panels.score_curves(run, layer, head, alpha, step))),
        "forms": lambda: {"held_forms": panels.held_forms(run, step, head)},
    }
    values = {}
    for name in wanted & set(drawn):
        values.update(drawn[name]())
    return [values.get(output, gr.skip()) for output in VIEW_ORDER]


def player(playing: bool) -> list:
    """The timer, the Play button's label and the playing state, playing or not."""
    return [gr.Timer(active=playing), gr.Button(PAUSE if playing else PLAY), playing]


def on_play(run_id, step, playing, layer, head, alpha, zoom=False, first_step=0, first_pos=0,
            size=panels.ZOOM_SIZES[1]):
    """Play starts the timer, from the first step when the slider is at the last; Pause stops it, and the views
    Play leaves behind (the masks, the scores over the steps) catch up at the step.

    Returns the step, the masks and the scores over the steps, then ``player``'s three."""
    if not run_id:
        raise gr.Error("Run something first, then press Play.", print_exception=False)
    run = load_run(run_id).run
    step = panels.clamp_step(run, step)
    if not playing:
        last = len(run.traces[0].tokens) - 1
        return [0 if step >= last else gr.skip(), gr.skip(), gr.skip(), *player(True)]
    return [gr.skip(), render_heatmap(run_id, layer, head, zoom, first_step, first_pos, size, step),
            panels.score_curves(run, layer, head, alpha, step)[1], *player(False)]


def on_tick(run_id, step, speed, layer, head, alpha, zoom=False, first_step=0, first_pos=0,
            size=panels.ZOOM_SIZES[1]):
    """One frame of Play: the step moves on by the speed's stride and the cheap views follow it (the kept
    tokens, the scores at the step, the masks' row); at the last step Play stops and the masks and the scores
    over the steps catch up. Without a run the timer just stops.

    Returns the step, the kept tokens, the scores at the step, the masks' row, the masks, the scores over
    the steps, then ``player``'s three."""
    if not run_id:
        return [gr.skip()] * 6 + player(False)
    run = load_run(run_id).run
    last = len(run.traces[0].tokens) - 1
    step = min(panels.clamp_step(run, step) + panels.play_stride(run, speed), last)
    frame = [step, panels.kept_tokens(run, step, layer, head, panels.PLAY_WINDOW, panels.PLAY_FAR),
             panels.score_snapshot(run, layer, head, alpha, step),
             panels.step_row(run, step, layer, head)]
    if step < last:
        return frame + [gr.skip()] * 5
    return frame + [render_heatmap(run_id, layer, head, zoom, first_step, first_pos, size, step),
                    panels.score_curves(run, layer, head, alpha, step)[1], *player(False)]


def run_request(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, evidence=""):
    """The run the controls describe (not yet checked); ``evidence``: strings of the text that hold the answer, one
    per line, marked in the views."""
    try:
        specs = specs_from_controls(names, budget, sinks, alpha, heads, custom)
    except (TypeError, ValueError):  # a raw API call with controls out of shape
        raise RequestError("The policy controls are out of range.") from None
    lines = evidence.splitlines() if isinstance(evidence, str) else evidence
    return api.RunRequest(prompt=prompt, specs=specs, mode=mode, max_new_tokens=max_new, model=model,
                          evidence=lines if isinstance(lines, list) else [])


def on_cost(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, evidence=""):
    """The line under the Run button: what the chosen set costs against the limit, before anything runs."""
    try:
        return markdown_text(api.cost(run_request(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom,
                                                model)).line)
    except RequestError as err:
        return markdown_text(str(err))


def sweep_request(prompt, mode, max_new, names, sinks, alpha, heads, model):
    """Every checked policy at every sweep budget, recorded like a run so the budget slider replays."""
    try:
        jobs = [(spec.partition(":")[0], budget, spec) for budget in SWEEP_BUDGETS
                for spec in specs_from_controls(names, budget, sinks, alpha, heads, "") if spec != "full"]
    except (TypeError, ValueError):
        raise RequestError("The policy controls are out of range.") from None
    return api.SweepRequest(prompt=prompt, jobs=jobs, mode=mode, max_new_tokens=max_new, model=model,
                                chat=True, record=True)


def _visitor(request: gr.Request | None) -> tuple[str | None, str]:
    """(browser session, or None for a raw API call; client address) of a request."""
    session_hash = getattr(request, "session_hash", None) or None
    return session_hash, getattr(getattr(request, "client", None), "host", None) or "unknown"


def _carrier(request: gr.Request | None):
    """The state of the HTTP request behind ``request``: Gradio hands the same HTTP request to a job's validator
    and to its run, while the session hash of a raw API call is assigned in between."""
    return getattr(getattr(request, "request", None), "state", None)


MARKUP_START = re.compile(r"<(?=[A-Za-z/!?])")


def _refuse(message: str, n_inputs: int) -> list:
    """Validator verdicts that show ``message`` under the first input (the prompt). The page writes a validator's
    message as text, so HTML entities would show as typed; instead every ``<`` that could open a tag (in a spec
    or a name the visitor typed) becomes a look-alike, which is inert wherever the message lands and still reads
    as what was typed."""
    plain = MARKUP_START.sub("‹", message)
    return [gr.validate(False, plain)] + [gr.validate(True, "")] * (n_inputs - 1)


def _verdicts(check, n_inputs: int, request: gr.Request | None):
    """Run the cheap check, then take an admission ticket (one model job per session, a few per address)."""
    try:
        check()
    except RequestError as err:
        return _refuse(str(err), n_inputs)
    ticket, reason = ADMISSION.enter(*_visitor(request))
    if ticket is None:
        return _refuse(reason, n_inputs)
    carrier = _carrier(request)
    if carrier is not None:  # without one the ticket expires (Admission.expire_s)
        setattr(carrier, TICKET, ticket)
    return [gr.validate(True, "")] * n_inputs


def check_run(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, evidence="",
              request: gr.Request = None):
    """Validator of a run: runs before the job queues, outside the model slot."""
    return _verdicts(lambda: api.check_run(run_request(prompt, mode, max_new, names, budget, sinks, alpha,
                                                           heads, custom, model, evidence)), 11, request)


def check_sweep(prompt, mode, max_new, names, sinks, alpha, heads, model, request: gr.Request = None):
    return _verdicts(lambda: api.check_sweep(sweep_request(prompt, mode, max_new, names, sinks, alpha, heads,
                                                               model)), 8, request)


class ClickData(gr.SelectData):
    """A click on a table's row as Gradio hands it to a handler, or an empty one where a call sends no click data
    (a raw API call may send none, or anything): its index is then None and the handler asks for a row, where
    gr.SelectData would fail inside Gradio before the handler, with a traceback in the log."""

    def __init__(self, target, data):
        super().__init__(target, {"index": None, "value": None, **(data if isinstance(data, dict) else {})})


def _leave(request: gr.Request | None) -> None:
    """The job's slot is free again: the ticket its validator took."""
    carrier = _carrier(request)
    if carrier is not None:
        ADMISSION.leave(getattr(carrier, TICKET, None))
        setattr(carrier, TICKET, None)


def selectors_for(run: Run) -> tuple:
    """The step slider (at the last step), and the layer and head choices a newly shown run sets: they follow
    the model's shape (allow-listed models differ)."""
    steps = len(run.traces[0].tokens)
    meta = run.full.meta
    return (gr.update(maximum=steps - 1, value=steps - 1), gr.update(choices=panels.layer_choices(meta["n_layers"])),
            gr.update(choices=panels.head_choices(meta["n_kv_heads"])))


def _follow(progress) -> Callable[[float, str], None] | None:
    """The engine's progress reports on the page's progress bar."""
    return None if progress is None else lambda frac, what: progress(frac, desc=what)


# The functions that run the model: on a ZeroGPU Space each runs inside a call that holds the GPU, so it gets
# plain arguments, returns its result and leaves the page's state (the recent runs, the admission tickets) to
# its caller (zerogpu.py).
@zerogpu.gpu(zerogpu.run_demand)
def compute_run(request: api.RunRequest, progress=None) -> Run:
    return api.run(request, zerogpu.own_store(STORE), _follow(progress))


@zerogpu.gpu(zerogpu.sweep_demand)
def compute_sweep(request: api.SweepRequest, progress=None):
    return api.sweep(request, zerogpu.own_store(STORE), _follow(progress))


@zerogpu.gpu(zerogpu.needle_demand)
def compute_needle(jobs: list[dict], progress=None) -> pd.DataFrame:
    return api.needle_grid(jobs, _follow(progress), no_cache=not STORE.available)


@zerogpu.gpu(zerogpu.sample_demand)
def compute_sample(request: api.SampleRequest, progress=None) -> api.SampleResult:
    return api.task_sample(request, zerogpu.own_store(STORE))


def on_run(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, evidence="",
           request: gr.Request = None, progress=gr.Progress()):
    try:
        run = compute_run(run_request(prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model,
                                      evidence), progress)
    except RequestError as err:
        raise shown(err) from None
    finally:
        _leave(request)
    RECENT_RUNS.remember(run)
    steps = len(run.traces[0].tokens)
    replayed = "replayed from the store" if all(run.replayed) else "computed"
    cached = "" if run.stored else " The trace store cannot keep runs here, so this run is not cached."
    status = f"{len(run.traces)} policies, {steps} tokens, {replayed}.{cached}"
    return (run.run_id, status, *selectors_for(run))


def on_sweep(prompt, mode, max_new, names, sinks, alpha, heads, model, request: gr.Request = None,
             progress=gr.Progress()):
    try:
        result = compute_sweep(sweep_request(prompt, mode, max_new, names, sinks, alpha, heads, model), progress)
    except RequestError as err:
        raise shown(err) from None
    finally:
        _leave(request)
    if not result.stored:  # a full or read-only disk: the sweep ran, but the slider has nothing to replay
        return panels.sweep_figure(result.table), ("The trace store could not write here, so these budgets are not "
                                                   "stored: moving the budget slider computes them again.")
    return panels.sweep_figure(result.table), "Budgets stored: moving the budget slider now replays them instantly."


def shipped_long_context(folder: Path = shipped.ASSETS):
    """The needle grid and sweep computed offline (assets/long_context/): two figures, and a message for
    each file that is missing or malformed (its figure is then None)."""
    figures, notes = [], []
    for read, draw, name in ((shipped.read_needle_grid, needle_figure, shipped.NEEDLE_FILE),
                             (shipped.read_sweep_summary, sweep_ci_figure, shipped.SWEEP_FILE)):
        try:
            figures.append(draw(read(folder / name)))
        except shipped.ShippedFileError as err:
            figures.append(None)
            notes.append(f"**{markdown_text(str(err))}**")
    return figures[0], figures[1], "\n\n".join(notes)


def needle_jobs(names, budget, lengths, model):
    """The jobs of a visitor's needle grid (checked against the limits; RequestError otherwise)."""
    try:
        specs = specs_from_controls([n for n in names or [] if n != "full"], budget, 4, 0.1, "paper default", "")
    except (TypeError, ValueError):
        raise RequestError("The policy controls are out of range.") from None
    return api.check_needle(specs, lengths, model)


def check_needle(names, budget, lengths, model, request: gr.Request = None):
    return _verdicts(lambda: needle_jobs(names, budget, lengths, model), 4, request)


def on_needle(names, budget, lengths, model, request: gr.Request = None, progress=gr.Progress()):
    started = time.monotonic()
    try:
        jobs = needle_jobs(names, budget, lengths, model)
        table = compute_needle(jobs, progress)
    except RequestError as err:
        raise shown(err) from None
    finally:
        _leave(request)
    rates = found_rates(table)
    found = ", ".join(f"{spec} {rate:.0%}" for spec, rate in zip(rates["spec"], rates["found"]))
    status = f"{len(jobs)} cells in {time.monotonic() - started:.0f} s; found: {found}."
    cells = table[NEEDLE_CELL_COLUMNS].reset_index(drop=True)
    return needle_figure(table, "Your needle grid"), needle_table_html(table), markdown_text(status), cells


NEEDLE_CELL_COLUMNS = ["spec", "length", "depth", "found", "answer"]


def needle_cell(table, evt: ClickData) -> tuple[str, int, float]:
    """The (spec, length, depth) of the needle cell whose row was clicked, or RequestError."""
    try:
        row = pd.DataFrame(table).iloc[int(evt.index[0])]
        return str(row["spec"]), int(row["length"]), float(row["depth"])
    except (TypeError, ValueError, IndexError, KeyError):
        raise RequestError("Pick a cell's row of the table.") from None


def check_needle_cell(table, model, evt: ClickData, request: gr.Request = None):
    return _verdicts(lambda: api.check_needle_cell(*needle_cell(table, evt), model), 2, request)


def on_needle_cell(table, model, evt: ClickData, request: gr.Request = None, progress=gr.Progress()):
    """A click on a needle cell's row: that cell as a run of its own, the needle's number marked as its evidence
    in the usual views."""
    try:
        spec, length, depth = needle_cell(table, evt)
        run = compute_run(api.needle_request(spec, length, depth, model), progress)
    except RequestError as err:
        raise shown(err) from None
    finally:
        _leave(request)
    RECENT_RUNS.remember(run)
    status = f"Needle cell {length:,} tokens, depth {depth:g}: Full and {spec}, the needle's number marked."
    return (run.run_id, markdown_text(status), *selectors_for(run))


def leaderboard_models(folder: Path | None = None) -> dict[str, Path]:
    """The shipped task leaderboards (assets/leaderboards/<model>.csv) by model, each file's stem: the default
    model's first (the one the tab opens on), then by name."""
    paths = sorted(shipped.leaderboard_files(folder), key=lambda path: path.stem != api.DEFAULT_MODEL)
    return {path.stem: path for path in paths}


def _read_leaderboard(model, folder: Path | None = None) -> pd.DataFrame:
    """The shipped leaderboard of ``model`` (a file's stem), or ShippedFileError."""
    files = leaderboard_models(folder)
    if not files:
        raise shipped.ShippedFileError("No task leaderboard is shipped here (expected in assets/leaderboards/).")
    if not isinstance(model, str) or model not in files:
        raise shipped.ShippedFileError(f"No leaderboard is shipped for {str(model)[:80]!r}.")
    return shipped.read_leaderboard(files[model])


def setting_choices(settings) -> list[tuple[str, str]]:
    """The setting radio's (label, value) pairs."""
    return [(SETTING_LABELS.get(s, s), s) for s in settings]


AVERAGE_VIEW = re.compile(r"average at (\d{1,3}(?:,\d{3}){0,3}) tokens")


def average_view(length: int) -> str:
    """The Tasks tab's name for the average over the tasks Full solves at ``length`` tokens."""
    return f"average at {int(length):,} tokens"


def parse_view(view) -> tuple[str, int | None]:
    """The task and length a leaderboard view shows: ("average", 1024) for "average at 1,024 tokens", a task's name
    and None (every length) otherwise."""
    found = AVERAGE_VIEW.fullmatch(str(view))
    return ("average", int(found.group(1).replace(",", ""))) if found else (str(view), None)


def _in_view(df: pd.DataFrame, view, samples: bool = False) -> pd.Series:
    """The rows ``view`` shows of a shipped summary, or with ``samples`` of its samples file (for an average, every
    task at its length)."""
    task, length = parse_view(view)
    tasks = pd.Series(True, index=df.index) if samples and task == "average" else df["task"] == task
    return tasks & (df["length"] == length) if length is not None else tasks


def shipped_leaderboard(model, view, setting, pick=None, folder: Path | None = None):
    """One shipped leaderboard's figure (a policy x ratio grid, ``pick`` drawn strong, the groups the samples tell
    apart marked in each length's columns) and table for (view, setting), or None, "" and a one-line message when
    the file is missing or malformed or holds no such rows. ``view``: a task (at every length it has) or the
    average at one length (``average_view``)."""
    try:
        df = _read_leaderboard(model, folder)
    except shipped.ShippedFileError as err:
        return None, "", f"**{markdown_text(str(err))}**"
    task, length = parse_view(view)
    rows = df[_in_view(df, view) & (df["setting"] == setting)]
    if rows.empty:
        where = f"{str(view)[:80]} (query-{str(setting)[:20]})"
        return None, "", f"**{markdown_text(f'The leaderboard of {model} has no rows for {where}.')}**"
    table = leaderboard_table_html(rows)
    solved = sorted({int(n) for n in rows.loc[rows["full_solves"].astype(bool), "length"]})
    if task == "average":  # the average's tasks at each length, the policies graded on every one there
        found = told_apart(model, setting, folder)
        by_length = {n: [row for row in found if row["length"] == n] for n in solved}
    else:  # a task's samples at each length Full solves it, every policy graded there
        by_length = {n: told_apart(model, setting, folder, (str(task), n)) for n in solved}
    table += "".join(ordered_groups_html(found, f"at {n:,} tokens") for n, found in by_length.items())
    if task == "average":
        table += _partly_graded_html(df[(df["task"] != "average") & (df["setting"] == setting)
                                        & (df["length"] == length)])
    ranked = {(int(row["length"]), float(row["ratio"])): row["groups"]
              for found in by_length.values() for row in found}
    pick = pick if isinstance(pick, str) else None
    return leaderboard_heatmap(rows, str(task), pick=pick, groups=ranked), table, ""


def _partly_graded_html(summary: pd.DataFrame) -> str:
    """A line naming the policies an average leaves out (graded on some of the tasks at its length only) and where
    each is graded, escaped; empty when every policy is graded on every task at each length it is graded at."""
    partly = partly_graded(summary)
    if not partly:
        return ""
    lines = "; ".join(f"{', '.join(policies)} on {', '.join(f'{task} at {length:,} tokens' for task, length in cells)}"
                      " only" for cells, policies in partly.items())
    text = f"Not in the average at that length, graded on fewer of its tasks: {lines}."
    return f'<p class="kvlens-leaderboard-partly">{html.escape(text)}</p>'


@lru_cache(maxsize=32)
def _told_apart(path: str, modified: int, setting: str, cell: tuple[str, int] | None) -> tuple:
    """``told_apart`` of one samples file as it was at ``modified`` (its mtime: a merged file is read anew)."""
    try:
        samples = shipped.read_leaderboard_samples(Path(path))
    except shipped.ShippedFileError:
        return ()
    return tuple(ordered_groups(paired_tests(samples, setting, cell=cell)))


def told_apart(model, setting, folder: Path | None = None, cell: tuple[str, int] | None = None) -> list[dict]:
    """Which policies the shipped samples, paired, tell apart at each length and ratio
    (``leaderboard.ordered_groups``): on the average's tasks at each length, or on one task at one length
    (``cell``); empty when the model ships no samples file or it does not read."""
    files = leaderboard_models(folder)
    path = shipped.samples_file(files[model]) if model in files else None
    if path is None or not path.is_file():
        return []
    return list(_told_apart(str(path), path.stat().st_mtime_ns, str(setting), cell))


SAMPLE_TABLE_COLUMNS = ["task", "sample", "policy", "ratio", "score", "answer"]


def leaderboard_samples(model, view, setting, folder: Path | None = None) -> pd.DataFrame:
    """The shipped answers behind one leaderboard view (every task at its length for an average), at the lengths a
    visitor can run: a row per sample, policy and ratio. Empty when the model ships none."""
    files = leaderboard_models(folder)
    path = shipped.samples_file(files[model]) if model in files else None
    if path is None or not path.is_file():
        return pd.DataFrame(columns=SAMPLE_TABLE_COLUMNS)
    try:
        df = shipped.read_leaderboard_samples(path)
    except shipped.ShippedFileError:
        return pd.DataFrame(columns=SAMPLE_TABLE_COLUMNS)
    rows = df[(df["setting"] == setting) & df["length"].isin(api.TASK_LENGTHS) & df["task"].isin(OFFLINE)
              & _in_view(df, view, samples=True)]
    rows = rows.sort_values(["task", "sample", "policy", "ratio"], kind="stable")
    return rows[SAMPLE_TABLE_COLUMNS].reset_index(drop=True)


def on_board_sample(table, setting, board, evt: ClickData):
    """A click on a shipped sample's row sets the sample controls to it (its task, sample, setting, policy at its
    ratio) and the model to the leaderboard's, so the next step runs it with its evidence marked."""
    try:
        row = pd.DataFrame(table).iloc[int(evt.index[0])]
        sample, ratio = int(row["sample"]), float(row["ratio"])
    except (TypeError, ValueError, IndexError, KeyError):
        raise gr.Error("Pick a row of the table.", print_exception=False) from None
    policy = str(row["policy"])
    names = [policy] if policy in POLICY_CHOICES and policy != "full" else TASK_DEFAULT_POLICIES
    ratio = ratio if TASK_RATIOS[0] <= ratio <= TASK_RATIOS[1] else TASK_DEFAULT_RATIO
    model = board if board in LIMITS.models else gr.skip()  # a shipped board of a model this server does not serve
    return str(row["task"]), sample, setting, names, ratio, model


def leaderboard_view(model, task=None, folder: Path | None = None):
    """A shipped model's views (the average at each length first, then its tasks), settings and policies, then the
    figure, table and note of view ``task`` (default its first) in its first setting (nothing and a message when the
    file is missing or bad)."""
    try:
        df = _read_leaderboard(model, folder)
    except shipped.ShippedFileError as err:
        return [], [], [], None, None, "", f"**{markdown_text(str(err))}**"
    averages = sorted(int(n) for n in df.loc[df["task"] == "average", "length"].unique())
    tasks = [*map(average_view, averages), *(t for t in dict.fromkeys(df["task"]) if t != "average")]
    settings = list(dict.fromkeys(df["setting"]))
    policies = [p for p in dict.fromkeys(df["policy"].astype(str)) if p != "full"]
    task = task if task in tasks else tasks[0]
    return tasks, settings, policies, task, *shipped_leaderboard(model, task, settings[0], None, folder)


def on_leaderboard_model(model, task=None):
    """A shipped model (or the tab opening): its tasks, settings and policies in the selectors, and the figure of
    ``task`` (default its first)."""
    tasks, settings, policies, task, figure, table, note = leaderboard_view(model, task)
    return (gr.update(choices=tasks, value=task),
            gr.update(choices=setting_choices(settings), value=settings[0] if settings else None,
                      visible=len(settings) > 1),
            gr.update(choices=["(none)", *policies], value="(none)"), figure, table, note)


def sample_request(task, sample, setting, names, ratio, model) -> api.SampleRequest:
    """The task sample the controls describe (not yet checked): each checked policy at the slider's ratio."""
    names = [n for n in names if n != "full"] if isinstance(names, (list, tuple)) else []
    if not names:
        raise RequestError(f"Pick 1 to {api.TASK_POLICIES} policies besides Full.")
    try:
        specs = [f"{name}:ratio={float(ratio):g}" for name in names]
    except (TypeError, ValueError):
        raise RequestError("The policy controls are out of range.") from None
    if isinstance(sample, float) and sample.is_integer():  # the slider's number
        sample = int(sample)
    return api.SampleRequest(task=task, sample=sample, specs=specs, setting=setting, model=model)


def on_task_cost(task, sample, setting, names, ratio, model):
    """The line under "Run the sample": how long it is expected to take here, before anything runs (never loads or
    runs the model: the seconds come once the model has loaded and a plain forward was timed, ``warm_up``)."""
    try:
        return markdown_text(api.sample_cost_line(sample_request(task, sample, setting, names, ratio, model)))
    except RequestError as err:
        return markdown_text(str(err))


def check_task_sample(task, sample, setting, names, ratio, model, request: gr.Request = None):
    return _verdicts(lambda: api.check_sample(sample_request(task, sample, setting, names, ratio, model)), 6,
                     request)


def on_task_sample(task, sample, setting, names, ratio, model, request: gr.Request = None):
    """One task sample under Full and the chosen policies: its question, references, scores and answers, and its
    run shown in the usual views.

    Returns the run id, the main status, the sample's status and table, then ``selectors_for``'s three."""
    started = time.monotonic()
    try:
        asked = sample_request(task, sample, setting, names, ratio, model)
        result = compute_sample(asked)
    except RequestError as err:
        raise shown(err) from None
    finally:
        _leave(request)
    run = result.run
    RECENT_RUNS.remember(run)
    cached = "" if run.stored else " The trace store cannot keep runs here, so this run is not cached."
    policies = f"{len(run.traces)} {'policy' if len(run.traces) == 1 else 'policies'}"
    what = (f"{asked.task}, sample {asked.sample}, {SETTING_LABELS[asked.setting]}: Full and {policies}, "
            f"{len(run.traces[0].tokens)} tokens, in {time.monotonic() - started:.0f} s.{cached}")
    return (run.run_id, markdown_text(what), sample_status_html(result.question, result.references, result.table, what),
            sample_table_html(result.table)
            + why_html(result.why, result.evidence.describe() if result.evidence is not None else ""),
            *selectors_for(run))


# The events that run the model, each with its validator: the cheap check, then an admission ticket (``_verdicts``)
# that the event gives back when it ends (``_leave``). ``model_job`` wires every route to them this way, a button's,
# a chained step's or a row's click alike, so none reaches the model unadmitted.
MODEL_JOBS = MappingProxyType({on_run: check_run, on_sweep: check_sweep, on_needle: check_needle,
                               on_needle_cell: check_needle_cell, on_task_sample: check_task_sample})
MODEL_SLOT = "model"  # the queue's concurrency id of the model's jobs: one at a time


def model_job(trigger, fn, inputs, outputs, **options):
    """``fn`` (one of ``MODEL_JOBS``) on ``trigger``: admitted by its validator, queued for the model's slot."""
    return trigger(fn, inputs, outputs, validator=MODEL_JOBS[fn], concurrency_id=MODEL_SLOT, **options)


def on_tsne(run_id, policy, layer, head):
    if not run_id:
        raise gr.Error("Run something first.", print_exception=False)
    try:
        shown_run = load_run(run_id)
        keys = panels.tsne_keys(shown_run.run, policy, layer, head)
        return panels.tsne_map(keys, shown_run.tsne_embedding(keys))
    except ValueError as err:  # e.g. that policy is not part of this run
        raise shown(err) from None


def prune_exports(max_age_s: float = EXPORT_TTL_S) -> None:
    """Delete our export folders older than ``max_age_s`` (Gradio deletes the zips in them on its schedule)."""
    for folder in EXPORTS.glob("*"):
        try:
            if time.time() - folder.stat().st_mtime > max_age_s:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass


def remove_exports() -> None:
    """This process's exports (at exit)."""
    shutil.rmtree(EXPORTS, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        pass
    return True


def remove_orphaned_exports() -> list[Path]:
    """Export folders of app processes that are gone (killed before they could clean up), in Gradio's cache
    and the system's temporary folder; returns those removed."""
    removed = []
    for root in {EXPORTS.parent, Path(tempfile.gettempdir())}:
        for folder in root.glob("kvlens-exports-*"):
            pid = folder.name.rpartition("-")[2]
            if folder.is_dir() and not folder.is_symlink() and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def on_export(run_id, layer, head, step, alpha):
    if not run_id:
        raise gr.Error("Run something first.", print_exception=False)
    shown_run = load_run(run_id)
    run = shown_run.run
    prune_exports()
    figures = panels.figures_html(run, layer, head, panels.clamp_step(run, step), alpha, shown_run.non_recent_shares)
    EXPORTS.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(dir=EXPORTS)) / f"kvlens-{run_id[:12]}.zip"
    path.write_bytes(api.export_zip(run, {"figures.html": figures}))
    return str(path)


def page_head() -> str:
    """What goes in the page's <head>: its description, and each policy's line and paper on hover."""
    return f'<meta name="description" content="{html.escape(DESCRIPTION)}">' + hover_script(POLICIES, "#policies")


def header_html() -> str:
    """The page's two lines above the first picture: what KV Lens is, and the lessons (``#lessons``)."""
    links = " ".join(f'<a href="?lesson={html.escape(name)}">{html.escape(lesson.title)}</a>'
                     for name, lesson in LESSONS.items())
    return (f'<h1>KV Lens <span>· what KV-cache policies keep inside a real model: each one\'s answer beside '
            f"the full cache's, and what its query read.</span></h1>"
            f'<nav id="lessons" aria-label="Lessons"><strong>Lessons:</strong> {links}</nav>')


def about(note: str, open_: bool = False) -> None:
    """A view's explanation, folded under its tab until asked for."""
    with gr.Accordion("About this view", open=open_, elem_classes=["kvl-about"]):
        gr.Markdown(NOTES[note])


def example_evidence(sample):
    """The evidence box for the example clicked: the string its answer lies in, if it has one."""
    label = sample[0] if isinstance(sample, (list, tuple)) and sample else sample
    return EXAMPLE_EVIDENCE.get(label, "") if isinstance(label, str) else gr.skip()


def merge_kinds(*boxes) -> list[str]:
    """The policies checked under every kind, in the registry's order: the list the runs read."""
    checked = {name for box in boxes for name in (box or []) if isinstance(name, str)}
    return [name for name in POLICY_CHOICES if name in checked]


def split_kinds(names) -> list:
    """The kinds' boxes for a list of policies (a named set, a lesson, a sample's row), then the named set it is
    (or ``OWN_PICK``)."""
    chosen = set(names or [])
    named = next((label for label, members in SETS if set(members) == chosen), OWN_PICK)
    return [[n for n in members if n in chosen] for members in POLICY_KINDS.values()] + [named]


def named_set(label):
    return list(dict(SETS)[label]) if label in dict(SETS) else gr.skip()


POLICIES_FOLD = "Policies by kind (hover for each one's paper)"
FIRST_STATUS = "A finished run, shipped with the app: change the prompt or the policies and press Run."


@dataclasses.dataclass(frozen=True)
class FirstScreen:
    """What the page is built showing, so a visitor sees it with no request: the shipped first run's id, status,
    summary, last step, view in sight and cost line."""

    run_id: str | None = None
    status: str = ""
    summary: str = SUMMARY_PLACEHOLDER
    last_step: int = 64
    kept: str | None = None  # the view in sight (``FIRST_VIEW``) at the last step, all layers and heads
    cost: str = ""


def first_screen() -> FirstScreen:
    """The shipped first run drawn once as the page is built (a fifth of a second); the placeholder without it.
    Its cost line counts the tokens the run counted: the model need not be loaded."""
    if FIRST_RUN_ID is None:
        return FirstScreen()
    try:
        shown_run = load_run(FIRST_RUN_ID)
    except gr.Error:
        return FirstScreen()
    run = shown_run.run
    last = len(run.traces[0].tokens) - 1
    try:
        cost = api.cost(run.request, tokens=run.tokens).line
    except RequestError as err:
        cost = str(err)
    return FirstScreen(FIRST_RUN_ID, FIRST_STATUS, panels.summary_html(run, shown_run.non_recent_shares), last,
                       panels.kept_tokens(run, last, "all", "all"), markdown_text(cost))


def first_paint(first: FirstScreen, pages: list[str]) -> bytes:
    """The first screen's still copy (``viz.first_paint``) that the plain landing's HTML carries; nothing without
    a shipped first run."""
    if first.run_id is None:
        return b""
    stylesheet = (ROOT / "assets" / "style.css").read_text()
    return first_paint_html(header_html(), pages, EXAMPLES[FIRST_EXAMPLE], SETS[0][0], POLICIES_FOLD,
                            first.summary, [html.unescape(first.cost), first.status], stylesheet).encode()


class FirstPaint:
    """ASGI middleware: every page's HTML carries ``script`` before Gradio's app (so it runs before Gradio's modules,
    which the page's head cannot promise: Gradio adds that once its client runs), and the plain landing page (GET /,
    no query: a lesson or a run opens on something else) carries the first screen's still copy first in its body, so
    its answers show while Gradio's client builds the page."""

    def __init__(self, app, fragment: bytes, script: bytes = b""):
        self.app, self.fragment, self.script = app, fragment, script

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "GET" or scope["path"] != "/":
            return await self.app(scope, receive, send)
        inserted = self.script + (b"" if scope.get("query_string") else self.fragment)
        if not inserted:
            return await self.app(scope, receive, send)
        start, chunks = None, []

        async def insert(message):
            nonlocal start
            if message["type"] == "http.response.start":
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                return await send(message)
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body, headers = b"".join(chunks), MutableHeaders(raw=list(start["headers"]))
            if headers.get("content-type", "").startswith("text/html") and b"<gradio-app" in body:
                body = body.replace(b"<gradio-app", inserted + b"<gradio-app", 1)
                headers["content-length"] = str(len(body))
            await send({**start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, insert)


def render_run_after_load(run_id, view, request: gr.Request = None):
    """``render_run`` after a page load, except on the plain page: it was built showing the first run's summary."""
    query = (request.query_params or {}) if request else {}
    if FIRST_RUN_ID is not None and not query.get("lesson") and not query.get("run"):
        return [gr.skip()] * 8
    return render_run(run_id, view)


def _no_lesson() -> list:
    return [None, gr.Column(visible=False), ""]


def _show_run(run_id: str, message: str, at=None, layer="all", head="all", fresh=False) -> list:
    """run id, status, then the step, layer and head selectors for a run the page opens (``at``: its step, the
    last by default); RequestError when it cannot be reopened. On a ``fresh`` page, selectors that already hold
    what the run needs are left alone (a change would draw the views twice)."""
    run = RECENT_RUNS.get(run_id, lambda: reopen(run_id)).run
    steps, layers, heads = selectors_for(run)
    if at is not None:
        steps = gr.update(maximum=len(run.traces[0].tokens) - 1, value=panels.clamp_step(run, at))
    selectors = []
    for update, value, default in ((layers, layer, panels.layer_choices()), (heads, head, panels.head_choices())):
        same = fresh and value == "all" and update["choices"] == default
        selectors.append(gr.skip() if same else gr.update(choices=update["choices"], value=value))
    return [run_id, message, steps, *selectors]


def lesson_step(name: str, index: int) -> list:
    """The page at step ``index`` of lesson ``name``: the narration, the shipped run and its controls, the view in
    sight, and (for a leaderboard step) the Tasks page on its task. In the order of ``build``'s lesson outputs."""
    found = LESSONS[name]
    index = min(max(int(index), 0), len(found.steps) - 1)
    step = found.steps[index]
    last = index == len(found.steps) - 1
    where = f"**{markdown_text(found.title)}** · step {index + 1} of {len(found.steps)}"
    text = f"{where}\n\n{step.text}" + ("\n\n*The end: pick another lesson above.*" if last else "")
    lesson = [(name, index), gr.Column(visible=True), text]
    if not step.run:  # a leaderboard step
        return lesson + [gr.skip()] * 11 + [gr.Tabs(selected="tasks"), step.task or gr.skip()]
    shipped = SHOWCASE[step.run]
    run_id = SHIPPED_RUN_IDS[step.run]
    run = RECENT_RUNS.get(run_id, lambda: reopen(run_id)).run
    at = panels.answer_step(run) if step.step is None else step.step
    shown_run = _show_run(run_id, f"Lesson run: {', '.join(shipped.policies)} at budget {shipped.budget}, "
                                  "shipped with the app (nothing computed).", at, step.layer, step.head)
    return lesson + shown_run + [shipped.prompt(), list(shipped.policies), shipped.budget, shipped.evidence,
                                 step.view, gr.Tabs(selected=step.view), gr.Tabs(selected="run-page"), gr.skip()]


def on_lesson_move(at, move: int) -> list:
    """Back or Next in the lesson running."""
    if not (isinstance(at, (list, tuple)) and len(at) == 2 and at[0] in LESSONS):
        return _no_lesson() + [gr.skip()] * 13
    return lesson_step(at[0], int(at[1]) + move)


def on_lesson_end():
    return None, gr.Column(visible=False)


def lesson_board(at, model, request: gr.Request = None):
    """The Tasks page's leaderboard when a lesson step (or ``?tab=tasks``) shows it; else nothing changes."""
    query = (request.query_params or {}) if request else {}
    if isinstance(at, (list, tuple)) and len(at) == 2 and at[0] in LESSONS:
        step = LESSONS[at[0]].steps[min(int(at[1]), len(LESSONS[at[0]].steps) - 1)]
        if not step.run:
            return on_leaderboard_model(model, step.task or None)
    elif query.get("tab") == "tasks":
        return on_leaderboard_model(model)
    return [gr.skip()] * 6


def on_load(request: gr.Request):
    """What the page opens on: ``?lesson=NAME`` a lesson's first step, ``?run=ID`` a stored run, else the shipped
    first run; ``?tab=tasks`` opens the leaderboard. Reads shipped files and the store only."""
    query = (request.query_params or {}) if request else {}
    lesson, run_id = query.get("lesson", ""), query.get("run", "")
    rest = [gr.skip()] * 6 + [gr.Tabs(selected="tasks") if query.get("tab") == "tasks" else gr.skip(), gr.skip()]
    if lesson in LESSONS:
        return lesson_step(lesson, 0)
    note = "" if not lesson else f"**There is no lesson {markdown_text(lesson[:40])!r}.** "
    try:
        if run_id:
            return _no_lesson() + _show_run(run_id, note + "Opened a shared run from the store.", fresh=True) + rest
        if FIRST_RUN_ID is not None:  # the page was built showing it (``first_screen``)
            return _no_lesson() + [gr.skip(), note + FIRST_STATUS if note else gr.skip()] + [gr.skip()] * 3 + rest
    except RequestError as err:
        return _no_lesson() + [None, note + f"**{markdown_text(str(err))}**"] + [gr.skip()] * 3 + rest
    return _no_lesson() + [None, note] + [gr.skip()] * 3 + rest


class QuietBlocks(gr.Blocks):
    """Blocks whose inputs' refusals (a value out of a component's range, of the wrong type: anyone can send
    any JSON) are one line for the visitor and no traceback in the log."""

    async def preprocess_data(self, *args, **kwargs):
        try:
            return await super().preprocess_data(*args, **kwargs)
        except gr.Error as err:
            if not err.print_exception:
                raise
            raise _input_error(err.message) from None
        except (ValueError, TypeError) as err:  # Gradio's ComponentProcessingError is a ValueError
            raise _input_error(err) from None


def _input_error(err) -> gr.Error:
    return gr.Error(markdown_text((str(err).strip().splitlines() or ["A control's value is out of range."])[0]),
                    print_exception=False)


async def unknown_endpoint(request, exc):
    """No endpoint of that name: 404, and nothing in the log (Gradio would answer 500 with a traceback)."""
    return PlainTextResponse("No such endpoint.", status_code=404)


FN_INDEX = pydantic.TypeAdapter(int | None)  # how Gradio reads a body's fn_index ("3" and true are indices too)


def unknown_function(body: bytes) -> tuple[int, str] | None:
    """A call that names a function by an ``fn_index`` the page does not have (queue/join, run/predict): 404 in
    one line, and nothing in the log (Gradio would answer 500, a KeyError's traceback in the log)."""
    try:
        index = FN_INDEX.validate_python(json.loads(body).get("fn_index"))
    except (ValueError, AttributeError, RecursionError):  # not JSON, not an object, no index: Gradio answers
        return None
    return None if index is None or index in demo.fns else (404, f"No such function: fn_index {index}.")


def build() -> gr.Blocks:
    # Export zips (in Gradio's cache) are deleted within 20 minutes of their making.
    with QuietBlocks(title="KV Lens", delete_cache=(EXPORT_TTL_S, EXPORT_TTL_S)) as demo:
        gr.HTML(header_html(), elem_id="kvl-header")
        first = first_screen()
        run_id = gr.State(first.run_id)
        # The run's view in sight: only it is drawn (the others when they open). A box, not a State, so that the
        # browser sets it when a tab opens and only a change reaches the server: a tab reports itself selected
        # as the page mounts, and that must not redraw what the page was built showing.
        view = gr.Textbox(FIRST_VIEW, visible=False, elem_id="view-in-sight")
        lesson = gr.State(None)  # (lesson name, step index) while a lesson runs
        # A lesson's narration, above every page: its steps move between the run's views and the leaderboard.
        with gr.Column(visible=False, elem_id="lesson") as lesson_box:
            lesson_text = gr.Markdown(elem_id="lesson-text")
            with gr.Row():
                lesson_back = gr.Button("◀ Back", elem_id="lesson-back", size="sm", scale=0, min_width=90)
                lesson_next = gr.Button("Next ▶", elem_id="lesson-next", size="sm", scale=0, min_width=90,
                                        variant="primary")
                lesson_end = gr.Button("End the lesson", elem_id="lesson-end", size="sm", scale=0, min_width=120)
        with gr.Tabs(elem_id="pages") as pages:
            with gr.Tab("This run", id="run-page", elem_id="run-page"):
                with gr.Row(elem_id="run-columns"):
                    with gr.Column(scale=1, min_width=300):
                        prompt = gr.Textbox(label="Prompt", lines=3, max_lines=8, value=EXAMPLES[FIRST_EXAMPLE],
                                            elem_id="prompt", max_length=LIMITS.text_chars)
                        policy_set = gr.Dropdown([label for label, _ in SETS] + [OWN_PICK], value=SETS[0][0],
                                                 label="Policies: a named set, or pick below", elem_id="policy-set")
                        names = gr.CheckboxGroup(POLICY_CHOICES, value=DEFAULT_POLICIES, visible=False,
                                                 label="Policies, side by side", elem_id="policy-names")
                        with gr.Accordion(POLICIES_FOLD, open=False, elem_id="policies"):
                            kind_boxes = [gr.CheckboxGroup(members, value=[n for n in DEFAULT_POLICIES if n in members],
                                                           label=heading, elem_id=f"policies-{kind}")
                                          for (kind, heading), members in zip(KINDS, POLICY_KINDS.values())]
                        run_button = gr.Button("Run", variant="primary", elem_id="run")
                        cost_line = gr.Markdown(first.cost, elem_id="cost")
                        status = gr.Markdown(first.status, elem_id="status")
                        # Labels only: the page would otherwise carry every text (the long ones are 40k characters).
                        examples = gr.Dataset(components=["textbox"], samples=[[label] for label in EXAMPLES],
                                              samples_per_page=len(EXAMPLES), label="Examples", elem_id="examples")
                        with gr.Accordion("Budget, mode and parameters", open=False, elem_id="parameters"):
                            budget = gr.Slider(4, MAX_BUDGET, value=DEFAULT_BUDGET, step=4,
                                               label="Budget: cached tokens each query reads", elem_id="budget")
                            mode = gr.Radio([("Generate a continuation", "generate"),
                                             ("Score the text (teacher-forced)", "prompt")],
                                            value="generate", label="Mode")
                            max_new = gr.Slider(4, LIMITS.new_tokens, value=24, step=4, label="Max new tokens")
                            sinks = gr.Slider(0, 16, value=4, step=1, label="sinks: attention sinks kept (Window+i)")
                            alpha = gr.Slider(0.0, 1.0, value=0.1, step=0.05, label="a2sf: forgetting factor alpha")
                            heads = gr.Radio(["paper default", "head", "layer"], value="paper default",
                                             label="h2o / tova / a2sf / oracle: decide per KV head or per layer")
                            custom = gr.Textbox(label="More policies, one spec per line (budget=N tokens, or ratio=R: "
                                                      "the share of the prompt's tokens removed, kvpress's "
                                                      "compression ratio)",
                                                lines=2, placeholder="tova:budget=32,heads=head\nsnapkv:ratio=0.75",
                                                elem_id="custom")
                            model = gr.Dropdown(list(LIMITS.models), value=api.DEFAULT_MODEL, label="Model",
                                                info="Hub models load only where the Space has internet.")
                            evidence = gr.Textbox(label="Evidence: a string of your text that holds the answer, one "
                                                        "per line (marked in the views: when did each policy stop "
                                                        "reading it?)", value=EXAMPLE_EVIDENCE.get(FIRST_EXAMPLE, ""),
                                                  lines=1, max_lines=4, elem_id="evidence")
                        with gr.Accordion("About KV Lens", open=False):
                            gr.Markdown(NOTES["intro"])
                    with gr.Column(scale=3, min_width=320):
                        summary = gr.HTML(first.summary, elem_id="summary")
                        with gr.Row():
                            layer = gr.Dropdown(panels.layer_choices(), value="all", label="Layer", elem_id="layer",
                                                min_width=90)
                            head_ = gr.Dropdown(panels.head_choices(), value="all", label="KV head", elem_id="head",
                                                min_width=90)
                            step = gr.Slider(0, first.last_step, value=first.last_step, step=1,
                                             label="Step (the query whose reads the views show)",
                                             elem_id="step", scale=3)
                            play = gr.Button(PLAY, elem_id="play", scale=0, min_width=100)
                        with gr.Accordion("Play's speed, and what it shows", open=False, elem_id="play-options"):
                            speed = gr.Radio(panels.PLAY_SPEEDS, value="auto", elem_id="play-speed",
                                             label="Play speed (a tick every half second)")
                            gr.Markdown(NOTES["play"], elem_id="play-note")
                        playing = gr.State(False)
                        timer = gr.Timer(PLAY_TICK_S, active=False)
                        with gr.Tabs(selected=FIRST_VIEW, elem_id="views") as view_tabs:
                            with gr.Tab("Kept tokens", id="kept") as kept_tab:
                                about("kept")
                                kept = gr.HTML(first.kept, elem_id="kept")
                            with gr.Tab("Masks", id="masks") as masks_tab:
                                about("masks")
                                with gr.Row(equal_height=True):
                                    zoom = gr.Checkbox(False, label="Zoom: one token per cell", elem_id="zoom",
                                                       info="Off: the whole text (long texts in bins)")
                                    zoom_step = gr.Number(0, label="First step (row)", precision=0, minimum=0,
                                                          elem_id="zoom-step")
                                    zoom_pos = gr.Number(0, label="First position (column)", precision=0, minimum=0,
                                                         elem_id="zoom-pos")
                                    zoom_size = gr.Dropdown(list(panels.ZOOM_SIZES), value=panels.ZOOM_SIZES[1],
                                                            label="Window (tokens)", elem_id="zoom-size")
                                step_row = gr.Plot(elem_id="step-row")
                                heatmap = gr.Plot(elem_id="heatmap")
                            with gr.Tab("Cache reach", id="reach") as reach_tab:
                                about("reach")
                                reach = gr.Plot(elem_id="reach")
                                reach_distance = gr.Plot(elem_id="reach-distance")
                            with gr.Tab("Held forms", id="forms") as forms_tab:
                                about("forms")
                                held_forms = gr.Plot(elem_id="forms")
                            with gr.Tab("A2S vs A2SF", id="curves") as curves_tab:
                                about("curves")
                                curve_alpha = gr.Slider(0.0, 1.0, value=0.3, step=0.05, label="alpha for A2SF")
                                curves = gr.Plot(elem_id="curves")
                                curves_steps = gr.Plot(elem_id="curves-steps")
                            with gr.Tab("K-cache t-SNE", id="tsne") as tsne_tab:
                                about("tsne")
                                with gr.Row():
                                    tsne_policy = gr.Dropdown(POLICY_CHOICES, value="tova", label="Policy")
                                    tsne_button = gr.Button("Compute t-SNE")
                                tsne_plot = gr.Plot(elem_id="tsne")
                            with gr.Tab("Divergence", id="divergence") as divergence_tab:
                                about("divergence")
                                divergence_plot = gr.Plot(elem_id="divergence")
                                continuations = gr.HTML(elem_id="continuations")
                            with gr.Tab("Retention", id="retention") as retention_tab:
                                about("retention")
                                first_token_plot = gr.Plot(elem_id="first-token")
                                non_recent_plot = gr.Plot(elem_id="non-recent")
                                retention_plot = gr.Plot(elem_id="retention")
                                pos_table = gr.Dataframe(panels.pos_placeholder(),
                                                         label="Mean lifetime by part of speech", interactive=False)
            with gr.Tab("Tasks leaderboard", id="tasks", elem_id="tasks-page") as tasks_page:
                about("tasks", open_=False)
                boards = list(leaderboard_models())
                with gr.Row():
                    board = gr.Dropdown(boards, value=boards[0] if boards else None,
                                        label="Shipped leaderboard (model)", elem_id="leaderboard-model")
                    board_task = gr.Dropdown([], value=None, label="Task", elem_id="leaderboard-task")
                    board_setting = gr.Radio([], value=None, label="Setting", elem_id="leaderboard-setting")
                    board_pick = gr.Dropdown([], value=None, label="Draw one policy strong",
                                             elem_id="leaderboard-highlight")
                board_note = gr.Markdown(elem_id="leaderboard-note")
                board_plot = gr.Plot(elem_id="leaderboard-plot")
                board_table = gr.HTML(elem_id="leaderboard-table")
                gr.Markdown("**The answers behind it**: click a row to run that sample here, its evidence "
                            "marked in the views and each policy's verdict below.")
                board_samples = gr.Dataframe(pd.DataFrame(columns=SAMPLE_TABLE_COLUMNS), interactive=False,
                                             max_height=260, elem_id="leaderboard-samples")
                gr.Markdown(f"**Run one sample**: Full and up to {api.TASK_POLICIES} policies at one "
                            f"compression ratio answer one sample of a RULER task at "
                            f"{api.TASK_LENGTHS[0]:,} tokens (the model chosen beside the prompt), as one "
                            "run: a minute or more on two CPU cores. Its run then shows under This run.")
                with gr.Row():
                    task_name = gr.Dropdown(list(OFFLINE), value=OFFLINE[0], label="Task", elem_id="task-name")
                    task_sample = gr.Slider(0, api.TASK_SAMPLES - 1, value=0, step=1, label="Sample",
                                            elem_id="task-sample")
                    task_setting = gr.Radio(setting_choices(SETTINGS), value=SETTINGS[0], label="Setting",
                                            elem_id="task-setting")
                with gr.Row():
                    task_names = gr.CheckboxGroup([n for n in POLICY_CHOICES if n != "full"],
                                                  value=TASK_DEFAULT_POLICIES, elem_id="task-policies",
                                                  label=f"Policies (up to {api.TASK_POLICIES})")
                task_ratio = gr.Slider(*TASK_RATIOS[:2], value=TASK_DEFAULT_RATIO, step=TASK_RATIOS[2],
                                       label="Compression ratio (share of the context's KV pairs removed)",
                                       elem_id="task-ratio")
                task_button = gr.Button("Run the sample", elem_id="task-run")
                task_cost = gr.Markdown(on_task_cost(OFFLINE[0], 0, SETTINGS[0], TASK_DEFAULT_POLICIES,
                                                     TASK_DEFAULT_RATIO, api.DEFAULT_MODEL), elem_id="task-cost")
                task_status = gr.HTML(elem_id="task-status")
                task_table = gr.HTML(elem_id="task-table")
            with gr.Tab("Long context", id="long-context", elem_id="long-context-page") as long_page:
                about("long_context", open_=False)
                long_note = gr.Markdown(elem_id="long-context-note")
                shipped_needle = gr.Plot(elem_id="shipped-needle")
                shipped_sweep = gr.Plot(elem_id="shipped-sweep")
                gr.Markdown(f"**Run a small needle grid**: Full and up to {api.NEEDLE_POLICIES} "
                            "policies, depths 0%, 50% and 100%, one seed; at most 6 cells, each half a "
                            "minute to two minutes on two CPU cores. The command line runs longer grids.")
                with gr.Row():
                    needle_names = gr.CheckboxGroup([n for n in POLICY_CHOICES if n != "full"],
                                                    value=NEEDLE_DEFAULT_POLICIES, elem_id="needle-policies",
                                                    label=f"Policies (up to {api.NEEDLE_POLICIES})")
                with gr.Row():
                    needle_budget = gr.Slider(16, 256, value=NEEDLE_DEFAULT_BUDGET, step=16, label="Budget")
                    needle_lengths = gr.CheckboxGroup(list(api.NEEDLE_LENGTHS), value=[api.NEEDLE_LENGTHS[0]],
                                                      label="Context length (tokens)")
                needle_button = gr.Button("Run the needle grid", elem_id="needle-run")
                needle_status = gr.Markdown(elem_id="needle-status")
                needle_plot = gr.Plot(elem_id="needle-grid")
                needle_table = gr.HTML(elem_id="needle-table")
                gr.Markdown("Click a cell's row to open it as a run, the needle's number marked in the views.")
                needle_cells = gr.Dataframe(pd.DataFrame(columns=NEEDLE_CELL_COLUMNS), interactive=False,
                                            max_height=240, elem_id="needle-cells")
            with gr.Tab("Sweep", id="sweep", elem_id="sweep-page"):
                about("sweep", open_=True)
                sweep_button = gr.Button("Compute every budget")
                sweep_status = gr.Markdown()
                sweep_plot = gr.Plot(elem_id="sweep")
            with gr.Tab("Share", id="share-page", elem_id="share-page"):
                share = gr.Markdown(elem_id="share")
                gr.Markdown("The zip holds every trace (npz arrays + json metadata, as `docs/trace-format.md` "
                            "describes) and `figures.html` with the current views; each plot's camera "
                            "button saves a PNG.")
                export_button = gr.Button("Download traces and figures (zip)")
                export_file = gr.File(label="Traces")

        run_views = [summary, divergence_plot, continuations, first_token_plot, non_recent_plot, retention_plot,
                     pos_table, share]
        views = [heatmap, reach, reach_distance, kept, curves, curves_steps, step_row, held_forms]
        selectors = [run_id, layer, head_, step, curve_alpha]
        zoom_controls = [zoom, zoom_step, zoom_pos, zoom_size]
        run_inputs = [prompt, mode, max_new, names, budget, sinks, alpha, heads, custom, model, evidence]
        # The model runs one job at a time ("model"); the views of stored runs share two workers ("views").
        # Moving the budget re-runs too: replayed from the store when that budget was computed before.
        views_ = {"concurrency_id": "views", "concurrency_limit": 2}
        # The cost line never queues (it only tokenizes): it follows every control that changes the cost, and
        # after a run, whose model may have just loaded (until then the count is an estimate).
        # The API's documentation (inlined in every page load) lists the Run button's chain, the tasks, the grids
        # and the export; the page's other events stay callable but undocumented.
        hidden = {"api_visibility": "undocumented"}
        cost_ = {"queue": False, "show_progress": "hidden", "trigger_mode": "always_last", **hidden}
        quick = {"queue": False, "show_progress": "hidden", **hidden}
        views_hidden = {**views_, **hidden}

        plots = [heatmap, step_row, reach, reach_distance, curves, curves_steps, held_forms]

        # Every event that shows a run or a view asks for one draw chain, by moving this counter: a chain's steps
        # each defer to their own pending call, so the last asked draw also finishes last. Separate chains could
        # finish out of order, and a slow draw of the run shown before would cover the new run's views.
        draws = gr.Number(0, visible=False, elem_id="draws")

        def draw(then):
            """Ask for the run's views after ``then`` (an event's ``then``, or a trigger)."""
            return then(lambda asked: (asked or 0) + 1, draws, draws, **quick, trigger_mode="always_last")

        # The draw: the summary and the view in sight. The plots are taken off the page first and drawn anew:
        # plotly cannot redraw four panels as one in place (its axes fail to scale). Each step defers, never
        # drops: a step still pending from an earlier draw would otherwise skip this one, and the rest with it.
        last = {"trigger_mode": "always_last"}
        cleared = draws.change(lambda: [gr.update(visible=False)] * len(plots), None, plots, **quick, **last)
        cleared.then(render_run, [run_id, view], run_views, **views_, **last).then(
            render_views, [*selectors, *zoom_controls, view], views, **views_, **last).then(
            lambda: [gr.update(visible=True)] * len(plots), None, plots, **quick, **last)

        for control in (prompt, mode, max_new, names, custom, model):
            control.change(on_cost, run_inputs, cost_line, **cost_)
        # The policies: the kinds' boxes and the named sets write the one list the runs read (``names``).
        for box in kind_boxes:
            box.input(merge_kinds, kind_boxes, names, **quick)
        policy_set.input(named_set, policy_set, names, **quick)
        names.change(split_kinds, names, [*kind_boxes, policy_set], **quick)
        # A run's progress shows on its status line only: on every output it would be drawn four times over, across
        # the layer, head and step controls too, each with a timer of its own.
        for trigger in (run_button.click, budget.input):  # input: a lesson setting the budget runs nothing
            ran = model_job(trigger, on_run, run_inputs, [run_id, status, step, layer, head_],
                            trigger_mode="always_last", show_progress_on=status,
                            **({} if trigger == run_button.click else hidden))
            draw(ran.then)
            ran.then(on_cost, run_inputs, cost_line, **cost_)
        for control in (layer, head_, curve_alpha):
            control.change(render_views, [*selectors, *zoom_controls, view], views, **views_hidden)
        step.release(render_views, [*selectors, *zoom_controls, view], views, trigger_mode="always_last",
                     **views_hidden)
        # A view drawn when it opens: only the one in sight is kept up to date.
        for tab, name in ((kept_tab, "kept"), (masks_tab, "masks"), (reach_tab, "reach"), (forms_tab, "forms"),
                          (curves_tab, "curves"), (tsne_tab, "tsne"), (divergence_tab, "divergence"),
                          (retention_tab, "retention")):
            tab.select(None, None, view, js=f"() => {json.dumps(name)}", **hidden)
        draw(view.change)
        # The zoom moves only the masks: the other views do not depend on it.
        for control in (zoom, zoom_size):
            control.change(render_heatmap, [run_id, layer, head_, *zoom_controls, step], heatmap, **views_hidden)
        for control in (zoom_step, zoom_pos):  # typed numbers count once done (Enter or leaving the box)
            for event in (control.submit, control.blur):
                event(render_heatmap, [run_id, layer, head_, *zoom_controls, step], heatmap, trigger_mode="always_last",
                      **views_hidden)
        # Play: each tick redraws only what is cheap at 8k tokens; a tick that comes while one is drawn is skipped.
        players = [timer, play, playing]
        play.click(on_play, [run_id, step, playing, layer, head_, curve_alpha, *zoom_controls],
                   [step, heatmap, curves_steps, *players], **views_hidden)
        timer.tick(on_tick, [run_id, step, speed, layer, head_, curve_alpha, *zoom_controls],
                   [step, kept, curves, step_row, heatmap, curves_steps, *players], trigger_mode="once",
                   show_progress="hidden", **views_hidden)
        examples.click(example_text, examples, prompt, queue=False, **hidden).then(example_evidence, examples, evidence,
                                                                          **quick)
        tsne_button.click(on_tsne, [run_id, tsne_policy, layer, head_], tsne_plot, **views_)
        model_job(sweep_button.click, on_sweep, [prompt, mode, max_new, names, sinks, alpha, heads, model],
                  [sweep_plot, sweep_status])
        # The experiments draw their shipped results when they first open (the page loads without them).
        long_page.select(shipped_long_context, None, [shipped_needle, shipped_sweep, long_note], **views_hidden)
        model_job(needle_button.click, on_needle, [needle_names, needle_budget, needle_lengths, model],
                  [needle_plot, needle_table, needle_status, needle_cells])
        draw(model_job(needle_cells.select, on_needle_cell, [needle_cells, model],
                       [run_id, status, step, layer, head_], show_progress_on=status).then)
        board_outputs = [board_task, board_setting, board_pick, board_plot, board_table, board_note]
        opened = tasks_page.select(on_leaderboard_model, [board, board_task], board_outputs, **views_hidden)
        opened.then(leaderboard_samples, [board, board_task, board_setting], board_samples, **views_hidden)
        board.input(on_leaderboard_model, [board], board_outputs, **views_hidden).then(
            leaderboard_samples, [board, board_task, board_setting], board_samples, **views_hidden)
        for control in (board_task, board_setting):
            control.input(shipped_leaderboard, [board, board_task, board_setting, board_pick],
                          [board_plot, board_table, board_note], **views_hidden).then(
                leaderboard_samples, [board, board_task, board_setting], board_samples, **views_hidden)
        board_pick.input(shipped_leaderboard, [board, board_task, board_setting, board_pick],
                         [board_plot, board_table, board_note], **views_hidden)
        # A task sample is a run: it takes the model's slot, then the usual views show it as the Run button's do.
        task_inputs = [task_name, task_sample, task_setting, task_names, task_ratio, model]
        sample_outputs = [run_id, status, task_status, task_table, step, layer, head_]
        sampled = model_job(task_button.click, on_task_sample, task_inputs, sample_outputs,
                            show_progress_on=[task_status, status])
        draw(sampled.then)
        # The expected time follows the controls, the page's opening (the model may have loaded since) and a sample.
        for control in (task_name, task_setting, task_names, task_ratio, model):
            control.change(on_task_cost, task_inputs, task_cost, **cost_)
        for event in (tasks_page.select, sampled.then):
            event(on_task_cost, task_inputs, task_cost, **cost_)
        # A shipped sample's row: the controls take it, then it runs as the button's sample does.
        picked = board_samples.select(on_board_sample, [board_samples, board_setting, board],
                                      [task_name, task_sample, task_setting, task_names, task_ratio, model],
                                      queue=False)
        draw(model_job(picked.then, on_task_sample, task_inputs, sample_outputs,
                       show_progress_on=[task_status, status]).then)
        export_button.click(on_export, selectors, export_file, **views_)
        # A lesson step sets the controls and the views from a shipped run: nothing computes.
        lesson_outputs = [lesson, lesson_box, lesson_text, run_id, status, step, layer, head_, prompt, names,
                          budget, evidence, view, view_tabs, pages, board_task]
        for button, move in ((lesson_back, -1), (lesson_next, 1)):
            stepped = button.click(lambda at, move=move: on_lesson_move(at, move), lesson, lesson_outputs, **quick)
            draw(stepped.then).then(lesson_board, [lesson, board], board_outputs, **views_hidden)
        lesson_end.click(on_lesson_end, None, [lesson, lesson_box], **quick)
        # The plain page asks nothing of the server: it is built showing the first run (summary, view in sight,
        # cost). A query (?lesson=, ?run=, ?tab=) reaches the server through a hidden box the browser fills, and
        # never waits behind the queue: a lesson and ?run=ID read shipped files or the store only.
        page_query = gr.Textbox("", visible=False, elem_id="page-query")
        demo.load(None, None, page_query, js="() => window.location.search", **hidden)
        loaded = page_query.change(on_load, None, lesson_outputs, queue=False, **hidden)
        drawn = loaded.then(render_run_after_load, [run_id, view], run_views, trigger_mode="always_last",
                            **views_hidden).then(
            render_views, [*selectors, *zoom_controls, view], views, trigger_mode="always_last", **views_hidden)
        drawn.then(lesson_board, [lesson, board], board_outputs, **views_hidden)
    demo.first_paint = first_paint(first, [tab.label for tab in pages.children])
    return demo


demo = build()
demo.queue(default_concurrency_limit=1, max_size=QUEUE_SIZE)
# Gradio's queue looks for a new event every millisecond, and for progress to send every 10 ms, while nothing is
# queued: a tenth of a core for an idle app, on a shared two-vCPU server. Every 20 ms and 100 ms: an event waits 10 ms
# more on average before it starts (a run takes seconds), and progress moves ten times a second (its timer shows
# tenths). Gradio has no public setting for either; an attribute it renames leaves its own.
for attribute, seconds in (("sleep_when_free", QUEUE_POLL_S), ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
    if hasattr(demo._queue, attribute):
        setattr(demo._queue, attribute, seconds)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# How long the page may take to answer the check Gradio's launch makes. Gradio asks once and gives it 3 s, then stops
# the app ("When localhost is not accessible, a shareable link must be created"); a starved server answers later: a
# Space's cold start on two busy vCPUs, or a machine already loaded, with the app at low priority.
PAGE_PATIENCE_S = 300


@contextmanager
def patient_page_check(patience_s: float = PAGE_PATIENCE_S):
    """While it runs, the check Gradio's launch makes that localhost serves the page waits up to ``patience_s`` for
    the answer. The check itself stays: a page that does not answer 200 in time, or a refused connection (localhost
    not accessible, what the check is for), goes on to Gradio's own check, which then stops the app as before."""
    from gradio import networking

    gradios_check = networking.url_ok

    def page_answers(url: str) -> bool:
        try:
            if httpx.head(url, timeout=patience_s, verify=False).status_code == 200:  # verify: as Gradio's check
                return True
        except httpx.HTTPError:
            pass
        return gradios_check(url)

    networking.url_ok = page_answers
    try:
        yield
    finally:
        networking.url_ok = gradios_check


def warm_up() -> None:
    """Load the default model, then time one plain forward of a task sample's length: what the Tasks tab's expected
    time is counted in (``api.sample_cost_line``). A second or so of one core, once."""
    try:
        api.time_plain_forward(api.get_model(), api.TASK_LENGTHS[0])
    except RequestError as err:  # the first run says it again, as its one line
        logging.getLogger(__name__).warning("the default model did not load: %s", err)


def launch(**options) -> None:
    """Serve the app (``options`` go to ``demo.launch``, e.g. ``prevent_thread_lock`` in tests)."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    remove_orphaned_exports()
    atexit.register(remove_exports)
    blocking = not options.pop("prevent_thread_lock", False)
    if blocking and threading.current_thread() is threading.main_thread():
        # SIGTERM (docker stop, a Space restarting) closes the server as Ctrl-C does: Gradio deletes its files,
        # then the exit handlers run.
        signal.signal(signal.SIGTERM, _interrupt)
    # Localhost unless the deployment says otherwise (the Dockerfile and Spaces set GRADIO_SERVER_NAME).
    settings = {"server_name": os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                "server_port": int(os.environ.get("GRADIO_SERVER_PORT", "7860")), **options}
    # The footer keeps the API docs and Gradio's credit (its settings button's icon repeats its label to a screen
    # reader).
    with patient_page_check():
        demo.launch(css_paths=[ROOT / "assets" / "style.css"], max_file_size=1, head=page_head(),
                    footer_links=["api", "gradio"],
                    # The page inlines its config (300 kB): compressed, it is a seventh of that. Event streams pass
                    # as they are.
                    app_kwargs={"middleware": [Middleware(RequestGuard, max_body=MAX_BODY, refuse=unknown_function),
                                               Middleware(GZipMiddleware, minimum_size=4096),
                                               Middleware(FirstPaint, fragment=demo.first_paint,
                                                          script=status_timer_script().encode())],
                                "exception_handlers": {FnIndexInferError: unknown_endpoint}},
                    prevent_thread_lock=True, **settings)
    # Load (and on first use convert) the default model before the first click, but once the page is served: during
    # the launch, a load takes the CPU and the interpreter's lock the server's thread needs to answer the check.
    threading.Thread(target=warm_up, daemon=True).start()
    if blocking:
        demo.block_thread()


if __name__ == "__main__":
    launch()
