"""RULER's essay tasks offline: each stand-in is lm-eval's essay task with the shipped speeches for a haystack
and Punkt trained on them for a sentence splitter, and nothing else changed."""
from __future__ import annotations

import pytest

from backend.experiments import ruler_speeches
from backend.experiments.ruler_speeches import NEEDLES, STANDINS, make_samples
from backend.experiments.tasks import (OFFLINE, RULER_OFFLINE, _manager, load_task, lm_eval_seeds, samples, score,
                                      tokenizer_source)

LENGTH = 1024


@pytest.fixture(scope="module")
def tokenizer(default_lm) -> str:
    return tokenizer_source(default_lm)


@pytest.mark.parametrize("task", list(NEEDLES))
def test_a_stand_in_makes_what_lm_evals_own_task_makes_over_the_same_haystack(task, tokenizer, monkeypatch):
    """lm-eval's own dataset function for the essay task, given the speeches where it would read Paul Graham's
    essays, makes the stand-in's samples, needle for needle: the needles' kinds and counts are lm-eval's."""
    from backend.experiments.ruler_words import import_needle_module

    import_needle_module()  # the generators niah_utils imports, their word list read from the cache, not sorted again
    from lm_eval.tasks.ruler import niah_utils

    monkeypatch.setattr(niah_utils, "get_haystack", lambda type_haystack: ruler_speeches.haystack_words())
    with lm_eval_seeds():
        ours = make_samples(task, tokenizer=tokenizer, max_seq_lengths=[LENGTH])["test"]
    with lm_eval_seeds(), ruler_speeches._speech_splitter():
        theirs = getattr(niah_utils, task)(tokenizer=tokenizer, max_seq_lengths=[LENGTH])["test"]
    assert len(ours) == len(theirs) == 500
    for i in (0, 1, 499):
        assert ours[i] == theirs[i]


def test_a_stand_in_sample_hides_its_needles_in_the_speeches_and_scores_with_lm_evals_metric(tokenizer):
    name = "niah_multivalue_speeches"
    task = load_task(name, LENGTH, tokenizer)
    (sample,) = samples(name, LENGTH, tokenizer, limit=1)
    values = sample["outputs"]
    # By hand: four 7-digit numbers for one key, each once in the text, amid Washington's first inaugural.
    assert len(values) == 4 and all(v.isdigit() and len(v) == 7 and sample["input"].count(f"is: {v}.") == 1
                                    for v in values)
    assert "Fellow-Citizens of the Senate and of the House of Representatives" in sample["input"]
    assert sample["length"] <= LENGTH and sample["max_length"] == LENGTH
    assert score(task, sample, ", ".join(values)) == 1.0
    assert score(task, sample, ", ".join(values[:2])) == 0.5
    assert score(task, sample, "none") == 0.0
    # The rest is lm-eval's niah_multivalue: its template, generation settings and metric.
    assert task.config.task == name and task.config.generation_kwargs["max_gen_toks"] == 128
    assert task.config.process_results.__module__ == "lm_eval.tasks.ruler.common_utils"
    index = _manager(tokenizer, LENGTH, False).task_index  # in none of lm-eval's tags of its own tasks
    assert not index[name].tags and "niah_multivalue" in index["longcxt"].tags and name not in index["longcxt"].tags


def test_the_shipped_splitter_is_punkt_trained_on_the_speeches(tmp_path):
    folder = ruler_speeches.write_splitter(ruler_speeches.train_splitter(), tmp_path)
    shipped = ruler_speeches.SPLITTER_DATA / "tokenizers" / "punkt_tab" / "english"
    for name in ruler_speeches.SPLITTER_FILES:
        assert (folder / name).read_bytes() == (shipped / name).read_bytes(), name


def test_the_speeches_splitter_is_nltks_only_while_a_stand_in_is_made():
    import nltk
    from nltk.tokenize import sent_tokenize

    before = list(nltk.data.path)
    with ruler_speeches._speech_splitter():
        # "Mr." is one of the abbreviations Punkt learnt from the speeches: no sentence ends there.
        assert sent_tokenize("Mr. Speaker, we meet today. The Union is strong.") == [
            "Mr. Speaker, we meet today.", "The Union is strong."]
    assert nltk.data.path == before


def test_the_stand_ins_are_offline_and_named_apart_from_rulers():
    assert set(STANDINS) <= set(OFFLINE) and not set(STANDINS) & set(RULER_OFFLINE)
    assert STANDINS == tuple(f"{task}_speeches" for task in NEEDLES)


@pytest.mark.slow
def test_lm_evals_command_line_names_a_stand_in(default_loaded, store_dir, capsys):
    from backend import cli

    argv = ["lm-eval", "--model", "kvlens", "--model_args", "policy=tova:budget=64", "--tasks",
            "niah_single_3_speeches", "--metadata", f"max_seq_lengths=[{LENGTH}]", "--limit", "1",
            "--gen_kwargs", "max_gen_toks=2", "--device", "cpu"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "niah_single_3_speeches" in table and f"|{LENGTH}|" in table.replace(" ", ""), table


def test_evaluate_runs_a_stand_in_through_lm_eval(tiny_dir, store_dir):
    from backend.experiments.lm_eval_model import evaluate

    results = evaluate(["niah_single_2_speeches"], 512, model=tiny_dir, policy="tova:budget=32",
                       limit=1, max_gen_toks=8)
    assert 0.0 <= results["results"]["niah_single_2_speeches"]["512,none"] <= 1.0
