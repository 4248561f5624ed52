"""The landing page's quality as Lighthouse 12 (desktop) and axe-core measure it, on a running app.

    npm i -E lighthouse@12.2.3 --prefix /tmp/lh          # once; Debian's chromium runs it
    python -m benchmarks.web_quality                     # starts the app on a free port, measures, stops it
    python -m benchmarks.web_quality --url http://127.0.0.1:7860/ --lighthouse /tmp/lh/node_modules/.bin/lighthouse
    python -m benchmarks.web_quality --baseline          # also a minimal Gradio Blocks page, measured alike
    python -m benchmarks.web_quality --runs 0 --long-tasks 6 --baseline   # only the long tasks, page by page

Prints performance, accessibility, layout shift and page weight (Lighthouse's desktop preset), each run's and their
medians, then axe-core's violations by impact (``axe-playwright-python``, at 1366x768). ``--long-tasks N`` loads
the page N times in Playwright (1366x768, a fresh context each) and prints each load's longest task and the sum of
its tasks' time past 50 ms (the blocking time, counted over the whole load): quicker and steadier than Lighthouse for
comparing two versions of the page. Lighthouse's performance depends on the machine's speed as much as on the page:
``--baseline`` measures a minimal Gradio page (one textbox, one button) in the same way right after, so the two read
against each other. Scores are not asserted in the tests: a timed figure belongs here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve() -> tuple[subprocess.Popen, str]:
    from tests.conftest import free_port

    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False",
           "KVLENS_STORE_DIR": tempfile.mkdtemp(prefix="kvlens-web-")}
    proc = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    wait_for(proc, url)
    time.sleep(30)  # the model loads in the background at start: measure the page, not the loading
    return proc, url


MINIMAL_PAGE = """import gradio as gr
with gr.Blocks() as demo:
    box = gr.Textbox(label="Prompt")
    gr.Button("Run").click(lambda text: text, box, box)
demo.launch()
"""


def wait_for(proc: subprocess.Popen, url: str) -> None:
    for _ in range(240):
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the page at {url} did not start")


def serve_minimal(directory: Path) -> tuple[subprocess.Popen, str]:
    """A minimal Gradio Blocks page (Gradio's own floor on this machine), its script written in ``directory``."""
    from tests.conftest import free_port

    port = free_port()
    script = directory / "minimal.py"
    script.write_text(MINIMAL_PAGE)
    env = {**os.environ, "GRADIO_SERVER_PORT": str(port), "GRADIO_ANALYTICS_ENABLED": "False"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/"
    wait_for(proc, url)
    return proc, url


def medians(runs: list[dict]) -> dict:
    return {name: statistics.median(run[name] for run in runs)
            for name in ("performance", "accessibility", "layout_shift", "page_kib", "lcp_s", "tbt_ms")}


def lighthouse(url: str, binary: str) -> dict:
    out = Path(tempfile.mkdtemp()) / "report.json"
    subprocess.run([binary, url, "--preset=desktop", "--output=json", f"--output-path={out}", "--quiet",
                    "--chrome-flags=--headless=new --no-sandbox --disable-gpu"],
                   env={**os.environ, "CHROME_PATH": shutil.which("chromium") or "chromium"}, check=True)
    report = json.loads(out.read_text())
    audits = report["audits"]
    failed = [ref["id"] for ref in report["categories"]["accessibility"]["auditRefs"]
              if audits.get(ref["id"], {}).get("score") not in (None, 1)]
    return {"performance": report["categories"]["performance"]["score"],
            "accessibility": report["categories"]["accessibility"]["score"],
            "layout_shift": audits["cumulative-layout-shift"]["numericValue"],
            "page_kib": audits["total-byte-weight"]["numericValue"] / 1024,
            "lcp_s": audits["largest-contentful-paint"]["numericValue"] / 1000,
            "tbt_ms": audits["total-blocking-time"]["numericValue"],
            "accessibility_failed": failed}


def axe(url: str) -> dict:
    try:
        from axe_playwright_python.sync_playwright import Axe
    except ImportError:
        return {"not measured": ["axe-playwright-python is not installed: pip install axe-playwright-python"]}
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1366, "height": 768})
        page.goto(url)
        page.wait_for_selector("#summary svg.kvl-strip", timeout=60_000)
        results_loading = Axe().run(page)  # while the view in sight loads, and once it has
        page.wait_for_selector("#kept .kvl-tok", timeout=60_000)
        results = Axe().run(page)
        browser.close()
    by_impact: dict[str, list[str]] = {}
    for when, found in (("loading", results_loading), ("loaded", results)):
        for violation in found.response["violations"]:
            by_impact.setdefault(violation["impact"], []).append(f"{violation['id']} ({when})")
    return by_impact


def blocking(durations_ms: list[float]) -> tuple[float, float]:
    """The longest task and the blocking time (each task's time past 50 ms, summed) of one load's long tasks."""
    return max(durations_ms, default=0.0), sum(max(0.0, d - 50.0) for d in durations_ms)


LONG_TASKS = """window.__longTasks = [];
new PerformanceObserver((list) => { for (const e of list.getEntries()) window.__longTasks.push(e.duration); })
  .observe({type: "longtask", buffered: true});"""


def long_tasks(url: str, loads: int, settle_s: float = 2.5) -> dict:
    """The page loaded ``loads`` times: each load's longest task and blocking time in ms, and their medians."""
    from playwright.sync_api import sync_playwright

    longest, blocked = [], []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=["--no-sandbox"])
        for _ in range(loads):
            context = browser.new_context(viewport={"width": 1366, "height": 768})
            page = context.new_page()
            page.add_init_script(LONG_TASKS)
            page.goto(url, timeout=120_000)
            page.wait_for_selector("footer", timeout=120_000)  # Gradio's footer comes with the built page
            time.sleep(settle_s)  # and what the page draws after it
            top, total = blocking(page.evaluate("window.__longTasks"))
            longest.append(round(top))
            blocked.append(round(total))
            context.close()
        browser.close()
    return {"longest_ms": longest, "blocking_ms": blocked, "median_longest_ms": statistics.median(longest),
            "median_blocking_ms": statistics.median(blocked)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running app (default: start one)")
    parser.add_argument("--runs", type=int, default=3,
                        help="Lighthouse runs (its scores vary run to run; 0: neither Lighthouse nor axe)")
    parser.add_argument("--lighthouse", default=shutil.which("lighthouse") or "/tmp/lh/node_modules/.bin/lighthouse")
    parser.add_argument("--baseline", action="store_true", help="also measure a minimal Gradio page alike")
    parser.add_argument("--long-tasks", type=int, default=0, metavar="N",
                        help="also load the page N times and print its long tasks")
    args = parser.parse_args(argv)
    proc, url = (None, args.url) if args.url else serve()
    try:
        urllib.request.urlopen(url, timeout=30)
        if args.runs:
            runs = [lighthouse(url, args.lighthouse) for _ in range(args.runs)]
            print(json.dumps({"lighthouse_desktop": runs, "median": medians(runs)}, indent=1), flush=True)
            print(json.dumps({"axe_violations_by_impact": axe(url)}, indent=1), flush=True)
        if args.long_tasks:
            print(json.dumps({"long_tasks": long_tasks(url, args.long_tasks)}, indent=1), flush=True)
    finally:
        if proc is not None:
            proc.terminate()
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="kvlens-web-") as directory:
            proc, url = serve_minimal(Path(directory))
            try:
                if args.runs:
                    runs = [lighthouse(url, args.lighthouse) for _ in range(args.runs)]
                    print(json.dumps({"minimal_gradio_page": runs, "median": medians(runs)}, indent=1), flush=True)
                if args.long_tasks:
                    print(json.dumps({"minimal_gradio_page_long_tasks": long_tasks(url, args.long_tasks)}, indent=1),
                          flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
