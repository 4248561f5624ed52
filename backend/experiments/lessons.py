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
from types import MappingProxyType

ROOT = Path(__file__).resolve().parents[2]
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


SHOWCASE: MappingProxyType[str, ShowcaseRun] = MappingProxyType({
    "first": ShowcaseRun("needle", ("sinks", "tova", "a2sf", "reattention"), evidence="317"),
    "window": ShowcaseRun("needle", ("window", "sinks", "streamingllm"), evidence="317"),
    "heavy": ShowcaseRun("needle", ("h2o", "tova", "a2sf"), evidence="317"),
    "needle": ShowcaseRun("needle", ("tova", "quest", "reattention"), evidence="317"),
    "question_after": ShowcaseRun("needle", ("snapkv", "adakv"), evidence="317"),
    "question_before": ShowcaseRun("needle_question_first", ("snapkv", "adakv"), evidence="317"),
    "held": ShowcaseRun("needle", ("kivi", "cam", "think"), evidence="317"),
})
FIRST = "first"


@dataclass(frozen=True)
class Claim:
    """A fact a step's text quotes, checked against the shipped traces (``holds``).

    ``what``: "answer" (the policy's answer holds ``value``), "not_answer" (it does not), "reads" (the query of
    the story's step, the first after the prompt, reads some of the evidence in some layer and KV head: ``value``
    "yes" or "no"), "token0" (the share of layers and KV heads still holding token 0 at the end, a whole
    percentage), "diverges" (the answer's first token unlike Full's, counted from 0), or "grade" (the default
    model's shipped leaderboard: ``policy``'s score on ``task`` at ``length`` and ``ratio``, query-agnostic, to two
    decimals).
    ``value`` is how the text quotes it: the test also checks that the text says it."""

    what: str
    policy: str
    value: str
    task: str = ""
    ratio: float = 0.0
    length: int = 0  # the context in tokens of a task or an average


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


def _answer(*claims: tuple[str, str]) -> tuple[Claim, ...]:
    return tuple(Claim("answer", policy, value) for policy, value in claims)


LESSONS: MappingProxyType[str, Lesson] = MappingProxyType({lesson.name: lesson for lesson in (
    Lesson("window", "Sinks and the window", (
        Step("Full reads the whole diary and answers **317**. Each policy here holds **40 tokens** of the 240. "
             "**window** keeps only the latest 40: the room number, near the start, left its cache long ago, and "
             "its answer never reaches a number.", "window", "kept",
             claims=(*_answer(("full", "317")), Claim("not_answer", "window", "317"), Claim("reads", "window", "no"))),
        Step("**sinks** keeps the first 4 tokens as well (the *attention sinks*) and the latest 36. Its answer is "
             "fluent again, and wrong: **1234**. The sinks steady the model; they do not keep the needle "
             "(outlined in orange: read by no layer and no head).", "window", "kept",
             claims=(*_answer(("sinks", "1234")), Claim("reads", "sinks", "no"))),
        Step("The masks, row by row: a band along the diagonal (the window) and, under sinks, a column at the left "
             "edge. Token 0 stays in **100%** of sinks' layers and heads to the end, in **15%** of window's (the "
             "model's own first tokens stay there only while the text is short).", "window", "masks",
             claims=(Claim("token0", "sinks", "100"), Claim("token0", "window", "15"))),
        Step("**StreamingLLM** keeps the same tokens as sinks but re-rotates the keys to their places in the cache. "
             "Here it answers as sinks does, **1234**: where a key sits was not what lost the number.", "window",
             "divergence", claims=_answer(("streamingllm:budget=40", "1234"))),
    )),
    Lesson("heavy", "Heavy hitters: H2O and TOVA", (
        Step("Three policies keep the tokens that drew attention. **H2O** adds up every query's attention, "
             "**TOVA** asks only the current query, **A2SF** adds up with a forgetting factor. At 40 tokens they "
             "answer **33**, **123** and **11**: close to a number, never the one.", "heavy", "kept",
             claims=_answer(("h2o", "33"), ("tova", "123"), ("a2sf", "11"))),
        Step("When the answer begins, TOVA and A2SF read none of the needle's tokens; H2O still reads a piece of it "
             "in a few heads, which may be where its 33 comes from.", "heavy", "kept",
             claims=(Claim("reads", "tova", "no"), Claim("reads", "a2sf", "no"), Claim("reads", "h2o", "yes"))),
        Step("Why sum attention with a forgetting factor: an early token collects attention from every later "
             "query, so a plain sum (A2S) favours the start of the text. A2SF's factor lets recent attention count "
             "more. Move the alpha slider to see the scores change.", "heavy", "curves"),
        Step("What they keep longest: token 0 stays in **99%** of H2O's layers and heads, **90%** of TOVA's and "
             "**89%** of A2SF's. TOVA's paper finds the first token among those kept longest.", "heavy", "retention",
             claims=(Claim("token0", "h2o", "99"), Claim("token0", "tova", "90"), Claim("token0", "a2sf", "89"))),
    )),
    Lesson("needle", "The needle lost and found", (
        Step("**TOVA evicts**: once it drops a token, no later query can read it. It answers **123**. **Quest** "
             "and **ReAttention** *select*: every token stays, and each query picks the few it reads. Both answer "
             "**317**.", "needle", "kept",
             claims=_answer(("tova", "123"), ("quest", "317"), ("reattention", "317"))),
        Step("The summary's strips show the first query of the answer: under TOVA the outlined needle is rose (read "
             "by nothing); under Quest and ReAttention some heads read it again, because the question asks for "
             "it.", "needle", "masks",
             claims=(Claim("reads", "tova", "no"), Claim("reads", "quest", "yes"), Claim("reads", "reattention",
                                                                                       "yes"))),
        Step("Cache reach: how far back each query reads. Selection reaches back to the needle when asked; "
             "eviction's reach ends at what it kept.", "needle", "reach"),
        Step("Where the answers part: TOVA's leaves Full's at token **6**, the number itself; Quest's and "
             "ReAttention's never do.", "needle", "divergence",
             claims=(Claim("diverges", "tova", "6"), Claim("diverges", "quest", "none"),
                     Claim("diverges", "reattention", "none"))),
    )),
    Lesson("question", "The question before or after", (
        Step("**SnapKV** compresses once, when the prompt is read: it keeps the 40 tokens the last few queries "
             "attend to. Here the question comes last, so those queries ask for the room number: SnapKV keeps it and "
             "answers **317**, as **AdaKV** does.", "question_after", "kept",
             claims=_answer(("snapkv", "317"), ("adakv", "317"))),
        Step("The same diary with the question first. Now the last queries are diary sentences; what they attend to "
             "is not the number, and neither policy answers 317.", "question_before", "kept",
             claims=(Claim("not_answer", "snapkv", "317"), Claim("not_answer", "adakv", "317"))),
        Step("kvpress calls the second setting *query-agnostic*: the cache is compressed before the question is "
             "known, as when one cached document serves many questions. The Tasks leaderboard grades SnapKV "
             "and AdaKV both ways.", "question_before", "masks"),
    )),
    Lesson("held", "Held in another form", (
        Step("Not every policy drops tokens. **KIVI** holds every token, rounded to 2 bits (the latest 40 in full "
             "precision), and answers **317**. The Held forms view shows how far each key and value moved.",
             "held", "forms", claims=_answer(("kivi", "317"))),
        Step("**ThinK** keeps SnapKV's 40 tokens and, of their keys, half the channels: it answers **317**. "
             "**CaM** keeps the same tokens and merges each dropped value into the kept ones; here its answer "
             "drifts away from the number.", "held", "forms",
             claims=(*_answer(("think", "317")), Claim("not_answer", "cam", "317"))),
        Step("Their answers beside Full's: KIVI's and ThinK's never leave it.", "held", "divergence",
             claims=(Claim("diverges", "kivi", "none"), Claim("diverges", "think", "none"))),
    )),
    Lesson("leaderboard", "Reading a leaderboard", (
        Step("Each cell is a policy's score on RULER's tasks at one **compression ratio**: the share of the "
             "context's KV pairs removed (0.75 keeps a quarter). Here, the mean over the tasks Full solves at 1,024 "
             "tokens, query-agnostic: at 0.5, KVzip scores **0.91**, Quest **0.73** and SnapKV **0.06**.",
             view="tasks", task="average at 1,024 tokens",
             claims=(Claim("grade", "kvzip", "0.91", "average", 0.5, 1024),
                     Claim("grade", "quest", "0.73", "average", 0.5, 1024),
                     Claim("grade", "snapkv", "0.06", "average", 0.5, 1024))),
        Step("One task: niah_single_1, one number hidden in 1,024 tokens, where every policy is graded. Full finds "
             "it every time (**1.00**). At ratio 0.75 TOVA finds it once in ten (**0.10**), Knorm in **0.40** of the "
             "samples, KVzip in all (**1.00**).",
             view="tasks", task="niah_single_1",
             claims=(Claim("grade", "full", "1.00", "niah_single_1", 0.0, 1024),
                     Claim("grade", "tova", "0.10", "niah_single_1", 0.75, 1024),
                     Claim("grade", "knorm", "0.40", "niah_single_1", 0.75, 1024),
                     Claim("grade", "kvzip", "1.00", "niah_single_1", 0.75, 1024))),
        Step("A few samples a cell cannot order close scores. Under the average, the table of groups says which "
             "policies the samples tell apart (a sign test per pair on the same samples); an orange line in the "
             "grid marks where a new group starts. Click a sample's row below to run it here, with its evidence "
             "marked.", view="tasks", task="average at 1,024 tokens"),
    )),
)})


def holds(claim: Claim, run=None, leaderboard=None) -> bool:
    """Whether ``claim`` is true of its run (``shipped_runs.load``) or of the default model's ``leaderboard`` (the
    shipped summary as a DataFrame)."""
    import numpy as np

    from ..analysis import metrics, reads
    from ..analysis.evidence import run_evidence

    if claim.what == "grade":
        rows = leaderboard[(leaderboard["task"] == claim.task) & (leaderboard["policy"] == claim.policy)
                           & (leaderboard["setting"] == "agnostic") & np.isclose(leaderboard["ratio"], claim.ratio)
                           & (leaderboard["length"] == claim.length)]
        return len(rows) == 1 and f"{float(rows['score'].iloc[0]):.2f}" == claim.value
    traces = {t.spec: t for t in [run.full, *run.traces]}
    trace = traces.get(claim.policy) or next(t for t in run.traces if t.meta["policy"] == claim.policy)
    answer = "".join(trace.meta["token_texts"][trace.meta["n_prompt"]:])
    if claim.what in ("answer", "not_answer"):
        return (claim.value in answer) == (claim.what == "answer")
    if claim.what == "reads":
        step = int(run.full.meta["n_prompt"])
        every = list(range(trace.meta["n_layers"])), list(range(trace.meta["n_kv_heads"]))
        evidence = run_evidence(run.full, run.request.evidence).positions
        read = reads.read_share_at(trace, *every, step)[evidence]
        return bool(np.any(read > 0)) == (claim.value == "yes")
    if claim.what == "token0":
        return f"{metrics.first_token_retention(trace)[:, 0].mean():.0%}" == f"{claim.value}%"
    if claim.what == "diverges":
        return str(metrics.first_divergence(trace, run.full)).lower() == claim.value
    raise ValueError(f"unknown claim {claim.what!r}")
