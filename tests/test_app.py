"""The app's helpers without a browser: controls -> specs, requests, run ids, deep links, export."""
import io
import json
import os
import re
import sqlite3
import subprocess
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace

import diskcache
import numpy as np
import pytest

import app
from backend import api
from backend.limits import Limits
from backend.engine.models import DEFAULT_MODEL
from backend.policies import parse_spec
from backend.api import RequestError, RunRequest
from backend.traces.store import TraceStore
from tests.conftest import free_port


def test_controls_become_specs_every_policy_accepts():
    specs = app.specs_from_controls(app.POLICY_CHOICES, 40, 4, 0.3, "paper default", "tova:budget=8,heads=head\n")
    assert specs[:3] == ["full", "window:budget=40", "sinks:budget=40"]  # a policy prints its own spec
    assert "a2sf:budget=40,alpha=0.3" in specs and specs[-1] == "tova:budget=8,heads=head"
    for budget in (4, 8, 12, 40, 128, app.MAX_BUDGET):
        for spec in app.specs_from_controls(app.POLICY_CHOICES, budget, 8, 0.1, "head", ""):
            parse_spec(spec)  # small budgets shrink sinks and ReAttention's parts instead of failing
    assert app.specs_from_controls(["tova", "h2o"], 40, 4, 0.1, "layer", "") == ["tova:budget=40", "h2o:budget=40,heads=layer"]


@pytest.mark.parametrize("request_, message", [
    (RunRequest(prompt="  ", specs=["tova"]), "Type a prompt"),
    (RunRequest(prompt="hi", specs=[]), "Pick at least one policy"),
    (RunRequest(prompt="hi", specs=["tova"] * 9), "At most 8 policies"),
    (RunRequest(prompt="hi", specs=["tova:budget=0"]), "budget must be an integer >= 1"),
    (RunRequest(prompt="hi", specs=["lru"]), "unknown policy"),
    (RunRequest(prompt="hi", specs=["tova"], max_new_tokens=0), "Max new tokens"),
    (RunRequest(prompt="hi", specs=["tova"], model="../../etc/passwd"), "unknown model"),
])
def test_bad_requests_are_messages_not_tracebacks(tmp_path, request_, message):
    with pytest.raises(RequestError, match=message):
        api.run(request_, TraceStore(tmp_path))


def test_run_reopens_from_its_id_and_exports(tiny_session):
    request = RunRequest(prompt="the cat sat on the mat, the dog sat on the log", specs=["tova:budget=6", "h2o:budget=6"],
                         mode="generate", max_new_tokens=5)
    run = api.run(request, tiny_session)
    again = api.reopen(run.run_id, tiny_session)
    assert [t.spec for t in again.traces] == ["tova:budget=6", "h2o:budget=6"]
    np.testing.assert_array_equal(again.traces[0].evicted_at, run.traces[0].evicted_at)
    with zipfile.ZipFile(io.BytesIO(api.export_zip(again))) as z:
        names = z.namelist()
        assert "run.json" in names and "00-tova-budget-6.npz" in names and "02-full.json" in names
        with np.load(io.BytesIO(z.read("00-tova-budget-6.npz")), allow_pickle=False) as npz:
            assert npz["evicted_at"].shape == run.traces[0].evicted_at.shape
        assert json.loads(z.read("01-h2o-budget-6.json"))["policy"] == "h2o"


@pytest.mark.parametrize("run_id, message", [("../../etc/passwd", "does not name a run"), ("0" * 32, "no longer stored")])
def test_deep_links_to_nothing_say_so(tiny_session, run_id, message):
    with pytest.raises(RequestError, match=message):
        api.reopen(run_id, tiny_session)
    returned_id, status = app.on_load(SimpleNamespace(query_params={"run": run_id}))[3:5]
    assert returned_id is None and message in status


def test_deep_link_and_views_render_a_stored_run(tiny_session):
    run = api.run(RunRequest(prompt="one two three four five six seven eight nine ten",
                                     specs=["tova:budget=6", "oracle:budget=6", "sparq:budget=6,r=4"], mode="prompt"),
                          tiny_session)
    app.RECENT_RUNS.clear()
    run_id, status = app.on_load(SimpleNamespace(query_params={"run": run.run_id}))[3:5]
    assert run_id == run.run_id and "shared run" in status
    summary, divergence, continuations, first_token, non_recent, by_position, pos_table, share = app.render_run(run_id)
    assert {d.name for d in first_token.data} == {"tova:budget=6", "oracle:budget=6", "sparq:budget=6,r=4"}
    assert len(first_token.data[0].y) == 2 and len(non_recent.data) == 3  # per layer of the tiny model
    assert [part.split('"')[0] for part in summary.split('<tr data-policy="')[1:]] == [
        "full", "tova:budget=6", "oracle:budget=6", "sparq:budget=6,r=4"]  # the answers, Full's first
    assert run.run_id in share and "no continuations" in continuations
    heatmap, reach, reach_distance, kept, curves, curves_steps, row, _forms = app.render_views(run_id, "1", "0", 30, 0.3)
    assert len(heatmap.data) == 3 and kept.count("at step 30") == 3 and curves.data and curves_steps.data
    assert "at step 30" in reach.layout.title.text and len(reach_distance.data) == 3
    assert len(heatmap.layout.shapes) == 3 and "at step 30" in row.layout.title.text  # the step's row, marked
    n = len(run.traces[0].tokens)
    zoomed = app.render_heatmap(run_id, "1", "0", True, 2, 1, 64)  # the window is moved inside the short text
    assert np.asarray(zoomed.data[0].z).shape == (n, n) and "steps 0–" in zoomed.layout.title.text
    assert app.on_tsne(run_id, "tova", "1", "0").data
    numbers = summary.split('class="kvl-metrics"')[1]
    assert [h in numbers for h in ("Token 0 kept", "Non-recent share", "Decides", "Budget shared")] == [True] * 4
    assert numbers.count(">every step<") == 1 and numbers.count(">before every query<") == 2
    assert "Similarity to oracle" in numbers
    with zipfile.ZipFile(app.on_export(run_id, "all", "all", 5, 0.3)) as z:
        figures = z.read("figures.html").decode()
        assert figures.count("plotly-graph-div") >= 7 and "tova:budget=6" in figures


def test_a_shown_run_computes_its_slow_views_once(tiny_session, monkeypatch):
    """The non-recent shares (summary and retention), the POS table and a t-SNE embedding are made once per
    run the app shows; the export reuses the shares and never tags."""
    run = api.run(RunRequest(prompt="one two three four five six seven eight nine ten",
                             specs=["tova:budget=6"], mode="prompt"), tiny_session)
    calls = []

    def counted(name):
        real = getattr(app.panels, name)
        monkeypatch.setattr(app.panels, name, lambda *a: calls.append(name) or real(*a))

    for name in ("non_recent_shares", "pos_lifetime_table", "tsne_embedding"):
        counted(name)
    app.RECENT_RUNS.clear()
    first = app.render_run(run.run_id)
    again = app.render_run(run.run_id)
    assert first[0] == again[0] and first[6].equals(again[6])
    app.on_tsne(run.run_id, "tova", "1", "0")
    app.on_tsne(run.run_id, "tova", "1", "0")
    app.on_tsne(run.run_id, "tova", "0", "0")  # another layer: its own embedding
    app.on_export(run.run_id, "all", "all", 5, 0.3)
    assert sorted(calls) == ["non_recent_shares", "pos_lifetime_table", "tsne_embedding", "tsne_embedding"]


def test_the_views_draw_chain_defers_a_step_still_pending_and_never_drops_it():
    """Gradio skips an event whose own earlier call is pending (trigger mode "once"), and with it the rest of its
    chain: a second view opened while the first still draws would stay empty, or its plots hidden. So every step
    that draws or shows the run's views waits for the pending one instead. Play is the exception: a tick that comes
    while one is drawn is meant to be skipped, and so is a second press of Play before the first is answered."""
    config = app.demo.get_config_file()
    elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    plots = {"heatmap", "curves", "kept", "reach", "summary"}
    drawing = [d for d in config["dependencies"] if plots & {elem_ids[i] for i in d["outputs"]}
               and d["api_name"] not in ("on_play", "on_tick")]
    chained = [d for d in drawing if d.get("trigger_after") is not None]
    assert len(chained) >= 4  # the draw chain and the page load's: draw, then show
    dropped = [(d["api_name"], d["targets"]) for d in drawing if d["trigger_mode"] == "once"]
    assert not dropped, f"events that would drop a draw: {dropped}"


def test_every_event_that_shows_a_run_asks_the_one_draw_chain_so_the_last_asked_finishes_last():
    """With a chain of its own per event, a tab opened just before a run replayed from the store would draw the run
    shown before over the new run's masks: two chains draw at once and the slower finishes last. So the Run button,
    the budget, a tab, a needle cell, a task sample and a lesson step each move one counter, whose change starts the
    only chain that draws after a run (the page load's draws before any); its steps defer to their own pending calls,
    in order."""
    config = app.demo.get_config_file()
    elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    by_id = {d["id"]: d for d in config["dependencies"]}
    counter = next(i for i, name in elem_ids.items() if name == "draws")
    summaries = [d for d in config["dependencies"] if "summary" in {elem_ids[i] for i in d["outputs"]}
                 and d["api_name"] != "render_run_after_load"]
    assert [d["api_name"] for d in summaries] == ["render_run"]

    def first_of(d):
        while d.get("trigger_after") is not None:
            d = by_id[d["trigger_after"]]
        return d

    assert [t[0] for t in first_of(summaries[0])["targets"]] == [counter]
    askers = [d for d in config["dependencies"] if counter in d["outputs"]]
    asked_after = {elem_ids.get(first_of(d)["targets"][0][0]) for d in askers}
    assert {"run", "budget", "view-in-sight", "needle-cells", "lesson-next", "lesson-back"} <= asked_after
    assert all(d["trigger_mode"] == "always_last" for d in askers)


def test_a_runs_progress_shows_on_its_status_line_only():
    """A run's progress bar and timer show on the status line (and a task sample's on the Tasks page's too), not
    again over the layer, head and step controls the run also sets."""
    config = app.demo.get_config_file()
    elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    in_the_model_slot = {index for index, fn in app.demo.fns.items() if fn.concurrency_id == app.MODEL_SLOT}
    runs = [d for d in config["dependencies"] if d["id"] in in_the_model_slot
            and {"status", "layer", "head", "step"} <= {elem_ids[i] for i in d["outputs"]}]
    assert {re.sub(r"_\d+$", "", d["api_name"]) for d in runs} == {"on_run", "on_needle_cell", "on_task_sample"}
    for d in runs:
        assert {elem_ids[i] for i in d["show_progress_on"]} in ({"status"}, {"status", "task-status"}), d["api_name"]


def test_zoom_controls_become_a_window_inside_the_text():
    run = SimpleNamespace(traces=[SimpleNamespace(tokens=np.arange(1000))])
    assert app.panels.zoom_window(run, False, 10, 10, 64) is None  # off: the whole text, binned
    assert app.panels.zoom_window(run, True, 900, -5, 256) == (744, 0, 256)  # moved inside the text
    assert app.panels.zoom_window(run, True, None, 3.0, 9999) == (0, 3, 256)  # blank box, size out of the choices
    # What the raw API may send instead of numbers: still a window, never an error.
    assert app.panels.zoom_window(run, True, float("nan"), "abc", "inf") == (0, 0, 256)
    assert app.panels.zoom_window(run, True, float("inf"), [], "64") == (0, 0, 64)


def test_the_summary_says_what_it_shows_before_any_run_and_its_columns_after(tiny_session):
    """The page is built showing the shipped first run's answers; without a run the summary says what a run will
    show; after one, each answer and the numbers' columns."""
    from viz import panels

    config = next(c["props"] for c in app.demo.config["components"] if c["props"].get("elem_id") == "summary")
    assert "317" in config["value"] and "reattention:budget=40" in config["value"]
    assert app.render_run(None)[0] == app.SUMMARY_PLACEHOLDER
    headers = ["Policy", "Perplexity", "Mean KL to Full (nats)", "Top-1 agreement", "Token 0 kept",
               "Non-recent share", "Decides", "Budget shared"]
    assert list(panels.SUMMARY_HEADERS) == headers
    run = api.run(RunRequest(prompt="the cat sat on the mat", specs=["tova:budget=6"], mode="prompt"), tiny_session)
    numbers = app.render_run(run.run_id)[0].split('class="kvl-metrics"')[1]
    assert [f'<th scope="col">{h}</th>' in numbers for h in headers] == [True] * len(headers)


def test_the_part_of_speech_table_says_what_it_waits_for_before_any_run():
    from viz import panels

    config = next(c["props"] for c in app.demo.config["components"]
                  if c["props"].get("label") == "Mean lifetime by part of speech")
    assert config["value"]["headers"] == ["note"]
    assert config["value"]["data"] == [list(panels.pos_placeholder()["note"])]


def test_summary_has_no_oracle_column_without_an_oracle(tiny_session):
    run = api.run(RunRequest(prompt="one two three four five six seven eight nine ten",
                                     specs=["tova:budget=6"], mode="prompt"), tiny_session)
    summary = app.render_run(run.run_id)[0]
    assert "Similarity to oracle" not in summary and "Perplexity" in summary


def test_too_long_prompt_is_refused(tiny_session):
    with pytest.raises(RequestError, match="limit here is 10"):
        api.run(RunRequest(prompt="x" * 11, specs=["tova"], mode="prompt"), tiny_session,
                        limits=Limits(prompt_tokens=10))


def test_budget_sweep_stores_every_budget_and_the_slider_replays(tiny_session):
    prompt = "the quick brown fox jumps over the lazy dog and runs away"
    figure, message = app.on_sweep(prompt, "prompt", 8, ["tova", "sinks", "reattention"], 4, 0.1, "paper default",
                                   DEFAULT_MODEL, progress=lambda *a, **k: None)
    assert len(figure.data) == 3 and "replays" in message
    run_id, status, _, layers, heads = app.on_run(prompt, "prompt", 8, ["tova", "sinks", "reattention"], 16, 4, 0.1,
                                                  "paper default", "", DEFAULT_MODEL, progress=lambda *a, **k: None)
    assert "replayed from the store" in status
    assert layers["choices"] == ["all", "0", "1"] and heads["choices"] == ["all", "0", "1"]  # the tiny model


def test_a_store_that_cannot_write_says_the_run_is_not_cached_and_offers_no_link(tiny_session, monkeypatch):
    def disk_full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")

    with monkeypatch.context() as full:
        full.setattr(diskcache.Cache, "_row_insert", disk_full)
        full.setattr(diskcache.Cache, "_row_update", disk_full)
        run_id, status, *_ = app.on_run("the cat sat on the mat", "prompt", 8, ["tova"], 16, 4, 0.1, "paper default",
                                        "", DEFAULT_MODEL, progress=lambda *a, **k: None)
        assert status.endswith("computed. The trace store cannot keep runs here, so this run is not cached."), status
        share = app.render_run(run_id)[-1]
        assert "?run=" not in share and run_id not in share and "not stored" in share
        with pytest.raises(RequestError, match="no longer stored"):
            api.reopen(run_id, tiny_session)
    # Space again: the same run is stored, with its link.
    run_id, status, *_ = app.on_run("the cat sat on the mat", "prompt", 8, ["tova"], 16, 4, 0.1, "paper default", "",
                                    DEFAULT_MODEL, progress=lambda *a, **k: None)
    assert status.endswith("computed.") and f"?run={run_id}" in app.render_run(run_id)[-1]


def test_a_sweep_the_store_cannot_keep_says_so_in_one_line(tiny_session, monkeypatch):
    def disk_full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "_row_insert", disk_full)
    monkeypatch.setattr(diskcache.Cache, "_row_update", disk_full)
    figure, message = app.on_sweep("the quick brown fox jumps over the lazy dog", "prompt", 8, ["tova"], 4, 0.1,
                                   "paper default", DEFAULT_MODEL, progress=lambda *a, **k: None)
    assert len(figure.data) == 1 and "\n" not in message
    assert message == ("The trace store could not write here, so these budgets are not stored: moving the budget "
                       "slider computes them again.")


def test_exports_are_pruned_and_folders_of_processes_gone_are_removed(tiny_session, tmp_path, monkeypatch):
    monkeypatch.setattr(app, "EXPORTS", tmp_path / "exports" / f"kvlens-exports-{os.getpid()}")
    run = api.run(RunRequest(prompt="one two three four five six", specs=["tova:budget=4"], mode="prompt"),
                          tiny_session)
    stale = app.on_export(run.run_id, "all", "all", 3, 0.3)
    assert zipfile.is_zipfile(stale)
    old = time.time() - app.EXPORT_TTL_S - 1
    os.utime(Path(stale).parent, (old, old))
    fresh = app.on_export(run.run_id, "all", "all", 3, 0.3)  # the next export prunes the stale one
    assert [p.name for p in app.EXPORTS.iterdir()] == [Path(fresh).parent.name]
    assert app.demo.delete_cache == (app.EXPORT_TTL_S, app.EXPORT_TTL_S)  # Gradio deletes the zips themselves
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = tmp_path / "exports" / f"kvlens-exports-{gone.pid}"
    (orphan / "x").mkdir(parents=True)
    (orphan / "x" / "kvlens-0123456789ab.zip").write_bytes(b"zip")
    assert orphan in app.remove_orphaned_exports()
    assert not orphan.exists() and Path(fresh).exists()  # this process's exports stay while it runs
    app.remove_exports()
    assert not app.EXPORTS.exists()


def test_the_app_binds_localhost_unless_the_deployment_says_otherwise(monkeypatch):
    seen, order = {}, []
    monkeypatch.setattr(app.demo, "launch", lambda **kw: (seen.update(kw), order.append("launched")))
    monkeypatch.setattr(app.demo, "block_thread", lambda: order.append("served until stopped"))
    monkeypatch.setattr(app.threading, "Thread", lambda **kw: SimpleNamespace(start=lambda: order.append("model")))
    monkeypatch.setattr(app.signal, "signal", lambda *a: None)  # pytest keeps its own SIGTERM handling
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    app.launch()
    assert seen["server_name"] == "127.0.0.1" and seen["app_kwargs"]["middleware"][0].cls is app.RequestGuard
    # The model loads once Gradio's launch has seen the page served, not while its server answers the first time.
    assert order == ["launched", "model", "served until stopped"]
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")  # what the Dockerfile and a Space set
    app.launch()
    assert seen["server_name"] == "0.0.0.0"


def test_the_launch_waits_for_a_slow_page_and_still_stops_where_localhost_refuses():
    from gradio import networking

    class SlowPage(BaseHTTPRequestHandler):
        def do_HEAD(self):
            time.sleep(4)  # more than the 3 s Gradio's check waits
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowPage)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url, closed = f"http://127.0.0.1:{server.server_address[1]}/", f"http://127.0.0.1:{free_port()}/"
    gradios_check = networking.url_ok
    try:
        assert not gradios_check(url)
        with app.patient_page_check(patience_s=30):
            assert networking.url_ok(url)
            started = time.monotonic()
            assert not networking.url_ok(closed)  # localhost not accessible: no wait, Gradio's answer
            assert time.monotonic() - started < 5
        assert networking.url_ok is gradios_check
    finally:
        server.shutdown()
        server.server_close()



def test_the_page_lists_example_labels_and_a_click_fetches_the_text():
    listed = next(block for block in app.demo.blocks.values() if getattr(block, "elem_id", None) == "examples")
    assert [sample[0] for sample in listed.samples] == list(app.EXAMPLES)  # labels only: the page stays light
    assert len(app.EXAMPLES["needle 8k tokens"]) > 30_000
    assert app.example_text(["needle 8k tokens"]) == app.EXAMPLES["needle 8k tokens"]
    for sample in (["no such example"], [], None, [3], "needle"[:2]):  # what a raw API call may send
        assert app.example_text(sample) == {"__type__": "update"}  # nothing changes


def _served(fragment: bytes, path: str, body: bytes, content_type: str = "text/html; charset=utf-8",
            method: str = "GET", script: bytes = b"") -> tuple[int, bytes, str]:
    """What ``app.FirstPaint`` sends for one request to a page that answers ``body``."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import Response
    from starlette.routing import Route
    from starlette.testclient import TestClient

    page = Starlette(routes=[Route("/", lambda request: Response(body, media_type=content_type),
                                   methods=["GET", "POST"]),
                             Route("/config", lambda request: Response(body, media_type=content_type))],
                     middleware=[Middleware(app.FirstPaint, fragment=fragment, script=script)])
    answer = TestClient(page).request(method, path)
    assert int(answer.headers["content-length"]) == len(answer.content)
    return answer.status_code, answer.content, answer.headers["content-type"]


def test_the_plain_landing_alone_carries_the_first_screens_copy_first_in_its_body():
    body = b"<html><head></head><body><gradio-app eager></gradio-app><gradio-app></gradio-app></body></html>"
    status, sent, _ = _served(b"<div>copy</div>", "/", body)
    assert status == 200 and sent == body.replace(b"<gradio-app eager>", b"<div>copy</div><gradio-app eager>")
    for path, method in (("/?lesson=window", "GET"), ("/?run=0123456789ab", "GET"), ("/config", "GET"),
                         ("/", "POST")):
        assert _served(b"<div>copy</div>", path, body, method=method)[1] == body, path  # a lesson opens on its own
    assert _served(b"<div>copy</div>", "/", body, content_type="application/json")[1] == body
    assert _served(b"", "/", body)[1] == body  # no shipped first run: nothing to copy


def test_every_page_carries_the_status_timer_script_before_gradios_app():
    body = b"<html><head></head><body><gradio-app eager></gradio-app></body></html>"
    script = b"<script>timers()</script>"
    for path, copy in (("/", b"<div>copy</div>"), ("/?lesson=window", b""), ("/?run=0123456789ab", b"")):
        sent = _served(b"<div>copy</div>", path, body, script=script)[1]
        assert sent == body.replace(b"<gradio-app", script + copy + b"<gradio-app"), path
    assert _served(b"", "/", body, script=script)[1] == body.replace(b"<gradio-app", script + b"<gradio-app")
    for path, method in (("/config", "GET"), ("/", "POST")):
        assert _served(b"", path, body, method=method, script=script)[1] == body, path


def test_an_idle_queue_looks_for_work_every_20_ms_not_every_millisecond():
    """Gradio's queue polls while nothing is queued (1 ms for events, 10 ms for progress: a tenth of a core for an
    idle app). The app sets both on its queue; should Gradio rename them, this says so."""
    queue = app.demo._queue
    assert {"sleep_when_free", "progress_update_sleep_when_free"} <= set(vars(queue))
    assert (queue.sleep_when_free, queue.progress_update_sleep_when_free) == (app.QUEUE_POLL_S, app.PROGRESS_POLL_S)
    assert app.QUEUE_POLL_S <= 0.05  # an event waits at most this long before it starts


def test_the_first_paint_is_the_shipped_runs_answers_inert_and_without_the_pages_ids():
    copy = app.demo.first_paint.decode()
    assert copy.startswith('<div id="kvl-first-paint" aria-hidden="true" inert>')
    assert re.findall(r'\sid="([^"]*)"', copy) == ["kvl-first-paint"]  # nothing answers for the page's elements
    assert "The meeting room number is 317." in copy and "The meeting room number is 1234." in copy
    assert ">Run<" in copy and "Tasks leaderboard" in copy and app.FIRST_STATUS in copy
    assert not re.search(r"<(button|input|textarea|select|a)\b", copy)  # nothing to click or type into
    # Text is escaped where it becomes HTML; the page's own HTML (header, summary) goes in as it is.
    from viz.first_paint import first_paint_html

    hostile = first_paint_html("<h1>KV</h1>", ["<b>tab</b>"], "<script>x()</script>", "a & b", "fold",
                               "<table></table>", ["<img src=x>"])
    assert "<script>x()" not in hostile and "&lt;script&gt;x()" in hostile and "&lt;b&gt;tab" in hostile
    assert "&lt;img src=x&gt;" in hostile and "a &amp; b" in hostile and "<h1>KV</h1>" in hostile
