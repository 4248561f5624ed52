"""The app killed (SIGKILL) in the middle of a run: it restarts on the same store, the run completes, a
repeat replays, and the store on disk stays readable.

End to end: the real app as a subprocess (default model, the normal model cache), driven through its
API with gradio_client on 127.0.0.1 only.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = (ROOT / "assets" / "examples" / "needle.txt").read_text().strip()
pytestmark = pytest.mark.slow  # each test starts app.py, and some start it twice
MODEL = "smollm2-135m-instruct"
# needle.txt (~200 tokens) scored teacher-forced under 3 policies (+ Full): several seconds of model work.
RUN = (NEEDLE, "prompt", 8, ["sinks", "tova", "a2sf"], 40, 4, 0.1, "paper default", "", MODEL, "")  # ..., evidence
OFFLINE_ENV = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1"}


class AppProcess:
    """``app.py`` as a subprocess on a loopback port, its store in ``store``; started again on the same
    store after a kill. Each start logs to its own file."""

    def __init__(self, store: Path, logs: Path, env: dict[str, str] | None = None):
        self.store, self.logs, self.env = store, logs, env or {}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def log(self) -> Path:
        return self.logs / f"app-{self.starts}.log"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def start(self, timeout_s: float = 90) -> str:
        """Start the app and return its URL once ``GET /`` answers 200."""
        assert self.proc is None or self.proc.poll() is not None, "the app is already running"
        self.starts += 1
        port = free_port()
        env = {**os.environ, **OFFLINE_ENV, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
               "KVLENS_STORE_DIR": str(self.store), **self.env}
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log,
                                         stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return url
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"the app did not start (start {self.starts}); its log ends:\n{self.log_tail()}")
            time.sleep(0.25)

    def cpu_s(self) -> float:
        """CPU seconds (user + system) the app has used so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def wait_idle(self, window_s: float = 2.0, timeout_s: float = 60) -> None:
        """Until the app has used under 0.2 s of CPU for ``window_s``: the model, which loads in a
        background thread after the page answers, is loaded."""
        deadline = time.monotonic() + timeout_s
        since, cpu = time.monotonic(), self.cpu_s()
        while time.monotonic() - since < window_s:
            assert time.monotonic() < deadline, f"the app never went idle\n{self.log_tail()}"
            time.sleep(0.25)
            if self.cpu_s() - cpu > 0.2:
                since, cpu = time.monotonic(), self.cpu_s()

    def kill(self) -> None:
        """SIGKILL: no cleanup of any kind runs in the app."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


@pytest.fixture
def app(tmp_path, monkeypatch):
    for name, value in OFFLINE_ENV.items():  # gradio_client's telemetry reads the environment
        monkeypatch.setenv(name, value)
    logs = tmp_path / "logs"
    logs.mkdir()
    process = AppProcess(tmp_path / "store", logs)
    try:
        yield process
    finally:
        process.stop()


def client(url: str):
    from gradio_client import Client

    return Client(url, verbose=False, download_files=False, analytics_enabled=False, httpx_kwargs={"timeout": 30})


def run_and_render(url: str, timeout_s: float) -> tuple[str, str, list[str]]:
    """(status, run id, the summary's policies) of RUN in a fresh api."""
    c = client(url)
    try:
        status = c.submit(*RUN, api_name="/on_run").result(timeout=timeout_s)[0]
        views = c.submit(api_name="/render_run").result(timeout=30)
    finally:
        c.close()
    run_id = re.search(r"Run id: `([0-9a-f]{32})`", views[-1])
    assert run_id, views[-1]
    policies = re.findall(r'<tr data-policy="([^"]+)"', views[0])  # the summary's answers, Full's first
    return status, run_id.group(1), policies[1:]


def test_killed_mid_run_restarts_completes_and_replays(app):
    from gradio_client.utils import Status

    url = app.start()
    app.wait_idle()  # the model is loaded: the kill lands in the run, not in the model load
    first = client(url)
    try:
        job = first.submit(*RUN, api_name="/on_run")
        deadline = time.monotonic() + 30
        while job.status().code not in (Status.PROCESSING, Status.PROGRESS):
            assert not job.done(), f"the run ended before the kill: {job.status()}\n{app.log_tail()}"
            assert time.monotonic() < deadline, f"the run did not start: {job.status()}\n{app.log_tail()}"
            time.sleep(0.05)
        cpu, deadline = app.cpu_s(), time.monotonic() + 15
        while app.cpu_s() - cpu < 1.0:  # one CPU second into the model work
            assert time.monotonic() < deadline, f"the app is not computing the run\n{app.log_tail()}"
            time.sleep(0.05)
        assert not job.done(), "the run ended before the kill: make RUN longer"
        app.kill()
        try:  # the visitor's run is lost with the process (the client reports it cancelled)
            pytest.fail(f"the killed run returned {job.result(timeout=30)!r}")
        except Exception as err:
            assert not isinstance(err, (TimeoutError, pytest.fail.Exception)), err
    finally:
        first.close()
    assert (app.store / "cache.db").exists()
    first_log = app.log

    url = app.start()  # same store directory
    status, _, specs = run_and_render(url, timeout_s=120)
    assert re.fullmatch(r"3 policies, \d+ tokens, (computed|replayed from the store)\.", status), status
    assert [spec.partition(":")[0] for spec in specs] == RUN[3]
    status, run_id, again = run_and_render(url, timeout_s=60)
    assert status.endswith("replayed from the store."), status
    assert again == specs
    app.stop()

    # The store is in place with its database (intact, or set aside and rebuilt: the log then says so),
    # and every entry reads back intact in this process.
    set_aside = list(app.store.parent.glob(f"{app.store.name}.broken-*"))
    assert bool(set_aside) == ("was damaged" in first_log.read_text() + app.log.read_text()), set_aside
    assert (app.store / "cache.db").is_file()
    from backend import api
    from backend.traces.store import TraceStore

    db = sqlite3.connect(app.store / "cache.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        keys = [key for (key,) in db.execute("SELECT key FROM Cache")]
    finally:
        db.close()
    assert len(keys) >= 6  # 3 policies + Full + the two share-link manifests
    with TraceStore(app.store) as store:
        assert store.available, store.disabled_reason
        assert all(store.get(key) is not None for key in keys)
        run = api.reopen(run_id, store)
    assert [trace.spec for trace in run.traces] == specs


@pytest.mark.parametrize("name, value", [("KVLENS_MAX_POLICIES", "abc"), ("KVLENS_PLUGINS", "os.system"),
                                         ("KVLENS_STORE_MB", "abc"), ("KVLENS_RUNS_PER_ADDRESS", "abc")])
def test_a_malformed_setting_stops_the_app_with_one_line_naming_it(tmp_path, name, value):
    env = {**os.environ, **OFFLINE_ENV, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(free_port()),
           "KVLENS_STORE_DIR": str(tmp_path / "store"), name: value}
    result = subprocess.run([sys.executable, "app.py"], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {name}")


def test_exports_are_removed_at_exit_and_at_start_up(tmp_path, monkeypatch):
    for name, value in OFFLINE_ENV.items():
        monkeypatch.setenv(name, value)
    cache = tmp_path / "gradio"  # Gradio's cache, where the zips are written and served from
    gone = subprocess.Popen(["true"])
    gone.wait()
    orphan = cache / f"kvlens-exports-{gone.pid}" / "x" / "kvlens-0123456789ab.zip"  # a process killed earlier
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"zip")
    (tmp_path / "logs").mkdir()
    process = AppProcess(tmp_path / "store", tmp_path / "logs", env={"GRADIO_TEMP_DIR": str(cache)})
    try:
        url = process.start()
        assert not orphan.parent.parent.exists()
        c = client(url)
        try:
            c.submit("The cat sat.", "generate", 4, ["tova"], 16, 4, 0.1, "paper default", "", MODEL, "",
                     api_name="/on_run").result(timeout=120)
            c.submit("all", "all", 4, 0.3, api_name="/on_export").result(timeout=60)  # through the API: no .then
        finally:
            c.close()
        zips = list(cache.rglob("*.zip"))
        assert [z.parent.parent.name for z in zips] == [f"kvlens-exports-{process.proc.pid}"], zips
        process.proc.terminate()  # SIGTERM, as docker stop or a Space restarting sends
        assert process.proc.wait(timeout=60) is not None
    finally:
        process.stop()
    assert list(cache.rglob("*.zip")) == [], process.log_tail()
    assert not list(cache.glob("kvlens-exports-*"))


# The app, built (imported) on a quiet machine, then told to start serving at low priority (`nice`) on one core, as a
# Space's cold start on a vCPU another tenant keeps busy, or a loaded machine, runs it. Every thread of it, those
# already started included, takes the core and the priority (both are a thread's own on Linux).
LAUNCH_WHEN_TOLD = """
import os, sys
import app
print("built", flush=True)
core = int(sys.stdin.readline())
for thread in os.listdir("/proc/self/task"):
    os.sched_setaffinity(int(thread), {core})
    os.setpriority(os.PRIO_PROCESS, int(thread), 15)
app.launch()
"""
# Gradio prints this once its launch has checked that localhost serves the page (without it, it stops the app).
LAUNCHED = "To create a public link"
# The share of the time the starved app runs: stopped (SIGSTOP) and continued in turn, it gets a fortieth of a core
# in slices of 2.5 ms, as a busy tenant on its core would leave it, with no core kept busy to do so.
RUNS_S, STOPPED_S = 0.0025, 0.0975


def starve(pid: int, done: threading.Event) -> None:
    """Stop and continue ``pid`` in turn until ``done``; it is left running."""
    try:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(STOPPED_S)
            os.kill(pid, signal.SIGCONT)
            time.sleep(RUNS_S)
    except ProcessLookupError:  # it ended
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_the_app_starts_and_serves_its_page_while_it_is_starved_of_its_core(tmp_path):
    """The app at nice 15 on one core, running a fortieth of the time: its first page takes seconds, more than the
    3 s Gradio's launch gives it before stopping the app as if localhost were not accessible. The app waits for the
    page, and serves it."""
    port, log_path = free_port(), tmp_path / "app.log"
    env = {**os.environ, **OFFLINE_ENV, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "KVLENS_STORE_DIR": str(tmp_path / "store"), "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-c", LAUNCH_WHEN_TOLD], cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                   stdout=log, stderr=subprocess.STDOUT, text=True)

    def wait_for(text: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in (logged := log_path.read_text(errors="replace")):
            stopped = process.poll() is not None or "Traceback" in logged  # Gradio's error may not end the process
            assert not stopped, f"the app stopped; its log ends:\n{logged[-3000:]}"
            assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s; the app's log ends:\n{logged[-3000:]}"
            time.sleep(0.25)

    done = threading.Event()
    starving = threading.Thread(target=starve, args=(process.pid, done), daemon=True)
    try:
        wait_for("built", 120)
        process.stdin.write(f"{max(os.sched_getaffinity(0))}\n")
        process.stdin.flush()
        told = time.monotonic()
        starving.start()
        wait_for(LAUNCHED, 150)
        assert time.monotonic() - told > 3  # the page did take longer than Gradio's own check allows
        done.set()
        starving.join()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=60) as response:
            assert response.status == 200 and b"KV Lens" in response.read()
        assert process.poll() is None
    finally:
        done.set()
        if starving.is_alive():
            starving.join()
        process.kill()
        process.wait(timeout=30)
