"""Replay from the store: 512 tokens x 4 policies, computed once, then loaded back with their summary.

    python -m benchmarks.replay

Goal: a replay (store get + trace decode + summary metrics) < 0.3 s.
"""
import statistics
import tempfile
import time

from backend.analysis import metrics
from backend.policies import parse_spec
from backend.runs import replay_or_compute
from backend.traces.store import TraceStore

from .common import inaugural, model

SPECS = ["sinks:budget=64", "h2o:budget=64", "tova:budget=64", "a2sf:budget=64"]


def main() -> None:
    lm = model()
    ids = lm.tokenizer(inaugural()).input_ids[:512]
    policies = [parse_spec(s) for s in SPECS]
    with tempfile.TemporaryDirectory() as directory:
        store = TraceStore(directory)
        start = time.perf_counter()
        replay_or_compute(lm, SPECS, policies, ids, "prompt", store=store)
        cold = time.perf_counter() - start
        times = []
        for _ in range(10):
            start = time.perf_counter()
            result = replay_or_compute(lm, SPECS, policies, ids, "prompt", store=store)
            [metrics.summary_row(t, result.full) for t in result.traces]
            times.append(time.perf_counter() - start)
        assert all(result.replayed)
        size = store.volume() / 2**20
    print(f"{len(ids)} tokens x {len(SPECS)} policies (+ Full), recorded layers {result.full.meta['recorded_layers']}, "
          f"store {size:.1f} MiB")
    print(f"cold run: {cold:.2f} s; replay with summary: median {statistics.median(times) * 1000:.0f} ms, "
          f"max {max(times) * 1000:.0f} ms over 10")


if __name__ == "__main__":
    main()
