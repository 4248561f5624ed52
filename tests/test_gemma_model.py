"""End to end on the second packaged model, Gemma 3 270M (Q4_K_M GGUF from PyPI): a base model with a 32k
context whose local layers read a sliding window of 512 keys."""
import numpy as np
import pytest
import torch

from backend.engine.models import GEMMA_MODEL, shared_model
from backend.engine.runner import compute_traces
from backend.policies import TOVA, Window


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


def test_full_equals_the_plain_model_past_the_window(gemma, long_ids):
    with torch.inference_mode():
        plain = torch.log_softmax(gemma.model(torch.tensor([long_ids])).logits[0].float(), -1)
    expected = plain[:-1].gather(-1, torch.tensor(long_ids[1:])[:, None])[:, 0].numpy()
    (full,), _ = compute_traces(gemma, ["full"], [Window(budget=4096)], long_ids, record_layers=())
    np.testing.assert_allclose(full.logprobs, expected, atol=2e-3)
    assert full.meta["layer_windows"][0] == 512 and full.reads(0)[:, -1].sum(-1).max() == 512
    assert full.reads(5)[:, -1].all()  # a global layer reads every key


def test_a_policy_decides_within_the_window_and_scores_real_text(gemma, long_ids):
    (tova, window), full = compute_traces(gemma, ["tova:budget=64", "window:budget=64"],
                                          [TOVA(budget=64), Window(budget=64)], long_ids, record_layers=())
    ppl = {name: float(np.exp(-t.logprobs.mean())) for name, t in (("tova", tova), ("window", window), ("full", full))}
    assert ppl["full"] < ppl["tova"] < ppl["window"], ppl
    assert tova.reads(0)[:, -1].sum(-1).max() <= 64  # the budget counts what the layer reads
