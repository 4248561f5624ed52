"""Every registered policy through the same invariants (in the spirit of kvpress's tests/default_presses.py):
a policy gets all of these by registering. Policies come from the registry itself, at small budgets
(``for_budget``); a plugin's policies are tested the same way when KVLENS_PLUGINS names them.
"""
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.policies import POLICIES, Full, load_plugins, parse_spec, policy_table
from backend.engine.runner import _teacher_force, compute_traces, new_cache, score_text
from tests.conftest import make_tiny

load_plugins()
NAMES = list(POLICIES)
ROOT = Path(__file__).resolve().parents[1]
T = 36


@pytest.fixture(scope="module")
def lm():
    """A tiny Llama with head size 16, so every default parameter (SparQ's r = 16) fits."""
    tiny = make_tiny()
    config = tiny.model.config
    assert config.hidden_size // config.num_attention_heads == 8
    return make_tiny_with_head(16)


def make_tiny_with_head(head_dim):
    from transformers import LlamaConfig, LlamaForCausalLM

    from backend.engine.attention import ATTN_IMPLEMENTATION
    from backend.engine.models import LoadedModel
    from tests.conftest import TinyTokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=6 * head_dim, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6.0)
    return LoadedModel(name="tiny16", model=model, tokenizer=TinyTokenizer(), fingerprint="tiny16")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 101, (T,), generator=torch.Generator().manual_seed(5)).tolist()


def small(name: str, budget: int = 8):
    """The policy at a small budget; compression policies also compress often (every 4 tokens)."""
    policy = POLICIES[name].for_budget(budget)
    if policy.kind == "compression":
        policy = dataclasses.replace(policy, interval=4, every=3)
    if getattr(policy, "dense_layers", 0):  # Quest: one of the tiny model's two layers dense, the other selecting
        policy = dataclasses.replace(policy, dense_layers=1)
    return policy


def reads(trace) -> np.ndarray:
    return np.stack([trace.reads(layer) for layer in range(trace.meta["n_layers"])])  # [L, H, T, T]


@pytest.mark.parametrize("name", NAMES)
def test_spec_parses_and_prints_back(name):
    for budget in (4, 8, 40, 128):
        policy = POLICIES[name].for_budget(budget)
        assert parse_spec(policy.spec()) == policy
        assert POLICIES[name].__doc__ and POLICIES[name].summary, "a registered policy documents itself"


@pytest.mark.parametrize("mode", ["prompt", "generate"])
@pytest.mark.parametrize("name", NAMES)
def test_budget_at_least_the_length_is_full(lm, ids, name, mode):
    policy = POLICIES[name].for_budget(64).whole()  # > T + new tokens, every token in its whole form
    (trace,), full = compute_traces(lm, [name], [policy], ids, mode=mode, max_new_tokens=6, record_layers=())
    np.testing.assert_allclose(trace.logprobs, full.logprobs, atol=1e-9)
    assert reads(trace).all(axis=(0, 1))[np.tril_indices(len(trace.tokens))].all()


@pytest.mark.parametrize("name", NAMES)
def test_what_each_query_reads_stays_within_the_budget(lm, ids, name):
    policy = small(name)
    (trace,), _ = compute_traces(lm, [name], [policy], ids, record_layers=())
    counts = reads(trace)[getattr(policy, "dense_layers", 0):].sum(-1)  # [L, H, T], past Quest's dense layers
    if policy.kind == "full" or policy.budget is None or not policy.within_budget:
        return  # Full; KIVI, which holds every token (quantised); SimLayerKV's busy layers, which hold the text
    if policy.kind != "compression":
        assert counts.max() <= policy.budget
        return
    # Compression: right after each compression (query t + 1 reads the kept set and itself), the layers'
    # and heads' mean is within the budget (PyramidKV and AdaKV share it unevenly); in between the cache
    # grows by one token a step until the next compression.
    after = [t + 1 for t in range(T - 1) if policy.compresses_after(t, None) and t + 1 >= policy.budget]
    assert after
    assert counts[:, :, after].mean(axis=(0, 1)).max() <= policy.budget + 1 + 1e-9
    assert counts.max() <= 2 * policy.budget + policy.interval  # PyramidKV's first layer keeps up to 2x


@pytest.mark.parametrize("name", NAMES)
def test_prompt_path_equals_token_by_token_decoding(lm, ids, name):
    policy = small(name)
    whole, s_whole, _ = score_text(lm, ids, [policy], chunk=T)
    single, s_single, _ = score_text(lm, ids, [policy], chunk=1)
    np.testing.assert_allclose(s_whole["logprobs"], s_single["logprobs"], atol=1e-9)
    if policy.kind in ("eviction", "compression"):
        np.testing.assert_array_equal(whole.evicted_at(1), single.evicted_at(1))
    if policy.kind == "selection":
        np.testing.assert_array_equal(whole.selected(1), single.selected(1))


@pytest.mark.parametrize("n_prompt", [None, 20])
@pytest.mark.parametrize("name", NAMES)
def test_a_fork_goes_on_exactly_as_the_original(lm, ids, name, n_prompt):
    policy = small(name)
    cache = new_cache(lm, [Full(), policy], (), len(ids))
    cache.n_prompt = n_prompt
    with torch.inference_mode(), cache.capture_prerope(lm.model):
        _teacher_force(lm, cache, ids[:20], 0, [20])
        twin = cache.fork()
        one_by_one = list(range(1, len(ids) - 20 + 1))
        _, original = _teacher_force(lm, cache, ids[20:], 20, one_by_one)
    with torch.inference_mode(), twin.capture_prerope(lm.model):
        _, forked = _teacher_force(lm, twin, ids[20:], 20, one_by_one)
    np.testing.assert_allclose(original["logprobs"], forked["logprobs"], atol=1e-12)
    if policy.kind in ("eviction", "compression"):
        np.testing.assert_array_equal(cache.evicted_at(1), twin.evicted_at(1))


def test_the_docs_policy_table_is_the_registrys():
    page = (ROOT / "docs" / "policies.md").read_text()
    builtin = [line for line in policy_table().splitlines()
               if not line.startswith("| `") or POLICIES[line.split("`")[1]].__module__.startswith("backend.")]
    assert "\n".join(builtin) in page  # plugins (KVLENS_PLUGINS) are not the docs'


def test_the_readme_lists_every_registered_policy_by_kind_with_its_paper():
    from viz.policy_menu import kinds_table

    builtin = {name: cls for name, cls in POLICIES.items() if cls.__module__.startswith("backend.")}
    table = kinds_table(builtin)
    assert table in (ROOT / "README.md").read_text()
    assert all(f"| `{name}` |" in table for name in builtin)


def test_the_app_lists_and_colours_every_registered_policy():
    import app
    from viz.colors import family_colors

    assert app.POLICY_CHOICES == NAMES
    colors = family_colors()
    assert set(colors) == set(NAMES) and len(set(colors.values())) == len(NAMES)
