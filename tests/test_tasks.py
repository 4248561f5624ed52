"""RULER through lm-evaluation-harness: lm-eval's samples and scores pass through KV Lens unchanged, and
``kvlens`` is an lm-eval model that answers every request under a policy, through the trace store."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from backend.experiments.tasks import TaskUnavailable, load_task, samples, score, tokenizer_source

ROOT = Path(__file__).resolve().parents[1]
SHORT = 256  # tokens: room for niah_single_1's instructions, needle and question in the default model's tokens


def test_a_needle_sample_scores_one_with_its_reference_and_zero_with_another_number(default_lm):
    task = load_task("niah_single_1", SHORT, tokenizer_source(default_lm))
    (sample,) = samples("niah_single_1", SHORT, tokenizer_source(default_lm), limit=1)
    (number,) = sample["outputs"]
    # By hand: one 7-digit number hidden once in the text, asked for by its key, the answer's start given.
    assert number.isdigit() and len(number) == 7 and sample["input"].count(f"is: {number}.") == 1
    assert sample["gen_prefix"].startswith("The special magic number for ") and sample["length"] <= SHORT
    assert score(task, sample, number) == 1.0
    assert score(task, sample, f" {number}.\nThat is all.") == 1.0  # found anywhere in the answer
    other = str((int(number) + 1) % 10 ** 7)
    assert score(task, sample, other) == 0.0 and score(task, sample, "") == 0.0


def test_every_reference_counts_for_its_share_of_the_score(default_lm):
    """ruler_cwe asks for the ten most common words: string_match_all gives the share of them in the answer."""
    task = load_task("ruler_cwe", 1024, tokenizer_source(default_lm))
    (sample,) = samples("ruler_cwe", 1024, tokenizer_source(default_lm), limit=1)
    words = sample["outputs"]
    assert len(words) == 10
    assert score(task, sample, ", ".join(words)) == 1.0
    assert score(task, sample, ", ".join(words[:5]).upper()) == 0.5  # half the words, in any case
    assert score(task, sample, "none of them") == 0.0


@pytest.mark.slow
def test_a_task_that_needs_the_hub_is_one_line_offline(default_lm):
    code = ("from backend.experiments.tasks import TaskUnavailable, load_task\n"
            "try:\n    load_task('niah_single_2', 256, %r)\n"
            "except TaskUnavailable as err:\n    print('UNAVAILABLE', err)\n") % tokenizer_source(default_lm)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("UNAVAILABLE")]
    assert line.startswith("UNAVAILABLE niah_single_2 needs data from the network that cannot be fetched here")
    assert line.endswith("; offline, niah_single_2_speeches stands in for it (the shipped speeches for a haystack)")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_task_makes_the_same_samples_whatever_a_process_loaded_before(default_lm):
    """RULER's generators draw from Python's global generator, and the first task a process loads imports NLTK,
    whose import draws too: each sample must still be the same, loaded first or after another task. These are the
    shipped leaderboards' samples (their references, by hand from assets/leaderboards/samples)."""
    code = ("import sys\nfrom backend.experiments.tasks import samples\n"
            "for name in sys.argv[1:]:\n    print(name, [s['outputs'] for s in samples(name, 1024, %r, limit=1)])\n"
            ) % tokenizer_source(default_lm)
    outputs = {}
    for order in (["ruler_fwe"], ["ruler_cwe", "ruler_fwe"]):
        result = subprocess.run([sys.executable, "-c", code, *order], cwd=ROOT, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        outputs[tuple(order)] = [line for line in result.stdout.splitlines() if line.startswith("ruler_fwe ")]
    shipped = ["ruler_fwe [['gplemk', 'qcszkr', 'fjtvxe']]"]
    assert outputs[("ruler_fwe",)] == outputs[("ruler_cwe", "ruler_fwe")] == shipped


def test_an_unknown_task_is_one_line_after_rulers_index_and_lm_evals_whole_one(default_lm):
    """A task is looked up among RULER's and the stand-ins first, in lm-eval's whole index only where it is none of
    them (one of lm-eval's other tasks, or no task)."""
    from backend.experiments.tasks import _manager

    with pytest.raises(TaskUnavailable, match=r"^lm-eval has no task 'niah_nowhere'; the offline tasks are"):
        load_task("niah_nowhere", SHORT, tokenizer_source(default_lm))
    ruler, everything = (_manager(tokenizer_source(default_lm), SHORT, whole) for whole in (False, True))
    assert ruler.match_tasks(["niah_single_1", "niah_single_2_speeches", "ruler"]) and len(ruler.all_tasks) < 100
    assert not ruler.match_tasks(["hellaswag"])
    assert everything.match_tasks(["hellaswag", "niah_single_2_speeches"]) and len(everything.all_tasks) > 10_000


def test_a_tasks_samples_are_made_once_a_process(default_lm):
    """Making a task's samples takes seconds at 1k tokens and longer at 32k: asked again for the same task, length and
    tokenizer, ``load_task`` gives the task it made."""
    source = tokenizer_source(default_lm)
    assert load_task("niah_single_1", SHORT, source) is load_task("niah_single_1", SHORT, source)


def test_a_length_too_short_for_a_generator_is_one_line_before_it_runs():
    with pytest.raises(TaskUnavailable, match=r"^ruler_vt needs 1024 tokens or more; lm-eval's generator does not"):
        load_task("ruler_vt", 512, "no tokenizer is loaded")


@pytest.mark.slow
def test_lm_eval_runs_kvlens_on_a_ruler_task_end_to_end(tiny_dir, store_dir):
    import lm_eval

    import backend.experiments.lm_eval_model  # noqa: F401  registers kvlens

    # The tiny tokenizer writes a character a token: at 512 most of niah_single_1's samples fit.
    results = lm_eval.simple_evaluate(model="kvlens", model_args={"model": tiny_dir, "policy": "tova:budget=32"},
                                      tasks=["niah_single_1"], limit=2, gen_kwargs={"max_gen_toks": 8},
                                      metadata={"max_seq_lengths": [512]}, log_samples=True)
    assert 0.0 <= results["results"]["niah_single_1"]["512,none"] <= 1.0
    assert len(results["samples"]["niah_single_1"]) == 2


def test_a_sample_past_those_the_task_makes_is_one_line(tiny_dir, store_dir):
    from backend.engine.models import shared_model
    from backend.experiments.task_runs import run_sample
    from backend.experiments.tasks import MAX_SAMPLES

    # RULER drops the samples that do not fit: at 512 of the tiny tokenizer's tokens 477 of the 500 are made.
    with pytest.raises(ValueError, match=r"^niah_single_1 has 477 samples at 512 tokens \(0 to 476\), not sample 499$"):
        run_sample(shared_model(tiny_dir), "niah_single_1", 512, MAX_SAMPLES - 1, ["full"])


def _request(context: str, **gen_kwargs) -> SimpleNamespace:
    """An lm-eval generate_until request: its ``args`` are the context and the generation settings."""
    return SimpleNamespace(args=(context, {"do_sample": False, "until": [], **gen_kwargs}))


def test_stop_strings_cut_the_answer_and_a_repeat_replays_from_the_store(tiny_dir, store_dir, monkeypatch):
    from backend import runs
    from backend.experiments.lm_eval_model import KVLensLM

    lm = KVLensLM(model=tiny_dir, policy="sinks:budget=8,sinks=2", max_gen_toks=12)
    context = "the secret word is apple. what is the secret word. the secret word is"
    (answer,) = lm.generate_until([_request(context)])
    stop = next(c for c in answer[1:] if c.strip())

    def computes(*args, **kwargs):
        raise AssertionError("the run should replay from the store")

    monkeypatch.setattr(runs, "compute_traces", computes)
    (cut,) = lm.generate_until([_request(context, until=[stop])])
    assert cut == answer.split(stop)[0] and cut != answer and lm.keys[0] == lm.keys[1]


def test_a_sample_holds_one_runs_traces_at_a_time(tiny_dir, store_dir, monkeypatch):
    """Answers without their traces (as ``run_sample`` asks): each run's traces are let go once answered, so a
    whole 8k sample (1-2 GB a selection row) is never held at once; the answers are the same as with traces."""
    import gc
    import weakref

    from backend.experiments import task_runs
    from backend.experiments.lm_eval_model import KVLensLM
    from backend.experiments.task_runs import TaskRequest, answer

    lm = KVLensLM(model=tiny_dir, policy="full", max_gen_toks=4).lm
    request = TaskRequest(context="the secret word is apple. what is the secret word?", until=(), max_new_tokens=4,
                          doc={})
    specs = ["full", "tova:budget=8", "sinks:budget=8", "h2o:budget=8", "knorm:budget=8"]
    monkeypatch.setenv("KVLENS_MAX_ROW_TOKENS", "64")  # one row a run
    alive, held = [], []
    compute = task_runs.replay_or_compute

    def counted(*args, **kwargs):
        gc.collect()
        held.append(sum(ref() is not None for ref in alive))  # earlier runs' traces still held as this one starts
        run = compute(*args, **kwargs)
        alive.extend(weakref.ref(t) for t in run.traces)
        return run

    monkeypatch.setattr(task_runs, "replay_or_compute", counted)
    kept = answer(lm, request, specs, "aware")
    assert held == [0, 1, 2, 3] and all(a.trace is not None for a in kept)
    alive.clear(), held.clear()
    light = answer(lm, request, specs, "aware", keep_traces=False)
    assert max(held) <= 1 and all(a.trace is None for a in light)  # at most the run before, as the next begins
    assert [(a.text, a.key, a.full_key) for a in light] == [(a.text, a.key, a.full_key) for a in kept]


def test_a_request_over_the_machines_row_tokens_is_one_line(tiny_dir, store_dir, monkeypatch):
    from backend.experiments.lm_eval_model import KVLensLM

    monkeypatch.setenv("KVLENS_MAX_ROW_TOKENS", "50")
    lm = KVLensLM(model=tiny_dir, policy="tova:budget=8", max_gen_toks=4)
    with pytest.raises(ValueError, match=r"^tova:budget=8 on 64 tokens costs 64 row-tokens, more than the 50 "):
        lm.generate_until([_request("a" * 60)])


def test_a_chat_model_reads_the_context_as_lm_eval_wrote_it_ending_in_gen_prefix(default_loaded, store_dir,
                                                                                 monkeypatch):
    from backend.experiments import lm_eval_model, task_runs

    lm = lm_eval_model.KVLensLM(policy="tova:budget=64", max_gen_toks=2)
    chat = [{"role": "user", "content": "Where is the key? It is under the mat."},
            {"role": "assistant", "content": "The key is"}]
    context = lm.apply_chat_template(chat, add_generation_prompt=False)
    assert context.rstrip().endswith("The key is")  # the assistant's turn is left open for the model
    read = []
    real = task_runs.replay_or_compute
    monkeypatch.setattr(task_runs, "replay_or_compute", lambda lm_, specs, policies, ids, *a, **k:
                        read.append(list(ids)) or real(lm_, specs, policies, ids, *a, **k))
    lm.generate_until([_request(context)])
    assert read == [default_loaded.encode(context)]  # as written: not wrapped in a second chat turn


def test_kvlens_only_generates(default_loaded):
    from backend.experiments.lm_eval_model import KVLensLM

    lm = KVLensLM(policy="full", no_cache=True)
    with pytest.raises(NotImplementedError, match="only generates"):
        lm.loglikelihood([])
    with pytest.raises(NotImplementedError, match="only generates"):
        lm.loglikelihood_rolling([])


def test_a_bad_policy_is_one_line_before_the_model_loads(monkeypatch):
    from backend.experiments import lm_eval_model
    from backend.policies import SpecError

    monkeypatch.setattr(lm_eval_model, "shared_model", lambda *a: pytest.fail("the model must not load"))
    with pytest.raises(SpecError, match="unknown parameter 'budgt'"):
        lm_eval_model.KVLensLM(policy="tova:budgt=32")


@pytest.mark.slow
def test_lm_evals_command_line_runs_kvlens_on_the_models_own_tokenizer(default_loaded, store_dir, capsys):
    """``python -m backend lm-eval`` is lm-eval's own command line with kvlens registered; RULER sizes its samples
    with the model's tokenizer, which a packaged model's name cannot give lm-eval itself."""
    from backend import cli

    argv = ["lm-eval", "--model", "kvlens", "--model_args", "policy=full", "--tasks", "niah_single_1",
            "--metadata", f"max_seq_lengths=[{SHORT}]", "--limit", "1", "--gen_kwargs", "max_gen_toks=2",
            "--device", "cpu"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    assert "kvlens" in table and f"|   {SHORT}|" in table, table


def test_a_bad_spec_on_lm_evals_command_line_is_one_line(capsys):
    from backend import cli

    argv = ["lm-eval", "--model", "kvlens", "--model_args", "policy=tova:budgt=32", "--tasks", "niah_single_1"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: tova: unknown parameter 'budgt' (parameters: budget, heads, sinks)"


TINY_LENGTH = 512  # the tiny model's tokens are characters: room for niah_single_1's instructions and needle


@pytest.mark.slow
@pytest.mark.parametrize("command", ["tasks", "lm-eval"])
def test_the_task_commands_print_no_false_alarm_about_nltks_data(command, tiny_dir, tmp_path):
    """RULER's needle module looks for NLTK's Punkt model as it loads and, where it is missing, tries to download
    it: offline, an NLTK error about a host it may not reach, then "Downloaded punkt_tab on rank 0" though
    nothing came. No offline task splits with that model, so neither command says either; lm-eval's real
    warnings still show."""
    import nltk

    try:
        nltk.data.find("tokenizers/punkt_tab")
        pytest.skip("NLTK's punkt_tab is installed here, so lm-eval tries no download")
    except LookupError:
        pass
    argv = {"tasks": ["tasks", "--model", tiny_dir, "--tasks", "niah_single_1", "--lengths", str(TINY_LENGTH),
                      "--samples", "1", "--policy", "tova", "--ratios", "0.5", "--settings", "agnostic",
                      "--out", str(tmp_path / "out")],
            "lm-eval": ["lm-eval", "--model", "kvlens", "--model_args", f"model={tiny_dir}", "--tasks", "niah_single_1",
                        "--metadata", f"max_seq_lengths=[{TINY_LENGTH}]", "--limit", "1", "--gen_kwargs",
                        "max_gen_toks=2", "--device", "cpu"]}[command]
    env = {**os.environ, "KVLENS_STORE_DIR": str(tmp_path / "store"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "backend", *argv], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    printed = result.stdout + result.stderr
    assert "[nltk_data]" not in printed and "punkt_tab" not in printed, printed[-3000:]
    if command == "tasks":  # it passes the lengths as the tasks' metadata: lm-eval's hint to do so is a false alarm
        assert "Custom kwargs can be passed" not in printed, printed[-3000:]
    assert "WARNING" in result.stderr  # lm-eval's own (samples that do not fit the length): nothing is muted
