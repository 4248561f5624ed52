"""The app's "Tasks" tab without a browser: the shipped task leaderboards and their faults, and one task sample a
visitor runs (checked before it queues, its text escaped, its run shown in the usual views)."""
import gradio as gr
import pandas as pd
import pytest

import app
from backend import api
from backend.api import RequestError, RunRequest, SampleRequest, SampleResult
from backend.engine.models import DEFAULT_MODEL
from backend.experiments import shipped
from viz.tasks import sample_status_html, sample_table_html

HEADER = "model,task,length,setting,policy,ratio,samples,score,lo,hi,full_score,full_solves\n"


def leaderboard_csv(settings=("agnostic", "aware")) -> str:
    """Two tasks at 1,024 tokens (Full fails ruler_vt) and their average, tova and snapkv at ratios 0.5 and 0.75."""
    rows = []
    for setting in settings:
        for task, length, full, solves in (("niah_single_1", 1024, 1.0, True), ("ruler_vt", 1024, 0.2, False),
                                           ("average", 1024, 1.0, True)):
            rows.append(f"m,{task},{length},{setting},full,0.0,4,{full},0.4,1.0,{full},{solves}")
            for policy, scores in (("tova", (0.75, 0.25)), ("snapkv", (1.0, 0.5))):
                for ratio, score in zip((0.5, 0.75), scores):
                    rows.append(f"m,{task},{length},{setting},{policy},{ratio},4,{score},0.1,1.0,{full},{solves}")
    return HEADER + "\n".join(rows) + "\n"


@pytest.fixture
def boards(tmp_path, monkeypatch):
    """A leaderboard folder holding m.csv; the app reads it as the shipped one."""
    (tmp_path / "m.csv").write_text(leaderboard_csv())
    monkeypatch.setattr(shipped, "LEADERBOARDS", tmp_path)
    return tmp_path


def test_a_leaderboard_offers_the_average_first_then_its_tasks_and_settings(boards):
    assert list(app.leaderboard_models()) == ["m"]
    (boards / "a-model.csv").write_text((boards / "m.csv").read_text())
    (boards / f"{app.api.DEFAULT_MODEL}.csv").write_text((boards / "m.csv").read_text())
    assert list(app.leaderboard_models()) == [app.api.DEFAULT_MODEL, "a-model", "m"]  # the default model's first
    (boards / "a-model.csv").unlink()
    (boards / f"{app.api.DEFAULT_MODEL}.csv").unlink()
    tasks, settings, policies, task, figure, table, note = app.leaderboard_view("m")
    assert tasks == ["average at 1,024 tokens", "niah_single_1", "ruler_vt"] and settings == ["agnostic", "aware"]
    assert policies == ["tova", "snapkv"] and task == "average at 1,024 tokens"
    assert note == "" and "mean over the tasks Full solves" in figure.layout.title.text


def test_the_leaderboard_draws_a_policy_by_ratio_grid_and_a_picked_policy_strong(boards):
    figure, table, note = app.shipped_leaderboard("m", "niah_single_1", "aware")
    assert note == "" and len(figure.data) == 1 and figure.data[0].type == "heatmap"
    assert list(figure.data[0].y) == ["snapkv", "tova"]  # the best mean first
    assert list(figure.data[0].x) == ["0.5", "0.75"] and [list(r) for r in figure.data[0].z] == [[1.0, 0.5],
                                                                                               [0.75, 0.25]]
    assert "query-aware" in figure.layout.title.text and "Full 1.00" in figure.layout.title.text
    assert not figure.layout.shapes
    assert "<td>tova</td><td>0.75</td><td>0.25</td>" in table and "ruler_vt" not in table  # the chosen task only
    assert table.index("<td>snapkv</td>") < table.index("<td>tova</td>")  # the grid's order: the best mean first
    # The title a line each for the model, the view and the setting with Full's score, so a phone's plot holds it.
    assert figure.layout.title.text == "m<br>niah_single_1 at 1,024 tokens<br>query-aware; Full 1.00"
    picked, _, _ = app.shipped_leaderboard("m", "niah_single_1", "aware", "tova")
    faint = [s for s in picked.layout.shapes if s.fillcolor == "rgba(255,255,255,0.72)"]
    strong = [s for s in picked.layout.shapes if s.line.color == "#C0392B"]
    assert len(faint) == 1 and faint[0].y0 == -0.5 and len(strong) == 1 and strong[0].y0 == 0.5  # snapkv faint


def test_the_average_says_which_policies_the_paired_samples_tell_apart(boards):
    # Nine samples of niah_single_1, which Full solves: tova right on every one, a hostile name on none. A sign test
    # over 9 of 9 gives p = 2 / 2^9, under 5% with Holm's correction over the one pair: two groups, escaped.
    rows = ["model,task,length,policy,ratio,setting,sample,score,answer,spec"]
    for sample in range(9):
        rows += [f"m,niah_single_1,1024,full,0.0,agnostic,{sample},1.0,a,full",
                 f"m,niah_single_1,1024,tova,0.5,agnostic,{sample},1.0,a,tova:ratio=0.5",
                 f'm,niah_single_1,1024,"{HOSTILE}",0.5,agnostic,{sample},0.0,b,x']
    (boards / "samples").mkdir()
    (boards / "samples" / "m.csv").write_text("\n".join(rows) + "\n")
    _, table, note = app.shipped_leaderboard("m", "average at 1,024 tokens", "agnostic")
    assert note == "" and "Told apart on the same samples" in table
    assert "<tr><td>0.5</td><td>1 of 1</td><td>tova &gt; &lt;img src=x onerror=alert(1)&gt;</td></tr>" in table
    assert HOSTILE not in table
    _, table, _ = app.shipped_leaderboard("m", "niah_single_1", "agnostic")  # the task's samples at 1,024 tokens
    assert "Told apart on the same samples at 1,024 tokens" in table
    assert "<td>1 of 1</td><td>tova &gt; &lt;img" in table and HOSTILE not in table


def test_the_average_at_each_length_is_a_view_of_its_own_with_its_full_and_its_groups(boards):
    # The average at 4,096 tokens too, where Full scores 0.5; three samples there tell nothing apart.
    summary = pd.read_csv(boards / "m.csv")
    longer = summary[summary["task"] == "average"].assign(length=4096, full_score=0.5)
    pd.concat([summary, longer]).to_csv(boards / "m.csv", index=False)
    rows = ["model,task,length,policy,ratio,setting,sample,score,answer,spec"]
    for length, samples in ((1024, 9), (4096, 3)):
        for sample in range(samples):
            rows += [f"m,niah_single_1,{length},full,0.0,agnostic,{sample},1.0,a,full",
                     f"m,niah_single_1,{length},tova,0.5,agnostic,{sample},1.0,a,tova:ratio=0.5",
                     f"m,niah_single_1,{length},snapkv,0.5,agnostic,{sample},0.0,b,snapkv:ratio=0.5"]
    (boards / "samples").mkdir()
    (boards / "samples" / "m.csv").write_text("\n".join(rows) + "\n")
    assert app.leaderboard_view("m")[0][:2] == ["average at 1,024 tokens", "average at 4,096 tokens"]
    figure, table, note = app.shipped_leaderboard("m", "average at 4,096 tokens", "agnostic")
    assert note == "" and list(figure.data[0].x) == ["0.5", "0.75"]
    assert figure.layout.title.text == "m<br>mean over the tasks Full solves at 4,096 tokens<br>query-agnostic; Full 0.50"
    assert "average at 4,096: Full 0.50" in table and "average at 1,024" not in table
    assert "Told apart on the same samples at 4,096 tokens: none of the 1 pairs, at any ratio." in table
    assert not [shape for shape in figure.layout.shapes if shape.type == "line"]
    figure, table, _ = app.shipped_leaderboard("m", "average at 1,024 tokens", "agnostic")
    assert "Told apart on the same samples at 1,024 tokens" in table and "<td>1 of 1</td>" in table
    assert [(s.x0, s.x1) for s in figure.layout.shapes if s.type == "line"] == [(-0.5, 0.5)]  # above snapkv at 0.5
    # A task at several lengths: a column per length and ratio, Full's score at each, a line for the groups at 1k.
    summary = pd.read_csv(boards / "m.csv")
    longer = summary[summary["task"] == "niah_single_1"].assign(length=4096, full_score=0.5)
    pd.concat([summary, longer]).to_csv(boards / "m.csv", index=False)
    figure, _, _ = app.shipped_leaderboard("m", "niah_single_1", "agnostic")
    assert list(figure.data[0].x) == ["1k · 0.5", "1k · 0.75", "4k · 0.5", "4k · 0.75"]
    assert figure.layout.title.text == "m<br>niah_single_1 at 1k, 4k<br>query-agnostic; Full 1.00, 0.50"


def test_a_policy_graded_on_some_tasks_only_is_named_under_the_average_and_grouped_on_its_task(boards):
    # Ruler_vt is solved here too; h2o is graded on niah_single_1 alone: the average leaves it out and says so.
    summary = pd.read_csv(boards / "m.csv")
    summary.loc[summary["task"] == "ruler_vt", ["full_score", "full_solves"]] = [1.0, True]
    extra = summary[(summary["task"] == "niah_single_1") & (summary["policy"] == "tova")].assign(policy="h2o")
    pd.concat([summary, extra]).to_csv(boards / "m.csv", index=False)
    _, table, note = app.shipped_leaderboard("m", "average at 1,024 tokens", "agnostic")
    assert note == "" and ("Not in the average at that length, graded on fewer of its tasks: h2o on niah_single_1 at "
                           "1,024 tokens only.") in table
    figure, _, _ = app.shipped_leaderboard("m", "niah_single_1", "agnostic")
    assert "h2o" in list(figure.data[0].y)


def test_a_task_full_fails_says_so(boards):
    figure, table, _ = app.shipped_leaderboard("m", "ruler_vt", "agnostic")
    assert "Full fails it" in figure.layout.title.text and "(Full fails it)" in table


def test_a_single_setting_hides_the_setting_radio(tmp_path, monkeypatch):
    (tmp_path / "m.csv").write_text(leaderboard_csv(settings=("agnostic",)))
    monkeypatch.setattr(shipped, "LEADERBOARDS", tmp_path)
    task, setting, pick, figure, table, note = app.on_leaderboard_model("m")
    assert pick["choices"] == ["(none)", "tova", "snapkv"] and task["choices"] == ["average at 1,024 tokens", "niah_single_1",
                                                                                 "ruler_vt"]
    assert task["value"] == "average at 1,024 tokens" and setting["value"] == "agnostic" and setting["visible"] is False
    assert figure is not None and note == ""


BAD_BOARDS = [
    # (content of m.csv or None for no folder at all, model asked for, message)
    (None, "m", "No task leaderboard is shipped here"),
    ("", "m", "m.csv is empty"),
    ("model,task,policy\nm,niah_single_1,tova\n", "m", "m.csv lacks the columns length, setting"),
    (HEADER, "m", "m.csv has no rows"),
    (HEADER + "m,niah_single_1,1024,agnostic,tova,0.5,4,<b>1</b>,0,1,1,True\n", "m", "score must be a number"),
    (HEADER + "m,niah_single_1,1024,agnostic,tova,0.5,4,1.5,0,1,1,True\n", "m", "scores must be 0 to 1"),
    (HEADER + "m,niah_single_1,1024,agnostic,tova,0.5,4,1,0,1,1,maybe\n", "m", "full_solves must be True or False"),
    (b"\xff\xfe\x00garbage", "m", "is not a readable CSV table"),
    (leaderboard_csv(), "../../etc/passwd", "No leaderboard is shipped for '../../etc/passwd'"),
    (leaderboard_csv(), ["m"], "No leaderboard is shipped for"),
]


@pytest.mark.parametrize("content, model, message", BAD_BOARDS, ids=[b[2] for b in BAD_BOARDS])
def test_a_missing_or_malformed_leaderboard_is_one_escaped_line(tmp_path, monkeypatch, content, model, message):
    folder = tmp_path / "leaderboards"
    if content is not None:
        folder.mkdir()
        (folder / "m.csv").write_bytes(content if isinstance(content, bytes) else content.encode())
    monkeypatch.setattr(shipped, "LEADERBOARDS", folder)
    for figure, table, note in (app.shipped_leaderboard(model, "average at 1,024 tokens", "agnostic"), app.leaderboard_view(model)[4:]):
        assert figure is None and table == ""
        assert message in note and len(note.splitlines()) == 1
        assert "<b>1" not in note  # the file's content reaches the page escaped


def test_a_task_or_setting_the_file_lacks_is_one_line(boards):
    figure, table, note = app.shipped_leaderboard("m", "<script>", "agnostic")
    assert figure is None and "no rows for &lt;script&gt; (query-agnostic)" in note
    for view in ("average at ,,, tokens", "average at 4,096 tokens", "average at 99999999999999 tokens"):
        figure, table, note = app.shipped_leaderboard("m", view, "agnostic")
        assert figure is None and "has no rows for" in note and len(note.splitlines()) == 1, view
    assert app.parse_view("average at 1,024 tokens") == ("average", 1024)
    assert app.parse_view("average at ,,, tokens") == ("average at ,,, tokens", None)


def test_every_shipped_leaderboard_reads_and_draws():
    for path in shipped.leaderboard_files():
        tasks, settings, _, _, figure, table, note = app.leaderboard_view(path.stem)
        assert note == "" and tasks[0] == "average at 1,024 tokens" and set(settings) <= {"agnostic", "aware"}
        rows = shipped.read_leaderboard(path)
        for view in tasks:
            for setting in settings:
                figure, table, note = app.shipped_leaderboard(path.stem, view, setting)
                has = (app._in_view(rows, view) & (rows["setting"] == setting)).any()
                assert (note == "" and figure is not None) if has else "has no rows for" in note, (view, setting)


HOSTILE = "<img src=x onerror=alert(1)>"


def test_a_sample_shows_its_question_references_and_answers_escaped():
    table = pd.DataFrame({"spec": ["full", "tova:ratio=0.5"], "budget": pd.array([None, 512], dtype="Int64"),
                          "score": [1.0, 0.0], "answer": ["1234567", HOSTILE]})
    status = sample_status_html("What is the <b>number</b>?", ["1234567", HOSTILE], table, "niah_single_1 <x>")
    shown = sample_table_html(table)
    for page in (status, shown):
        assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "&lt;b&gt;number&lt;/b&gt;" in status and "niah_single_1 &lt;x&gt;" in status
    assert "<b>tova:ratio=0.5</b>: score 0.00" in status and "<b>full</b>: score 1.00" in status
    assert "<td>full</td><td></td><td>1.00</td>" in shown and "<td>512</td><td>0.00</td>" in shown


def test_a_task_sample_runs_through_the_api_and_its_run_reaches_the_usual_views(tiny_session, monkeypatch):
    run = api.run(RunRequest(prompt="one two three four five six seven eight nine ten", specs=["tova:budget=6"],
                             mode="generate", max_new_tokens=3), tiny_session)
    asked = []

    def canned(request, store, limits=api.LIMITS):
        asked.append(request)
        table = pd.DataFrame({"spec": ["full", "tova:ratio=0.5"], "budget": pd.array([None, 6], dtype="Int64"),
                              "score": [1.0, 0.0], "answer": ["42", HOSTILE]})
        return SampleResult(run=run, table=table, references=["42"], question=f"Which number? {HOSTILE}")

    monkeypatch.setattr(api, "task_sample", canned)
    run_id, status, sample_status, sample_table, step, layer, head = app.on_task_sample(
        "niah_single_1", 3.0, "aware", ["tova"], 0.5, DEFAULT_MODEL)
    assert asked == [SampleRequest(task="niah_single_1", sample=3, specs=["tova:ratio=0.5"], setting="aware",
                                   model=DEFAULT_MODEL)]
    assert run_id == run.run_id and status.startswith("niah_single_1, sample 3, query-aware: Full and 1 policy,")
    for page in (sample_status, sample_table):
        assert "<img" not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    assert "score 0.00" in sample_status and "Which number?" in sample_status
    steps = len(run.traces[0].tokens)
    assert step["maximum"] == steps - 1 and step["value"] == steps - 1
    summary = app.render_run(run_id)[0]  # the usual views find the run among the recent ones
    assert "tova:budget=6" in summary


SAMPLE_REFUSALS = [
    # (task, sample, setting, names, ratio, message)
    ("niah_single_1", 0, "agnostic", ["tova", "h2o", "snapkv", "kvzip"], 0.5, "Pick at most 3 policies besides Full"),
    ("niah_single_1", 0, "agnostic", [], 0.5, "Pick 1 to 3 policies besides Full"),
    ("niah_single_1", 0, "agnostic", ["full"], 0.5, "Pick 1 to 3 policies besides Full"),
    ("niah_single_1", 0, "agnostic", "tova", 0.5, "Pick 1 to 3 policies besides Full"),
    ("niah_single_1", 10, "agnostic", ["tova"], 0.5, "Samples here are numbered 0 to 9"),
    ("niah_single_1", -1, "agnostic", ["tova"], 0.5, "Samples here are numbered 0 to 9"),
    ("niah_single_1", 2.5, "agnostic", ["tova"], 0.5, "Samples here are numbered 0 to 9"),
    ("niah_single_1", "0", "agnostic", ["tova"], 0.5, "Samples here are numbered 0 to 9"),
    ("niah_multivalue", 0, "agnostic", ["tova"], 0.5, "Pick one of the tasks offered here"),
    ("<script>", 0, "agnostic", ["tova"], 0.5, "Pick one of the tasks offered here"),
    ("niah_single_1", 0, "sideways", ["tova"], 0.5, "The setting is one of agnostic, aware"),
    ("niah_single_1", 0, "agnostic", ["lru"], 0.5, "unknown policy"),
    ("niah_single_1", 0, "agnostic", ["tova"], 1.0, "ratio must be at least 0 and below 1"),
    ("niah_single_1", 0, "agnostic", ["tova"], "many", "out of range"),
]


@pytest.mark.parametrize("task, sample, setting, names, ratio, message", SAMPLE_REFUSALS,
                         ids=[f"{r[-1]} {i}" for i, r in enumerate(SAMPLE_REFUSALS)])
def test_a_sample_over_the_bounds_is_refused_in_one_line_before_it_queues(monkeypatch, task, sample, setting, names,
                                                                         ratio, message):
    monkeypatch.setattr(api, "get_model", lambda *a: pytest.fail("a cheap check must not load the model"))
    verdicts = app.check_task_sample(task, sample, setting, names, ratio, DEFAULT_MODEL)  # the validator
    assert not verdicts[0]["is_valid"] and message in verdicts[0]["message"]
    assert len(verdicts[0]["message"].splitlines()) == 1 and all(v["is_valid"] for v in verdicts[1:])
    with pytest.raises(gr.Error) as refused:  # the same refusal from a raw call that skips the validator
        app.on_task_sample(task, sample, setting, names, ratio, DEFAULT_MODEL)
    assert message in refused.value.message and "<script>" not in refused.value.message


def test_the_sample_request_is_each_policy_at_the_sliders_ratio():
    request = app.sample_request("ruler_cwe", 9, "agnostic", ["tova", "full", "kvzip"], 0.875, DEFAULT_MODEL)
    assert request.specs == ["tova:ratio=0.875", "kvzip:ratio=0.875"] and request.length == api.TASK_LENGTHS[0]
    with pytest.raises(RequestError, match="Pick 1 to 3"):
        app.sample_request("ruler_cwe", 9, "agnostic", None, 0.5, DEFAULT_MODEL)


SAMPLES_HEADER = "model,task,length,policy,ratio,setting,sample,score,answer,references,run_id,spec,budget,tokens,context_tokens\n"


def test_the_answers_behind_a_leaderboard_are_listed_and_a_click_picks_one(boards):
    (boards / "samples").mkdir()
    (boards / "samples" / "m.csv").write_text(SAMPLES_HEADER + "\n".join([
        'm,niah_single_1,1024,full,0.0,agnostic,1,1.0,42,"[""42""]",,full,,900,860',
        'm,niah_single_1,1024,tova,0.75,agnostic,1,0.0,<b>7</b>,"[""42""]",,tova:ratio=0.75,215,900,860',
        'm,niah_single_1,1024,tova,0.75,aware,1,1.0,42,"[""42""]",,tova:ratio=0.75,215,900,860',
        'm,niah_single_1,4096,tova,0.75,agnostic,0,0.0,1,"[""42""]",,tova:ratio=0.75,860,3900,3860',
        'm,ruler_vt,1024,tova,0.5,agnostic,2,0.0,X,"[""Y""]",,tova:ratio=0.5,430,900,860']) + "\n")
    rows = app.leaderboard_samples("m", "niah_single_1", "agnostic")
    assert list(rows.columns) == app.SAMPLE_TABLE_COLUMNS
    assert rows[["policy", "ratio", "sample"]].values.tolist() == [["full", 0.0, 1], ["tova", 0.75, 1]]  # 1k only
    assert rows["answer"].tolist() == ["42", "<b>7</b>"]  # plain text: the Dataframe shows it as text
    assert len(app.leaderboard_samples("m", "average at 1,024 tokens", "agnostic")) == 3  # every task at 1,024 tokens
    assert app.leaderboard_samples("nosuch", "niah_single_1", "agnostic").empty

    class Click:
        index = (1, 2)

    assert app.on_board_sample(rows, "agnostic", "m", Click())[:5] == ("niah_single_1", 1, "agnostic", ["tova"], 0.75)
    # The run takes the leaderboard's model where this server serves it, and keeps the model control otherwise.
    assert app.on_board_sample(rows, "agnostic", "gemma3-270m", Click())[5] == "gemma3-270m"
    assert app.on_board_sample(rows, "agnostic", "m", Click())[5] == gr.skip()
    Click.index = (0, 0)  # Full's row: the default policies at the default ratio
    assert app.on_board_sample(rows, "agnostic", "m", Click())[:5] == ("niah_single_1", 1, "agnostic",
                                                                      app.TASK_DEFAULT_POLICIES, app.TASK_DEFAULT_RATIO)
    Click.index = (9, 0)
    with pytest.raises(gr.Error, match="Pick a row"):
        app.on_board_sample(rows, "agnostic", "m", Click())
