"""Where the test suite's time goes: ``make test``'s command run once, with the CPU seconds of every process it
starts, summed by kind (the pytest workers, the apps under the browser tests, Chromium, the commands, Ray, ...).

    python -m benchmarks.suite_cpu [--workers 2] [--top 12] [pytest arguments, default: tests]

On two cores the suite keeps both busy, so its wall time is about its CPU seconds over two: a test makes the suite
shorter by the CPU it saves, wherever that CPU is spent (a test's own duration also counts the time it waits for its
subprocesses, and not the CPU of a Chromium or a Ray it talks to). Every process is read from /proc once a second
while it lives (its user and system time, ``/proc/PID/stat``); one that lives under a second may be missed, which the
total against the machine's busy time (``/proc/stat``) shows. Linux only.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")

# The first pattern found in a process's command line names its kind.
KINDS = (
    ("the 8k browser test's app", "app.py", "test_browser_8k"),
    ("apps (app.py)", "app.py", None),
    ("Chromium", "chromium", None),
    ("Playwright's driver", "playwright/driver", None),
    ("Ray", "ray::", None), ("Ray", "/ray/", None),
    ("the notebook's kernel", "ipykernel", None),
    # python -m backend, the kvlens script, and the tests' python -c scripts that import backend
    ("commands and scripts of KV Lens", "backend", None), ("commands and scripts of KV Lens", "kvlens ", None),
    ("pytest-xdist workers", "execnet", None), ("pytest-xdist workers", "-c import sys", None),
    ("pytest (the controller)", "pytest", None),
    ("other Python (python -c, ...)", "python", None),
)


def kind_of(cmdline: str, test: str) -> str:
    for name, pattern, during in KINDS:
        if pattern in cmdline and (during is None or during in test):
            return name
    return "other processes"


def read_cpu(pid: str) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


def busy_seconds() -> float:
    """The machine's CPU seconds spent other than idle or waiting for I/O, since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(values) - values[3] - values[4]) / TICK


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--top", type=int, default=12, help="list this many single processes, the largest first")
    args, pytest_args = parser.parse_known_args()
    command = [sys.executable, "-m", "pytest", "-q", "-n", str(args.workers), "--dist", "loadgroup",
               *(pytest_args or ["tests"])]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    before = {pid: read_cpu(pid) for pid in os.listdir("/proc") if pid.isdigit()}
    busy, start = busy_seconds(), time.monotonic()
    # The suite's output goes to a file: a pipe read only at the end would fill and stop the suite.
    log = tempfile.TemporaryFile("w+")
    suite = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    seen: dict[str, list] = {}  # pid: [command line, the suite's test at its start, CPU seconds]
    while suite.poll() is None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before:
                continue
            cpu = read_cpu(pid)
            if cpu is None:
                continue
            if pid not in seen:
                try:
                    cmdline = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                    test = Path(f"/proc/{pid}/environ").read_bytes().split(b"PYTEST_CURRENT_TEST=")
                except OSError:
                    continue
                seen[pid] = [cmdline, test[1].split(b"\0")[0].decode(errors="replace") if len(test) > 1 else "", 0.0]
            seen[pid][2] = max(seen[pid][2], cpu)
        time.sleep(1.0)
    wall, busy = time.monotonic() - start, busy_seconds() - busy
    log.seek(0)
    output = log.read()
    by_kind = collections.Counter()
    for cmdline, test, cpu in seen.values():
        by_kind[kind_of(cmdline, test)] += cpu
    counted = sum(by_kind.values())
    print(output.strip().splitlines()[-1] if output.strip() else "(no output)")
    print(f"\n{' '.join(command[1:])}: {wall:.0f} s, {len(seen)} processes, {counted:.0f} CPU s counted "
          f"of the machine's {busy:.0f} busy ({os.cpu_count()} cores: {busy / wall / os.cpu_count():.0%} busy)\n")
    print("| processes | CPU s | share |\n|---|---:|---:|")
    for kind, cpu in by_kind.most_common():
        print(f"| {kind} | {cpu:.0f} | {cpu / counted:.0%} |")
    by_file = collections.Counter()
    for cmdline, test, cpu in seen.values():
        if test:
            by_file[test.split("::")[0]] += cpu
    print(f"\nThe processes the tests start (apps, commands, Chromium, Ray, ...), by the test file that started them, "
          f"the {args.top} largest:")
    for name, cpu in by_file.most_common(args.top):
        print(f"  {cpu:6.1f} s  {name}")
    print(f"\nThe {args.top} largest single processes:")
    for cmdline, test, cpu in sorted(seen.values(), key=lambda row: -row[2])[: args.top]:
        print(f"  {cpu:6.1f} s  {cmdline[:70]}  [{test.split(' ')[0][:90]}]")
    sys.exit(suite.returncode)


if __name__ == "__main__":
    main()
