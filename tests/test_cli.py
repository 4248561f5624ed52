"""The CLI: bad input is one line on stderr and exit status 2, never a traceback."""
import json
import os
import subprocess
import sys
import time

import pytest

from backend.engine import models
from backend.traces.trace import Trace


@pytest.fixture(autouse=True)
def private_store(tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_STORE_DIR", str(tmp_path / "store"))


def cli(*args):
    """The command in a process of its own, as a user starts it."""
    return subprocess.run([sys.executable, "-m", "backend", *args], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ))


@pytest.fixture
def refused(capsys, monkeypatch):
    """The command through the same door (settings checked, then ``cli.main``) in this process, for what it answers
    before any model loads: a process of its own would spend seconds importing torch to say one line. An exception
    that escapes fails the test, as a traceback on stderr would."""
    from backend.__main__ import main

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["kvlens", *args])
        try:
            status = main()
        except SystemExit as exit_:  # argparse's own answers (--help, a malformed option)
            status = exit_.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(args, status, out, err)

    return run


@pytest.mark.parametrize("policy, message", [
    ("lru:budget=4", "unknown policy 'lru'"),
    ("tova:budget=0", "budget must be an integer >= 1"),
    ("tova:alpha=0.3", "unknown parameter 'alpha'"),
    ("kivi:budget=48", "kivi: KIVI holds every token and takes no budget (its parameters: "),
])
def test_bad_policy_is_a_one_line_error(refused, text_file, tmp_path, policy, message):
    result = refused("run", "--text", str(text_file), "--policy", policy, "--out", str(tmp_path / "o"))
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {result.stderr.strip()[7:]}" and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("content, message", [(b"", "is empty"), (b"  \n", "is empty"),
                                               (b"caf\xe9 au lait", "is not UTF-8 text")])
def test_bad_text_file_is_a_one_line_error(refused, tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    result = refused("run", "--text", str(path), "--policy", "tova:budget=4", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("source", ["/dev/zero", "fifo", "directory"])
def test_the_text_must_be_a_regular_file(refused, tmp_path, source):
    if source == "fifo":  # nobody ever writes to it: reading it would wait forever
        source = tmp_path / "fifo"
        os.mkfifo(source)
    elif source == "directory":
        source = tmp_path
    result = refused("run", "--text", str(source), "--policy", "tova:budget=8", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip() == f"error: not a regular file: {source}"


def test_a_long_text_file_is_read_only_as_far_as_the_limits_allow(tmp_path):
    from backend.cli import read_text
    from backend.limits import Limits

    path = tmp_path / "long.txt"
    path.write_bytes("€".encode() * 3000)  # 3 bytes a character: the cap (4,004 bytes) falls inside one
    text = read_text(str(path), Limits(text_chars=1001))
    assert text == "€" * 1334  # the characters whole within the cap


def test_missing_file_and_unknown_model_are_one_line_errors(refused, text_file, tmp_path):
    result = refused("run", "--text", str(tmp_path / "nope.txt"), "--policy", "full", "--out", str(tmp_path))
    assert result.returncode == 2 and "text file not found" in result.stderr
    result = refused("run", "--text", str(text_file), "--policy", "full", "--model", "../etc/passwd", "--out",
                     str(tmp_path))
    assert result.returncode == 2 and "no such model" in result.stderr and "Traceback" not in result.stderr


def test_bad_store_size_and_out_path_are_one_line_errors(refused, text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("KVLENS_STORE_MB", "lots")
    result = refused("run", "--text", str(text_file), "--policy", "full", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "KVLENS_STORE_MB" in result.stderr and "Traceback" not in result.stderr
    monkeypatch.delenv("KVLENS_STORE_MB")
    result = refused("run", "--text", str(text_file), "--policy", "full", "--out", str(text_file))
    assert result.returncode == 2 and "not a directory" in result.stderr


@pytest.mark.parametrize("name, value", [("KVLENS_MAX_POLICIES", "abc"), ("KVLENS_MAX_POLICIES", "0"),
                                         ("KVLENS_PLUGINS", "os.system"), ("KVLENS_STOER_MB", "5")])
def test_a_malformed_setting_stops_the_start_with_one_line_naming_it(refused, text_file, tmp_path, monkeypatch, name,
                                                                    value):
    monkeypatch.setenv(name, value)
    result = refused("run", "--text", str(text_file), "--policy", "tova:budget=4", "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {name}")


def test_help_lists_every_policy_and_its_parameters(refused):
    out = refused("run", "--help").stdout
    for name in ("full", "window", "sinks", "h2o", "tova", "a2sf", "oracle"):
        assert f"\n  {name} " in out
    assert "alpha=0.1" in out and "sinks=4" in out and "recent=-1" in out


# Run in a fresh interpreter: the command line's refusal, then which of transformers' and the engine's modules it
# imported on the way.
IMPORTS_OF_A_REFUSAL = """import sys
from backend.__main__ import main
sys.argv = ["kvlens", *sys.argv[1:]]
status = main()
print(status, sorted(m for m in sys.modules if m.startswith(("transformers", "backend.engine.attention",
                                                             "backend.engine.runner"))))"""


@pytest.mark.slow
def test_help_and_a_refusal_answer_without_importing_transformers_or_the_engine(text_file, tmp_path):
    """transformers' modelling modules are most of a command's start (about 4 s of its 6); the command line and the
    front door import them, with the engine's attention and runner, where a run computes."""
    refusal = ["run", "--text", str(text_file), "--policy", "lru:budget=4", "--out", str(tmp_path / "o")]
    too_short = ["tasks", "--tasks", "niah_single_1", "--lengths", "0", "--out", str(tmp_path / "t")]
    for argv in (refusal, ["policies"], too_short):
        result = subprocess.run([sys.executable, "-c", IMPORTS_OF_A_REFUSAL, *argv], capture_output=True, text=True,
                                timeout=300, env=dict(os.environ))
        assert result.stdout.strip().splitlines()[-1] in ("0 []", "2 []"), (argv, result.stdout, result.stderr)


@pytest.mark.slow
def test_default_model_generate_run_writes_traces_and_summary(tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("List three colours of the rainbow.")
    out = tmp_path / "out"
    result = cli("run", "--text", str(prompt), "--policy", "tova:budget=16", "--policy", "a2sf:budget=16,alpha=0.3",
                 "--policy", "full", "--mode", "generate", "--max-new-tokens", "12", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary) == ["tova:budget=16", "a2sf:budget=16,alpha=0.3", "full"]
    assert summary["full"]["kl_to_full"] == 0 and summary["full"]["top1_agreement"] == 1
    for spec, row in summary.items():
        trace = Trace.load(out / row["trace"])
        assert trace.spec == spec and row["ppl"] > 1 and 0 <= row["top1_agreement"] <= 1
        assert 1 <= len(trace.generated_ids) <= 12
    tova = Trace.load(out / summary["tova:budget=16"]["trace"])
    assert tova.evicted_at.shape == (30, 3, len(tova.tokens))
    assert "replayed" not in result.stdout

    again = cli("run", "--text", str(prompt), "--policy", "tova:budget=16,heads=layer", "--mode", "generate",
                "--max-new-tokens", "12", "--out", str(tmp_path / "again"))
    assert again.returncode == 0 and "(replayed from the store)" in again.stdout
    replayed = Trace.load(tmp_path / "again" / "00-tova-budget-16-heads-layer.npz")
    assert (replayed.evicted_at == tova.evicted_at).all() and replayed.spec == "tova:budget=16,heads=layer"


@pytest.mark.parametrize("args, message", [
    (["--out", "/proc/kvlens-x"], "is not a writable directory"),
    (["--policy", "tova:budget=8", "--policy", "tova:budget=8"], "list each policy once"),
    (["--mode", "generate", "--max-new-tokens", "10000"], "Max new tokens must be a whole number from 1 to 4096"),
    (["--policy", "tova:budget=8,budget=9"], "parameter budget is given twice"),
    (["--max-tokens", "1"], "Max tokens must be an integer, 2 or more."),
])
def test_cheap_mistakes_are_reported_before_the_model_loads(text_file, tmp_path, monkeypatch, capsys, args, message):
    from backend import api, cli
    monkeypatch.setattr(api, "get_model", lambda *a: pytest.fail("checked after loading the model"))
    argv = ["run", "--text", str(text_file), "--policy", "full", "--out", str(tmp_path / "o"), *args]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--lengths", "40"], "error: --lengths must be at least 48 tokens (prompt and answer)"),
    (["--lengths", "512,100000"], "error: --lengths: smollm2-135m-instruct reads at most 8,192 tokens, got 100,000"),
    (["--lengths", "1000000000"], "error: --lengths: smollm2-135m-instruct reads at most 8,192 tokens, got "
                                  "1,000,000,000"),
])
def test_a_needle_grid_past_the_models_context_is_refused_before_any_job_is_made(default_lm, tmp_path, monkeypatch,
                                                                                 capsys, args, message):
    """``default_lm``: the packaged model's first use converts it (a minute, once per machine)."""
    from backend import cli
    from backend.experiments import needle

    monkeypatch.setattr(needle, "needle_jobs", lambda *a, **k: pytest.fail("jobs made before the checks"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    assert cli.main(["needle", "--policy", "tova:budget=8", *args, "--out", str(tmp_path / "o")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == message


def test_a_one_token_generate_prompt_without_chat_is_a_one_line_error(tiny, tmp_path, monkeypatch, capsys):
    from backend import cli
    from backend.engine.models import DEFAULT_MODEL
    monkeypatch.setitem(models.LOADED, DEFAULT_MODEL, tiny)
    path = tmp_path / "one.txt"
    path.write_text("a")
    argv = ["run", "--text", str(path), "--policy", "tova:budget=8", "--mode", "generate", "--no-chat", "--out",
            str(tmp_path / "o"), "--no-cache"]
    assert cli.main(argv) == 2
    assert "at least 2 tokens" in capsys.readouterr().err


@pytest.mark.slow
def test_a_local_model_directory_runs_in_bfloat16_on_the_device_auto_picks(default_lm, tmp_path):
    """The command line's user names any local transformers directory, its dtype and its device."""
    directory = next(p for p in models.cache_dir().iterdir() if p.name.startswith(models.DEFAULT_MODEL + "-"))
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox jumps over the lazy dog. " * 4)
    out = tmp_path / "out"
    result = cli("run", "--text", str(prompt), "--model", str(directory), "--dtype", "bfloat16", "--device", "auto",
                 "--policy", "tova:budget=16", "--mode", "prompt", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    trace = Trace.load(out / summary["tova:budget=16"]["trace"])
    assert trace.meta["model_fingerprint"].startswith("dir:") and "+bfloat16" in trace.meta["model_fingerprint"]
    assert summary["tova:budget=16"]["ppl"] > 1 and (trace.evicted_at >= 0).any()


@pytest.mark.slow
@pytest.mark.skipif(models.torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_missing_device_and_an_unreachable_hub_id_are_one_line_errors(text_file, tmp_path, monkeypatch):
    result = cli("run", "--text", str(text_file), "--policy", "tova:budget=8", "--device", "cuda",
                 "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and result.stderr.strip() == "error: device cuda: no CUDA device is available here"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without internet
    result = cli("run", "--text", str(text_file), "--policy", "tova:budget=8", "--model", "nobody-here/no-such-model",
                 "--out", str(tmp_path / "o"))
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: could not load nobody-here/no-such-model")


# Gemma shapes with no global layer: every layer keeps a sliding window only.
ALL_SLIDING = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=16, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention"] * 4)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_text", "gemma2"])
def test_a_gemma_model_whose_layers_all_slide_runs_and_records_its_layers(family, tmp_path):
    from tests.conftest import tiny_model_dir

    model = tiny_model_dir(tmp_path / "model", family, **ALL_SLIDING)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the quick brown fox jumps over the lazy dog. " * 2)
    out = tmp_path / "out"
    result = cli("run", "--text", str(prompt), "--model", model, "--policy", "full", "--policy", "tova:budget=512",
                 "--mode", "prompt", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    trace = Trace.load(out / summary["tova:budget=512"]["trace"])
    assert trace.meta["layer_windows"] == [16] * 4 and trace.meta["recorded_layers"] == [0, 2, 3]
    assert trace.keys.shape[:2] == (3, 2) and summary["tova:budget=512"]["kl_to_full"] == pytest.approx(0, abs=1e-6)


# Seconds each refusal may take in this process: the lm-eval task names it does not know are looked up in lm-eval's
# index of its tasks (7 s on two idle cores, 30 s on a slow machine with the suite's other worker beside), the rest
# at once.
@pytest.mark.parametrize("args, message, seconds", [
    (["--samples", "1000000000"], "error: --first-sample and --samples: a task has at most 500 samples at a length "
                                  "(0 to 499), got 0 to 999999999", 2),
    (["--first-sample", "499", "--samples", "2"], "got 499 to 500", 2),
    (["--lengths", "1000000000"], "error: --lengths: smollm2-135m-instruct reads at most 8,192 tokens, got "
                                  "1,000,000,000", 5),
    (["--lengths", "1024,100000"], "reads at most 8,192 tokens, got 100,000", 5),
    (["--tasks", "niah_single_1,no_such_task"], "error: lm-eval has no task 'no_such_task'; the offline tasks are",
     60),
    (["--tasks", "ruler_vt", "--lengths", "512"], "error: ruler_vt needs 1024 tokens or more", 2),
])
def test_a_task_leaderboard_past_its_bounds_is_refused_before_any_job_is_made(default_lm, tmp_path, monkeypatch,
                                                                               capsys, args, message, seconds):
    """``default_lm``: the packaged model's first use converts it (a minute, once per machine), not timed here."""
    from backend import cli
    from backend.experiments import leaderboard

    # Neither a job (a billion of them filled gigabytes) nor the model (RULER's generators run on at any length).
    monkeypatch.setattr(leaderboard, "task_jobs", lambda *a, **k: pytest.fail("jobs made before the checks"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the checks"))
    started = time.monotonic()
    assert cli.main(["tasks", *args, "--out", str(tmp_path / "o")]) == 2
    assert time.monotonic() - started < seconds
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: ") and message in line
