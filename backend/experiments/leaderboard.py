"""The task leaderboard: lm-eval's tasks at several lengths, every policy at every compression ratio, scored
per sample, then averaged with an interval over the samples.

A job is one task sample in one setting (``task_runs.SETTINGS``): every policy and ratio is a row of one
batched generate-mode run with Full (``task_runs.run_sample``), so the grid runner
(``experiments.grid``) runs the jobs serially or on Ray, resumes from its checkpoint, and replays finished
runs from the store. ``leaderboard_frame`` joins the jobs' rows into the per-sample table (``COLUMNS``);
``summarize`` gives each (model, task, length, setting, policy, ratio) its mean score and interval, beside
Full's; ``averaged`` gives each policy and ratio its mean over the tasks Full solves at each length;
``paired_tests`` says which policies the samples, paired, tell apart.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import fields

import numpy as np
import pandas as pd

from ..policies import POLICIES, parse_spec
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
SHIPPED_RATIOS = (0.25, 0.5, 0.75, 0.875)


def graded_policies() -> tuple[str, ...]:
    """The policies a leaderboard grades unless told otherwise, in the registry's order: every registered policy
    that takes a compression ratio, as a budget in tokens or in a form of its own (KIVI's and GEAR's bits: 16 x
    (1 - ratio)). Full, which holds everything, is every sample's reference row instead."""
    return tuple(name for name, cls in POLICIES.items() if "budget" in {f.name for f in fields(cls)})


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


def graded_everywhere(summary: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``summary`` on the tasks and lengths Full solves, of Full and, at each length, the policies graded
    on every task Full solves there (per model and setting). A policy added to a leaderboard on some tasks only (its
    samples still to come on the others) stays out of that length's average: a mean over other tasks than the
    rest's would not compare with theirs."""
    solved = summary[summary["full_solves"]]
    kept = []
    for _, part in solved.groupby(["model", "setting", "length"], sort=False):
        policies = part[part["policy"] != "full"]
        cells = policies.groupby("policy", sort=False)["task"].agg(frozenset)
        every = frozenset(policies["task"])
        complete = {policy for policy, where in cells.items() if where == every}
        kept.append(part[(part["policy"] == "full") | part["policy"].isin(complete)])
    return pd.concat(kept, ignore_index=True) if kept else solved


def averaged(summary: pd.DataFrame, confidence: float = 0.95) -> pd.DataFrame:
    """Per (model, setting, length, policy, ratio), as RULER reports its grades: the mean over the tasks Full solves
    at that length (each weighs the same), with Wilson's interval over all their samples; for the policies graded
    on every one of them (``graded_everywhere``). The rows' task is "average"."""
    solved = graded_everywhere(summary)
    rows = []
    for (model, setting, length, policy, ratio), part in solved.groupby(
            ["model", "setting", "length", "policy", "ratio"], sort=False, dropna=False):
        mean, n = float(part["score"].mean()), int(part["samples"].sum())
        lo, hi = wilson(mean, n, confidence)
        rows.append({"model": model, "task": "average", "length": int(length), "setting": setting,
                     "policy": policy, "ratio": ratio, "samples": n, "score": mean, "lo": lo, "hi": hi,
                     "full_score": float(part["full_score"].mean()), "full_solves": True})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def partly_graded(summary: pd.DataFrame) -> dict[tuple[tuple[str, int], ...], list[str]]:
    """The policies ``averaged`` leaves out of one model's and setting's ``summary`` at some length (graded on some
    of the tasks Full solves there only), by the tasks and lengths they are graded on there."""
    solved = summary[summary["full_solves"] & (summary["policy"] != "full")]
    averaged_at = set(zip(*(graded_everywhere(summary)[key] for key in ("policy", "length"))))
    found: dict[tuple[tuple[str, int], ...], list[str]] = {}
    for (length, policy), rows in solved.groupby(["length", "policy"], sort=False):
        if (policy, length) not in averaged_at:
            cells = tuple(sorted({(str(t), int(length)) for t in rows["task"]}))
            found.setdefault(cells, []).append(str(policy))
    return found


PAIR_COLUMNS = ["model", "setting", "length", "ratio", "policy", "other", "above", "below", "same", "p", "ordered"]


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of p-values tested together: the k-th smallest is multiplied by the number of
    tests not yet passed, and an adjusted value is never below the one before it."""
    order = sorted(range(len(pvalues)), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * len(pvalues), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(pvalues) - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@functools.cache
def sign_test(above: int, below: int) -> float:
    """The two-sided sign test's p of ``above`` wins and ``below`` losses (scipy's exact binomial test at 1/2; 1 with
    neither). Remembered: the same counts come up for many pairs, and a leaderboard's tests number tens of
    thousands."""
    from scipy import stats

    return float(stats.binomtest(above, above + below).pvalue) if above + below else 1.0


def paired_tests(samples: pd.DataFrame, setting: str = "agnostic", alpha: float = 0.05,
                 cell: tuple[str, int] | None = None) -> pd.DataFrame:
    """Which policies the samples tell apart, pair by pair at each length and ratio (``PAIR_COLUMNS``), over the
    tasks Full solves at that length, as ``averaged`` grades them (the policies graded on every one of them);
    ``cell``, a task and a length: on that one's samples alone, every policy graded there.

    Every policy answers the same samples, so two policies are compared sample by sample, a test of the pair where
    two overlapping or apart intervals are not one: on how many samples ``policy`` (the one graded higher, or first
    in the grades' order on a tie) scores above ``other``, below it and the same, and the two-sided sign test's p
    over the samples that differ. ``ordered``: ``policy`` wins, with Holm's correction over every pair at that
    length and ratio keeping p under ``alpha``. The grades weigh each task the same and the test each sample, so a
    pair may also come out the other way (more samples below than above); that is not ``ordered``."""
    rows = samples[samples["setting"] == setting]
    if cell is not None:
        rows = rows[(rows["task"] == cell[0]) & (rows["length"] == int(cell[1]))]
    full = rows[rows["policy"] == "full"].groupby(["model", "task", "length"])["score"].mean()
    rows = rows[rows.set_index(["model", "task", "length"]).index.isin(full[full >= SOLVED].index)]
    if (rows["policy"] == "full").all():
        return pd.DataFrame(columns=PAIR_COLUMNS)
    grades = averaged(summarize(rows))
    grades = grades[grades["policy"] != "full"]
    pairs = []
    for (model, length, ratio), part in grades.groupby(["model", "length", "ratio"], sort=True):
        order = list(part.sort_values("score", ascending=False, kind="stable")["policy"])
        cell = rows[(rows["model"] == model) & (rows["length"] == length) & (rows["ratio"] == ratio)
                    & rows["policy"].isin(order)]
        # One column a policy, one row a sample (NaN where a policy did not answer it).
        wide = cell.set_index(["task", "length", "sample", "policy"])["score"].unstack("policy")[order].to_numpy()
        found = []
        for i, policy in enumerate(order):
            for j in range(i + 1, len(order)):
                a, b = wide[:, i], wide[:, j]
                both = ~(np.isnan(a) | np.isnan(b))
                above, below = int((a[both] > b[both] + 1e-9).sum()), int((b[both] > a[both] + 1e-9).sum())
                p = sign_test(above, below)
                found.append({"model": model, "setting": setting, "length": int(length), "ratio": float(ratio),
                              "policy": policy, "other": order[j], "above": above, "below": below,
                              "same": int(both.sum()) - above - below, "p": p})
        for pair, adjusted in zip(found, holm([pair["p"] for pair in found])):
            pair["ordered"] = bool(adjusted < alpha and pair["above"] > pair["below"])
        pairs.extend(found)
    return pd.DataFrame(pairs, columns=PAIR_COLUMNS)


def ordered_groups(pairs: pd.DataFrame) -> list[dict]:
    """``paired_tests``' verdicts as groups, per (model, setting, length, ratio): the policies in the grades' order,
    a new group starting at the first policy the samples order below the current group's first. So each group's
    first is told apart from the next group's first; policies within a group may be too (``pairs_ordered`` of
    ``pairs`` are). Each: model, setting, length, ratio, pairs, pairs_ordered, groups (lists of policies)."""
    found = []
    for (model, setting, length, ratio), part in pairs.groupby(["model", "setting", "length", "ratio"], sort=True):
        first = part["policy"].iloc[0]
        order = [first, *part.loc[part["policy"] == first, "other"]]
        ordered = set(zip(part.loc[part["ordered"], "policy"], part.loc[part["ordered"], "other"]))
        groups = [[order[0]]]
        for policy in order[1:]:
            if (groups[-1][0], policy) in ordered:
                groups.append([policy])
            else:
                groups[-1].append(policy)
        found.append({"model": model, "setting": setting, "length": int(length), "ratio": float(ratio),
                      "pairs": len(part), "pairs_ordered": int(part["ordered"].sum()), "groups": groups})
    return found
