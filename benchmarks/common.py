"""Shared helpers for the benchmarks: the default model and a real text, timed in one process."""
from __future__ import annotations

import statistics
import time

import torch

from backend.engine.models import DEFAULT_MODEL, load_model
from backend.texts import inaugural  # noqa: F401  a long real text that ships in the repo


def best_of(fn, repeat: int = 3) -> float:
    """Median wall time of ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model(name: str = DEFAULT_MODEL):
    torch.set_grad_enabled(False)
    return load_model(name)
