"""SparQ as a KV Lens policy: exact where it must be, and the paper's algorithm step by step."""
import math

import numpy as np
import pytest
import torch

from backend.policies import SparQ, parse_spec
from backend.policies.base import Block
from backend.engine.runner import compute_traces, score_text
from kernels.sparq import sparq_attention_reference
from kernels.sparq_triton import sparq_attention_triton, triton_enabled
from tests.conftest import make_tiny


def straightforward_sparq(q, K, V, k, r, l):
    """App. B for one query, written plainly with loops (GQA: one group per KV head)."""
    n_q, d = q.shape
    n_kv, S, _ = K.shape
    group = n_q // n_kv
    out = torch.zeros(n_q, d, dtype=torch.float64)
    for kv in range(n_kv):
        heads = range(kv * group, (kv + 1) * group)
        magnitude = sum(q[h].abs() for h in heads)
        i1 = sorted(sorted(range(d), key=lambda c: (-float(magnitude[c]), c))[:r])
        s_hat = {}
        for h in heads:
            tau = math.sqrt(d * float(q[h, i1].abs().sum()) / float(q[h].abs().sum()))
            s_hat[h] = torch.softmax(K[kv][:, i1] @ q[h, i1] / tau, 0)
        summed = sum(s_hat[h] for h in heads)
        k_eff, l_eff = min(k, S), min(l, k, S)
        local = list(range(S - l_eff, S))
        others = sorted(range(S - l_eff), key=lambda j: (-float(summed[j]), j))[: k_eff - l_eff]
        chosen = sorted(others + local)
        for h in heads:
            w = torch.softmax(K[kv][chosen] @ q[h] / math.sqrt(d), 0)
            alpha = 1.0 if k_eff == S else float(s_hat[h][chosen].sum())
            out[h] = alpha * (w @ V[kv][chosen]) + (1 - alpha) * V[kv].mean(0)
    return out


def test_attend_block_matches_a_straightforward_app_b():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((6, 5, 16), (2, 30, 16), (2, 30, 16)))
    policy = SparQ(budget=8, r=4, local=2)
    _, result = policy.attend_block({}, Block(q=q, k=k, v=v, first=25, scaling=16 ** -0.5))
    for i in range(5):
        t = 25 + i
        expected = straightforward_sparq(q[:, i], k[:, : t + 1], v[:, : t + 1], 8, 4, 2)
        torch.testing.assert_close(result.out[i], expected, atol=1e-5, rtol=1e-5)
        assert (result.reads[:, i].sum(-1) == 8).all() and result.reads[:, i, t - 1: t + 1].all()  # local window


def test_budget_at_least_length_equals_full(tiny, text_ids):
    (trace,), full = compute_traces(tiny, ["sparq:budget=40"], [SparQ(budget=40, r=2)], text_ids, record_layers=())
    np.testing.assert_array_equal(trace.logprobs, full.logprobs)
    assert (trace.stats["alpha"] == 1).all()


def test_prompt_path_equals_decode_loop(tiny, text_ids):
    policy = SparQ(budget=6, r=3)
    whole, s_whole, _ = score_text(tiny, text_ids, [policy], chunk=len(text_ids))
    step, s_step, _ = score_text(tiny, text_ids, [policy], chunk=1)
    np.testing.assert_array_equal(whole.selected(1), step.selected(1))
    np.testing.assert_allclose(s_whole["logprobs"], s_step["logprobs"], atol=1e-9)


def test_records_alpha_agreement_and_transfer(tiny, text_ids):
    (trace,), _ = compute_traces(tiny, ["sparq:budget=8,r=4"], [parse_spec("sparq:budget=8,r=4")], text_ids, record_layers=())
    n = len(text_ids)
    assert trace.stats["alpha"].shape == (2, n, 6) and trace.stats["topk_agreement"].shape == (2, n, 2)
    assert ((trace.stats["alpha"] > 0) & (trace.stats["alpha"] <= 1 + 1e-9)).all()
    assert (trace.stats["alpha"][:, :8] == 1).all() and (trace.stats["alpha"][:, 8:] < 1).all()
    sparq_bytes, dense_bytes = trace.stats["transfer_bytes"][0, -1]
    assert dense_bytes == 2 * (2 * n * 8 + 2 * 8) * 2  # App. C: 2 KV heads, 2 bytes per element
    assert sparq_bytes == 2 * (n * 4 + 2 * 8 * 8 + 4 * 8) * 2


@pytest.mark.parametrize("r", [1, 4, 8])
def test_top_k_agreement_is_perfect_with_every_component(tiny, text_ids, r):
    (trace,), _ = compute_traces(tiny, ["sparq"], [SparQ(budget=8, r=r)], text_ids, record_layers=())
    agreement = trace.stats["topk_agreement"][:, 8:].mean()
    assert 0 <= agreement <= 1
    if r == 8:  # r = d: the approximate scores rank like the exact ones (temperature aside)
        assert agreement == 1


@pytest.mark.parametrize("heads, head_dim", [(6, 8), (3, 16)])
def test_r_is_a_quarter_of_the_models_head_size_unless_given(text_ids, heads, head_dim):
    """The paper's share of the query's components (r = 32 of d_h = 128): 16 on the default model, 64 on Gemma 3
    270M, whose 256 components r = 16 ranks too coarsely; a run with the default is one with that r, to the bit."""
    assert [SparQ().components(d) for d in (8, 64, 128, 256)] == [2, 16, 32, 64]
    assert SparQ(r=5).components(256) == 5
    model = make_tiny(heads=heads, kv_heads=heads // 3)
    assert model.model.config.head_dim == head_dim

    def run(spec):
        (trace,), _ = compute_traces(model, [spec], [parse_spec(spec)], text_ids, record_layers=())
        return trace
    default, given, half = (run(f"sparq:budget=6{r}") for r in ("", f",r={head_dim // 4}", f",r={head_dim // 2}"))
    np.testing.assert_array_equal(default.logprobs, given.logprobs)
    np.testing.assert_array_equal(default.stats["transfer_bytes"], given.stats["transfer_bytes"])
    assert not np.array_equal(default.stats["transfer_bytes"], half.stats["transfer_bytes"])


def test_bad_parameters_are_clear_errors():
    with pytest.raises(ValueError, match="r must be >= 1, or -1"):
        SparQ(budget=8, r=0)
    with pytest.raises(ValueError, match="local must be <= budget"):
        SparQ(budget=8, local=9)


@pytest.mark.slow
@pytest.mark.skipif(not triton_enabled(torch.empty(0)), reason="needs TRITON_INTERPRET=1 (on a GPU: test_engine_cuda)")
def test_kernel_path_equals_reference_path(monkeypatch, text_ids):
    """What a GPU runs (the Triton kernels, a block's later queries in one call with ``lengths``), here
    through the Triton interpreter on a float32 model: same reads, same log-probs as the CPU's block path."""
    model = make_tiny(dtype=torch.float32)
    policy = SparQ(budget=6, r=3)
    (reference,), _ = compute_traces(model, ["sparq"], [policy], text_ids, record_layers=(1,))
    monkeypatch.setattr(SparQ, "attend_block",
                        lambda self, state, block: (state, self.attend_rows(block, sparq_attention_triton)))
    (kernel,), _ = compute_traces(model, ["sparq"], [policy], text_ids, record_layers=(1,))
    for layer in range(2):
        np.testing.assert_array_equal(kernel.reads(layer), reference.reads(layer))
    np.testing.assert_allclose(kernel.logprobs, reference.logprobs, atol=1e-5)
    np.testing.assert_allclose(kernel.stats["alpha"], reference.stats["alpha"], atol=1e-5)


@pytest.mark.parametrize("first, n, budget, local", [(0, 30, 8, 2), (5, 20, 8, 0), (25, 5, 8, 8), (0, 7, 16, 4)])
def test_block_path_equals_one_reference_call_per_query(first, n, budget, local):
    """The CPU's whole-block computation (kernels/sparq.py ``sparq_attention_block``) against the decode
    reference called row by row (``attend_rows``): outputs, reads, alpha, agreement and attention rows."""
    g = torch.Generator().manual_seed(first + n)
    q = torch.randn(6, n, 16, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(2, first + n, 16, generator=g, dtype=torch.float64) for _ in range(2))
    policy = SparQ(budget=budget, r=4, local=local)
    block = Block(q=q, k=k, v=v, first=first, scaling=16 ** -0.5)
    _, whole = policy.attend_block({}, block)
    rows = policy.attend_rows(block, sparq_attention_reference)
    torch.testing.assert_close(whole.out, rows.out, atol=1e-10, rtol=1e-10)
    np.testing.assert_array_equal(whole.reads, rows.reads)
    np.testing.assert_allclose(whole.attn, rows.attn, atol=1e-6)
    for name in ("alpha", "topk_agreement", "transfer_bytes"):
        np.testing.assert_allclose(whole.stats[name], rows.stats[name], atol=1e-6)


def test_block_path_breaks_score_ties_toward_the_earlier_position():
    """Equal keys give equal approximate scores: the earlier positions are read, as a stable sort keeps them."""
    k = torch.zeros(1, 12, 4, dtype=torch.float64)
    k[0, :, 0] = 1.0  # every key the same
    q = torch.ones(1, 3, 4, dtype=torch.float64)
    policy = SparQ(budget=4, r=4, local=1)
    _, result = policy.attend_block({}, Block(q=q, k=k, v=k.clone(), first=9, scaling=0.5))
    for i, t in enumerate(range(9, 12)):
        assert np.flatnonzero(result.reads[0, i]).tolist() == [0, 1, 2, t]
