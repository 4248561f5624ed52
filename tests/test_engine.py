"""The engine on a tiny random-weight Llama: exactness of both paths against the plain model."""
import numpy as np
import pytest
import torch

from backend.engine.attention import PolicyCache
from kernels import eviction_walk_triton
from backend.policies import A2SF, H2O, TOVA, Full, Oracle, ReAttention, Sinks, SparQ, Window
from backend.engine.runner import compute_traces, generate, rope_function, score_text

SMALL = [Window(budget=5), Sinks(budget=6, sinks=2), H2O(budget=6), H2O(budget=6, heads="layer"), TOVA(budget=5),
         TOVA(budget=5, heads="head"), TOVA(budget=5, sinks=1), A2SF(budget=5, alpha=0.3), Oracle(budget=4),
         Oracle(budget=4, heads="layer")]
IDS = [p.__class__.__name__ + str(sorted(p.params().items())) for p in SMALL]


def plain_logprobs(lm, ids, mask=None):
    """The unmodified model (SDPA), optionally with a 4D boolean attention mask shared by all layers."""
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids]), attention_mask=mask).logits[0]
    return torch.log_softmax(logits.double(), -1)


def reads_of(cache, row, policy, n):
    if policy.kind == "selection":
        return cache.selected(row)
    return np.stack([PolicyTrace(e).reads() for e in cache.evicted_at(row)])


class PolicyTrace:
    def __init__(self, evicted_at):
        self.e = evicted_at

    def reads(self):
        n = self.e.shape[-1]
        t, j = np.arange(n)[:, None], np.arange(n)[None]
        return (j <= t)[None] & ((self.e[:, None] < 0) | (t[None] < self.e[:, None]))


def test_full_reproduces_plain_model_logprobs(tiny, text_ids):
    _, stats, _ = score_text(tiny, text_ids, [Full()])
    expected = plain_logprobs(tiny, text_ids)[:-1].gather(-1, torch.tensor(text_ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(stats["logprobs"][0], expected.numpy(), atol=1e-6)  # stored as float32


@pytest.mark.parametrize("policy", [Window(budget=40), Sinks(budget=41), H2O(budget=40), TOVA(budget=40),
                                    A2SF(budget=45, alpha=0.5), Oracle(budget=40)], ids=lambda p: p.name)
def test_budget_at_least_length_equals_full(tiny, text_ids, policy):
    cache, stats, _ = score_text(tiny, text_ids, [policy])
    np.testing.assert_allclose(stats["logprobs"][1], stats["logprobs"][0], atol=1e-12)
    assert np.abs(stats["kl_to_full"][1]).max() < 1e-12
    if policy.kind == "eviction":
        e = cache.evicted_at(1)
        assert ((e < 0) | (e >= len(text_ids))).all()  # nothing leaves while the text lasts


@pytest.mark.parametrize("policy", SMALL, ids=IDS)
def test_prompt_path_equals_decode_loop(tiny, text_ids, policy):
    """One forward over the text (or chunks of it) equals feeding it one token at a time."""
    whole, s_whole, _ = score_text(tiny, text_ids, [policy], chunk=len(text_ids))
    chunked, s_chunked, _ = score_text(tiny, text_ids, [policy], chunk=7)
    stepwise, s_step, _ = score_text(tiny, text_ids, [policy], chunk=1)
    for other, s_other in ((chunked, s_chunked), (stepwise, s_step)):
        np.testing.assert_array_equal(reads_of(whole, 1, policy, 40), reads_of(other, 1, policy, 40))
        np.testing.assert_allclose(s_whole["logprobs"], s_other["logprobs"], atol=1e-9)


@pytest.mark.parametrize("policy", SMALL, ids=IDS)
def test_each_query_reads_exactly_min_of_budget_and_length(tiny, text_ids, policy):
    cache, _, _ = score_text(tiny, text_ids, [policy])
    counts = reads_of(cache, 1, policy, 40).sum(-1)  # [L, H, T]
    expected = np.minimum(np.arange(1, 41), policy.budget)
    assert (counts == expected).all()


@pytest.mark.parametrize("policy", [Window(budget=6), Sinks(budget=7, sinks=3)], ids=lambda p: p.name)
def test_static_policies_match_plain_model_with_the_same_mask(tiny, text_ids, policy):
    """An independent check of masks and positions: transformers' own SDPA path with a 4D mask."""
    cache, stats, _ = score_text(tiny, text_ids, [policy])
    reads = reads_of(cache, 1, policy, 40)
    assert (reads == reads[0, 0]).all()  # same mask in every layer and head
    expected = plain_logprobs(tiny, text_ids, torch.from_numpy(reads[0, 0])[None, None])
    expected = expected[:-1].gather(-1, torch.tensor(text_ids[1:])[:, None])[:, 0]
    np.testing.assert_allclose(stats["logprobs"][1], expected.numpy(), atol=1e-6)  # stored as float32


def test_generation_uses_text_positions_at_small_budget(tiny, text_ids):
    """Each greedy token under Sinks(budget=5) is what the plain model predicts with the same mask and
    positions 0..T-1: a position taken from the cache length would give other tokens."""
    prompt = text_ids[:12]
    policy = Sinks(budget=5, sinks=1)
    cache, outputs, _ = generate(tiny, prompt, [policy], max_new_tokens=10)
    text = prompt + outputs[1]
    reads = reads_of(cache, 1, policy, len(text))[0, 0]
    logp = plain_logprobs(tiny, text, torch.from_numpy(reads)[None, None])
    assert logp[len(prompt) - 1:-1].argmax(-1).tolist() == outputs[1]


def test_generation_with_full_budget_equals_full(tiny, text_ids):
    _, outputs, _ = generate(tiny, text_ids[:10], [TOVA(budget=64), H2O(budget=64)], max_new_tokens=8)
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


def test_a2sf_alpha_one_drops_what_h2o_drops(tiny, text_ids):
    cache, _, _ = score_text(tiny, text_ids, [A2SF(budget=6, alpha=1.0, window=3), H2O(budget=6, recent=3)])
    np.testing.assert_array_equal(cache.evicted_at(1), cache.evicted_at(2))
    assert (cache.evicted_at(1) >= 0).any()


def test_layerwise_tova_drops_the_same_token_from_every_head(tiny, text_ids):
    cache, _, _ = score_text(tiny, text_ids, [TOVA(budget=5), TOVA(budget=5, heads="head")])
    layerwise, headwise = cache.evicted_at(1), cache.evicted_at(2)
    assert (layerwise == layerwise[:, :1]).all()
    assert not (headwise == headwise[:, :1]).all()


def test_attention_output_equals_gathering_the_kept_keys():
    """PolicyCache.attend against a plain loop that keeps only the cached keys of each head (GQA 6/2)."""
    g = torch.Generator().manual_seed(3)
    n, d = 12, 4
    q, k, v = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    cache = PolicyCache([TOVA(budget=4, heads="head")], n_layers=1, n_kv_heads=2)
    out = cache.attend(0, q, k, v, scaling=0.5)[0]  # [n, H, d]
    e = cache.evicted_at(0)[0]
    for t in range(n):
        for h in range(6):
            kv = h // 3
            keep = [j for j in range(t + 1) if e[kv, j] < 0 or t < e[kv, j]]
            assert len(keep) == min(t + 1, 4)
            w = torch.softmax(q[0, h, t] @ k[0, kv, keep].T * 0.5, -1)
            torch.testing.assert_close(out[t, h], w @ v[0, kv, keep])


def test_a_decoding_step_widens_a_rows_token_arrays_in_place():
    """A step adds a column to what a row keeps per token (when each token left): within the buffer it has, not by
    copying every column (quadratic over a long answer), and to the values one block of the same queries gives."""
    g = torch.Generator().manual_seed(5)
    n, d = 40, 4
    q, k, v = (torch.randn(1, h, n, d, generator=g, dtype=torch.float64) for h in (6, 2, 2))
    whole = PolicyCache([H2O(budget=6)], n_layers=1, n_kv_heads=2)
    whole.attend(0, q, k, v, scaling=0.5)
    steps = PolicyCache([H2O(budget=6)], n_layers=1, n_kv_heads=2)
    widened = []
    for t in range(n):
        steps.attend(0, q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], scaling=0.5)
        widened.append(steps.rows[0][0].evicted_at)
    np.testing.assert_array_equal(steps.evicted_at(0), whole.evicted_at(0))
    assert (whole.evicted_at(0) >= 0).any()
    assert all(np.shares_memory(widened[0], later) for later in widened[1:])


def test_run_returns_traces_in_spec_order_with_full_reference(tiny, text_ids):
    specs = ["tova:budget=5", "full"]
    traces, full = compute_traces(tiny, specs, [TOVA(budget=5), Full()], text_ids)
    assert [t.spec for t in traces] == specs
    assert traces[0].evicted_at.shape == (2, 2, 40) and traces[1].evicted_at is None
    np.testing.assert_array_equal(traces[1].logprobs, full.logprobs)


def test_generate_mode_scores_every_policy_on_fulls_continuation(tiny, text_ids):
    traces, full = compute_traces(tiny, ["window:budget=4"], [Window(budget=4)], text_ids[:8], mode="generate", max_new_tokens=6)
    (trace,) = traces
    assert len(trace.generated_ids) == 6 and len(trace.tokens) == 14
    np.testing.assert_array_equal(trace.scored_ids, full.tokens)
    assert trace.meta["score_start"] == 7
    assert trace.evicted_at.shape == (2, 2, 14)


def test_our_kernels_folder_is_not_taken_for_hugging_faces_kernels_library():
    from transformers.utils import import_utils
    assert not import_utils.is_kernels_available()


@pytest.mark.parametrize("policy", [Full(), TOVA(budget=5), Window(budget=4), Oracle(budget=4)], ids=lambda p: p.name)
def test_recorded_attention_rows_are_what_each_query_read(tiny, text_ids, policy):
    traces, _ = compute_traces(tiny, [policy.name], [policy], text_ids, record_layers=(1,))
    (trace,) = traces
    assert trace.attention.exact  # a short text keeps every entry of every row
    rows = trace.attention.dense(0).astype(np.float64)  # [H_kv, T, T]
    np.testing.assert_allclose(rows.sum(-1), 1.0, atol=2e-3)  # float16 on disk
    assert ((rows > 0) == trace.reads(1)).all()
    assert trace.keys.shape == (1, 2, len(text_ids), 8)


def test_recorded_keys_are_the_keys_before_rope(tiny, text_ids):
    """The hook's keys, rotated by the model's RoPE at their positions, are the keys the cache holds."""
    cache, _, _ = score_text(tiny, text_ids, [TOVA(budget=5)], record_layers=(1,))
    where = np.array([0, 3, 7, len(text_ids) - 1])
    before = torch.from_numpy(cache.recorded_keys(1, where)[0].astype(np.float32))  # [H_kv, 4, d]
    after = rope_function(tiny)(before, torch.from_numpy(where))
    np.testing.assert_allclose(after.numpy(), cache.layers[1].keys[1][:, where].numpy(), atol=2e-2)
    assert not np.allclose(before.numpy(), cache.layers[1].keys[1][:, where].numpy(), atol=2e-2)


GENERATING = [Window(budget=6), TOVA(budget=6), H2O(budget=6), SparQ(budget=6, r=2),
              ReAttention(budget=12, global_size=2, span=2, topk=2, chunk=4),
              ReAttention(budget=14, global_size=1, span=1, topk=2, chunk=8)]


def test_generate_mode_scores_what_decoding_predicts(tiny, text_ids):
    """Generate mode scores every policy on Full's continuation from the generation's own prompt state:
    while a row's own tokens equal Full's, its top-1 prediction at each step is the token it generated.
    (ReAttention included: the continuation is read one token per step, as Algorithm 2 decodes.)"""
    prompt = text_ids[:26]  # not a multiple of ReAttention's chunks: its last prompt chunk is a short one
    traces, full = compute_traces(tiny, [p.name for p in GENERATING], GENERATING, prompt, mode="generate", max_new_tokens=10,
                       record_layers=())
    compared = 0
    for trace in traces:
        own, theirs = trace.generated_ids.tolist(), full.generated_ids.tolist()
        for i, token in enumerate(own[:len(theirs)]):
            if own[:i] != theirs[:i]:
                break
            assert trace.top1_ids[len(prompt) - 1 + i] == token, (trace.spec, i)
            compared += 1
    assert compared > 2 * len(GENERATING)


def test_generate_mode_scores_equal_a_second_teacher_forced_pass(tiny, text_ids):
    """For policies whose prompt path equals their decode path, scoring from the forked prompt state equals
    scoring prompt + Full's continuation from scratch: the fork is untouched by the generation that follows."""
    prompt, policies = text_ids[:24], [TOVA(budget=6), H2O(budget=6), SparQ(budget=6, r=2)]
    traces, full = compute_traces(tiny, [p.name for p in policies], policies, prompt, mode="generate", max_new_tokens=10,
                       record_layers=())
    _, stats, index = score_text(tiny, prompt + full.generated_ids.tolist(), policies)
    start = len(prompt) - 1  # score_start: the prompt's positions before it are not scored in generate mode
    for trace, row in zip([full, *traces], [0, *index]):
        np.testing.assert_allclose(trace.logprobs[start:], stats["logprobs"][row][start:], atol=1e-9, err_msg=trace.spec)
        np.testing.assert_allclose(trace.kl_to_full[start:], stats["kl_to_full"][row][start:], atol=1e-9,
                                   err_msg=trace.spec)
        np.testing.assert_array_equal(trace.top1_ids[start:], stats["top1_ids"][row][start:])
        assert np.isnan(trace.logprobs[:start]).all() and np.isnan(trace.kl_to_full[:start]).all()
        assert (trace.top1_ids[:start] == -1).all()


def test_generate_mode_runs_no_lm_head_over_the_prompts_positions(tiny, text_ids):
    """What metrics count in generate mode starts at the prompt's last position: the LM head never reads the prompt's
    other positions (on Gemma 3 they were two thirds of a row's prefill)."""
    positions = []
    hook = tiny.model.lm_head.register_forward_hook(lambda module, args, out: positions.append(args[0].shape[-2]
                                                                                              if args[0].dim() == 3 else 1))
    try:
        compute_traces(tiny, ["tova:budget=6"], [TOVA(budget=6)], text_ids[:26], mode="generate", max_new_tokens=4)
    finally:
        hook.remove()
    assert positions and max(positions) <= 4  # a decoding step's, the first answer token's, Full's continuation's


@pytest.mark.parametrize("device_walk", [False, True], ids=["walks-apart", "device-walk"])
def test_a_row_whose_answer_ended_goes_idle_and_every_row_answers_as_it_would_alone(tiny, text_ids, monkeypatch,
                                                                                    device_walk):
    """Rows stop at EOS at different steps: once a row has read its EOS it leaves the forward calls (no policy
    decides for it, no matmul carries it), and every row's trace is the one it gets in a batch of its own (with
    Full), to the bit. With ``device_walk`` the running-score rows walk together in one launch per layer (Triton,
    interpreted on the CPU), as on a GPU."""
    from backend.engine import attention
    from backend.policies import parse_spec

    if device_walk and not eviction_walk_triton.usable(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 (or a GPU)")
    monkeypatch.setattr(attention, "DEVICE_WALK", device_walk)

    specs = ["window:budget=12", "tova:budget=10", "snapkv:budget=12", "sparq:budget=12,r=4", "cam:budget=12"]
    ids = text_ids[:30]
    (first, *_), _ = compute_traces(tiny, specs[:1], [parse_spec(specs[0])], ids, mode="generate",
                                    max_new_tokens=10, record_layers=())
    monkeypatch.setattr(tiny.tokenizer, "eos_token_id", int(first.generated_ids[2]), raising=False)
    calls = {}
    attend = attention.RowLayerState.attend

    def counted(state, *args, **kwargs):
        calls[state.policy] = calls.get(state.policy, 0) + 1
        return attend(state, *args, **kwargs)

    monkeypatch.setattr(attention.RowLayerState, "attend", counted)
    carried = []  # how many rows each one-token forward call carries through the MLPs
    hook = tiny.model.model.layers[0].mlp.register_forward_pre_hook(
        lambda _module, args: carried.append(args[0].shape[0]) if args[0].shape[1] == 1 else None)
    try:
        batched, full = compute_traces(tiny, specs, [parse_spec(s) for s in specs], ids, mode="generate",
                                       max_new_tokens=10, record_layers=(0,))
    finally:
        hook.remove()
    lengths = [len(t.generated_ids) for t in batched]
    assert min(lengths) < max(lengths) == 10, lengths  # some rows stopped early, one ran to the limit
    # Decoding step s carries the rows still answering: those with more than s tokens, Full's row among them.
    answering = [len(full.generated_ids), *lengths]
    assert carried == [sum(n > step for n in answering) for step in range(10)], (carried, answering)
    early, late = parse_spec(specs[lengths.index(min(lengths))]), parse_spec(specs[lengths.index(10)])
    # An attending row (SparQ), or a row walked with the others on the device, computes its output elsewhere.
    if not early.attends and not late.attends and not device_walk:
        assert calls[early] < calls[late]  # the early row stopped attending, once its EOS was read
    for spec, trace in zip(specs, batched):
        (alone,), _ = compute_traces(tiny, [spec], [parse_spec(spec)], ids, mode="generate", max_new_tokens=10,
                                     record_layers=(0,))
        np.testing.assert_array_equal(trace.generated_ids, alone.generated_ids, err_msg=spec)
        np.testing.assert_array_equal(trace.logprobs, alone.logprobs, err_msg=spec)
        for layer in range(tiny.n_layers):  # what every query read, whatever the kind
            np.testing.assert_array_equal(trace.reads(layer), alone.reads(layer), err_msg=f"{spec} layer {layer}")
        np.testing.assert_array_equal(trace.attention.dense(0), alone.attention.dense(0), err_msg=spec)
        np.testing.assert_array_equal(trace.keys, alone.keys, err_msg=spec)
