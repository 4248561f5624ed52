"""Every policy on every common decoder family, each a tiny random-weight model built from its transformers
config with the feature that sets it apart: Full equals the plain model, a budget at or above the length
equals Full, and the prompt path equals token-by-token decoding. The policies are the registry's, with the
plugins KVLENS_PLUGINS names."""
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from backend.engine.attention import ATTN_IMPLEMENTATION
from backend.engine.features import UnsupportedModel, read_features
from backend.engine.models import LoadedModel
from backend.engine.runner import compute_traces, score_text
from backend.policies import POLICIES, load_plugins
from tests.conftest import TinyTokenizer

COMMON = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=1, eos_token_id=2)
# Each family with what sets it apart, small enough to matter on a 20-token text.
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},  # QK-norm before RoPE
    "mistral": {},
    "gemma2": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,  # scale, soft-capping, windows
               "attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,  # local and global RoPE
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
    "phi3": {},  # a fused QKV projection
    "olmo2": {},  # QK-norm over all heads at once
    "cohere": {"use_qk_norm": True, "logit_scale": 0.5},  # interleaved RoPE, parallel blocks, scaled logits
    "glm": {"head_dim": 16, "partial_rotary_factor": 0.5},  # partial, interleaved RoPE
    "granite": {"attention_multiplier": 0.3, "logits_scaling": 2.0},  # its own attention and logit scales
    "smollm3": {"no_rope_layers": [1, 0, 1]},  # a NoPE layer
}
# No global layer at all: every layer keeps a sliding window only (Gemma 3's rotary embedding then has no
# global RoPE). These run what the windows change: Full, every policy against Full, and the recorded keys.
ALL_SLIDING = {f"{family} all sliding": {**FAMILIES[family], "layer_types": ["sliding_attention"] * 3}
               for family in ("gemma2", "gemma3_text")}
IDS = torch.randint(3, 101, (20,), generator=torch.Generator().manual_seed(1)).tolist()
load_plugins()  # the operator's plugins (KVLENS_PLUGINS) run on every family too
NAMES = list(POLICIES)


def tiny_family(family: str) -> LoadedModel:
    """A tiny model of a family of FAMILIES or ALL_SLIDING ("gemma2 all sliding" is a gemma2)."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(family.split()[0], **COMMON, **{**FAMILIES, **ALL_SLIDING}[family])
    config._attn_implementation = ATTN_IMPLEMENTATION
    model = AutoModelForCausalLM.from_config(config).to(torch.float64).eval()
    with torch.no_grad():  # sharper attention than the default init, so the policies' choices matter
        for layer in model.model.layers:
            projection = getattr(layer.self_attn, "q_proj", None) or layer.self_attn.qkv_proj
            projection.weight.mul_(4.0)
    return LoadedModel(name=family, model=model, tokenizer=TinyTokenizer(), fingerprint=family)


@pytest.fixture(scope="module", params=list(FAMILIES))
def lm(request) -> LoadedModel:
    return tiny_family(request.param)


@pytest.fixture(scope="module", params=list(FAMILIES) + list(ALL_SLIDING))
def any_lm(request) -> LoadedModel:
    """Every family, and the all-sliding ones too."""
    return tiny_family(request.param)


def refused(lm: LoadedModel, name: str) -> bool:
    """A policy that computes its own attention and cannot yet honour this model's windows or soft-capping."""
    features = lm.features
    return not POLICIES[name].honours_layer_limits and bool(features.softcap or any(features.windows))


def plain_logprobs(lm: LoadedModel, implementation: str = "eager") -> np.ndarray:
    """Log-probs of IDS under the plain model: transformers' own eager attention (soft-capping and windows in
    the model's code, not KV Lens's), or another attention function registered with transformers."""
    lm.model.set_attn_implementation(implementation)
    try:
        with torch.inference_mode():
            plain = torch.log_softmax(lm.model(torch.tensor([IDS])).logits[0].float(), -1)
    finally:
        lm.model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return plain[:-1].gather(-1, torch.tensor(IDS[1:])[:, None])[:, 0].numpy()


def test_full_equals_the_plain_model(any_lm):
    lm = any_lm
    (full,), _ = compute_traces(lm, ["full"], [POLICIES["full"]()], IDS, record_layers=())
    np.testing.assert_allclose(full.logprobs, plain_logprobs(lm), atol=2e-5)


@pytest.mark.parametrize("name", NAMES)
def test_a_budget_at_least_the_length_equals_full(any_lm, name):
    lm = any_lm
    policy = POLICIES[name].for_budget(64).whole()  # every token in its whole form
    if refused(lm, name):
        with pytest.raises(ValueError, match="does not honour this model's"):
            compute_traces(lm, [name], [policy], IDS, record_layers=())
        return
    (trace,), full = compute_traces(lm, [name], [policy], IDS, mode="generate", max_new_tokens=4, record_layers=())
    np.testing.assert_allclose(trace.logprobs, full.logprobs, atol=1e-9)


@pytest.mark.parametrize("name", NAMES)
def test_prompt_path_equals_token_by_token_decoding(lm, name):
    if refused(lm, name):
        return
    policy = POLICIES[name].for_budget(6)
    whole, s_whole, _ = score_text(lm, IDS, [policy], chunk=len(IDS))
    single, s_single, _ = score_text(lm, IDS, [policy], chunk=1)
    np.testing.assert_allclose(s_whole["logprobs"], s_single["logprobs"], atol=1e-9)
    if policy.kind in ("eviction", "compression"):
        np.testing.assert_array_equal(whole.evicted_at(1), single.evicted_at(1))


def test_the_keys_after_rope_of_every_recorded_layer_are_the_ones_the_cache_held(any_lm):
    """The t-SNE map's keys after RoPE: each recorded layer's keys, re-rotated with that layer's own RoPE (Gemma 3's
    local and global bases, GLM's partial and Cohere's interleaved rotation, none on a NoPE layer), are the keys
    the model's own attention read."""
    from backend.analysis.metrics import key_samples

    lm = any_lm
    layers = tuple(range(lm.n_layers))
    (trace,), _ = compute_traces(lm, ["window"], [POLICIES["window"](budget=64)], IDS, record_layers=layers)
    cache, _, _ = score_text(lm, IDS, [], record_layers=())  # Full's row: every key as the model rotated it
    for layer in layers:
        for head in range(lm.n_kv_heads):
            samples = key_samples(trace, layer, head)
            cached = cache.layers[layer].keys[0, head, samples.positions].numpy()
            # The trace keeps keys before RoPE as float16: agreement to its rounding.
            np.testing.assert_allclose(samples.after_rope, cached, atol=2e-3 * np.abs(cached).max(),
                                       err_msg=f"{lm.name}: layer {layer}, KV head {head}")


def test_a_gemma_local_layer_keeps_its_own_rope_base():
    """Gemma 3 turns its local layers' keys with base 10,000 and its global ones' with 1,000,000: the trace keeps
    each layer's frequencies, in rotate_half's layout (dimension i with i + 8)."""
    lm = tiny_family("gemma3_text")
    (full,), _ = compute_traces(lm, ["full"], [POLICIES["full"]()], IDS, record_layers=(0, 2))
    bases = lm.model.config.rope_parameters
    for layer, kind in ((0, "sliding_attention"), (2, "full_attention")):
        rope = full.rope(layer)
        inv_freq = 1.0 / bases[kind]["rope_theta"] ** (np.arange(0, 16, 2) / 16)
        np.testing.assert_allclose(rope.freq, np.concatenate([inv_freq, -inv_freq]), rtol=1e-5, atol=1e-9)
        assert rope.partner.tolist() == [*range(8, 16), *range(8)] and rope.scaling == pytest.approx(1.0)


def test_a_sliding_window_layer_reads_only_its_window():
    """Gemma's local layers: whatever a policy keeps, a query reads at most the latest `window` keys there."""
    lm = tiny_family("gemma3_text")
    (trace,), full = compute_traces(lm, ["window"], [POLICIES["window"](budget=64)], IDS, record_layers=(0, 2))
    assert full.meta["layer_windows"] == [8, 8, None]
    reads = full.reads(0)  # [H, T, T] in a sliding layer
    assert reads.sum(-1).max() == 8 and reads[:, -1, : len(IDS) - 8].sum() == 0
    assert full.reads(2)[:, -1].all()  # the global layer reads everything


def test_the_features_are_read_from_the_config_and_the_modules():
    gemma = read_features(tiny_family("gemma2").model)
    assert gemma.windows == [8, None, 8] and gemma.softcap == 0.5 and gemma.final_softcap == 3.0
    assert read_features(tiny_family("cohere").model).logit_scale == 0.5
    assert read_features(tiny_family("granite").model).logits_scaling == 2.0
    phi = read_features(tiny_family("phi3").model).layers[0].capture
    assert phi.q_module is phi.k_module and phi.k_slice == slice(64, 96)  # q: 4 heads x 16, k: 2 x 16
    smol = read_features(tiny_family("smollm3").model).layers
    x, positions = torch.randn(2, 3, 16, dtype=torch.float64), torch.arange(3)
    assert torch.equal(smol[1].rope(x, positions), x) and not torch.equal(smol[0].rope(x, positions), x)


def test_the_output_projection_is_found_by_its_shape_in_every_family(lm):
    """CriticalKV weighs values by the attention's output projection, found as the linear map from the heads to
    the hidden size; where the input projections share that shape (as many heads as the hidden size holds), the
    last one: the module transformers names as the output."""
    for layer, features in zip(lm.model.model.layers, read_features(lm.model).layers):
        names = [name for name, module in layer.self_attn.named_children() if module is features.output]
        assert names and names[0] in ("o_proj", "dense", "out_proj"), names


class HandWrittenAttention(torch.nn.Module):
    """Stands in for an attention module written by hand: its own forward never dispatches through transformers'
    attention functions (here it only wraps the original, so the model still runs)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.layer_idx = inner, inner.layer_idx

    def forward(self, hidden_states, *args, **kwargs):
        return self.inner(hidden_states, *args, **kwargs)


def _refusal(model) -> str:
    with pytest.raises(UnsupportedModel) as refused:
        read_features(model)
    message = str(refused.value)
    assert "\n" not in message and len(message) < 200
    return message


def test_a_model_the_engine_cannot_serve_is_one_line_naming_the_feature():
    from transformers import T5ForConditionalGeneration

    t5 = AutoConfig.for_model("t5", vocab_size=101, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    assert "encoder-decoder" in _refusal(T5ForConditionalGeneration(t5))
    mamba = AutoConfig.for_model("mamba", vocab_size=101, hidden_size=32, num_hidden_layers=2, state_size=4)
    assert "decoder layers and a rotary embedding" in _refusal(AutoModelForCausalLM.from_config(mamba))
    hybrid = AutoConfig.for_model(  # linear-attention layers beside attention layers
        "qwen3_next", vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=2, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
        moe_intermediate_size=32, shared_expert_intermediate_size=32)
    assert "linear_attention" in _refusal(AutoModelForCausalLM.from_config(hybrid))
    llama = tiny_family("llama").model
    llama.model.layers[1].self_attn = HandWrittenAttention(llama.model.layers[1].self_attn)
    assert "layer 1 has no self-attention module that calls transformers' AttentionInterface" in _refusal(llama)


def test_bfloat16_runs_on_the_cpu():
    lm = tiny_family("llama")
    lm.model.to(torch.bfloat16)
    (trace,), full = compute_traces(lm, ["tova"], [POLICIES["tova"](budget=6)], IDS, record_layers=())
    assert np.isfinite(trace.logprobs).all() and np.isfinite(full.logprobs).all()
    assert trace.evicted_at.max() > 0  # it evicted


def top_k_reference(budget: int):
    """An attention function for transformers' AttentionInterface, independent of KV Lens's engine: the model's
    own eager logits (scale, soft-cap, causal and window mask as transformers builds them), then each query reads
    only the ``budget`` keys of its highest exact attention, ranked by the mean row over the query heads of a
    KV head (the oracle's definition, A2SF Sec. 4.3)."""
    def attend(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        logits = (query @ key.transpose(2, 3)) * scaling
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits + attention_mask[..., : key.shape[2]]
        rows = torch.softmax(logits, -1)
        batch, heads, n, m = rows.shape
        ranking = rows.view(batch, heads // group, group, n, m).mean(2).repeat_interleave(group, 1)
        unread = torch.ones_like(rows, dtype=torch.bool).scatter_(-1, ranking.topk(min(budget, m), -1).indices,
                                                                  False)
        weights = torch.softmax(logits.masked_fill(unread, float("-inf")), -1)
        return (weights @ value).transpose(1, 2).contiguous(), weights
    return attend


def test_the_oracle_equals_a_top_k_reading_of_transformers_own_attention(lm):
    """The oracle on every family, against top-k reading written on transformers' eager attention (on a
    sliding-window layer the top keys are chosen within the window, which transformers' mask leaves visible)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask

    budget = 6
    AttentionInterface.register("top_k_reference", top_k_reference(budget))
    AttentionMaskInterface.register("top_k_reference", eager_mask)
    reference = plain_logprobs(lm, "top_k_reference")
    _, scores, (row,) = score_text(lm, IDS, [POLICIES["oracle"](budget=budget)], chunk=len(IDS))
    np.testing.assert_allclose(scores["logprobs"][row], reference, atol=1e-6)
    assert np.abs(reference - plain_logprobs(lm)).max() > 1e-3  # the budget changes what the model reads
