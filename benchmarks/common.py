"""Shared helpers for the benchmarks: the default model, a real text, and timings taken in one process.

Ratios to a baseline (one plain forward, plain ``generate()``) are measured in pairs (``paired``): baseline,
run, baseline, run, ... so that each run is divided by the baseline timed right beside it, and a load that
comes and goes on a shared machine slows both halves of a pair rather than one side of the ratio. The
reported ratio is the median of the per-pair ratios, with their range (min-max) as the spread.
"""
from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from backend.engine.models import DEFAULT_MODEL, load_model
from backend.texts import inaugural  # noqa: F401  a long real text that ships in the repo

DEFAULT_PAIRS = 3


def best_of(fn, repeat: int = 3) -> float:
    """Median wall time of ``repeat`` calls (after one warm-up call). For a time alone; a ratio to a
    baseline is ``paired``'s."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Paired:
    """Wall times of ``len(baseline_s)`` baseline/run pairs, taken A B A B ..., and the run's last result.

    ``scale`` multiplies every ratio (e.g. new tokens of the baseline / new tokens of the run, for a ratio
    per generated token)."""

    baseline_s: list[float]
    run_s: list[float]
    last: Any = field(default=None, repr=False)
    scale: float = 1.0

    @property
    def ratios(self) -> list[float]:
        """Each pair's run / that pair's baseline (times ``scale``), in the order taken."""
        return [self.scale * r / b for b, r in zip(self.baseline_s, self.run_s)]

    @property
    def ratio(self) -> float:
        """The median of the per-pair ratios: the figure to report."""
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def baseline(self) -> float:
        """Median baseline time (for display; the ratio is not median run / median baseline)."""
        return statistics.median(self.baseline_s)

    @property
    def run(self) -> float:
        """Median run time (for display)."""
        return statistics.median(self.run_s)

    def spread(self, digits: int = 2) -> str:
        """The per-pair ratios' range, e.g. ``4.52-4.91x`` (one pair: just its ratio)."""
        if len(self.ratios) == 1:
            return f"{self.low:.{digits}f}x"
        return f"{self.low:.{digits}f}-{self.high:.{digits}f}x"

    def as_dict(self) -> dict:
        """The timings as plain JSON-able values (for a child process to hand back)."""
        return {"pairs": len(self.baseline_s), "baseline_all_s": self.baseline_s, "run_all_s": self.run_s,
                "ratios": self.ratios, "ratio": self.ratio, "ratio_min": self.low, "ratio_max": self.high,
                "baseline_s": self.baseline, "run_s": self.run}


def paired(baseline: Callable[[], Any], run: Callable[[], Any], pairs: int = DEFAULT_PAIRS,
           warmup: bool | Callable[[], Any] = True, scale: float = 1.0) -> Paired:
    """Time ``baseline`` and ``run`` alternately, ``pairs`` times each: A B A B ...

    ``warmup``: True calls each once untimed first, a callable is called instead (e.g. a short prefix, where a
    full call costs minutes), False warms nothing. Garbage is collected (untimed) before every timed call,
    and the previous run's result is dropped first, so no call pays for another's leftovers and two results
    are never held at once. ``run`` must really compute each time: a run through a store must empty it (or
    bypass it) itself. Returns the times and the last run's result (``Paired.last``)."""
    if pairs < 1:
        raise ValueError("pairs must be at least 1")
    if callable(warmup):
        warmup()
    elif warmup:
        baseline()
        run()
    base_s, run_s, last = [], [], None

    for _ in range(pairs):
        gc.collect()
        start = time.perf_counter()
        baseline()  # its result is dropped at once
        base_s.append(time.perf_counter() - start)
        last = None
        gc.collect()
        start = time.perf_counter()
        last = run()
        run_s.append(time.perf_counter() - start)
    return Paired(base_s, run_s, last, scale)


def add_pairs_argument(parser, default: int = DEFAULT_PAIRS, *aliases: str) -> None:
    """``--pairs N`` (and any ``aliases``, e.g. an older ``--repeat``): baseline/run pairs per ratio."""
    parser.add_argument("--pairs", *aliases, dest="pairs", type=int, default=default,
                        help="baseline/run pairs timed A B A B ...; the ratio is the median of the per-pair "
                             f"ratios, with their min-max (default {default})")


def model(name: str = DEFAULT_MODEL, device: str = "cpu", dtype: str = "float32"):
    torch.set_grad_enabled(False)
    return load_model(name, device=device, dtype=dtype)

