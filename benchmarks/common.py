"""Shared helpers for the benchmarks: the default model and a real text, timed in one process."""
from __future__ import annotations

import os
import statistics
import time
import zipfile
from pathlib import Path

import torch

from backend.models import load_model

SHARED_NLTK = Path(__file__).resolve().parents[1].parent / "shared" / "nltk_data"


def inaugural(name: str = "1789-Washington.txt") -> str:
    """A long real text that ships offline (NLTK's inaugural corpus, read straight from its zip)."""
    root = Path(os.environ.get("NLTK_DATA", SHARED_NLTK))
    with zipfile.ZipFile(root / "corpora" / "inaugural.zip") as z:
        return z.read(f"inaugural/{name}").decode("utf-8", "replace")


def best_of(fn, repeat: int = 3) -> float:
    """Median wall time of ``repeat`` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def model():
    torch.set_grad_enabled(False)
    return load_model()
