"""The landing page's quality as Lighthouse 12 (desktop) and axe-core measure it, on a running app.

    npm i -E lighthouse@12.2.3 --prefix /tmp/lh          # once; Debian's chromium runs it
    python -m benchmarks.web_quality                     # starts the app on a free port, measures, stops it
    python -m benchmarks.web_quality --url http://127.0.0.1:7860/ --lighthouse /tmp/lh/node_modules/.bin/lighthouse

Prints performance, accessibility, layout shift and page weight (Lighthouse's desktop preset), and axe-core's
violations by impact (``axe-playwright-python``, at 1366x768). Scores are not asserted in the tests: a timed figure
belongs here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
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
    for _ in range(240):
        try:
            urllib.request.urlopen(url, timeout=2)
            time.sleep(30)  # the model loads in the background at start: measure the page, not the loading
            return proc, url
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the app did not start")


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
    from axe_playwright_python.sync_playwright import Axe
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running app (default: start one)")
    parser.add_argument("--runs", type=int, default=3, help="Lighthouse runs (its scores vary run to run)")
    parser.add_argument("--lighthouse", default=shutil.which("lighthouse") or "/tmp/lh/node_modules/.bin/lighthouse")
    args = parser.parse_args(argv)
    proc, url = (None, args.url) if args.url else serve()
    try:
        urllib.request.urlopen(url, timeout=30)
        runs = [lighthouse(url, args.lighthouse) for _ in range(args.runs)]
        print(json.dumps({"lighthouse_desktop": runs, "axe_violations_by_impact": axe(url)}, indent=1))
    finally:
        if proc is not None:
            proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
