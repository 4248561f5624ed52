"""On a GPU the engine keeps its invariants, in float32 and bfloat16, on the default model's attention shape
(SmolLM2: 9 query heads over 3 KV heads of 64) and Gemma 3 270M's (4 over 1 KV head of 256, sliding-window
layers, a scaled query): Full equals the plain model, the prompt path equals the token loop, and every policy
at a budget of the whole text equals Full. The running-score policies walk in one Triton launch per block
there, SparQ and ReAttention take their kernels. Random weights, three layers, a small vocabulary.

Skipped without CUDA. ``ENGINE_TEST_DEVICE=cpu`` (not a ``KVLENS_`` setting, which the app checks) runs the same
tests on the CPU, to try them where there is no GPU; the tolerances are the GPU's.
"""
import os

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.engine.attention import ATTN_IMPLEMENTATION
from backend.engine.models import LoadedModel
from backend.engine.runner import compute_traces, score_text
from backend.policies import POLICIES, H2O, TOVA, Oracle, ReAttention, SparQ, load_plugins
from tests.conftest import TinyTokenizer, make_tiny
from tests.test_families import refused

DEVICE = os.environ.get("ENGINE_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

load_plugins()
NAMES = list(POLICIES)
VOCAB = 128
COMMON = dict(vocab_size=VOCAB, intermediate_size=256, num_hidden_layers=3, max_position_embeddings=512,
              tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
SHAPES = {
    "smollm2": ("llama", dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)),
    "gemma3": ("gemma3_text", dict(hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                   query_pre_attn_scalar=256, sliding_window=12,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
}
# Log-prob tolerances. On the CPU, float32 differs by 2e-6 at most (the order of the sums: SDPA's kernels against
# the engine's masked softmax), bfloat16 by 0.025 (its 8-bit mantissa through three layers), and a policy at
# budget 8 from Full by 0.19 to 1.1: the tolerances sit between the two.
ATOL = {torch.float32: 1e-3, torch.bfloat16: 0.1}
IDS = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(1)).tolist()


def shaped(shape: str, dtype: torch.dtype) -> LoadedModel:
    family, config = SHAPES[shape]
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **COMMON, **config)
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sharper attention than the default init, so the policies' choices matter
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
    model.to(DEVICE, dtype)
    return LoadedModel(name=shape, model=model, tokenizer=TinyTokenizer(), fingerprint=f"{shape}-{dtype}")


@pytest.fixture(scope="module", params=[(s, d) for s in SHAPES for d in ATOL],
                ids=lambda p: f"{p[0]}-{str(p[1]).split('.')[-1]}")
def lm(request) -> LoadedModel:
    return shaped(*request.param)


def atol(lm: LoadedModel) -> float:
    return ATOL[lm.model.dtype]


def plain_logprobs(lm: LoadedModel) -> np.ndarray:
    lm.model.set_attn_implementation("sdpa")
    try:
        with torch.inference_mode():
            logits = lm.model(torch.tensor([IDS], device=lm.model.device)).logits[0].float()
    finally:
        lm.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    plain = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(IDS[1:], device=logits.device)[:, None])
    return plain[:, 0].cpu().numpy()


def test_full_equals_the_plain_model(lm):
    (full,), _ = compute_traces(lm, ["full"], [POLICIES["full"]()], IDS, record_layers=())
    np.testing.assert_allclose(full.logprobs, plain_logprobs(lm), atol=atol(lm))


@pytest.mark.parametrize("name", NAMES)
def test_a_budget_of_the_whole_text_equals_full(lm, name):
    if refused(lm, name):
        return
    policy = POLICIES[name].for_budget(64).whole()
    (trace,), full = compute_traces(lm, [name], [policy], IDS, mode="generate", max_new_tokens=4, record_layers=())
    np.testing.assert_array_equal(trace.tokens, full.tokens)
    np.testing.assert_allclose(trace.logprobs, full.logprobs, atol=atol(lm), err_msg=name)


@pytest.mark.parametrize("name", NAMES)
def test_the_prompt_path_equals_the_token_loop(lm, name):
    if refused(lm, name):
        return
    policy = POLICIES[name].for_budget(8)
    whole, s_whole, _ = score_text(lm, IDS, [policy], chunk=len(IDS))
    single, s_single, _ = score_text(lm, IDS, [policy], chunk=1)
    # On the CPU the two are equal (tests/test_registry.py). On a GPU the keys of a block of 24 queries and of one
    # come from matrix products of different shapes, which cuBLAS sums in different orders: a near-tie may then
    # break the other way (ReAttention's top 2 of a few candidates is such a choice), and change the log-probs
    # after it. So: the decisions agree almost everywhere, and the log-probs agree up to the first
    # query whose decisions differ (after it they may rightly differ).
    differ = len(IDS)
    if policy.kind in ("eviction", "compression"):  # row 1: the policy's (row 0 is Full's)
        a, b = whole.evicted_at(1), single.evicted_at(1)
        agree = (a == b).mean()
        gone = np.where(a != b, np.minimum(np.where(a < 0, differ, a), np.where(b < 0, differ, b)), differ)
        differ = int(gone.min()) - 1  # evicted_at: the first query that no longer reads the token
    elif policy.kind == "selection":
        a, b = whole.selected(1), single.selected(1)  # [L, H, T, T]
        agree = (a == b).mean()
        rows = np.nonzero((a != b).any(axis=(0, 1, 3)))[0]
        differ = int(rows[0]) if len(rows) else differ
    else:
        agree = 1.0
    assert agree >= (0.99 if lm.model.dtype == torch.float32 else 0.9), (name, agree)
    before = slice(0, max(differ, 0))  # log-probs are [rows, T - 1]: the queries before the first that differs
    np.testing.assert_allclose(s_whole["logprobs"][:, before], s_single["logprobs"][:, before],
                               atol=atol(lm), err_msg=f"{name}: decisions agree in {agree:.1%}; the first query "
                               f"whose decisions differ: {differ if differ < len(IDS) else 'none'}")

# The running-score rows walk in one launch per layer on the GPU (three: TOVA scores the layer, the others walk
# their heads apart, Keyformer's Gumbel-softmax apart from them), each with its own budget; numba walks each alone on
# the CPU.
POLICIES_ON_BOTH = [TOVA(budget=8), H2O(budget=12), POLICIES["sinks"](budget=10, sinks=2),
                    POLICIES["a2sf"](budget=9, alpha=0.5, window=3), POLICIES["keyformer"](budget=11, recent=3),
                    Oracle(budget=8), SparQ(budget=8, r=4), ReAttention(budget=20, global_size=2, span=3, topk=2,
                                                                       chunk=4)]


def test_a_gpu_run_matches_a_cpu_run():
    ids = torch.randint(0, 101, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    cpu = make_tiny(dtype=torch.float32)
    gpu = make_tiny(dtype=torch.float32)
    gpu.model.to(DEVICE)
    specs = [p.name for p in POLICIES_ON_BOTH]
    cpu_traces, cpu_full = compute_traces(cpu, specs, POLICIES_ON_BOTH, ids, mode="generate", max_new_tokens=6,
                                          record_layers=(1,))
    gpu_traces, gpu_full = compute_traces(gpu, specs, POLICIES_ON_BOTH, ids, mode="generate", max_new_tokens=6,
                                          record_layers=(1,))
    np.testing.assert_array_equal(cpu_full.tokens, gpu_full.tokens)
    for a, b in zip(cpu_traces, gpu_traces):
        np.testing.assert_array_equal(a.tokens, b.tokens, err_msg=a.spec)
        for layer in range(a.meta["n_layers"]):
            agree = (a.reads(layer) == b.reads(layer)).mean()
            assert agree > 0.99, (a.spec, layer, agree)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-3, err_msg=a.spec)
