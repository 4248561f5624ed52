"""The runs that ship with the app and the lessons told over them: data, no UI.

``SHOWCASE``: each shipped run as the app's controls make it (a text, the checked policies, the budget slider, the
evidence box), the first one being what the page opens on. ``benchmarks/shipped_runs.py`` runs them and writes
``assets/runs/`` (``backend.shipped_runs``).

``LESSONS``: a few narrated steps each. A step names a shipped run and what the views show of it (the view, the
step, the layer and head), so it shows at once and computes nothing; or, for the leaderboard lesson, a task of a
shipped leaderboard. A step's ``claims`` are the facts its text quotes, each checked against the shipped traces
by ``tests/test_lessons.py``: a lesson cannot say what its traces do not show.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "assets" / "examples"
LESSON_TEXTS = ROOT / "assets" / "lessons"


@dataclass(frozen=True)
class ShowcaseRun:
    """A shipped run as the controls set it: ``text`` is an example's label or a file of ``assets/lessons/``."""

    text: str
    policies: tuple[str, ...]
    budget: int = 40
    evidence: str = ""
    max_new_tokens: int = 24

    def prompt(self) -> str:
        for folder in (EXAMPLES, LESSON_TEXTS):
            path = folder / f"{self.text.replace(' ', '_')}.txt"
            if path.is_file():
                return path.read_text().strip()
        raise FileNotFoundError(f"no example or lesson text {self.text!r}")


SHOWCASE: dict[str, ShowcaseRun] = {
    "first": ShowcaseRun("needle", ("sinks", "tova", "a2sf", "reattention"), evidence="317"),
    "window": ShowcaseRun("needle", ("window", "sinks", "streamingllm"), evidence="317"),
    "heavy": ShowcaseRun("needle", ("h2o", "tova", "a2sf"), evidence="317"),
    "needle": ShowcaseRun("needle", ("tova", "quest", "reattention"), evidence="317"),
    "question_after": ShowcaseRun("needle", ("snapkv", "adakv"), evidence="317"),
    "question_before": ShowcaseRun("needle_question_first", ("snapkv", "adakv"), evidence="317"),
    "held": ShowcaseRun("needle", ("kivi", "cam", "think"), evidence="317"),
}
FIRST = "first"


@dataclass(frozen=True)
class Claim:
    """A fact a step's text quotes, checked against the shipped traces.

    ``what``: "answer" (the policy's continuation holds ``value``), "not_answer" (it does not), "reads" (the
    query at ``step`` reads the evidence in some layer and KV head: ``value`` "yes" or "no"), "token0" (the
    share of layers and heads holding token 0 at the end, as a whole percentage ``value``), or "grade" (the
    shipped leaderboard's grade, ``value`` as printed)."""

    what: str
    policy: str
    value: str
    step: int | None = None  # None: the run's last prompt token (the query that starts the answer)


@dataclass(frozen=True)
class Step:
    text: str  # markdown
    run: str = ""  # a SHOWCASE name; "" for a leaderboard step
    view: str = "kept"  # the tab of the run's views (app.VIEW_TABS) or "tasks"
    step: int | None = None  # None: the run's last prompt token
    layer: str = "all"
    head: str = "all"
    task: str = ""  # a leaderboard step's task
    claims: tuple[Claim, ...] = ()


@dataclass(frozen=True)
class Lesson:
    name: str
    title: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


LESSONS: dict[str, Lesson] = {}
