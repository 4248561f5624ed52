"""The docs as a reference: what every page and the README may say, where their links lead, and that the figures they
quote from the shipped files are the shipped files' own.

- No page names a work session, a date of work or an issue number; no page is longer than 800 lines, the README 200.
- Every relative link of the README and the docs leads to a file (and a heading, where it names one).
- The README names the two commands (`make run`, `make test`) that the Makefile and CI run.
- A table marked ``<!-- shipped ... -->`` quotes the shipped leaderboards' samples (``assets/leaderboards/samples``):
  each cell is recomputed from them (see ``_check_table``). The averaged grades and the needle grid's tables are
  the tools' own output (``tests/test_leaderboard_tables.py``, ``tests/test_needle_tables.py``).
"""
from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
MAX_DOCS_LINES = 800
MAX_README_LINES = 200


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- what a page may say ------------------------------------------------------------------------------------------

# A work session, an issue (by number or by name), a number with a hash, or a date of work. A quoted model answer may
# hold a date ('The meeting is in the 2023-01-01'): text in single quotes that open after a space or a bar is left out
# of the date check, and only of it.
FORBIDDEN = [
    (re.compile(r"\bsessions?\b", re.I), "a work session"),
    (re.compile(r"\bissues?\b", re.I), "an issue"),
    (re.compile(r"(?<![\w&])#\d+\b"), "an issue number"),
    (re.compile(r"\b2026\b"), "a year of work"),
]
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
QUOTED = re.compile(r"(?<![\w'])'[^'\n]*'")


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_names_a_session_a_date_of_work_or_an_issue(page):
    found = []
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        found += [f"{_rel(page)}:{number}: {what}: {line.strip()[:120]}" for pattern, what in FORBIDDEN
                  if pattern.search(line)]
        if DATE.search(QUOTED.sub("", line)):
            found.append(f"{_rel(page)}:{number}: a date: {line.strip()[:120]}")
    assert not found, "\n".join(found)


def test_the_checks_catch_what_they_are_for():
    def flagged(line):
        return any(p.search(line) for p, _ in FORBIDDEN) or bool(DATE.search(QUOTED.sub("", line)))

    for line in ["## Results (session of 2026-11-26)", "as issue 12 asked", "see #36", "measured 2025-03-04",
                 "the next Session will"]:
        assert flagged(line), line
    for line in ["| keydiff | 64 | 'The meeting is in the 2023-01-01' | same |", "Xiao et al., 2023, Sec. 3.2",
                 "KV Lens's `tova:budget=64`", "`#summary`", "C&#35;"]:
        assert not flagged(line), line


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_no_page_is_too_long(page):
    limit = MAX_README_LINES if page.name == "README.md" and page.parent == ROOT else MAX_DOCS_LINES
    lines = len(page.read_text(encoding="utf-8").splitlines())
    assert lines <= limit, f"{_rel(page)} has {lines} lines, more than {limit}: split it by question"


RESULTS = ["faithfulness.md", "leaderboards.md", "leaderboards-by-task.md", "evidence.md", "performance.md",
           "long-texts.md", "models.md", "robustness.md"]


@pytest.mark.parametrize("name", RESULTS)
def test_a_results_page_opens_with_its_answer_in_three_lines(name):
    """The heading, then a paragraph of at most three lines, before any other heading, table, list or picture."""
    lines = (ROOT / "docs" / name).read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# ") and lines[1] == "", name
    answer = lines[2:lines.index("", 2)]
    assert 1 <= len(answer) <= 3 and not any(line.startswith(("#", "|", "-", "!", "`")) for line in answer), answer


# --- links ---------------------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\*", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.*)$", text, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_relative_link_leads_somewhere(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no such heading in {_rel(file)}")
    assert not broken, f"{_rel(page)}:\n" + "\n".join(broken)


def test_no_tracked_file_names_a_docs_page_that_is_gone():
    """A path such as `docs/<page>.md` in any tracked text file (code comments included) names a page that exists."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    missing = []
    for name in files:
        if not name.endswith((".py", ".md", ".ipynb", ".txt", ".sh", ".cfg", ".toml", ".yml", ".yaml")):
            continue
        try:
            text = (ROOT / name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        missing += [f"{name}: {page}" for page in sorted(set(re.findall(r"\bdocs/[\w\-/]+\.md\b", text)))
                    if not (ROOT / page).exists()]
    assert not missing, "\n".join(missing)


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"\]\(([\w\-]+\.md)\)", index))
    assert {page.name for page in DOCS if page.name != "README.md"} <= listed


# --- the README ----------------------------------------------------------------------------------------------------

def test_the_readme_names_the_commands_the_makefile_and_ci_run():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^make run\b", readme, re.M) and re.search(r"^make test\b", readme, re.M)
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert re.search(r"^make test$", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)
    assert "docs/screenshot.png" in readme and "?lesson=" in readme


def test_the_readme_links_every_lesson_that_exists():
    from backend.experiments.lessons import LESSONS

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert {name for name in LESSONS} <= set(re.findall(r"\?lesson=(\w+)", readme))


# --- figures quoted from the shipped leaderboards ------------------------------------------------------------------

MODELS = {"smollm2": "smollm2-135m-instruct", "gemma": "gemma3-270m"}
TASKS = {"needle": "niah_single_1", "niah_single_1": "niah_single_1", "fwe": "ruler_fwe", "cwe": "ruler_cwe",
         "single_2": "niah_single_2_speeches", "single_3": "niah_single_3_speeches",
         "multikey_1": "niah_multikey_1_speeches", "multivalue": "niah_multivalue_speeches",
         "multiquery": "niah_multiquery_speeches", "niah_multikey_2": "niah_multikey_2",
         "niah_multikey_3": "niah_multikey_3", "ruler_vt": "ruler_vt", "ruler_fwe": "ruler_fwe",
         "ruler_cwe": "ruler_cwe"}
LENGTHS = {"1k": 1024, "4k": 4096, "8k": 8192}
RATIOS = (0.25, 0.5, 0.75, 0.875)
MARK = re.compile(r"^<!-- shipped (?P<args>[^>]*?) -->\n+(?P<table>(?:\|.*\n?)+)", re.M)


@cache
def _samples(model: str) -> pd.DataFrame:
    df = pd.read_csv(ROOT / "assets" / "leaderboards" / "samples" / f"{model}.csv",
                     usecols=["task", "length", "policy", "ratio", "setting", "sample", "score"])
    return df.assign(policy=df["policy"].map(_policy))


def _sample_list(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        out += list(range(int(first), int(last or first) + 1))
    return out


def _policy(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def _column(header: str, before: dict) -> dict:
    """What a header cell selects: a ratio, a setting, a model, a task, a length, a sample; all but the ratio and the
    sample carry over from the column before when the header does not name them."""
    column = {key: before[key] for key in ("model", "setting", "task", "length") if before.get(key)}
    column.setdefault("setting", None)
    for word in re.split(r"[\s,()/]+", header.strip().lower()):
        if word in {f"{r:g}" for r in RATIOS}:
            column["ratio"] = float(word)
        elif word in ("agnostic", "aware"):
            column["setting"] = word
        elif word.startswith(tuple(MODELS)):
            column["model"] = MODELS[next(m for m in MODELS if word.startswith(m))]
        elif word in TASKS:
            column["task"] = TASKS[word]
        elif word in LENGTHS:
            column["length"] = LENGTHS[word]
        elif re.fullmatch(r"s\d+", word):
            column["sample"] = int(word[1:])
    return column


def _scores(sets, column, policy, ratio, default_setting) -> list[float]:
    """The shipped scores of ``policy`` at ``ratio`` over the sets a column selects."""
    scores = []
    for model, task, length, samples in sets:
        if any(column.get(key) not in (None, value) for key, value in
               (("model", model), ("task", task), ("length", length))):
            continue
        chosen = [column["sample"]] if "sample" in column else samples
        df = _samples(model)
        rows = df[(df["task"] == task) & (df["length"] == length) & (df["policy"] == policy)
                  & ((df["ratio"] - ratio).abs() < 1e-9) & (df["setting"] == (column["setting"] or default_setting))
                  & df["sample"].isin(chosen)]
        assert len(rows) == len(chosen), f"{model} {task} {length} {policy} {ratio}: samples {chosen} not shipped"
        scores += rows.sort_values("sample")["score"].tolist()
    return scores


def _same(printed: str, value: float) -> bool:
    decimals = len(printed.partition(".")[2])
    return abs(float(printed) - value) <= (0.5 * 10 ** -decimals if decimals else 0) + 1e-9


def _check_table(args: str, table: str) -> list[str]:
    """Each cell against the shipped samples. ``rows=MODEL/TASK/LENGTH/SAMPLES`` (repeatable) names the sets the
    table is over; a column's header narrows them (a model, a task, a length, ``sN`` for one sample) and names the
    ratio, or none when each cell holds the four ratios. A cell is a mean score (``0.75``), a count of the samples
    answered (``3 (1101)``: the samples in order), four means (``0.6 / 0.6 / 0.67 / 0.8``) or, for one sample, its
    four scores (``1101``). ``format=full`` checks Full's mean over every shipped sample of a task and length instead
    (rows: task, tokens; a column per model; a cell ``0.20 (10)``: mean and samples; ``-``: none shipped)."""
    options = dict(arg.split("=", 1) for arg in args.split() if not arg.startswith("rows="))
    sets = []
    for arg in args.split():
        if arg.startswith("rows="):
            model, task, length, samples = arg[5:].split("/")
            sets.append((model, task, int(length), _sample_list(samples)))
    setting = options.get("setting", "agnostic")
    lines = [line.strip().strip("|").split("|") for line in table.strip().splitlines()]
    header, body = [cell.strip() for cell in lines[0]], [[cell.strip() for cell in row] for row in lines[2:]]
    problems = []
    if options.get("format") == "full":
        models = [MODELS[next(m for m in MODELS if h.lower().startswith(m))] for h in header[2:]]
        for row in body:
            task, length = TASKS[row[0].split()[0].strip("`")], int(row[1].replace(",", ""))
            for model, cell in zip(models, row[2:]):
                df = _samples(model)
                full = df[(df["task"] == task) & (df["length"] == length) & (df["policy"] == "full")
                          & (df["setting"] == "agnostic")]
                if cell == "-":
                    if len(full):
                        problems.append(f"{model} {task} {length}: shipped, the table says not")
                    continue
                mean, count = re.match(r"([\d.]+) \((\d+)\)", cell).groups()
                if len(full) != int(count) or not _same(mean, full["score"].mean()):
                    problems.append(f"{model} {task} {length}: {cell}, shipped {full['score'].mean():.3f} "
                                    f"({len(full)})")
        return problems
    columns, before = [], {}
    for cell in header[1:]:
        before = _column(cell, before)
        columns.append(before)
    for row in body:
        for name in row[0].split(", "):
            policy = _policy(name)
            for column, cell in zip(columns, row[1:]):
                ratios = [column["ratio"]] if "ratio" in column else list(RATIOS)
                if "ratio" not in column and re.fullmatch(r"[01]{4}", cell):
                    values = list(cell)
                elif "ratio" not in column:
                    values = [v.strip() for v in cell.split("/")]
                else:
                    values = [cell]
                if len(values) != len(ratios):
                    problems.append(f"{name}, {cell!r}: {len(ratios)} values expected")
                    continue
                for ratio, value in zip(ratios, values):
                    scores = _scores(sets, column, policy, ratio, setting)
                    count = re.fullmatch(r"(\d+) \(([01]+)\)", value)
                    if options.get("format") == "count":
                        n = int(count.group(1)) if count else int(value)
                        bits = "".join(str(int(s)) for s in scores)
                        ok = n == sum(scores) and set(bits) <= {"0", "1"} and (not count or count.group(2) == bits)
                        expected = f"{int(sum(scores))} ({bits})"
                    else:
                        ok = bool(scores) and _same(value, sum(scores) / len(scores))
                        expected = f"{sum(scores) / len(scores):.3f}" if scores else "none"
                    if not ok:
                        problems.append(f"{name} at {ratio:g} ({column}): {value}, shipped {expected}")
    return problems


def _marked_tables():
    for page in DOCS:
        for match in MARK.finditer(page.read_text(encoding="utf-8")):
            yield pytest.param(page, match["args"], match["table"],
                               id=f"{page.name}:{match['table'].splitlines()[0][:40]}")


@pytest.mark.parametrize("page, args, table", list(_marked_tables()))
def test_a_marked_table_quotes_the_shipped_samples(page, args, table):
    problems = _check_table(args, table)
    assert not problems, f"{_rel(page)}, table '{table.splitlines()[0]}':\n" + "\n".join(problems)


def test_the_table_check_fails_a_wrong_cell():
    table = "| policy | 0.25 | 0.5 |\n|---|---|---|\n| kvzip, oracle | 1 | 1 |\n"
    args = "rows=smollm2-135m-instruct/niah_single_1/4096/2"
    assert _check_table(args, table) == []
    assert _check_table(args, table.replace("| 1 | 1 |", "| 1 | 0 |"))
    assert _check_table(args, table.replace("oracle", "random"))
    assert _check_table("format=count " + args.replace("/2", "/0-4"), table.replace("| 1 | 1 |", "| 5 | 4 |"))


def test_every_results_page_has_a_marked_or_tool_checked_table():
    marked = {page.name for page, *_ in (p.values for p in _marked_tables())}
    assert {"leaderboards.md", "evidence.md"} <= marked
