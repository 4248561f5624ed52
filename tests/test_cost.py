"""The cost line under the Run button: what a set of policies costs before it runs, by the very rule the run's
check applies (Full free, new tokens counted, the prompt as the model reads it)."""
import dataclasses
import time
from types import SimpleNamespace

import pytest

import app
from backend import api
from backend.api import RequestError, RunRequest
from backend.engine import models
from backend.engine.models import DEFAULT_MODEL
from backend.limits import Limits

from tests.conftest import TinyTokenizer

CHAT_TURN = 7  # tokens the chat tokenizer below wraps a user turn in


class ChatTokenizer(TinyTokenizer):
    """The tiny tokenizer with a chat template: a user turn is the text between 3 and 4 characters of markup."""

    chat_template = "user turn"

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=False):
        text = "<u>" + messages[0]["content"] + "</u>"
        return {"input_ids": self(text).input_ids} if tokenize else text


def request(**changes) -> RunRequest:
    fields = dict(prompt="x" * 100, specs=["tova:budget=8", "full", "h2o:budget=8"], mode="generate",
                  max_new_tokens=24)
    return RunRequest(**{**fields, **changes})


def test_the_line_counts_the_prompt_the_new_tokens_and_not_full(tiny_session):
    cost = api.cost(request())
    assert cost.line == "Cost: 2 policies x 124 tokens (100 prompt + 24 new) = 248 of 32,768 row-tokens; Full is free."
    assert (cost.tokens, cost.length, cost.rows, cost.row_tokens, cost.fits, cost.exact) == (100, 124, 2, 248, True, True)
    assert api.cost(request(mode="prompt", specs=["tova:budget=8"])).line == \
        "Cost: 1 policy x 100 tokens = 100 of 32,768 row-tokens."
    assert api.cost(request(specs=["full"])).line == "Cost: Full alone is free (0 of 32,768 row-tokens)."


def test_a_set_that_does_not_fit_says_what_would(tiny_session):
    cost = api.cost(request(), Limits(row_tokens=200))
    assert not cost.fits
    assert cost.line == ("Cost: 2 policies x 124 tokens (100 prompt + 24 new) = 248 row-tokens, over the 200 allowed "
                         "here; Full is free. What fits: 1 of these 2 policies, or a prompt of up to 76 tokens.")
    assert api.cost(request(prompt="x" * 76), Limits(row_tokens=200)).fits
    assert not api.cost(request(prompt="x" * 77), Limits(row_tokens=200)).fits
    kvzip = api.cost(request(prompt="x" * 400, mode="prompt", specs=["tova:budget=8", "kvzip:budget=8"]),
                     Limits(row_tokens=1000))
    assert kvzip.line == ("Cost: 2 policies x 400 tokens = 1,200 row-tokens, over the 1,000 allowed here (kvzip "
                          "counts 2x). What fits: 1 of these 2 policies, or a text of up to 333 tokens.")


@pytest.mark.parametrize("changes", [dict(), dict(mode="prompt", specs=["tova:budget=8", "oracle:budget=8"]),
                                     dict(specs=["full", "kvzip:budget=8", "sinks:budget=8"], max_new_tokens=9)],
                         ids=["generate", "selection", "kvzip"])
def test_the_preview_and_the_runs_check_agree_at_the_edge(tiny_session, changes):
    """At exactly its cost the set fits and runs; one row-token less, the preview says no and the run refuses."""
    chatting = dataclasses.replace(models.LOADED[DEFAULT_MODEL], tokenizer=ChatTokenizer(), fingerprint="chat")
    models.LOADED[DEFAULT_MODEL] = chatting  # tiny_session puts the tiny model back
    spent = api.cost(request(**changes)).row_tokens
    edge = api.cost(request(**changes), Limits(row_tokens=spent))
    assert edge.fits and edge.row_tokens == spent
    api.run(request(**changes), None, limits=Limits(row_tokens=spent))
    over = api.cost(request(**changes), Limits(row_tokens=spent - 1))
    assert not over.fits and "over the" in over.line
    with pytest.raises(RequestError, match="row-tokens"):
        api.run(request(**changes), None, limits=Limits(row_tokens=spent - 1))


def test_generate_mode_counts_the_chat_turn_and_prompt_mode_does_not(tiny_session):
    models.LOADED[DEFAULT_MODEL] = dataclasses.replace(models.LOADED[DEFAULT_MODEL], tokenizer=ChatTokenizer())
    assert api.cost(request()).tokens == 100 + CHAT_TURN
    assert "(107 prompt as a chat turn + 24 new)" in api.cost(request()).line
    assert api.cost(request(mode="prompt")).tokens == 100
    assert api.cost(request(chat=False)).tokens == 100


def test_what_the_run_would_refuse_before_counting_is_a_message(tiny_session):
    with pytest.raises(RequestError, match="limit here is 50"):
        api.cost(request(), Limits(prompt_tokens=50))
    with pytest.raises(RequestError, match="the model reads at most 512"):  # the tiny model's context
        api.cost(request(prompt="x" * 500))
    with pytest.raises(RequestError, match="Pick at least one policy"):
        api.cost(request(specs=[]))
    with pytest.raises(RequestError, match="head size 8"):  # the loaded model's: the tiny model's heads are small
        api.cost(request(specs=["sparq:budget=8,r=16"]))


def test_without_the_model_loaded_the_count_is_an_estimate_and_nothing_loads(monkeypatch):
    monkeypatch.setattr(models, "LOADED", {})
    cost = api.cost(request(prompt="x" * 101))
    assert not cost.exact and cost.tokens == 26  # 4 characters a token, rounded up
    assert cost.line.startswith("Cost: 2 policies x about 50 tokens (about 26 prompt + 24 new) = about 100 of")
    assert "estimated" in cost.line and models.LOADED == {}
    # oracle reads every key for every query: 3000 * 3000 // 1024 = 8789 row-tokens, and 2395 + 5601 <= 8000
    selection = api.cost(request(prompt="x" * 12000, mode="prompt", specs=["tova:budget=8", "oracle:budget=8"]),
                         Limits(row_tokens=8000))
    assert selection.line == ("Cost: 2 policies x about 3,000 tokens = about 11,789 row-tokens, over the 8,000 "
                              "allowed here (oracle counts 2.93x) (estimated from the characters until the model "
                              "is loaded). What fits: 1 of these 2 policies, or a text of up to about 2,395 tokens.")

    # A stored run of the very request knows its count: exact, still without the model.
    counted = api.cost(request(prompt="x" * 101), tokens=40)
    assert counted.exact and counted.line.startswith("Cost: 2 policies x 64 tokens (40 prompt + 24 new) = 128 of")
    assert "estimated" not in counted.line and models.LOADED == {}


def test_the_app_shows_the_line_escaped(tiny_session):
    controls = ["generate", 24, ["tova", "h2o"], 8, 4, 0.1, "paper default"]
    assert app.on_cost("x" * 100, *controls, "", DEFAULT_MODEL).startswith("Cost: 2 policies x 124 tokens")
    typed = app.on_cost("x" * 100, *controls, "tova:<b>", DEFAULT_MODEL)
    assert "&lt;b&gt;" in typed and "<b>" not in typed
    assert app.on_cost("x" * 100, *controls, "", "<script>") == \
        "unknown model '&lt;script&gt;'; offered here: " + ", ".join(api.LIMITS.models)


def test_the_cost_line_never_queues_and_follows_the_controls_and_runs():
    config = app.demo.get_config_file()
    elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    events = {d["id"]: d for d in config["dependencies"]}
    cost_events = [d for d in events.values() if [elem_ids[i] for i in d["outputs"]] == ["cost"]]
    assert cost_events and not any(d["queue"] for d in cost_events)
    assert {"prompt", "policy-names"} <= {elem_ids.get(target) for d in cost_events for target, _ in d["targets"]}
    after = [events[d["trigger_after"]]["api_name"] for d in cost_events if d.get("trigger_after") is not None]
    # a run may have just loaded the model: the estimate becomes a count (after the button's and the slider's)
    assert len(after) == 2 and all(name.startswith("on_run") for name in after)


def test_a_190_kb_prompt_costs_well_under_a_second(default_lm, monkeypatch):
    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, default_lm)
    prompt = ("Fellow citizens, the cache keeps what the queries read. " * 4000)[:190 * 1024]
    started = time.perf_counter()
    cost = api.cost(request(prompt=prompt, max_tokens=8000, specs=["tova:budget=64"]))
    assert time.perf_counter() - started < 1.0 and cost.exact and cost.tokens == 8000


# --- What a task sample is expected to take ------------------------------------------------------------------

def sample(**changes) -> api.SampleRequest:
    return api.SampleRequest(**{**dict(task="niah_single_1", sample=0, specs=["tova:ratio=0.5", "snapkv:ratio=0.5"]),
                                **changes})


def test_a_sample_is_priced_by_the_prompt_each_row_computes_itself_and_its_rows():
    F, P, R = api.SAMPLE_FULL_FORWARDS, api.SAMPLE_PREFILL_FORWARDS, api.SAMPLE_ROW_FORWARDS
    assert api.sample_forwards(["full"], 1024) == F  # Full's row alone
    # TOVA at ratio 0.5 keeps 512 of 1,024 tokens: it takes Full's prefill until its budget fills, then computes
    # the other half of the prompt itself
    assert api.sample_forwards(["full", "tova:ratio=0.5"], 1024) == F + 0.5 * P + R
    # SnapKV compresses once the prompt is read: all of its prefill is Full's
    assert api.sample_forwards(["full", "snapkv:ratio=0.5"], 1024) == F + R
    # KVzip's second pass over the text is its own (the Run line counts its row twice)
    assert api.sample_forwards(["full", "kvzip:ratio=0.5"], 1024) == F + P + R
    # a selection row reads every earlier token until its cache outgrows its budget (Quest: 32 pages of 16)
    assert api.sample_forwards(["full", "quest:ratio=0.5"], 1024) == F + 0.5 * P + R
    assert api.sample_forwards(["full", "quest:ratio=0.5,page_size=24"], 1024) == F + (1 - 504 / 1024) * P + R
    # a row that reads every key costs more per token past SELECTION_UNIT, as in the Run line: 4,096 tokens, 4x,
    # less the half it takes from Full
    assert api.sample_forwards(["full", "oracle:ratio=0.5"], 4096) == F + 3.5 * P + R
    assert api.sample_forwards(["full", "tova:ratio=0.5", "snapkv:ratio=0.5"], 1024) == F + 0.5 * P + 2 * R


@pytest.mark.parametrize("seconds, text", [(0.2, "1 s"), (40.4, "40 s"), (89, "89 s"), (150, "2 min"),
                                           (3599, "1 h 0 min"), (4200, "1 h 10 min")])
def test_a_duration_reads_as_a_person_says_it(seconds, text):
    assert api.duration_text(seconds) == text


def test_the_line_gives_seconds_only_where_a_plain_forward_was_timed(monkeypatch):
    monkeypatch.setattr(models, "LOADED", {})
    monkeypatch.setattr(api, "_FORWARD_SECONDS", {})
    forwards = api.SAMPLE_FULL_FORWARDS + 0.5 * api.SAMPLE_PREFILL_FORWARDS + 2 * api.SAMPLE_ROW_FORWARDS
    assert api.sample_cost_line(sample()) == (f"Expected: 1 sample, Full and 2 policies: about {forwards:.3g} plain "
                                              "forwards of 1,024 tokens.")
    assert models.LOADED == {}  # the line never loads the model
    lm = SimpleNamespace(fingerprint="m", model=SimpleNamespace(device="cpu"))
    monkeypatch.setattr(api, "loaded_model", lambda *args: lm)
    assert "plain forwards of 1,024 tokens." in api.sample_cost_line(sample())  # loaded, never timed
    api._FORWARD_SECONDS[("m", "cpu", 512)] = 3.0  # the nearest length timed, scaled by the tokens: 6 s at 1,024
    assert api.sample_cost_line(sample()) == (f"Expected: about {api.duration_text(forwards * 6.0)} here (1 sample, "
                                              f"Full and 2 policies: about {forwards:.3g} plain forwards of 1,024 "
                                              "tokens; a plain forward takes 6 s).")
    api._FORWARD_SECONDS[("other", "cpu", 1024)] = 0.1  # another model's timing is not this one's
    assert "a plain forward takes 6 s" in api.sample_cost_line(sample())
    with pytest.raises(RequestError, match="Pick at most"):  # what check_sample refuses
        api.sample_cost_line(sample(specs=[f"{n}:ratio=0.5" for n in ("tova", "h2o", "snapkv", "knorm")]))


def test_a_plain_forward_is_timed_once_per_model_and_length(tiny, monkeypatch):
    monkeypatch.setattr(api, "_FORWARD_SECONDS", {})
    lm = tiny
    calls = []
    forward = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *args, **kwargs: calls.append(args[0].shape) or
                        forward(*args, **kwargs))
    seconds = api.time_plain_forward(lm, 200)
    assert seconds > 0 and calls == [(1, 16), (1, 200)]  # a short one to warm up, then the timed one
    assert api.time_plain_forward(lm, 200) == seconds and len(calls) == 2
    assert api.forward_seconds(lm, 400) == pytest.approx(2 * seconds)


def test_the_tasks_tab_says_what_the_sample_will_take_before_it_runs_and_follows_its_controls():
    line = app.on_task_cost("niah_single_1", 0, "agnostic", ["tova", "snapkv", "kvzip"], 0.5, DEFAULT_MODEL)
    assert line.startswith("Expected: ") and "Full and 3 policies" in line
    assert app.on_task_cost("niah_single_1", 0, "agnostic", [], 0.5, DEFAULT_MODEL) == "Pick 1 to 3 policies besides Full."
    assert app.on_task_cost("niah_single_1", 0, "agnostic", ["tova"], 0.5, "<script>").startswith(
        "unknown model '&lt;script&gt;'")
    config = app.demo.get_config_file()
    elem_ids = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    by_id = {d["id"]: d for d in config["dependencies"]}
    events = [d for d in by_id.values() if [elem_ids[i] for i in d["outputs"]] == ["task-cost"]]
    assert events and not any(d["queue"] for d in events)
    targets = {elem_ids.get(target) for d in events for target, _ in d["targets"]}
    assert {"task-name", "task-policies", "task-ratio", "tasks-page"} <= targets
    after = {d["trigger_after"] for d in events if d.get("trigger_after") is not None}
    assert {by_id[i]["api_name"] for i in after} == {"on_task_sample"}  # the model may have loaded
