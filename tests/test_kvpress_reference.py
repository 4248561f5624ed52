"""KV Lens's kvpress-compatible settings keep exactly kvpress 0.5.5's tokens.

The fixture (tests/fixtures/kvpress_kept.json) holds kvpress's kept positions per layer and KV head on the needle
example in SmolLM2's chat template, written in a separate venv by benchmarks/kvpress_reference.py (its docstring
has the commands); benchmarks/kvpress_compare.py prints the whole comparison, defaults and answers included.
"""
from pathlib import Path

import pytest

from benchmarks.kvpress_compare import MATCHED, fits, fixture, kept_sets, run

# TOVA evicts a token a step (the paper), kvpress once after the prompt; Random draws from another generator.
DIFFERENT = {"tova", "random_seed0"}
BUDGETS = (40, 96)


@pytest.fixture(scope="module")
def kvpress():
    return fixture()


def test_the_fixture_is_kv_lens_own_tokens(default_lm, kvpress):
    assert default_lm.encode(Path(kvpress["text"]).read_text(), chat=True) == kvpress["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_kvpress_compatible_settings_keep_kvpress_tokens_in_every_layer_and_head(default_lm, kvpress, budget):
    presses = [p for p in MATCHED if p not in DIFFERENT and fits(p, budget)]
    specs = [MATCHED[p].format(b=budget, b1=budget + 1) for p in presses]
    traces = run(default_lm, specs, kvpress["input_ids"], max_new_tokens=1)
    n = kvpress["n"]
    for press, trace in zip(presses, traces):
        theirs = kvpress["presses"][press]["budgets"][str(budget)]
        tied = {tuple(h) for h in theirs.get("tied_heads", [])}  # where kvpress's topk broke a tie its own way
        ours = kept_sets(trace, n)
        for layer, heads in enumerate(theirs["kept"]):
            for head, kept in enumerate(heads):
                if (layer, head) not in tied:
                    assert ours[layer][head] == kept, (press, layer, head)


def test_lagkv_keeps_kvpress_tokens_up_to_the_ties_of_its_ranks(default_lm, kvpress):
    """LagKV scores a token by its rank in its partition, so every rank recurs once per partition and the budget's
    boundary falls among equal scores in every head: kvpress's topk breaks those ties its own way, KV Lens keeps
    the earliest. At budget 96 each head's kept set is kvpress's but for one such swap at most."""
    n = kvpress["n"]
    (trace,) = run(default_lm, [MATCHED["lagkv_lag32"].format(b=96)], kvpress["input_ids"], max_new_tokens=1)
    theirs = kvpress["presses"]["lagkv_lag32"]["budgets"]["96"]
    assert len(theirs["tied_heads"]) == 90  # every head ties at the boundary (the fixture says so)
    for layer, (ours, kept) in enumerate(zip(kept_sets(trace, n), theirs["kept"])):
        for head, (a, b) in enumerate(zip(ours, kept)):
            assert len(a) == len(b) == 96 and len(set(a) ^ set(b)) <= 2, (layer, head)


SPECIAL = Path(__file__).resolve().parent / "fixtures" / "kvpress_special.json"


@pytest.fixture(scope="module")
def special():
    """kvpress's ThinK channels, SimLayerKV lazy layers and FINCH kept sets (benchmarks/kvpress_special.py)."""
    import json

    return json.loads(SPECIAL.read_text())


@pytest.mark.parametrize("share", ["0.25", "0.5", "0.75"])
def test_think_with_kvpress_settings_prunes_kvpress_channels_and_answers_alike(default_lm, special, share):
    """ThinK alone (a budget above the prompt: SnapKV keeps every token), every key pruned and channels scored over
    the last 32 queries, as kvpress's ThinKPress: the same channels in every layer and KV head, the same answer."""
    import numpy as np

    think = special["think"]
    spec = f"think:budget=100000,window={think['window']},whole_window=false,channels={share}"
    (trace,) = run(default_lm, [spec], special["input_ids"], max_new_tokens=special["max_new_tokens"])
    np.testing.assert_array_equal(trace.forms["channel_steps"], [len(special["input_ids"]) - 1])
    pruned = [[np.flatnonzero(~head).tolist() for head in layer] for layer in trace.forms["channels"][0]]
    assert pruned == think["runs"][share]["pruned"]
    assert trace.generated_ids.tolist() == think["runs"][share]["answer_ids"]


def test_simlayerkv_finds_kvpress_lazy_layers_and_answers_alike(default_lm, special):
    """At thresholds 0.5, 0.7 and 0.9 (23, 12 and 0 lazy layers of 30 in kvpress), the same layers are lazy and the
    answers are kvpress's (a lazy layer keeps one token more here: n_recent against n_recent - n_last)."""
    sim = special["simlayerkv"]
    n = len(special["input_ids"])
    budget = sim["n_initial"] + sim["n_recent"]
    specs = [f"simlayerkv:budget={budget},sinks={sim['n_initial']},last={sim['n_last']},threshold={t}"
             for t in sim["runs"]]
    traces = run(default_lm, specs, special["input_ids"], max_new_tokens=special["max_new_tokens"])
    for (threshold, theirs), trace in zip(sim["runs"].items(), traces):
        lazy = [bool((layer[..., :n] != -1).any()) for layer in trace.evicted_at]
        assert lazy == theirs["lazy"], threshold
        assert trace.generated_ids.tolist() == theirs["answer_ids"], threshold


@pytest.mark.parametrize("budget", ["40", "96"])
def test_finch_keeps_kvpress_tokens_and_answers_alike_with_rerotated_keys(default_lm, special, budget):
    """FINCH with the question as its window (kvpress cuts it off with a delimiter token): the same kept tokens in
    every layer and KV head, and, keys re-rotated to consecutive positions in both, the same answer."""
    finch = special["finch"]
    (trace,) = run(default_lm, [f"finch:budget={budget},window={finch['question']}"], special["input_ids"],
                   max_new_tokens=special["max_new_tokens"])
    theirs = finch["budgets"][budget]
    assert kept_sets(trace, len(special["input_ids"])) == theirs["kept"]
    assert trace.generated_ids.tolist() == theirs["answer_ids"]


@pytest.mark.parametrize("budget", ["40", "96"])
def test_cam_with_kvpress_settings_holds_and_merges_as_kvpress(default_lm, special, budget):
    """kvpress's CAMPress over Knorm's scores, merging once per decoded token (compression_interval=1), its draws
    replaced by their expectation in both: after the answer, every layer holds kvpress's positions in every KV head,
    each held value carries kvpress's merges (its error against the model's own value, recorded in float16), and the
    answer is kvpress's. At budget 40 layer 0 merges other tokens where Knorm's scores tie (its keys depend on the
    token alone, and the two sides round the tied norms apart); its values then move every later layer's queries a
    little, and so the merges' shares, by up to 1%. At 96 every layer's values agree to the fixture's rounding."""
    import numpy as np

    theirs = special["cam"]["budgets"][budget]
    n, read = len(special["input_ids"]), len(theirs["answer_ids"]) - 1  # kvpress's last token is never read
    spec = f"cam:budget={budget},window=0,scorer=knorm,merge={special['cam']['merge_budget']},preset=kvpress,sample=expected"
    (trace,) = run(default_lm, [spec], special["input_ids"], max_new_tokens=read)
    assert trace.generated_ids.tolist() == theirs["answer_ids"][:read]
    for layer, record in enumerate(theirs["layers"]):
        held = trace.evicted_at[layer][:, : n + read] == -1
        assert all(np.flatnonzero(head).tolist() == record["held"] for head in held), layer
        ours = trace.forms["value_error"][layer][:, record["held"]].astype(float)
        if budget == "96":
            np.testing.assert_allclose(ours, record["value_error"], rtol=2e-3, atol=2e-6, err_msg=str(layer))
        elif layer:
            np.testing.assert_allclose(ours, record["value_error"], rtol=1e-2, atol=2e-6, err_msg=str(layer))


@pytest.mark.parametrize("budget", ["40", "96"])
def test_merging_with_knorm_keeps_kvpress_tokens_and_values_and_answers_alike(default_lm, special, budget):
    """kvpress's MergingPress(KnormPress()): the same kept tokens in every layer and KV head, each kept value moved
    as kvpress moved it (its error against the model's own value, recorded in float16), the same answer."""
    import numpy as np

    theirs = special["merging"]["budgets"][budget]
    (trace,) = run(default_lm, [f"merging:budget={budget},scorer=knorm"], special["input_ids"],
                   max_new_tokens=special["max_new_tokens"])
    n = len(special["input_ids"])
    assert kept_sets(trace, n) == theirs["kept"]
    for layer, (kept, errors) in enumerate(zip(theirs["kept"], theirs["value_error"])):
        ours = np.stack([trace.forms["value_error"][layer][h, positions] for h, positions in enumerate(kept)])
        np.testing.assert_allclose(ours.astype(float), errors, rtol=2e-3, atol=2e-6, err_msg=str(layer))
    assert trace.generated_ids.tolist() == theirs["answer_ids"]
