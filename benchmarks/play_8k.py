"""Play's frames on a run of 8192 tokens (``views_8k.synthetic_run``, no model): seconds and bytes per tick.

    python -m benchmarks.play_8k [--tokens 8192] [--policies 4]

Each tick redraws the kept tokens, the scores at the step and the masks' row (``app.on_tick``); the goal is
well under Play's interval (``app.PLAY_TICK_S``) and a few hundred kB at most, where the full masks are
megabytes. The run holds Full and ``--policies`` of sinks, h2o, tova, a2sf and the oracle (the app's
default shows four).
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from .views_8k import payload_bytes, synthetic_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--policies", type=int, default=4, help="compressing policies beside Full (1-5)")
    args = parser.parse_args()
    os.environ.setdefault("KVLENS_STORE_DIR", tempfile.mkdtemp(prefix="kvlens-bench-"))
    import app

    run = synthetic_run(args.tokens)
    run.traces = run.traces[1:1 + args.policies]  # an app run lists the policies; Full is run.full
    app.RECENT_RUNS.remember(run)
    app.on_tick(run.run_id, 10, "1", "all", "all", 0.3)  # warm-up: plotly's validators
    print(f"{args.tokens} tokens, {len(run.traces)} policies; a tick every {app.PLAY_TICK_S} s\n")
    print(f"{'selectors':<22} {'step':>6} {'seconds':>8} {'kB':>7}")
    for layer, head in (("all", "all"), ("15", "1")):
        for step in (100, args.tokens // 2, args.tokens - 200):
            times = []
            for _ in range(3):
                start = time.perf_counter()
                frame = app.on_tick(run.run_id, step, "1", layer, head, 0.3)
                times.append(time.perf_counter() - start)
            size = sum(payload_bytes(item) for item in frame[:4] if not isinstance(item, int))
            print(f"layer {layer}, head {head:<8} {frame[0]:>6} {statistics.median(times):8.3f} {size / 1e3:7.0f}")


if __name__ == "__main__":
    main()
