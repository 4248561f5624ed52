"""Bad and hostile input, through the front door, the app's checks and the real HTTP API: each gets a
one-line message (never a traceback, a hang or a bare "Error"), and what already worked keeps working.
The list mirrors docs/robustness.md ("Bad input").
"""
import html
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import plotly.graph_objects as go
import pytest

import app
from backend import guard
from backend.engine import models
from backend import api
from backend.runs import link_key
from backend.limits import Limits
from backend.engine.models import DEFAULT_MODEL
from backend.api import RequestError, RunRequest
from backend.traces.store import TraceStore
from tests.conftest import free_port, make_tiny

LIMITS = Limits()


def request(**changes) -> RunRequest:
    return RunRequest(**{"prompt": "the cat sat on the mat and looked at the dog", "specs": ["tova:budget=6"],
                         "mode": "prompt", **changes})


BAD_REQUESTS = [
    # (what, request, message)
    ("empty prompt", request(prompt="   "), "Type a prompt"),
    ("oversize prompt", request(prompt="x" * (LIMITS.text_chars + 1)), "characters long; the limit here is"),
    ("lone surrogate in the prompt", request(prompt="caf\ud800"), "not valid Unicode at position 3"),
    ("lone surrogate in a spec", request(specs=["tova:heads=\udfff"]), "A policy spec contains a character"),
    ("duplicate parameter", request(specs=["tova:budget=8,budget=9"]), "parameter budget is given twice"),
    ("underscore digits", request(specs=["tova:budget=1_0"]), "must be an integer of at most 9 digits"),
    ("huge integer", request(specs=["tova:budget=99999999999"]), "must be an integer of at most 9 digits"),
    ("nan", request(specs=["a2sf:alpha=nan"]), "must be a decimal number"),
    ("negative sentinel, h2o", request(specs=["h2o:recent=-7"]), "recent must be >= 0, or -1 for budget // 2"),
    ("negative sentinel, sparq", request(specs=["sparq:local=-7"]), "local must be >= 0, or -1 for budget // 4"),
    ("same policy twice", request(specs=["tova:budget=64", "tova"]), "is the same as"),
    ("unknown policy", request(specs=["lru"]), "unknown policy"),
    ("no policy", request(specs=[" "]), "Pick at least one policy"),
    ("too many policies", request(specs=[f"tova:budget={b}" for b in range(4, 13)]), "At most 8 policies"),
    ("policies not a list", request(specs="tova"), "must be a list of specs"),
    ("unknown mode", request(mode="<b>x</b>"), "Unknown mode"),
    ("max new tokens too big", request(max_new_tokens=10_000), "Max new tokens must be a whole number from 1 to 256"),
    ("max new tokens zero", request(max_new_tokens=0), "Max new tokens"),
    ("max new tokens fractional", request(max_new_tokens=2.5), "Max new tokens"),
    ("max new tokens a string", request(max_new_tokens="8"), "Max new tokens"),
    ("unknown model", request(model="../../etc/passwd"), "unknown model"),
    ("model as a hub id not allowed", request(model="evil/remote-code"), "unknown model"),
]


@pytest.mark.parametrize("what, bad, message", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_cheap_checks_refuse_bad_requests_with_one_line_and_no_model(what, bad, message, monkeypatch):
    monkeypatch.setattr(api, "get_model", lambda *a: pytest.fail("a cheap check must not load the model"))
    with pytest.raises(RequestError) as err:
        api.check_run(bad)
    assert message in str(err.value) and len(str(err.value).splitlines()) == 1


def test_a_20_mb_prompt_is_refused_by_its_size_before_tokenizing(monkeypatch, tiny_session):
    monkeypatch.setattr(type(models.LOADED[DEFAULT_MODEL]), "encode",
                        lambda *a, **k: pytest.fail("must not tokenize"))
    with pytest.raises(RequestError, match="20,000,000 characters long"):  # refused by size: encode never runs
        api.run(request(prompt="x" * 20_000_000), tiny_session)


def test_the_text_limits_message_names_real_numbers_on_the_space_and_the_command_line():
    with pytest.raises(RequestError) as space:
        api.check_run(request(prompt="x" * (LIMITS.text_chars + 1)), LIMITS)
    assert str(space.value).endswith("the limit here is 196,608 characters and 32,768 tokens.")
    with pytest.raises(RequestError) as machine:  # a 17 MB text: the model's context bounds its tokens
        api.check_run(request(prompt="x" * 17_000_000), Limits.for_machine({}))
    assert str(machine.value) == ("The prompt is 17,000,000 characters long; the limit here is 16,777,216 "
                                  "characters and as many tokens as the model reads.")


@pytest.mark.parametrize("what, bad, message", [
    ("sparq r above the head size (8 in the tiny model)", request(specs=["sparq:budget=6,r=9"]), "r must be <= the model's head size 8"),
    ("one-token text", request(prompt="a"), "at least 2 tokens"),
    ("one-token text, generate mode without chat", request(prompt="a", mode="generate", chat=False), "at least 2 tokens"),
    ("cost over the limit", request(specs=[f"tova:budget={b}" for b in range(4, 9)], prompt="y" * 30),
     "row-tokens one request may use"),
])
def test_model_side_checks_refuse_before_running(tiny_session, what, bad, message):
    with pytest.raises(RequestError, match=message):
        api.run(bad, tiny_session, limits=Limits(row_tokens=100))


@pytest.mark.parametrize("link", ["", "../../etc/passwd", "0" * 64, "a" * 32 + "\n", "A" * 32, None, 42])
def test_malformed_deep_links_say_they_name_no_run(tiny_session, link):
    with pytest.raises(RequestError, match="does not name a run"):
        api.reopen(link, tiny_session)


def test_a_trace_key_used_as_a_link_is_not_a_run_and_ids_are_unguessable(tiny_session):
    first = api.run(request(), tiny_session)
    second = api.run(request(), tiny_session)
    assert first.run_id != second.run_id  # the same request twice: two links, one set of traces
    assert second.replayed == [True] and first.keys == second.keys
    with pytest.raises(RequestError, match="does not name a run"):
        api.reopen(first.keys[0], tiny_session)  # 64 hex: a trace key, not a link
    returned, status = app.on_load(type("R", (), {"query_params": {"run": first.keys[0][:32]}})())[3:5]
    assert returned is None and "no longer stored" in status
    assert api.reopen(first.run_id, tiny_session).traces[0].spec == "tova:budget=6"


def test_a_damaged_manifest_reads_as_no_run(tiny_session):
    run = api.run(request(), tiny_session)
    tiny_session.put(link_key(run.run_id), b"\xff\xfe not json")
    with pytest.raises(RequestError, match="does not name a run"):
        api.reopen(run.run_id, tiny_session)


def test_error_messages_shown_on_the_page_are_escaped():
    err = app.shown(RequestError("Policy: unknown policy '<img src=x onerror=alert(1)>'"))
    assert "<img" not in err.message and html.escape("<img src=x onerror=alert(1)>") in err.message


def test_validator_messages_carry_no_markup_a_visitor_typed():
    controls = ("hi there", "prompt", 8, ["tova"], 40, 4, 0.1, "paper default")
    verdict = app.check_run(*controls, "<script>alert(1)</script>", DEFAULT_MODEL, request=visitor("s-markup"))[0]
    assert verdict["is_valid"] is False and "unknown policy" in verdict["message"]
    assert "<" not in verdict["message"] and "‹script>alert(1)‹/script>" in verdict["message"]
    budget = app.check_run("hi", "prompt", 8, ["tova"], 40, 4, 0.1, "paper default", "tova:budget=0",
                           DEFAULT_MODEL, request=visitor("s-markup"))[0]
    assert ">= 1" in budget["message"]  # the app's own comparisons stay as they are


def visitor(session: str | None, host: str = "10.0.0.1"):
    """A request as the validator and the run see it: a session, an address, and the HTTP request's state."""
    return SimpleNamespace(session_hash=session, client=SimpleNamespace(host=host),
                           request=SimpleNamespace(state=SimpleNamespace()))


def test_the_validator_refuses_outside_the_model_slot_and_gates_one_job_per_session(monkeypatch):
    monkeypatch.setattr(api, "get_model", lambda *a: pytest.fail("the validator must not load the model"))
    first, second = visitor("s1"), visitor("s1")
    controls = ("hi there", "prompt", 8, ["tova"], 40, 4, 0.1, "paper default", "", DEFAULT_MODEL)
    bad = app.check_run("x" * (LIMITS.text_chars + 1), *controls[1:], request=first)
    assert bad[0]["is_valid"] is False and "characters long" in bad[0]["message"] and len(bad) == 11
    ok = app.check_run(*controls, request=first)
    assert all(v["is_valid"] for v in ok)
    again = app.check_run(*controls, request=second)  # the first job has not ended yet
    assert again[0]["is_valid"] is False and "still waiting or running" in again[0]["message"]
    app._leave(first)
    assert all(v["is_valid"] for v in app.check_run(*controls, request=second))
    app._leave(second)
    assert len(app.ADMISSION) == 0


def test_a_run_frees_the_slot_its_validator_took_though_its_session_changed_in_between(monkeypatch):
    # A raw API call has no session at the validator; Gradio gives its run one afterwards.
    monkeypatch.setattr(app, "ADMISSION", guard.Admission(per_session=1, per_address=1))
    controls = ("hi there", "prompt", 8, ["tova"], 40, 4, 0.1, "paper default", "", DEFAULT_MODEL)
    for _ in range(3):
        call = visitor(None)
        assert all(v["is_valid"] for v in app.check_run(*controls, request=call))
        call.session_hash = f"event-{time.time_ns()}"
        app._leave(call)
        assert len(app.ADMISSION) == 0


def test_controls_out_of_range_from_the_raw_api_are_messages():
    for budget, sinks in ((-5, 4), ("x", 4), (40, None)):
        with pytest.raises(RequestError):
            api.check_run(app.run_request("hi there", "prompt", 8, ["sinks"], budget, sinks, 0.1, "paper default",
                                              "", DEFAULT_MODEL))


# --- The real HTTP API, served in this process with the tiny model -----------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    saved = dict(models.LOADED)
    models.LOADED[DEFAULT_MODEL] = make_tiny()
    store, app.STORE = app.STORE, TraceStore(tmp_path_factory.mktemp("store"))
    port = free_port()
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    yield f"http://127.0.0.1:{port}"
    app.demo.close()
    app.STORE = store
    models.LOADED.clear()
    models.LOADED.update(saved)


def join(url: str, data: list, fn: str = "on_run") -> httpx.Response:
    """Queue one event the way the page does (fn_index of the named function)."""
    config = httpx.get(f"{url}/config").json()
    index = next(d["id"] for d in config["dependencies"] if d.get("api_name") == fn)
    body = {"data": data, "fn_index": index, "session_hash": f"test-{time.time_ns()}", "event_data": None,
            "trigger_id": None}
    # ASCII JSON, as a browser's JSON.stringify sends a lone surrogate: "\ud800"
    return httpx.post(f"{url}/gradio_api/queue/join", timeout=30, content=json.dumps(body, ensure_ascii=True),
                      headers={"content-type": "application/json"})


CONTROLS = ["prompt", 8, ["tova"], 40, 4, 0.1, "paper default", "", DEFAULT_MODEL, ""]  # ... model, evidence


def test_uploads_are_refused_and_nothing_is_kept(server):
    response = httpx.post(f"{server}/gradio_api/upload", files={"files": ("a.txt", b"x" * 20_000_000)}, timeout=30)
    assert response.status_code == 403 and "no uploads" in response.text


def test_a_20_mb_api_call_is_refused_by_size_at_the_door(server):
    response = join(server, ["x" * 20_000_000, *CONTROLS])
    assert response.status_code == 413 and "Request too large" in response.text


def test_api_bad_inputs_get_their_one_line_message(server):
    for prompt, specs, message in [("caf\ud800", "", "not valid Unicode"),
                                   ("hello there", "<img src=x onerror=alert(1)>", "unknown policy"),
                                   ("x" * (LIMITS.text_chars + 1), "", "characters long")]:
        data = [prompt, *CONTROLS[:7], specs, DEFAULT_MODEL, ""]
        response = join(server, data)
        assert response.status_code == 422, response.text
        detail = json.loads(response.text)["detail"]
        refused = [d for d in detail if d["is_valid"] is False]
        assert len(refused) == 1 and message in refused[0]["message"]


def test_the_page_still_loads_while_the_queue_is_busy(server):
    assert httpx.get(server, timeout=10).status_code == 200
    assert httpx.get(f"{server}/?run={'0' * 32}", timeout=10).status_code == 200


class HtmlWordTokenizer:
    """A tokenizer whose tokens are hostile HTML pieces, so the views see them as token texts."""

    eos_token_id = None
    chat_template = None
    WORDS = ["<img src=x onerror=alert(1)>", "<script>alert(2)</script>", " & ", "<b>", " plain", "\n"]

    def __call__(self, text):
        ids = []
        rest = text
        while rest:
            match = next((i for i, w in enumerate(self.WORDS) if rest.startswith(w)), None)
            ids.append(match if match is not None else 4)
            rest = rest[len(self.WORDS[match]):] if match is not None else rest[1:]
        return type("Encoded", (), {"input_ids": ids})()

    def decode(self, ids):
        return "".join(self.WORDS[i % len(self.WORDS)] for i in ids)


def test_html_in_the_prompt_is_text_in_every_view(tmp_path, monkeypatch):
    lm = make_tiny()
    lm.tokenizer = HtmlWordTokenizer()
    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, lm)
    monkeypatch.setattr(app, "STORE", TraceStore(tmp_path / "store"))
    prompt = "".join(HtmlWordTokenizer.WORDS * 3)
    run = api.run(RunRequest(prompt=prompt, specs=["tova:budget=4", "sinks:budget=4,sinks=1"], mode="generate",
                                     max_new_tokens=4), app.STORE)
    outputs = [*app.render_run(run.run_id), *app.render_views(run.run_id, "all", "all", 5, 0.3)]
    html_outputs = [o for o in outputs if isinstance(o, str)]
    assert len(html_outputs) >= 4  # the summary's answers, continuations, share, kept tokens
    for text in html_outputs:
        assert "<img src=x" not in text and "<script>" not in text
    assert any("&lt;img src=x onerror=alert(1)&gt;" in text for text in html_outputs)
    figures = [o for o in outputs if isinstance(o, go.Figure)]
    for figure in figures:  # plotly renders a subset of HTML in labels: token texts reach it escaped
        assert "<img src=x" not in figure.to_json() and "<script>" not in figure.to_json()
    # The summary's answers are HTML: what the model wrote comes back as the text it is.
    assert "&lt;img src=x onerror=alert(1)&gt;" in outputs[0] and "<img src=x" not in outputs[0]


def test_admission_limits_each_session_and_each_address_and_forgets_lost_jobs(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(guard.time, "monotonic", lambda: clock[0])
    gate = guard.Admission(per_session=1, per_address=2, expire_s=10)
    a, _ = gate.enter("a", "1.2.3.4")
    assert a and gate.enter("b", "1.2.3.4")[0]
    assert gate.enter("a", "5.6.7.8") == (None, "Your previous run is still waiting or running; it comes first.")
    ticket, reason = gate.enter("c", "1.2.3.4")
    assert ticket is None and "from your address" in reason
    assert gate.enter("d", "5.6.7.8")[0]  # another address is not held up
    gate.leave(a)
    assert gate.enter("c", "1.2.3.4")[0]
    clock[0] = 11.0  # jobs whose visitors left while waiting stop counting
    assert gate.enter("b", "1.2.3.4")[0] and gate.enter("e", "1.2.3.4")[0]


def test_admission_refuses_past_the_queue_size_under_a_burst():
    gate = guard.Admission(per_session=1, per_address=200, queue=64)
    start, results = threading.Barrier(80), []

    def enter(n):
        start.wait()
        results.append(gate.enter(f"s{n}", "10.0.0.1"))

    threads = [threading.Thread(target=enter, args=(n,)) for n in range(80)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [reason for ticket, reason in results if ticket is None]
    assert len(gate) == 64 and len(refused) == 16
    assert set(refused) == {"The queue is full (64 runs waiting or running); try again in a few minutes."}


def call_api(url: str, data: list, fn: str = "on_run") -> httpx.Response:
    return httpx.post(f"{url}/gradio_api/call/{fn}", json={"data": data}, timeout=30)


def result_of(url: str, response: httpx.Response, fn: str = "on_run") -> str:
    """The event stream of a call, to its end: "event: complete ..." or "event: error ..."."""
    event_id = response.json()["event_id"]
    return httpx.get(f"{url}/gradio_api/call/{fn}/{event_id}", timeout=120).text


RAW_RUN = ["The cat sat.", "generate", 4, ["tova"], 16, 4, 0.1, "paper default", "", DEFAULT_MODEL, ""]


def test_an_api_client_runs_again_once_its_run_has_ended(server):
    for _ in range(3):
        response = call_api(server, RAW_RUN)
        assert response.status_code == 200, response.text
        assert "event: complete" in result_of(server, response)
    assert len(app.ADMISSION) == 0


def test_a_burst_of_runs_is_refused_politely_at_the_queue_size(server, monkeypatch):
    monkeypatch.setattr(app, "ADMISSION", guard.Admission(per_session=1, per_address=200, queue=app.QUEUE_SIZE))
    release = threading.Event()

    def held_run(*args, **kwargs):  # the model is busy until every request of the burst has its answer
        release.wait(timeout=300)
        raise RequestError("done")

    monkeypatch.setattr(api, "run", held_run)
    with ThreadPoolExecutor(80) as pool:
        responses = list(pool.map(lambda _: call_api(server, RAW_RUN), range(80)))
    release.set()
    accepted = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(accepted) == app.QUEUE_SIZE, [r.text for r in refused][:3]
    for response in refused:
        assert response.status_code == 422
        (message,) = [d["message"] for d in response.json()["detail"] if d["is_valid"] is False]
        assert message.startswith("The queue is full")
    for response in accepted:
        assert "event: error" in result_of(server, response)
    assert len(app.ADMISSION) == 0


def test_an_unknown_endpoint_is_a_404_with_nothing_in_the_log(server, capfd):
    response = call_api(server, [], fn="nope")
    assert response.status_code == 404 and response.text == "No such endpoint."
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.parametrize("path, index", [("queue/join", 9999), ("queue/join", -1), ("queue/join", "9999"),
                                         ("run/predict", 9999)],
                         ids=["join", "join-negative", "join-as-text", "predict"])
def test_an_unknown_function_index_is_a_404_with_nothing_in_the_log(server, capfd, path, index):
    body = {"data": [], "fn_index": index, "session_hash": f"test-{time.time_ns()}", "event_data": None,
            "trigger_id": None}
    response = httpx.post(f"{server}/gradio_api/{path}", json=body, timeout=30)
    assert response.status_code == 404 and response.text == f"No such function: fn_index {int(index)}."
    assert "Traceback" not in capfd.readouterr().err
    assert httpx.post(f"{server}/gradio_api/{path}", json={**body, "fn_index": "x"}, timeout=30).status_code == 422


def test_a_control_out_of_range_is_one_line_with_nothing_in_the_log(server, capfd):
    # The view controls of render_views: layer, head, step, alpha, zoom, first step, first position, window.
    response = call_api(server, ["all", "all", -1e9, 0.3, False, -1e9, 0, 128], fn="render_views")
    assert response.status_code == 200, response.text
    stream = result_of(server, response, fn="render_views")
    assert "event: error" in stream, stream
    message = json.loads(stream.split("data:", 1)[1].strip())
    assert message and "\n" not in str(message), message
    assert "Traceback" not in capfd.readouterr().err


# --- Every route to the model is admitted alike; a click without its data is one line -----------------------

COMPUTES = ("compute_run", "compute_sweep", "compute_needle", "compute_sample")  # what runs the model (zerogpu.gpu)


def calls_the_model(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return getattr(fn, "__module__", None) == "app" and code is not None and bool(set(COMPUTES) & set(code.co_names))


# The app's functions that reach the model, read from their code: a new one is found without being listed here.
RUNNERS = {name for name, fn in vars(app).items() if calls_the_model(fn)}
NEEDLE_CELLS = {"headers": app.NEEDLE_CELL_COLUMNS, "data": [["tova:budget=64", 512, 0.5, True, "4"]]}
BOARD_SAMPLES = {"headers": app.SAMPLE_TABLE_COLUMNS, "data": [["niah_single_1", 1, "tova", 0.75, 1.0, "42"]]}
# A request each runner's validator lets through (the model is held: nothing runs).
ADMISSIBLE = {
    "on_run": RAW_RUN,
    "on_sweep": ["The cat sat.", "prompt", 4, ["tova"], 4, 0.1, "paper default", DEFAULT_MODEL],
    "on_needle": [["tova"], 64, [512], DEFAULT_MODEL],
    "on_needle_cell": [NEEDLE_CELLS, DEFAULT_MODEL],
    "on_task_sample": ["niah_single_1", 0, "agnostic", ["tova"], 0.5, DEFAULT_MODEL],
}
CLICK = {"index": [0, 0], "value": "tova:budget=64"}


def model_routes() -> list[tuple[int, str]]:
    """(fn_index, api name) of every event whose function runs the model, whatever triggers it (a button, a
    chained step, a row's click)."""
    return [(index, fn.api_name) for index, fn in app.demo.fns.items() if getattr(fn.fn, "__name__", "") in RUNNERS]


def test_every_event_that_runs_the_model_is_wired_through_its_admission():
    assert RUNNERS == {fn.__name__ for fn in app.MODEL_JOBS}  # every function that runs the model has its validator
    routes = model_routes()
    assert {"on_task_sample_1", "on_needle_cell", "on_run_1"} < {name for _, name in routes}  # chained, a click
    for index, _ in routes:
        fn = app.demo.fns[index]
        assert fn.validator is app.MODEL_JOBS[fn.fn] and fn.concurrency_id == app.MODEL_SLOT, fn.api_name


def queue_join(url: str, index: int, data: list, event_data=None) -> httpx.Response:
    """One event queued as the page queues it, with the click data a select event carries."""
    body = {"data": data, "fn_index": index, "session_hash": f"test-{time.time_ns()}", "event_data": event_data,
            "trigger_id": None}
    return httpx.post(f"{url}/gradio_api/queue/join", json=body, timeout=30)


def test_concurrent_calls_on_every_route_to_the_model_meet_the_per_address_limit(server, monkeypatch):
    monkeypatch.setattr(app, "ADMISSION", guard.Admission(per_session=1, per_address=2, queue=app.QUEUE_SIZE))
    release = threading.Event()

    def held(*args, **kwargs):  # the model is busy until every call of a burst has its answer
        release.wait(timeout=300)
        raise RequestError("done")

    for name in COMPUTES:
        monkeypatch.setattr(app, name, held)
    monkeypatch.setattr(api, "needle_request", lambda *args, **kwargs: None)  # a cell's haystack needs the model
    admitted = {}
    for index, name in model_routes():
        release.clear()
        fn = app.demo.fns[index].fn.__name__
        with ThreadPoolExecutor(5) as pool:
            responses = list(pool.map(lambda _: queue_join(server, index, ADMISSIBLE[fn], CLICK), range(5)))
        release.set()
        admitted[name] = sum(r.status_code == 200 for r in responses)
        refused = [r for r in responses if r.status_code != 200]
        for response in refused:
            assert response.status_code == 422, (name, response.text)
            (message,) = [d["message"] for d in response.json()["detail"] if d["is_valid"] is False]
            assert message.startswith("Too many runs from your address"), (name, message)
        deadline = time.monotonic() + 60
        while len(app.ADMISSION) and time.monotonic() < deadline:  # the admitted calls end and free their slots
            time.sleep(0.05)
        assert len(app.ADMISSION) == 0, name
    assert admitted == {name: 2 for _, name in model_routes()}


def test_a_click_without_its_data_is_one_line_with_nothing_in_the_log(server, capfd):
    tables = {"on_needle_cell": [NEEDLE_CELLS, DEFAULT_MODEL], "on_board_sample": [BOARD_SAMPLES, None, DEFAULT_MODEL]}
    clicks = [(index, fn.api_name) for index, fn in app.demo.fns.items() if fn.collects_event_data]
    assert {name for _, name in clicks} == set(tables)  # every select handler: a new one is added above
    for index, name in clicks:
        for event_data in (None, "x", {"index": "x"}, {"index": [99, 0]}, {"value": 1}):
            response = queue_join(server, index, tables[name], event_data)
            if response.status_code == 422:  # refused by the validator, before the queue
                (message,) = [d["message"] for d in response.json()["detail"] if d["is_valid"] is False]
            else:
                stream = httpx.get(f"{server}/gradio_api/queue/data", timeout=60,
                                   params={"session_hash": json.loads(response.request.content)["session_hash"]})
                (line,) = [line for line in stream.text.splitlines() if '"process_completed"' in line]
                message = json.loads(line.split("data:", 1)[1])["output"]["error"]
            assert message in ("Pick a cell's row of the table.", "Pick a row of the table."), (name, event_data)
    assert "Traceback" not in capfd.readouterr().err
