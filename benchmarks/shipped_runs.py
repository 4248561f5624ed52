"""Write the runs the app opens on and its lessons show (``backend.lessons.SHOWCASE``) into ``assets/runs/``.

    python -m benchmarks.shipped_runs            # every shipped run, then the traces no run names are deleted
    python -m benchmarks.shipped_runs --check    # say which are stale, write nothing (exit 1 if any)

Each run is made as the app's Run button makes it (``app.run_request`` over the run's control settings), so the
same click on the page replays it from the store. ``tests/test_shipped_runs.py`` fails when they are stale.
"""
from __future__ import annotations

import argparse
import secrets
import sys
import time

from backend import api
from backend.experiments import shipped_runs
from backend.experiments.lessons import SHOWCASE, ShowcaseRun


def request_of(setting: ShowcaseRun) -> api.RunRequest:
    import app  # the page's own mapping from its controls to specs

    return app.run_request(setting.prompt(), "generate", setting.max_new_tokens, list(setting.policies),
                           setting.budget, 4, 0.1, "paper default", "", api.DEFAULT_MODEL, setting.evidence)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which shipped runs are stale")
    args = parser.parse_args(argv)
    stale = []
    for name, setting in SHOWCASE.items():
        request = request_of(setting)
        keys = api.trace_keys(request)
        try:
            shipped = shipped_runs.manifest(name)
            fresh = (list(shipped.keys), shipped.full_key) == keys and shipped.request == request.__dict__
            run_id = shipped.run_id
        except shipped_runs.ShippedRunError:
            fresh, run_id = False, secrets.token_hex(16)
        if fresh:
            print(f"{name}: up to date")
            continue
        stale.append(name)
        if args.check:
            print(f"{name}: stale")
            continue
        started = time.monotonic()
        run = api.run(request, None)
        run.run_id = run_id
        shipped_runs.write(name, run, request.__dict__)
        print(f"{name}: written in {time.monotonic() - started:.1f} s")
    if not args.check:
        for path in shipped_runs.prune():
            print(f"deleted {path.name}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
