"""What an open, idle page costs: the app's process and a headless Chromium showing its page, CPU seconds a second
while nobody clicks (after the app's warm-up and the page's first events are over).

    python -m benchmarks.idle_page [--seconds 20] [--query ?lesson=window]

A Space serves many such pages from two shared vCPUs, and a phone or a classroom laptop keeps its tab open for an
hour: what an idle page costs is paid all that time. Both numbers are CPU time read from /proc (user and system,
every thread and child process), not wall time, so a busy machine moves them little. Linux only; Chromium is
Debian's (as the browser tests use).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .load_test import cpu_s
from .web_quality import wait_for

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_s(pid) or 0.0 for pid in pids)


def processes(pattern: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if pattern in Path(f"/proc/{pid}/cmdline").read_text():
                found.append(int(pid))
        except OSError:
            continue
    return found


def rate(pids, seconds: float) -> float:
    before = cpu_seconds(pids)
    time.sleep(seconds)
    return (cpu_seconds(pids) - before) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each idle measurement lasts")
    parser.add_argument("--query", default="", help="the page's query, e.g. ?lesson=window")
    args = parser.parse_args()
    from tests.conftest import free_port

    port = free_port()
    env = {**os.environ, "GRADIO_SERVER_NAME": "127.0.0.1", "GRADIO_SERVER_PORT": str(port),
           "KVLENS_STORE_DIR": tempfile.mkdtemp(prefix="kvlens-idle-"), "GRADIO_ANALYTICS_ENABLED": "False"}
    app = subprocess.Popen([sys.executable, "app.py"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/{args.query}"
    try:
        wait_for(app, url)
        while rate([app.pid], 2.0) > 0.5:  # the warm-up (the model loads, a plain forward is timed)
            pass
        alone = rate([app.pid], args.seconds)
        from playwright.sync_api import sync_playwright

        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"),
                                                 args=["--no-sandbox", "--disable-gpu",
                                                       "--disable-background-networking"])
            page = browser.new_page(viewport={"width": 1366, "height": 768})
            page.goto(url)
            page.wait_for_selector("#run", timeout=120_000)
            time.sleep(10)  # the page's own first events and plots
            chromium = processes("chromium")
            before_app, before_chromium = cpu_seconds([app.pid]), cpu_seconds(chromium)
            time.sleep(args.seconds)
            served = (cpu_seconds([app.pid]) - before_app) / args.seconds
            shown = (cpu_seconds(chromium) - before_chromium) / args.seconds
            browser.close()
    finally:
        app.terminate()
        app.wait(30)
    print(f"idle, {args.seconds:.0f} s each, CPU seconds a second: the app alone {alone:.3f}; with a page open "
          f"({url.split('/', 3)[-1] or '/'}): the app {served:.3f}, Chromium {shown:.3f}")


if __name__ == "__main__":
    main()
