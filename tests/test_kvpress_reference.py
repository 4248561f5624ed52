"""KV Lens's kvpress-compatible settings keep exactly kvpress 0.5.5's tokens.

The fixture (tests/fixtures/kvpress_kept.json) holds kvpress's kept positions per layer and KV head on the needle
example in SmolLM2's chat template, written in a separate venv by benchmarks/kvpress_reference.py (its docstring
has the commands); benchmarks/kvpress_compare.py prints the whole comparison, defaults and answers included.
"""
from pathlib import Path

import numpy as np
import pytest

from backend.policies import CaM, LagKV, Merging
from benchmarks.kvpress_compare import MATCHED, fits, fixture, kept_sets, run

# TOVA evicts a token a step (the paper), kvpress once after the prompt; Random draws from another generator.
DIFFERENT = {"tova", "random_seed0"}
# Compared by the tests of their own below: LagKV up to its ties, KVzip at every budget.
OWN_TEST = {"lagkv_lag32", "kvzip", "kvzip_layerwise"}
BUDGETS = (40, 96)


@pytest.fixture(scope="module")
def kvpress():
    return fixture()


def test_the_fixture_is_kv_lens_own_tokens(default_lm, kvpress):
    assert default_lm.encode(Path(kvpress["text"]).read_text(), chat=True) == kvpress["input_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("budget", BUDGETS)
def test_kvpress_compatible_settings_keep_kvpress_tokens_in_every_layer_and_head(default_lm, kvpress, budget):
    presses = [p for p in MATCHED if p not in DIFFERENT | OWN_TEST and fits(p, budget)]
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


@pytest.mark.parametrize("press, spec", [("kvzip", "kvzip:budget={b},preset=kvpress"),
                                         ("kvzip_layerwise", "kvzip:budget={b},preset=kvpress,scope=layer")])
def test_kvzip_preset_kvpress_keeps_kvpress_tokens_in_every_layer_and_head_at_every_budget(default_lm, kvpress, press,
                                                                                          spec):
    """KVzip's preset=kvpress is KVzipPress (scope=layer beside it: layerwise=True): its kept sets are kvpress's in
    every layer and KV head, no tie set aside (kvpress's scores tie at no budget's cut here)."""
    theirs = kvpress["presses"][press]["budgets"]
    assert all(theirs[str(b)]["boundary_ties"] == 0 for b in kvpress["budgets"])
    traces = run(default_lm, [spec.format(b=b) for b in kvpress["budgets"]], kvpress["input_ids"], max_new_tokens=1)
    for budget, trace in zip(kvpress["budgets"], traces):
        assert kept_sets(trace, kvpress["n"]) == theirs[str(budget)]["kept"], budget


def scores_at_compression(monkeypatch, cls) -> dict:
    """(budget, layer) -> the scores [H, t+1] a ``cls`` policy gave at its last compression, recorded from here on."""
    seen, score = {}, cls.score

    def recorded(self, view):
        seen[self.budget, view.layer] = out = np.asarray(score(self, view))
        return out

    monkeypatch.setattr(cls, "score", recorded)
    return seen


def test_lagkv_keeps_kvpress_tokens_but_where_its_scores_tie_at_the_cut(default_lm, kvpress, monkeypatch):
    """LagKV scores a token by its rank in its partition, so every rank recurs once per partition, and the sinks,
    the last partition and what is left over all score 1: a budget's cut falls among equal scores, where KV Lens
    keeps the earliest and kvpress's topk its own choice. On any text, then, each head keeps as many tokens as
    kvpress's, and every position where the two differ scores exactly the cut's score (the lowest kept)."""
    scores = scores_at_compression(monkeypatch, LagKV)
    budgets, n = kvpress["budgets"], kvpress["n"]
    traces = run(default_lm, [MATCHED["lagkv_lag32"].format(b=b) for b in budgets], kvpress["input_ids"],
                 max_new_tokens=1)
    for budget, trace in zip(budgets, traces):
        theirs = kvpress["presses"]["lagkv_lag32"]["budgets"][str(budget)]["kept"]
        for layer, (ours, kept) in enumerate(zip(kept_sets(trace, n), theirs)):
            for head, (a, b) in enumerate(zip(ours, kept)):
                score = scores[budget, layer][head]
                differ = sorted(set(a) ^ set(b))
                assert len(a) == len(b) == budget, (budget, layer, head)
                assert (score[differ] == score[a].min()).all(), (budget, layer, head, differ)


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


def equal_to_float32(a, b):
    """Equal to float32's precision: kvpress scores in float32, so it cannot tell such scores apart."""
    return np.isclose(a, b, rtol=2.0 ** -23, atol=0.0)


def cam_compressions(monkeypatch) -> dict:
    """(layer, step) -> (scores [H, t+1], held before, kept after, tokens arrived since the last eviction) of each
    CaM compression from here on, as the generating cache made it (the runner's scoring fork, which reads Full's
    continuation after it, compresses at the same steps: the first record of a step is kept)."""
    seen, keep = {}, CaM.keep

    def recorded(self, view):
        kept = keep(self, view)
        seen.setdefault((view.layer, view.t), (np.asarray(self.score(view)), view.kept.copy(), kept.copy(),
                                               view.state["arrived"]))
        return kept

    monkeypatch.setattr(CaM, "keep", recorded)
    return seen


def tied_at_a_cut(score, held, kept, arrived) -> bool:
    """Do equal scores straddle one of CaM's cuts: what is kept against what is evicted, or, of the evicted, the
    ``arrived`` best-scored that merge against the others?"""
    for h in range(score.shape[0]):
        evicted = np.sort(score[h][held[h] & ~kept[h]])[::-1]
        if len(evicted) and equal_to_float32(score[h][kept[h]].min(), evicted[0]):
            return True
        if 0 < arrived < len(evicted) and equal_to_float32(evicted[arrived - 1], evicted[arrived]):
            return True
    return False


@pytest.mark.parametrize("budget", ["40", "96"])
def test_cam_with_kvpress_settings_parts_from_kvpress_only_after_a_tie_at_a_cut(default_lm, special, budget,
                                                                              monkeypatch):
    """kvpress's CAMPress over Knorm's scores, merging once per decoded token (compression_interval=1), its draws
    replaced by their expectation in both. The two decide alike until Knorm's scores tie at a cut (equal to float32's
    precision; in layer 0, whose keys depend on the token alone, a repeated token's): there each breaks the tie its
    own way, so the layer may hold or merge other tokens, its values differ, and from the next step on so do every
    later layer's queries and the keys of the tokens decoded, which can change later layers' held tokens too. What
    holds on any text, then: the answer is kvpress's up to the first token read after a tied cut; if no cut ties,
    every layer holds kvpress's positions with kvpress's merges (its values' error against the model's own, recorded
    in float16) and the answer is kvpress's whole; a layer before the first that tied holds and merges as kvpress's
    (while the answers agree); and layer 0 holds kvpress's positions but where they tie at its cut (its scores move
    with nothing else). On the needle example no cut ties at budget 96; at 40 layer 0's first compression does."""
    theirs = special["cam"]["budgets"][budget]
    n, read = len(special["input_ids"]), len(theirs["answer_ids"]) - 1  # kvpress's last token is never read
    compressions = cam_compressions(monkeypatch)
    spec = (f"cam:budget={budget},window=0,scorer=knorm,merge={special['cam']['merge_budget']},preset=kvpress,"
            "sample=expected")
    (trace,) = run(default_lm, [spec], special["input_ids"], max_new_tokens=read)
    ties = sorted((step, layer) for (layer, step), cut in compressions.items() if tied_at_a_cut(*cut))
    first_step = ties[0][0] if ties else n + read
    first_layer = min((layer for _, layer in ties), default=len(theirs["layers"]))
    answer = trace.generated_ids.tolist()
    # A compression after step t changes what later queries read: the tokens predicted up to step t are kvpress's.
    predicted = first_step - n + 2
    assert answer[:predicted] == theirs["answer_ids"][: min(read, predicted)]
    agree = answer == theirs["answer_ids"][:read]
    assert agree or ties
    last = max(step for _, step in compressions)
    for layer, record in enumerate(theirs["layers"]):
        held = trace.evicted_at[layer][:, : n + read] == -1
        assert (held == compressions[layer, last][2][:, : n + read]).all(), layer  # the trace's compressions
        ours = [np.flatnonzero(head).tolist() for head in held]
        if agree and layer < first_layer:
            assert all(positions == record["held"] for positions in ours), layer
            np.testing.assert_allclose(trace.forms["value_error"][layer][:, record["held"]].astype(float),
                                       record["value_error"], rtol=2e-3, atol=2e-6, err_msg=str(layer))
        if agree and layer == 0:
            score, _, kept, _ = compressions[0, last]
            for h, positions in enumerate(ours):
                differ = sorted(set(positions) ^ set(record["held"]))
                assert equal_to_float32(score[h, differ], score[h, kept[h]].min()).all(), (h, differ)


@pytest.mark.parametrize("budget", ["40", "96"])
def test_merging_with_knorm_keeps_kvpress_tokens_and_values_but_where_knorms_scores_tie_at_the_cut(
        default_lm, special, budget, monkeypatch):
    """kvpress's MergingPress(KnormPress()), which compresses once, after the prompt, every layer from the prompt's own
    keys: in every layer and KV head the same kept tokens but where Knorm's scores tie at the cut (equal to float32's
    precision, which kvpress scores in: how the machine rounds the keys' products then picks the side), each kept
    value of a head that keeps kvpress's tokens moved as kvpress moved it (its error against the model's own value,
    recorded in float16), and, where no head parts, kvpress's answer. On the needle example, at 40, layer 0's
    second head holds tokens 76 and 186, whose key norms agree to 3e-9, one for the other on an AVX-512 machine."""
    theirs = special["merging"]["budgets"][budget]
    cuts, keep = {}, Merging.keep

    def recorded(self, view):
        kept = keep(self, view)
        cuts.setdefault(view.layer, (np.asarray(self.score(view)), kept.copy()))
        return kept

    monkeypatch.setattr(Merging, "keep", recorded)
    (trace,) = run(default_lm, [f"merging:budget={budget},scorer=knorm"], special["input_ids"],
                   max_new_tokens=special["max_new_tokens"])
    n = len(special["input_ids"])
    parted = False
    for layer, (ours, kept, errors) in enumerate(zip(kept_sets(trace, n), theirs["kept"], theirs["value_error"])):
        score, held = cuts[layer]
        for h, (mine, positions) in enumerate(zip(ours, kept)):
            differ = sorted(set(mine) ^ set(positions))
            if differ:
                parted = True
                assert equal_to_float32(score[h, differ], score[h][held[h]].min()).all(), (layer, h, differ)
                continue
            np.testing.assert_allclose(trace.forms["value_error"][layer][h, positions].astype(float), errors[h],
                                       rtol=2e-3, atol=2e-6, err_msg=f"layer {layer}, KV head {h}")
    assert parted or trace.generated_ids.tolist() == theirs["answer_ids"]
