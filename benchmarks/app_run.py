"""What a visitor waits for: the example prompts, 4 policies, 64 new tokens, cold and replayed; then a
prompt near the app's 1024-token limit (the first ~1000 tokens of an inaugural address), 16 new tokens.

    python -m benchmarks.app_run [--repeat 3]

Cold runs vary by about a second on the 2-core machine; ``--repeat`` reports the best and the worst of
several (the store is emptied before each, and each is checked to have computed every row, not replayed it).
No ratio is reported here, so nothing is timed against a baseline; the ratios to a plain forward or
``generate()`` (``scaling``, ``prompt_ratio``, ``decode_ratio``) are timed in pairs (``common.paired``).

Goals: cold < 20 s on the 2-core machine for the examples; replay < 0.3 s plus rendering.
"""
import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from .common import inaugural, model

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=1, help="cold runs per example")
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="kvlens-bench-")
    os.environ["KVLENS_STORE_DIR"] = directory
    start = time.perf_counter()
    model()
    import app  # builds the page; the model is loaded once per process
    from backend import api

    api.get_model()
    load = time.perf_counter() - start
    specs = app.specs_from_controls(app.DEFAULT_POLICIES, app.DEFAULT_BUDGET, 4, 0.1, "paper default", "")
    print(f"model load + app import: {load:.1f} s; {len(specs)} policies {specs}")
    lm = api.get_model()
    long_text = lm.tokenizer.decode(lm.tokenizer(inaugural()).input_ids[:980])  # + chat template: ~1010
    cases = [(name, (ROOT / "assets" / "examples" / f"{name}.txt").read_text().strip(), 64)
             for name in ("needle", "story")] + [("inaugural", long_text, 16)]
    for example, prompt, max_new in cases:
        request = api.RunRequest(prompt=prompt, specs=specs, mode="generate", max_new_tokens=max_new)
        colds = []
        for _ in range(args.repeat):
            app.STORE.clear()
            start = time.perf_counter()
            run = api.run(request, app.STORE)
            colds.append(time.perf_counter() - start)
            assert not any(run.replayed), "a cold run replayed from the store"
        cold = f"{min(colds):.1f} s" + (f" (worst {max(colds):.1f} s)" if len(colds) > 1 else "")
        replays, renders = [], []
        for _ in range(5):
            app.RECENT_RUNS.clear()
            start = time.perf_counter()
            again = api.reopen(run.run_id, app.STORE)
            replays.append(time.perf_counter() - start)
            app.RECENT_RUNS.remember(again)
            start = time.perf_counter()
            app.render_run(run.run_id)
            app.render_views(run.run_id, "all", "all", 10_000, 0.3)
            renders.append(time.perf_counter() - start)
        new = max(len(t.generated_ids) for t in [*run.traces, run.full])
        print(f"{example}: prompt {run.full.meta['n_prompt']} tokens, up to {new} new; cold run (generate, then score "
              f"on Full's continuation, store): {cold}; replay {statistics.median(replays) * 1000:.0f} ms; "
              f"rendering every view but t-SNE {statistics.median(renders) * 1000:.0f} ms (medians of 5)")


if __name__ == "__main__":
    main()
