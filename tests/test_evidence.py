"""backend/analysis/evidence.py: evidence located by hand in real tokenizations, and followed through hand-built
traces (held, the step it left, the answer's attention on it, the verdict's numbers)."""
import numpy as np
import pytest

from backend.analysis.evidence import follow, locate, spans_of, token_offsets, verdict
from tests.test_metrics import make_trace


@pytest.fixture(scope="module")
def tokenizer(default_lm):
    return default_lm.tokenizer  # SmolLM2's byte-level BPE


def spans(evidence):
    return [(s.label, s.start, s.end) for s in evidence.spans]


def test_offsets_map_every_token_to_its_characters(tokenizer):
    ids = tokenizer("VAR QWERTY = 12345").input_ids
    text, starts, ends = token_offsets(tokenizer, ids)
    assert text == "VAR QWERTY = 12345"
    assert [text[a:b] for a, b in zip(starts, ends)] == [tokenizer.decode([i]) for i in ids]


def test_a_string_split_otherwise_in_context_is_found_by_its_characters(tokenizer):
    """Alone, "QWERTY" is 4 tokens starting "QW"; in context it is " Q", "W", "ER", "TY" (tokens 2-5), and "apple"
    alone is another token than " apple" in context."""
    ids = tokenizer("VAR QWERTY = 12345").input_ids
    assert tokenizer("QWERTY").input_ids != ids[2:6]
    assert spans(locate(tokenizer, ids, ["QWERTY"])) == [("QWERTY", 2, 6)]
    ids = tokenizer("I ate an apple pie").input_ids
    assert tokenizer("apple").input_ids[0] not in ids
    assert spans(locate(tokenizer, ids, ["apple"])) == [("apple", 3, 4)]


def test_every_occurrence_whole_words_only_and_case_is_ignored(tokenizer):
    ids = tokenizer("I ate applesauce and an apple pie, APPLE!").input_ids  # "applesauce" is not "apple"
    assert [tokenizer.decode([i]) for i in ids[10:12]] == [" AP", "PLE"]
    evidence = locate(tokenizer, ids, ["apple", "apple pie"])
    found = spans(evidence)
    assert [s for s in found if s[0] == "apple"] == [("apple", 7, 8), ("apple", 10, 12)]
    assert [s for s in found if s[0] == "apple pie"] == [("apple pie", 7, 9)]
    assert evidence.positions.tolist() == [7, 8, 10, 11]


def test_a_reference_absent_from_the_prompt_is_said_not_raised(tokenizer):
    ids = tokenizer("The magic number is 7645321.").input_ids
    evidence = locate(tokenizer, ids, ["7645321", "1234567", " "])
    assert evidence.missing == ("1234567",)
    assert [s.label for s in evidence.spans] == ["7645321"]
    assert "not in the prompt: 1234567" in evidence.describe()


def test_the_question_after_the_context_is_not_evidence(tokenizer):
    context = "The magic number is 7645321. "
    ids = tokenizer(context + "Is the magic number 7645321?").input_ids
    end = len(tokenizer(context).input_ids)
    assert len(locate(tokenizer, ids, ["7645321"]).spans) == 2
    assert [s.end <= end for s in locate(tokenizer, ids, ["7645321"], end).spans] == [True]


# One layer, two KV heads, 8 tokens, the answer produced by query 7. Evidence: tokens 2 and 3.
# Head 0 drops token 2 at step 4 and token 3 at step 6; head 1 drops token 2 at step 5 and keeps token 3.
EVICTED = [[[-1, -1, 4, 6, -1, -1, -1, -1], [-1, -1, 5, -1, -1, -1, -1, -1]]]


def test_held_and_the_step_each_token_left_per_head():
    trace = make_trace(8, evicted_at=EVICTED, n_kv_heads=2)
    followed = follow(trace, spans_of([(2, 4)]))
    assert followed.step == 7
    assert followed.held.tolist() == [[[False, False], [False, True]]]
    assert followed.left.tolist() == [[[4, 6], [5, -1]]]
    assert followed.held_share() == 0.25
    assert followed.held_share(follow(make_trace(8, n_kv_heads=2), spans_of([(2, 4)]))) == 0.25
    assert followed.lost_layers().tolist() == [False]
    early = follow(trace, spans_of([(2, 4)]), step=4)  # query 4 no longer reads token 2 in head 0
    assert early.held.tolist() == [[[False, True], [True, True]]]


def test_the_answers_attention_on_the_evidence_against_full():
    attention = np.zeros((1, 2, 8, 8))
    attention[0, 0, 7, [0, 3, 7]] = [0.5, 0.25, 0.25]  # head 0: a quarter on token 3
    attention[0, 1, 7, [3, 7]] = [0.75, 0.25]  # head 1: three quarters
    trace = make_trace(8, evicted_at=EVICTED, n_kv_heads=2, attention=attention, recorded_layers=(0,))
    followed = follow(trace, spans_of([(2, 4)]))
    np.testing.assert_allclose(followed.attention, [0.5], atol=1e-3)  # (0.25 + 0.75) / 2
    assert followed.attention_top_k is None  # whole rows: the share is exact


def test_attention_cut_to_a_rows_top_k_is_said_to_be_a_lower_bound():
    """Rows cut to their 2 largest weights (as at 8k tokens, k = 7): head 0's top 2 hold token 3, head 1's do
    not, so the share read is a lower bound, and the verdict says so."""
    from backend.traces.recorded import TopAttention

    attention = np.zeros((1, 2, 8, 8))
    attention[0, 0, 7, [0, 3, 7]] = [0.5, 0.3, 0.2]  # head 0: top 2 = tokens 0 and 3
    attention[0, 1, 7, [0, 3, 7]] = [0.5, 0.1, 0.4]  # head 1: top 2 = tokens 0 and 7, token 3 cut
    whole = TopAttention.from_dense(attention)
    order = np.argsort(-whole.val.astype(np.float32), axis=-1, kind="stable")[..., :2]
    cut = TopAttention(np.take_along_axis(whole.pos, order, -1), np.take_along_axis(whole.val, order, -1))
    trace = make_trace(8, evicted_at=EVICTED, n_kv_heads=2, attention=attention, recorded_layers=(0,))
    trace.attention = cut
    followed = follow(trace, spans_of([(2, 4)]))
    assert followed.attention_top_k == 2
    np.testing.assert_allclose(followed.attention, [0.15], atol=1e-3)  # (0.3 + 0) / 2, not (0.3 + 0.1) / 2
    line = verdict("TOVA", followed, followed, spans_of([(2, 4)]))
    assert "put at least 15% of its attention on it, Full 15% (of the 2 largest weights a head's row keeps)" in line
    early = follow(trace, spans_of([(2, 4)]), step=1)  # query 1 has 2 weights: its row is whole
    assert early.attention_top_k is None


def test_the_verdict_counts_layers_and_tokens_and_when_they_left():
    """Two layers: layer 0 loses both evidence tokens in both heads (the last at step 5), layer 1 keeps them."""
    evicted = [[[-1, -1, 4, 5, -1, -1, -1, -1], [-1, -1, 3, 5, -1, -1, -1, -1]], np.full((2, 8), -1)]
    mine = follow(make_trace(8, evicted_at=evicted, n_layers=2, n_kv_heads=2), spans_of([(2, 4)]))
    full = follow(make_trace(8, n_layers=2, n_kv_heads=2), spans_of([(2, 4)]))
    line = verdict("TOVA", mine, full, spans_of([(2, 4)]), score=0.0, context_end=6)
    assert line == ("TOVA had lost all 2 evidence tokens in 1 of 2 layers, the last by token 5, 1 tokens before the "
                    "question: no KV head read them when the answer began (answered wrong).")
    # Layer 1 keeps token 3 in head 1 only, and loses token 2 in both heads at steps 6 and 7 (past the question).
    evicted[1] = [[-1, -1, 6, 4, -1, -1, -1, -1], [-1, -1, 7, -1, -1, -1, -1, -1]]
    mine = follow(make_trace(8, evicted_at=evicted, n_layers=2, n_kv_heads=2), spans_of([(2, 4)]))
    assert verdict("H2O", mine, full, spans_of([(2, 4)]), context_end=6) == (
        "H2O had lost all 2 evidence tokens in 1 of 2 layers and up to 1 of 2 in 1 more, the last by token 7, as "
        "the question was read: no KV head read them when the answer began.")
    assert mine.lost_layers(full).tolist() == [True, False]
    kept = follow(make_trace(8, n_layers=2, n_kv_heads=2), spans_of([(2, 4)]))
    assert verdict("Full", kept, full, spans_of([(2, 4)]), score=1.0).startswith(
        "Full held all 2 evidence tokens in every layer")


def test_a_layer_full_cannot_read_either_is_not_held_against_the_policy():
    """A sliding-window layer of 3: at step 7 nobody reads tokens 2-3 there, Full included."""
    mine = make_trace(8, evicted_at=np.full((1, 1, 8), -1), n_kv_heads=1)
    mine.meta["layer_windows"] = [3]
    full = make_trace(8, n_kv_heads=1)
    full.meta["layer_windows"] = [3]
    evidence = spans_of([(2, 4)])
    assert not follow(full, evidence).held.any()
    assert verdict("TOVA", follow(mine, evidence), follow(full, evidence), evidence).startswith("TOVA held all")


@pytest.fixture(scope="module")
def small_dir(default_lm, tmp_path_factory):
    """A tiny random Llama that reads SmolLM2's tokens (RULER's prompts tokenize as the default model's)."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from backend.experiments.tasks import tokenizer_source

    out = tmp_path_factory.mktemp("small") / "model"
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(default_lm.tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    source = Path(tokenizer_source(default_lm))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            (out / name).write_bytes((source / name).read_bytes())
    return str(out)


@pytest.mark.slow
def test_the_evidence_command_explains_every_stored_leaderboard_row(small_dir, tmp_path, monkeypatch, capsys):
    """A leaderboard of one needle sample, then `evidence` from the store alone: the needle's number is found in
    the context, Full read all of it as the answer began, and every row has its verdict."""
    import json

    import pandas as pd

    from backend.cli import main

    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "store"))
    board = tmp_path / "board"
    assert main(["tasks", "--model", small_dir, "--tasks", "niah_single_1", "--lengths", "256", "--samples", "1",
                 "--policy", "tova,knorm", "--ratios", "0.875", "--out", str(board)]) == 0
    leaderboard = pd.read_csv(board / "leaderboard.csv", keep_default_na=False, na_values=[""])
    from backend import api
    from backend.traces.store import TraceStore

    tova = leaderboard[leaderboard["policy"] == "tova"].iloc[0]
    reopened = api.reopen(tova.run_id, TraceStore())  # the row's link opens with its references as evidence
    assert reopened.request.evidence == json.loads(tova.references)
    assert reopened.request.evidence_end == tova.context_tokens
    capsys.readouterr()
    assert main(["evidence", "--leaderboard", str(board / "leaderboard.csv"), "--model", small_dir,
                 "--out", str(tmp_path / "why")]) == 0
    assert "go together in" in capsys.readouterr().out
    rows = pd.read_csv(tmp_path / "why" / "evidence.csv", keep_default_na=False, na_values=[""])
    assert len(rows) == len(leaderboard) == 3
    assert (rows["evidence_tokens"] > 0).all() and rows["missing"].isna().all()  # "" is read as missing
    full = rows[rows["policy"] == "full"].iloc[0]
    assert full["held"] == 1.0 and full["verdict"].startswith("full held all")
    # At ratio 0.875 a budget of an eighth of the context: a policy cannot have read more than Full did.
    assert rows["held"].between(0, 1).all()
    summary = pd.read_csv(tmp_path / "why" / "evidence_summary.csv")
    assert set(summary["policy"]) == {"full", "tova", "knorm"}
    # Rows the store does not hold are said, not computed again.
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "empty"))
    assert main(["evidence", "--leaderboard", str(board / "leaderboard.csv"), "--model", small_dir,
                 "--out", str(tmp_path / "none")]) == 2
    assert "in the store here" in capsys.readouterr().err


def test_a_run_names_its_evidence_and_the_views_mark_it(default_lm, tmp_path):
    """A user's own prompt with the evidence typed: its tokens are underlined in the kept tokens (shown even when
    the window is elsewhere), banded in the masks and the cache reach; bad evidence is one line."""
    import plotly.graph_objects as go

    from backend import api
    from backend.api import RequestError, RunRequest
    from backend.traces.store import TraceStore
    from viz import panels
    from viz.heatmap import EVIDENCE_COLOR

    prompt = "Remember this: the secret code is 48151 and nothing else. " + "Then we walked home. " * 12 + "Code?"
    request = RunRequest(prompt=prompt, specs=["tova:budget=16"], mode="generate", max_new_tokens=2,
                         evidence=["48151", "  "])
    api.check_run(request)
    assert request.evidence == ["48151"]
    run = api.run(request, TraceStore(tmp_path / "store"))
    positions = panels.evidence_positions(run)
    texts = run.full.meta["token_texts"]
    assert "".join(texts[p] for p in positions).strip() == "48151"
    kept = panels.kept_tokens(run, len(run.full.tokens) - 1, "all", "all", window=8, far=16)
    assert kept.count(" kvl-evidence") == len(positions)  # outside the shown window, still shown (up to far / 2)
    assert panels.kept_tokens(run, len(run.full.tokens) - 1, "all", "all", window=8, far=6).count(" kvl-evidence") == 3
    bands = [s for s in panels.heatmaps(run, "0", "all").layout.shapes if s.fillcolor == EVIDENCE_COLOR]
    assert bands and all(s.type == "rect" for s in bands)
    reach_picture, _ = panels.cache_reach(run, len(run.full.tokens) - 1)
    assert any(s.fillcolor == EVIDENCE_COLOR for s in reach_picture.layout.shapes)
    assert isinstance(reach_picture, go.Figure)
    for bad in (["x"] * 9, ["y" * 201], [3]):
        with pytest.raises(RequestError, match="evidence|Evidence"):
            api.check_run(RunRequest(prompt="hello", specs=["tova:budget=4"], evidence=bad))


def test_the_why_table_escapes_what_it_shows():
    import pandas as pd

    from viz.tasks import why_html

    hostile = "<img src=x onerror=alert(1)>"
    why = pd.DataFrame([{"name": hostile, "score": 0.0, "held": 0.25, "lost_layers": 3, "attention": 0.03,
                         "full_attention": 0.41, "verdict": f"{hostile} had lost all 7 evidence tokens"}])
    page = why_html(why, f"7 tokens in 1 occurrences of {hostile}")
    assert "<img" not in page and page.count("&lt;img src=x onerror=alert(1)&gt;") == 3
    assert "<td>25%</td><td>3</td><td>3%</td>" in page
    assert why_html(None) == ""


def test_the_answer_step_is_the_query_that_wrote_its_first_visible_token():
    from backend.analysis.evidence import answer_step

    trace = make_trace(8, n_prompt=5, mode="generate")
    trace.meta["token_texts"] = ["a", "b", "c", "d", "e", " ", "\n", "42"]
    assert answer_step(trace) == 6  # query 6 wrote "42" (position 7), after a space and a newline
    trace.meta["token_texts"] = ["a", "b", "c", "d", "e", "4", "2", "."]
    assert answer_step(trace) == 4
    assert answer_step(make_trace(8)) == 7  # a text with no answer: its last query


def test_evidence_columns_become_runs_of_cells_and_one_band_each_per_panel():
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from viz.heatmap import evidence_cells, mark_columns

    # Columns of 4 tokens from token 8: positions 9, 10 share cell 0, 17 is cell 2, 30 is past 4 cells.
    assert evidence_cells([9, 10, 17, 30, 3], first=8, size=4, n_cells=4) == [(0, 0), (2, 2)]
    assert evidence_cells([8, 12, 16, 24], first=8, size=4, n_cells=5) == [(0, 2), (4, 4)]
    assert evidence_cells([], 0, 1, 5) == []
    fig = make_subplots(rows=1, cols=2)
    for col in (1, 2):
        fig.add_trace(go.Heatmap(z=[[0, 1, 2, 3]]), row=1, col=col)
    mark_columns(fig, [(0, 0), (2, 3)])
    bands = [(s.xref, s.x0, s.x1) for s in fig.layout.shapes]
    assert bands == [("x", -0.5, 0.5), ("x", 1.5, 3.5), ("x2", -0.5, 0.5), ("x2", 1.5, 3.5)]


def test_play_shows_the_evidence_leave(default_lm, tmp_path, monkeypatch):
    """Play's frames underline the evidence: kept when it has just arrived, evicted by the end (TOVA, budget 32,
    layer 0, KV head 0, over a prompt that goes on for a hundred tokens after it)."""
    import re

    import app
    from backend import api
    from backend.api import RunRequest
    from backend.traces.store import TraceStore

    prompt = "Remember this: the secret code is 48151 and nothing else. " + "Then we walked home. " * 12 + "Code?"
    run = api.run(RunRequest(prompt=prompt, specs=["tova:budget=32"], mode="generate", max_new_tokens=2,
                             evidence=["48151"]), TraceStore(tmp_path / "store"))
    app.RECENT_RUNS.remember(run)
    from viz import panels

    arrived = int(panels.evidence_positions(run).max()) + 1

    def evidence_states(step):
        kept = app.on_tick(run.run_id, step - 1, 1, "0", "0", 0.1)[1]  # speed 1: one step a tick
        return re.findall(r'class="kvl-tok kvl-(\w+) kvl-evidence', kept)

    assert set(evidence_states(arrived)) == {"kept"}
    assert set(evidence_states(len(run.full.tokens) - 1)) == {"evicted"}
