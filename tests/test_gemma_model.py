"""End to end on the second packaged model, Gemma 3 270M (Q4_K_M GGUF from PyPI): a base model with a 32k
context whose local layers read a sliding window of 512 keys."""
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.engine.models import GEMMA_MODEL, shared_model
from backend.engine.runner import compute_traces
from backend.policies import TOVA, Window

ROOT = Path(__file__).resolve().parent.parent
# One worker takes the module, so Gemma loads once for it (a module fixture is made on each worker it reaches).
pytestmark = pytest.mark.xdist_group("gemma")


@pytest.fixture(scope="module")
def gemma():
    return shared_model(GEMMA_MODEL)


@pytest.fixture(scope="module")
def long_ids(gemma, inaugural_text):
    return gemma.tokenizer(inaugural_text).input_ids[:700]  # past the 512-token window


def test_gemma_is_the_packaged_base_model_with_its_features(gemma):
    assert gemma.context == 32768 and not gemma.chat  # a base model: prompts are read as they are
    windows = gemma.features.windows
    assert len(windows) == 18 and windows.count(512) == 15 and windows[5::6] == [None, None, None]
    assert gemma.encode("The cat", chat=True) == gemma.encode("The cat")


@pytest.fixture(scope="module")
def scored(gemma, long_ids):
    """One run over the text: a window wider than it (which reads as Full), TOVA and Window at 64, and Full. A row's
    numbers do not depend on the rows beside it (tests/test_shared_prefill.py), so the tests below share it."""
    rows, full = compute_traces(gemma, ["window:budget=4096", "tova:budget=64", "window:budget=64"],
                                [Window(budget=4096), TOVA(budget=64), Window(budget=64)], long_ids, record_layers=())
    return dict(zip(("wide", "tova", "window"), rows), full=full)


@pytest.mark.slow
def test_full_equals_the_plain_model_past_the_window(gemma, long_ids, scored):
    with torch.inference_mode():
        plain = torch.log_softmax(gemma.model(torch.tensor([long_ids])).logits[0].float(), -1)
    expected = plain[:-1].gather(-1, torch.tensor(long_ids[1:])[:, None])[:, 0].numpy()
    for trace in (scored["wide"], scored["full"]):
        np.testing.assert_allclose(trace.logprobs, expected, atol=2e-3)
        assert trace.meta["layer_windows"][0] == 512 and trace.reads(0)[:, -1].sum(-1).max() == 512
        assert trace.reads(5)[:, -1].all()  # a global layer reads every key


@pytest.mark.slow
def test_a_policy_decides_within_the_window_and_scores_real_text(scored):
    tova, window, full = scored["tova"], scored["window"], scored["full"]
    ppl = {name: float(np.exp(-t.logprobs.mean())) for name, t in (("tova", tova), ("window", window), ("full", full))}
    assert ppl["full"] < ppl["tova"] < ppl["window"], ppl
    assert tova.reads(0)[:, -1].sum(-1).max() <= 64  # the budget counts what the layer reads


@pytest.mark.slow
def test_generate_mode_reads_a_base_model_prompt_as_is_through_the_front_door(gemma, tmp_path):
    """The app's and the CLI's path: a base model gets no chat template, and its few-shot example is answered."""
    from backend import api
    from backend.api import RunRequest
    from backend.traces.store import TraceStore

    text = (ROOT / "assets" / "examples" / "base_model_few_shot.txt").read_text().strip()
    request = RunRequest(prompt=text, specs=["full", "sinks:budget=32", "tova:budget=32"], mode="generate",
                         max_new_tokens=4, model=GEMMA_MODEL)
    run = api.run(request, TraceStore(tmp_path / "store"))
    full = run.full
    assert list(full.tokens[: len(full.tokens) - len(full.generated_ids)]) == gemma.encode(text)  # no template
    assert "Oslo" in gemma.tokenizer.decode(full.generated_ids)
    assert run.stored
    np.testing.assert_array_equal(api.reopen(run.run_id, TraceStore(tmp_path / "store")).full.generated_ids,
                                  full.generated_ids)
    sinks, tova = run.traces[1:]
    assert len(sinks.generated_ids) == len(tova.generated_ids) == 4 and tova.evicted_at.max() > 0


@pytest.mark.slow
def test_the_command_line_runs_gemma_by_name(tmp_path):
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "backend", "run", "--model", "gemma3-270m", "--text",
         str(ROOT / "assets" / "examples" / "base_model_continuation.txt"), "--policy", "tova:budget=32",
         "--mode", "generate", "--max-new-tokens", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "KVLENS_STORE_DIR": str(tmp_path / "s")})
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tova:budget=32"]["ppl"] > 1


def test_the_packaged_gguf_is_assembled_whole_when_a_file_was_cut_short_or_processes_race(tmp_path, monkeypatch):
    """An assembly cut short leaves part of the file: the next load assembles it again instead of refusing. Two
    loads at once (the suite's workers) each read a whole file: each writes under its own name, then moves it in."""
    from concurrent.futures import ThreadPoolExecutor

    from backend.engine import models

    monkeypatch.setenv("KVLENS_MODEL_CACHE", str(tmp_path))
    target = tmp_path / "gguf" / "gemma-3-270m-q4_k_m.gguf"
    target.parent.mkdir()
    target.write_bytes(b"GGUF" + bytes(1000))  # the first kilobyte of an interrupted assembly
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: models._gemma_gguf(), range(2)))
    assert paths == [target, target] and target.stat().st_size == 253_113_024
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]  # no partial file is left
