"""Many visitors at once: N concurrent browser sessions each run their own request through the app's API.

    python -m benchmarks.load_test [--visitors 20] [--timeout 900]
    python -m benchmarks.load_test --burst 80 [--timeout 300]

It starts ``app.py`` as a subprocess on a free loopback port with its own empty trace store (a temp
dir), waits for the page and for the model load to settle, then starts N threads, one
``gradio_client.Client`` (= one browser session) each. Every visitor sends a distinct prompt
("Visitor 7: ...") with its own policies, budget, alpha and head setting (mode "generate", 8 new
tokens) to ``/on_run``, then asks ``/render_run`` for the views of the run its session holds, and
checks that they are its own: the summary's policies are exactly the specs its controls describe
(``app.specs_from_controls``) and the status counts that many policies.

All visitors come from 127.0.0.1, while the app admits at most 4 model jobs per client address by
default; each simulated visitor stands for a visitor with an address of its own, so the app runs
here with ``KVLENS_RUNS_PER_ADDRESS=64`` (one job per session still applies).

Reported: errors (any exception, with its message), latency per visitor from submitting the run to
its result (and to its rendered views), and the app's resident memory (VmRSS from /proc, and its
anonymous part RssAnon) before the load (model loaded: RSS steady and CPU idle for 5 s), right after
it, and after 20 s idle. The model's weights are memory-mapped and paged in by the first run, so
VmRSS rises by about their size (~0.5 GB) with the first run whatever the load; RssAnon shows what
the runs themselves keep. Exit status 0 only when there were no errors and every visitor got its own
content.

``--burst N`` instead sends N page loads and N raw API runs (``POST /gradio_api/call/on_run``, no session)
at the same instant, with ``KVLENS_RUNS_PER_ADDRESS=200`` so that only the queue's cap refuses runs: every
page load must answer 200, at most the queue's size (64) runs may be accepted, and every refusal must be one
line saying the queue is full. It does not wait for the accepted runs: the app is stopped once every
request of the burst has its answer.

Bounded: one global deadline (``--timeout`` seconds from the start, app start-up included), a
timeout on every request, traffic to 127.0.0.1 only (telemetry off), and the app subprocess is
always terminated at the end. The app's log is kept (its path is printed) when anything failed.
Linux only (/proc, PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# No telemetry from gradio_client or huggingface_hub: nothing leaves the loopback interface.
# (gradio_client's Client(analytics_enabled=False) alone is not enough: it ORs in this variable.)
OFFLINE_ENV = {"GRADIO_ANALYTICS_ENABLED": "False", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_OFFLINE": "1"}
os.environ.update(OFFLINE_ENV)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
MAX_NEW = 8
# Policy sets (1 to 3 policies) and budgets cycle with coprime periods (11 and 8), so up to 88 visitors
# all differ in their specs (checked in plan()); no set is "full" alone (that ignores the budget).
POLICY_SETS = [["tova", "sinks"], ["h2o"], ["a2sf", "window"], ["sinks"], ["tova"], ["oracle", "a2sf"],
               ["window", "h2o"], ["reattention"], ["sparq"], ["full", "tova", "sinks"], ["a2sf"]]
BUDGETS = [16, 20, 24, 28, 32, 36, 40, 44]
HEADS = ["paper default", "head", "layer"]
REQUEST_TIMEOUT_S = 60  # one HTTP request (config, join, status); a queued job waits on the deadline instead
RENDER_TIMEOUT_S = 120


@dataclass
class Visitor:
    index: int
    prompt: str
    names: list[str]
    budget: int
    sinks: int
    alpha: float
    heads: str
    expected: list[str]  # the specs the controls describe
    run_s: float | None = None  # submit -> /on_run result
    total_s: float | None = None  # submit -> /render_run result
    status: str = ""
    policies: list[str] = field(default_factory=list)
    matched: bool = False
    error: str = ""

    def inputs(self):
        return (self.prompt, "generate", MAX_NEW, self.names, self.budget, self.sinks, self.alpha, self.heads, "",
                MODEL, "")  # ..., the model, no evidence


def expected_specs():
    """app.specs_from_controls, imported with a throwaway store dir (importing app opens a TraceStore)."""
    scratch = tempfile.mkdtemp(prefix="kvlens-load-driver-")
    saved = os.environ.get("KVLENS_STORE_DIR")
    os.environ["KVLENS_STORE_DIR"] = scratch
    try:
        sys.path.insert(0, str(ROOT))
        from app import specs_from_controls
    finally:
        if saved is None:
            os.environ.pop("KVLENS_STORE_DIR", None)
        else:
            os.environ["KVLENS_STORE_DIR"] = saved
    return specs_from_controls, scratch


def plan(n: int, specs_from_controls) -> list[Visitor]:
    visitors = []
    for i in range(1, n + 1):
        names = POLICY_SETS[i % len(POLICY_SETS)]
        budget, heads = BUDGETS[i % len(BUDGETS)], HEADS[i % len(HEADS)]
        sinks, alpha = 2 + i % 5, round(0.05 * (1 + i % 6), 2)
        prompt = (f"Visitor {i}: list three facts about the number {i}, one short sentence each, and say why {i} "
                  f"is odd or even.")
        expected = specs_from_controls(names, budget, sinks, alpha, heads, "")
        visitors.append(Visitor(i, prompt, names, budget, sinks, alpha, heads, expected))
    distinct = {tuple(v.expected) for v in visitors}
    if len(distinct) != len(visitors):
        raise SystemExit("the visitors' policy specs are not all distinct; change POLICY_SETS/BUDGETS")
    return visitors


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGTERM if this driver dies (even by SIGKILL), so the app never outlives it."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def start_app(port: int, store: Path, log_path: Path, runs_per_address: int = 64) -> subprocess.Popen:
    env = {**os.environ, **OFFLINE_ENV, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "KVLENS_STORE_DIR": str(store), "KVLENS_RUNS_PER_ADDRESS": str(runs_per_address)}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=_die_with_parent)


def wait_for_page(proc: subprocess.Popen, url: str, deadline: float) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"the app exited with status {proc.returncode} before answering")
        if time.monotonic() > deadline:
            raise RuntimeError("the app did not answer before the deadline")
        time.sleep(0.5)


def rss_mib(pid: int, field: str = "VmRSS") -> float | None:
    """A memory figure of /proc/<pid>/status in MiB: VmRSS (resident), RssAnon (its anonymous part)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds the process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_settled(pid: int, deadline: float, window_s: float = 5.0, tolerance_mib: float = 2.0,
                 max_cpu_s: float = 0.5) -> float | None:
    """RSS once the app has settled: RSS within ``tolerance_mib`` and under ``max_cpu_s`` of CPU used for
    ``window_s`` (the model loads in a background thread after the page answers); at most 120 s."""
    stop = min(deadline, time.monotonic() + 120)
    reference = None
    while time.monotonic() < stop:
        now, rss, cpu = time.monotonic(), rss_mib(pid), cpu_s(pid)
        if rss is None or cpu is None:
            return None
        if reference is None or abs(rss - reference[0]) > tolerance_mib or cpu - reference[1] > max_cpu_s:
            reference = (rss, cpu, now)
        elif now - reference[2] >= window_s:
            return rss
        time.sleep(0.5)
    return rss_mib(pid)


def visit(visitor: Visitor, url: str, start: threading.Barrier, deadline: float) -> None:
    from gradio_client import Client

    client = None
    try:
        client = Client(url, verbose=False, download_files=False, analytics_enabled=False,
                        httpx_kwargs={"timeout": REQUEST_TIMEOUT_S})
        start.wait(timeout=max(1.0, deadline - time.monotonic()))
        t0 = time.perf_counter()
        job = client.submit(*visitor.inputs(), api_name="/on_run")
        try:
            outputs = job.result(timeout=max(1.0, deadline - time.monotonic()))
        except TimeoutError:
            job.cancel()
            raise TimeoutError("no result from /on_run before the global deadline") from None
        visitor.run_s = time.perf_counter() - t0
        visitor.status = str(outputs[0])  # the run id is session state, not an API output
        job = client.submit(api_name="/render_run")  # reads this session's run id
        try:
            views = job.result(timeout=max(1.0, min(RENDER_TIMEOUT_S, deadline - time.monotonic())))
        except TimeoutError:
            job.cancel()
            raise TimeoutError("no result from /render_run in time") from None
        visitor.total_s = time.perf_counter() - t0
        summary = views[0]
        column = summary["headers"].index("Policy")
        visitor.policies = [str(row[column]) for row in summary["data"]]
        count_ok = visitor.status.startswith(f"{len(visitor.expected)} policies, ")
        visitor.matched = visitor.policies == visitor.expected and count_ok
        if not visitor.matched:
            visitor.error = (f"content mismatch: expected {visitor.expected} and '{len(visitor.expected)} policies', "
                             f"got {visitor.policies} and {visitor.status!r}")
    except BaseException as err:  # anything at all counts as an error, with its message
        visitor.error = f"{type(err).__name__}: {str(err).strip() or repr(err)}"[:500]
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def mib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f} MiB"


def stop_app(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


QUEUE_SIZE = 64  # app.QUEUE_SIZE (not imported: importing app builds the whole UI)
BURST_RUN = ["The cat sat.", "generate", 4, ["tova"], 16, 4, 0.1, "paper default", "", MODEL, ""]


def burst(n: int, timeout_s: float) -> int:
    """N page loads and N runs at once against a fresh app; 0 when the page loads all answered and the runs were
    accepted up to the queue's size, the rest refused with one line."""
    import httpx

    work = Path(tempfile.mkdtemp(prefix="kvlens-burst-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    proc = start_app(port, work / "store", work / "app.log", runs_per_address=200)
    pages: list[int] = []
    runs: list[tuple[int, str]] = []
    try:
        wait_for_page(proc, url + "/", deadline)
        start = threading.Barrier(2 * n)
        request_timeout = max(1.0, min(REQUEST_TIMEOUT_S, deadline - time.monotonic()))

        def page() -> None:
            start.wait(timeout=request_timeout)
            try:
                pages.append(httpx.get(url + "/", timeout=request_timeout).status_code)
            except httpx.HTTPError as err:
                pages.append(-1)
                print(f"  page load: {type(err).__name__}: {err}")

        def run() -> None:
            start.wait(timeout=request_timeout)
            try:
                response = httpx.post(f"{url}/gradio_api/call/on_run", json={"data": BURST_RUN},
                                      timeout=request_timeout)
                runs.append((response.status_code, response.text))
            except httpx.HTTPError as err:
                runs.append((-1, f"{type(err).__name__}: {err}"))

        threads = [threading.Thread(target=target, daemon=True) for target in [page] * n + [run] * n]
        t0 = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        wall = time.perf_counter() - t0
    finally:
        stop_app(proc)
    accepted = sum(1 for code, _ in runs if code == 200)
    refusals = Counter((code, (text.strip().splitlines() or [""])[0][:200]) for code, text in runs if code != 200)
    print(f"burst of {n} page loads and {n} runs, answered in {wall:.1f} s")
    print(f"page loads: {pages.count(200)}/{n} answered 200")
    print(f"runs: {accepted} accepted (queue size {QUEUE_SIZE}), {len(runs) - accepted} refused")
    for (code, line), count in sorted(refusals.items()):
        print(f"  {count} x HTTP {code}: {line}")
    ok = (pages.count(200) == n and len(runs) == n and accepted <= QUEUE_SIZE
          and all(code in (422, 503) and "queue is full" in line.lower() for code, line in refusals))
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"app log kept: {work / 'app.log'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--visitors", type=int, default=20)
    parser.add_argument("--burst", type=int, default=0, metavar="N",
                        help="instead: N page loads and N runs at once (bounded; the runs are not awaited)")
    parser.add_argument("--timeout", type=float, default=900, help="global deadline in seconds, start-up included")
    parser.add_argument("--idle", type=float, default=20, help="seconds idle before the last RSS reading")
    args = parser.parse_args()
    if args.visitors < 1:
        parser.error("--visitors must be >= 1")
    if args.burst < 0 or args.burst > 500:
        parser.error("--burst must be 0 to 500")
    if args.burst:
        return burst(args.burst, args.timeout)
    began = time.monotonic()
    deadline = began + args.timeout

    specs_from_controls, scratch = expected_specs()
    visitors = plan(args.visitors, specs_from_controls)
    work = Path(tempfile.mkdtemp(prefix="kvlens-load-"))
    log_path = work / "app.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}/"
    proc = start_app(port, work / "store", log_path)
    rss_before = rss_after = rss_idle = None
    anon = {}
    threads: list[threading.Thread] = []
    wall = None
    failed_setup = ""
    try:
        wait_for_page(proc, url, deadline)
        up = time.monotonic() - began
        rss_before = wait_settled(proc.pid, deadline)
        anon["before"] = rss_mib(proc.pid, "RssAnon")
        print(f"app up on {url} after {up:.0f} s, settled after {time.monotonic() - began:.0f} s "
              f"(RSS {mib(rss_before)}); {len(visitors)} visitors", flush=True)
        barrier = threading.Barrier(len(visitors) + 1)
        threads = [threading.Thread(target=visit, args=(v, url, barrier, deadline), daemon=True,
                                    name=f"visitor-{v.index}") for v in visitors]
        for thread in threads:
            thread.start()
        try:
            barrier.wait(timeout=max(1.0, min(120.0, deadline - time.monotonic())))
        except threading.BrokenBarrierError:
            pass  # some client could not connect: its visitor records the error; the others go on
        t0 = time.perf_counter()
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        wall = time.perf_counter() - t0
        rss_after, anon["after"] = rss_mib(proc.pid), rss_mib(proc.pid, "RssAnon")
        if proc.poll() is None and args.idle > 0:
            time.sleep(args.idle)
            rss_idle, anon["idle"] = rss_mib(proc.pid), rss_mib(proc.pid, "RssAnon")
    except Exception as err:
        failed_setup = f"{type(err).__name__}: {err}"
    finally:
        stop_app(proc)
        shutil.rmtree(scratch, ignore_errors=True)

    for visitor, thread in zip(visitors, threads):
        if thread.is_alive() and not visitor.error:
            visitor.error = "still running at the deadline"
    if not threads:
        for visitor in visitors:
            visitor.error = visitor.error or f"never started ({failed_setup})"
    errors = [v for v in visitors if v.error and not v.error.startswith("content mismatch")]
    mismatched = [v for v in visitors if not v.matched]
    runs = [v.run_s for v in visitors if v.run_s is not None]
    totals = [v.total_s for v in visitors if v.total_s is not None]

    def spread(values):
        if not values:
            return "n/a"
        return (f"p50 {percentile(values, 50):.1f} s, p90 {percentile(values, 90):.1f} s, "
                f"max {max(values):.1f} s")

    computed = sum(1 for v in visitors if v.status.endswith("computed."))
    rows = [
        ("visitors", f"{len(visitors)} concurrent sessions, mode generate, {MAX_NEW} new tokens, "
                     f"{sum(len(v.expected) for v in visitors)} policy traces"),
        ("errors", f"{len(errors)}"),
        ("latency, submit -> run result", spread(runs)),
        ("latency, submit -> views", spread(totals)),
        ("wall time, all visitors", "n/a" if wall is None else f"{wall:.1f} s"),
        ("app RSS before / after / idle", f"{mib(rss_before)} / {mib(rss_after)} / {mib(rss_idle)} "
                                          f"(idle = {args.idle:.0f} s after the load)"),
        ("  of which anonymous", " / ".join(mib(anon.get(k)) for k in ("before", "after", "idle"))
                                 + " (the rest is file-backed, mostly the memory-mapped weights)"),
        ("content matched", f"{'yes' if not mismatched else 'NO'} ({len(visitors) - len(mismatched)}/"
                            f"{len(visitors)}; {computed} computed)"),
    ]
    if failed_setup:
        rows.append(("setup failure", failed_setup))
    width = max(len(name) for name, _ in rows)
    print()
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    for visitor in visitors:
        if visitor.error:
            print(f"  visitor {visitor.index}: {visitor.error}")
    ok = not errors and not mismatched and not failed_setup
    if ok:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"app log kept: {log_path}")
    sys.stdout.flush()
    alive = [t for t in threads if t.is_alive()]
    if alive:  # a client thread stuck past the deadline: don't wait for it at exit
        os._exit(0 if ok else 1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
