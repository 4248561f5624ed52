"""The task leaderboard: lm-eval's tasks at several lengths, every policy at every compression ratio, scored
per sample, then averaged with an interval over the samples.

A job is one task sample in one setting (``task_runs.SETTINGS``): every policy and ratio is a row of one
batched generate-mode run with Full (``task_runs.run_sample``), so the grid runner
(``experiments.grid``) runs the jobs serially or on Ray, resumes from its checkpoint, and replays finished
runs from the store. ``leaderboard_frame`` joins the jobs' rows into the per-sample table (``COLUMNS``);
``summarize`` gives each (model, task, length, setting, policy, ratio) its mean score and interval, beside
Full's; ``averaged`` gives each policy and ratio its mean over the tasks Full solves.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd

from ..policies import parse_spec
from ..runs import ENGINE_VERSION
from .sweep import ratio_jobs
from .task_runs import SETTINGS

COLUMNS = ["model", "task", "length", "policy", "ratio", "setting", "sample", "score", "answer", "references",
           "run_id", "spec", "budget", "tokens", "context_tokens"]
# Answers and references are text even where every one looks like a number (" 8284194.", not 8284194.0): pass as
# read_csv's dtype wherever a leaderboard is read back.
TEXT_COLUMNS = {"answer": str, "references": str}
SUMMARY_COLUMNS = ["model", "task", "length", "setting", "policy", "ratio", "samples", "score", "lo", "hi",
                   "full_score", "full_solves"]
# Full solves a task at a length when its mean score reaches this; a task it fails is kept out of averages.
SOLVED = 0.5
# The policies the shipped leaderboard grades, in its order: every kind KV Lens has.
SHIPPED_POLICIES = ("sinks", "streamingllm", "h2o", "tova", "a2sf", "snapkv", "pyramidkv", "adakv", "knorm",
                    "expected_attention", "kvzip", "rkv", "keyformer", "scissorhands", "random", "quest", "sparq",
                    "reattention", "oracle")
SHIPPED_RATIOS = (0.25, 0.5, 0.75, 0.875)


def task_specs(policies: Sequence[str], ratios: Sequence[float]) -> list[str]:
    """Every policy (a name, parameters allowed but no budget) at every ratio, policy by policy; Full is every
    sample's reference row, never a ratio. SpecError for a policy that does not parse."""
    specs = [spec for _, _, spec in ratio_jobs(policies, ratios)]
    for spec in specs:
        parse_spec(spec)
    return specs


def task_jobs(model: str, tasks: Sequence[str], lengths: Sequence[int], samples: int, specs: Sequence[str],
              settings: Sequence[str] = ("agnostic",), chat: bool = True, first: int = 0) -> list[dict]:
    """The grid's jobs (``experiments.grid``): one per (task, length, sample, setting), every spec a row of it;
    samples ``first`` .. ``first + samples - 1``, each in every setting before the next (a grid cut short has
    the same samples in both)."""
    if samples < 1 or first < 0:
        raise ValueError(f"samples must be at least 1 and first at least 0, got {samples} and {first}")
    for setting in settings:
        if setting not in SETTINGS:
            raise ValueError(f"settings must be among {', '.join(SETTINGS)}, got {setting!r}")
    versions = {spec: type(parse_spec(spec)).version for spec in specs}
    return [{"kind": "task", "model": model, "engine": ENGINE_VERSION, "versions": versions,
             "payload": {"task": task, "length": int(length), "sample": index, "specs": list(specs),
                         "setting": setting, "chat": bool(chat)}}
            for task in tasks for length in lengths for index in range(first, first + samples) for setting in settings]


def leaderboard_frame(results: Sequence[Sequence[dict]]) -> pd.DataFrame:
    """The rows of every job (``run_grid``'s result) as the per-sample table (``COLUMNS``)."""
    df = pd.DataFrame([row for rows in results for row in rows], columns=COLUMNS)
    df["budget"] = df["budget"].astype("Int64")
    return df


def wilson(score: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson's score interval of a mean ``score`` in [0, 1] over ``n`` samples: exact in kind for RULER's 0/1
    needles and close for its shares of references, never outside [0, 1] and never of zero width at 0 or 1, as
    Student's t over a handful of samples would be."""
    from scipy import stats

    if n < 1:
        return float("nan"), float("nan")
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    centre = (score + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * np.sqrt(score * (1 - score) / n + z * z / (4 * n * n))
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def summarize(df: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per (model, task, length, setting, policy, ratio): the mean score over the samples with its interval
    (``wilson``), and Full's mean on the same samples (``full_solves``: it reaches ``SOLVED``)."""
    rows = []
    keys = ["model", "task", "length", "setting"]
    for group, part in df.groupby(keys, sort=False):
        full = float(part.loc[part["policy"] == "full", "score"].mean())
        for (policy, ratio), cell in part.groupby(["policy", "ratio"], sort=False, dropna=False):
            scores = cell["score"].to_numpy(float)
            mean = float(scores.mean())
            lo, hi = wilson(mean, len(scores), confidence)
            rows.append({**dict(zip(keys, group)), "policy": policy, "ratio": ratio, "samples": len(scores),
                         "score": mean, "lo": lo, "hi": hi, "full_score": full, "full_solves": bool(full >= SOLVED)})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def averaged(summary: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per (model, setting, policy, ratio): the mean over the tasks and lengths Full solves (each weighs the same),
    with Wilson's interval over all their samples."""
    solved = summary[summary["full_solves"]]
    rows = []
    for (model, setting, policy, ratio), part in solved.groupby(["model", "setting", "policy", "ratio"],
                                                               sort=False, dropna=False):
        mean, n = float(part["score"].mean()), int(part["samples"].sum())
        lo, hi = wilson(mean, n, confidence)
        rows.append({"model": model, "task": "average", "length": 0, "setting": setting, "policy": policy,
                     "ratio": ratio, "samples": n, "score": mean, "lo": lo, "hi": hi,
                     "full_score": float(part["full_score"].mean()), "full_solves": True})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
