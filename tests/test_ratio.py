"""Budgets as compression ratios (kvpress's meaning: the share of the context's KV pairs removed).

A ratio R on a context of n tokens leaves int(n x (1 - R)) tokens, at least 1; each policy takes its own
parameters for that budget (``for_budget``), as the app's budget slider gives them.
"""
import pytest

from backend import api
from backend.api import RequestError, RunRequest
from backend.policies import NOMINAL_CONTEXT, SpecError, parse_spec, ratio_budget


def test_a_ratio_gives_the_budget_worked_by_hand_for_each_kind_of_policy():
    # eviction: 1000 tokens at 0.75 keep 250.
    assert parse_spec("tova:ratio=0.75", 1000).budget == 250
    # compression: the needle prompt, 241 tokens at 0.9 keep int(24.1) = 24; SnapKV's window at budget 24 is 8.
    snapkv = parse_spec("snapkv:ratio=0.9", 241)
    assert (snapkv.budget, snapkv.window) == (24, 8)
    # compression with a second pass: 100 tokens at 0.5 keep 50, the sinks among them.
    kvzip = parse_spec("kvzip:ratio=0.5", 100)
    assert (kvzip.budget, kvzip.sinks) == (50, 4)
    # selection: 64 tokens at 0.875 read int(8.0) = 8 per query.
    assert parse_spec("sparq:ratio=0.875", 64).budget == 8
    # attending: StreamingLLM's sinks shrink with a small budget as for_budget says (3 tokens: 2 sinks).
    streaming = parse_spec("streamingllm:ratio=0.7", 10)
    assert (streaming.budget, streaming.sinks) == (3, 2)
    # nothing is left below 1 token, and ratio 0 keeps everything.
    assert parse_spec("tova:ratio=0.999", 100).budget == 1 and ratio_budget(0.0, 77) == 77
    # the other parameters stay the user's.
    assert parse_spec("a2sf:ratio=0.5,alpha=0.3", 200).alpha == 0.3


def test_before_the_text_is_read_ratios_stand_for_budgets_on_a_nominal_context_and_stay_apart():
    assert parse_spec("tova:ratio=0.5").budget == NOMINAL_CONTEXT // 2
    assert parse_spec("tova:ratio=0.5") != parse_spec("tova:ratio=0.75")


@pytest.mark.parametrize("spec", ["tova:ratio=1", "tova:ratio=-0.1", "tova:ratio=0.5,budget=8",
                                  "tova:budget=8,ratio=0.5", "tova:ratio=0.5,ratio=0.6", "full:ratio=0.5",
                                  "tova:ratio=nan"])
def test_a_bad_ratio_is_one_line(spec):
    with pytest.raises(SpecError) as err:
        parse_spec(spec, 100)
    assert "\n" not in str(err.value)


def test_a_run_takes_the_budget_from_its_own_text(tiny_session):
    prompt = " ".join(f"w{i}" for i in range(40))
    request = RunRequest(prompt=prompt, specs=["tova:ratio=0.75", "tova:budget=8"], mode="prompt")
    run = api.run(request, tiny_session)
    n = len(run.full.tokens)
    ratio, fixed = run.traces
    assert ratio.spec == "tova:ratio=0.75" and ratio.meta["params"]["budget"] == int(n * 0.25)
    assert fixed.meta["params"]["budget"] == 8
    # the cache holds the ratio's budget at the end: every head reads int(n / 4) tokens at the last step
    assert ratio.reads_at(0, n - 1).sum(-1).tolist() == [int(n * 0.25)] * ratio.meta["n_kv_heads"]
    with pytest.raises(RequestError, match="ratio"):
        api.run(RunRequest(prompt=prompt, specs=["tova:ratio=2"], mode="prompt"), tiny_session)
