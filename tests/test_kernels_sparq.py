"""SparQ Attention: hand-worked examples for each step, dense equivalence, Triton == reference.

Run the Triton part on CPU with TRITON_INTERPRET=1 (it is skipped without CUDA or the interpreter).
"""
import math

import pytest
import torch

from kernels import sparq, sparq_triton
from kernels.sparq import sparq_attention_reference, sparq_transfer_bytes
from kernels.sparq_triton import sparq_attention, sparq_attention_triton, triton_enabled

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_enabled(torch.empty(0, device=DEV)),
                                  reason="needs CUDA or TRITON_INTERPRET=1")
IMPLS = [pytest.param(sparq_attention_reference, id="reference"),
         pytest.param(sparq_attention_triton, id="triton", marks=needs_triton)]

LN = math.log


def worked_example():
    """d=4, S=6, one head. q = [1,1,1,1]: all |q| tie, so r=1 keeps component 0 (lower index wins)
    and tau = sqrt(4 * 1/4) = 1 (Eq. D2); the approximate logits are then K[:, 0] itself.

    K[:, 0] = ln [1, 2, 1, 3, 2, 1] -> s_hat = [.1, .2, .1, .3, .2, .1].
    K[:, 1] is set so that the exact logits q.K[j] / sqrt(4) of positions 1, 3, 5 are ln [1, 2, 1]
    (up to a constant): exact weights over {1, 3, 5} are [.25, .5, .25]. V[1], V[3], V[5] are
    e0, e1, e2; other rows are 100 so that reading a wrong row shows. v_mean = e3.
    """
    s_hat_w = [1, 2, 1, 3, 2, 1]
    exact_w = {1: 1.0, 3: 2.0, 5: 1.0}
    K = torch.zeros(6, 4)
    V = torch.full((6, 4), 100.0)
    for j, w in enumerate(s_hat_w):
        K[j, 0] = LN(w)
        K[j, 1] = 2 * LN(exact_w.get(j, 1.0)) - K[j, 0]
    V[1], V[3], V[5] = torch.eye(4)[0], torch.eye(4)[1], torch.eye(4)[2]
    q = torch.ones(1, 1, 4)
    v_mean = torch.tensor([[[0.0, 0.0, 0.0, 1.0]]])
    return [t.to(DEV) for t in (q, K[None, None], V[None, None], v_mean)]


@pytest.mark.parametrize("impl", IMPLS)
def test_worked_example_every_step(impl):
    q, K, V, vm = worked_example()
    res = impl(q, K, V, vm, k=3, r=1, l=1)
    # Step 1: component 0 (tie broken by index), tau = 1, s_hat = K[:, 0] softmaxed.
    assert res.components.tolist() == [[[0]]]
    assert res.tau.item() == pytest.approx(1.0)
    assert res.scores[0, 0].tolist() == pytest.approx([.1, .2, .1, .3, .2, .1], abs=1e-6)
    # Step 2: window {5}; best 2 of 0..4 are 3 (.3) then 1 and 4 tie at .2 -> earlier (1) wins.
    assert res.positions.tolist() == [[[1, 3, 5]]]
    # Step 3: alpha = .2 + .3 + .1; y = [.25, .5, .25, 0]; out = .6 y + .4 e3.
    assert res.alpha.item() == pytest.approx(0.6, abs=1e-6)
    assert res.out[0, 0].tolist() == pytest.approx([.15, .3, .15, .4], abs=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k,l,positions,alpha", [
    (3, 2, [3, 4, 5], .3 + .2 + .1),   # window {4, 5} inside k=3, plus the best of 0..3
    (3, 0, [1, 3, 4], .3 + .2 + .2),   # no window: top 3 of all
    (2, 0, [1, 3], .3 + .2),           # 1 and 4 tie at .2: earlier position wins
    (2, 2, [4, 5], .2 + .1),           # all of k is window
    (9, 2, [0, 1, 2, 3, 4, 5], 1.0),   # k >= S: everything, alpha exactly 1
])
def test_window_inside_k_and_position_ties(impl, k, l, positions, alpha):
    q, K, V, vm = worked_example()
    res = impl(q, K, V, vm, k=k, r=1, l=l)
    assert res.positions.tolist() == [[positions]]
    assert res.alpha.item() == pytest.approx(alpha, abs=1e-6)


def test_component_choice_and_temperature():
    q = torch.tensor([[[1.0, -1.0, 1.0, 1.0]]])  # all |q| tie: lowest indices win
    K = torch.randn(1, 1, 5, 4)
    res = sparq_attention_reference(q, K, K, K.mean(2), k=2, r=2, l=0)
    assert res.components.tolist() == [[[0, 1]]]
    assert res.tau.item() == pytest.approx(math.sqrt(4 * 2 / 4))  # Eq. D2
    q = torch.tensor([[[0.5, -3.0, 0.0, 2.0]]])
    res = sparq_attention_reference(q, K, K, K.mean(2), k=2, r=2, l=0)
    assert res.components.tolist() == [[[1, 3]]]
    assert res.tau.item() == pytest.approx(math.sqrt(4 * 5 / 5.5))


def gqa_example():
    """H_q=2 share H_kv=1, d=4, S=4. q0 = [4,0,0,0], q1 = [0,1,0,3]: summed |q| = [4,1,0,3], so r=2
    keeps components {0, 3} for both heads (head 1 alone would keep {1, 3}).
    tau0 = sqrt(4 * 4/4) = 2, tau1 = sqrt(4 * 3/4) = sqrt(3).
    Head 0 logits 4 K[:,0] / 2 = ln [7,1,1,1] -> s_hat0 = [.7,.1,.1,.1];
    head 1 logits 3 K[:,3] / sqrt(3) = ln [1,4,4,1] -> s_hat1 = [.1,.4,.4,.1].
    Group sum [.8,.5,.5,.2]: k=2 picks 0 and (1 and 2 tie) 1. K[:,1] is large but unused.
    """
    q = torch.tensor([[[4.0, 0, 0, 0], [0, 1, 0, 3]]])
    K = torch.zeros(1, 1, 4, 4)
    K[0, 0, :, 0] = torch.log(torch.tensor([7.0, 1, 1, 1])) / 2
    K[0, 0, :, 3] = torch.log(torch.tensor([1.0, 4, 4, 1])) / math.sqrt(3)
    K[0, 0, :, 1] = torch.tensor([0.0, 0, 50, 0])
    V = torch.arange(16.0).reshape(1, 1, 4, 4)
    return [t.to(DEV) for t in (q, K, V, V.mean(2))]


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_group_sums(impl):
    q, K, V, vm = gqa_example()
    res = impl(q, K, V, vm, k=2, r=2, l=0)
    assert res.components.tolist() == [[[0, 3]]]
    assert res.tau[0].tolist() == pytest.approx([2.0, math.sqrt(3)])
    assert res.scores[0, 0].tolist() == pytest.approx([.7, .1, .1, .1], abs=1e-6)
    assert res.scores[0, 1].tolist() == pytest.approx([.1, .4, .4, .1], abs=1e-6)
    assert res.positions.tolist() == [[[0, 1]]]
    assert res.alpha[0].tolist() == pytest.approx([.8, .5], abs=1e-6)  # alpha per query head
    # Exact attention over rows 0, 1 with the full query, then the Eq. D4 mix, written out.
    qc, Kc, Vc, vmc = (t.cpu().double() for t in (q, K, V, vm))
    for h, a in enumerate([.8, .5]):
        w = torch.softmax(Kc[0, 0, :2] @ qc[0, h] / 2.0, dim=0)
        expect = a * (w @ Vc[0, 0, :2]) + (1 - a) * vmc[0, 0]
        assert res.out[0, h].double().cpu() == pytest.approx(expect, abs=1e-5)


def random_case(B, H_q, H_kv, S, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, d, generator=g, dtype=dtype)
    K = torch.randn(B, H_kv, S, d, generator=g, dtype=dtype)
    V = torch.randn(B, H_kv, S, d, generator=g, dtype=dtype)
    return [t.to(DEV) for t in (q, K, V, V.mean(2))]


def dense(q, K, V):
    B, H_q, d = q.shape
    H_kv = K.shape[1]
    qg = q.reshape(B, H_kv, H_q // H_kv, d)
    return torch.nn.functional.scaled_dot_product_attention(qg, K, V).reshape(B, H_q, d)


@pytest.mark.parametrize("k", [37, 50])
def test_k_at_least_S_is_dense_attention(k):
    q, K, V, vm = random_case(2, 6, 2, 37, 16, dtype=torch.float64)
    res = sparq_attention_reference(q, K, V, vm, k=k, r=3, l=4)
    assert torch.equal(res.alpha, torch.ones_like(res.alpha))
    assert res.positions.tolist() == [[list(range(37))] * 2] * 2
    torch.testing.assert_close(res.out, dense(q, K, V), rtol=0, atol=1e-12)


@needs_triton
def test_triton_k_at_least_S_is_dense_attention():
    q, K, V, vm = random_case(2, 6, 2, 37, 16)
    res = sparq_attention_triton(q, K, V, vm, k=40, r=3, l=4, block_s=16)
    assert torch.equal(res.alpha, torch.ones_like(res.alpha))
    torch.testing.assert_close(res.out, dense(q, K, V), rtol=1e-5, atol=1e-5)


def test_sparse_output_differs_from_dense_and_uses_v_mean():
    """Guards against a kernel that silently ignores k or v_mean."""
    q, K, V, vm = random_case(1, 3, 1, 64, 16)
    a = sparq_attention_reference(q, K, V, vm, k=8, r=4, l=2)
    b = sparq_attention_reference(q, K, V, vm + 1.0, k=8, r=4, l=2)
    assert (a.alpha < 1).all()
    torch.testing.assert_close(b.out - a.out, (1 - a.alpha)[..., None].expand_as(a.out))
    assert not torch.allclose(a.out, dense(q, K, V), atol=1e-3)


@needs_triton
@pytest.mark.parametrize("B,H_q,H_kv,S,d,k,r,l,block,sel_block,chunk", [
    (2, 3, 1, 100, 16, 20, 4, 5, 64, 32, 16),     # G=3, d=16, S not a multiple of any block
    (1, 9, 3, 300, 64, 40, 8, 10, 128, 64, 64),   # our default model's heads (9 query / 3 KV)
    (3, 2, 2, 77, 64, 30, 64, 0, 32, 16, 32),     # G=1, r=d, no window, k-l > selection block
    (2, 3, 3, 50, 16, 60, 5, 7, 16, None, 2048),  # G=1, k > S
    (2, 3, 1, 33, 16, 6, 2, 6, 16, None, 2048),   # window fills k
])
@pytest.mark.parametrize("twice", [False, True], ids=["K", "K+K_t"])
def test_triton_matches_reference(B, H_q, H_kv, S, d, k, r, l, block, sel_block, chunk, twice):
    q, K, V, vm = random_case(B, H_q, H_kv, S, d, seed=S)
    ref = sparq_attention_reference(q, K, V, vm, k, r, l)
    K_t = K.transpose(-1, -2).contiguous() if twice else None
    got = sparq_attention_triton(q, K, V, vm, k, r, l, K_t=K_t, block_s=block,
                                 select_block=sel_block, row_chunk=chunk)
    assert torch.equal(got.positions, ref.positions)
    assert torch.equal(got.components, ref.components)
    torch.testing.assert_close(got.tau, ref.tau)
    torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.alpha, ref.alpha, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_half_precision_inputs():
    q, K, V, vm = random_case(2, 9, 3, 200, 64, seed=3)
    half = [t.half() for t in (q, K, V, vm)]
    ref = sparq_attention_reference(*half, k=32, r=16, l=8)
    got = sparq_attention_triton(*half, k=32, r=16, l=8, block_s=64)
    assert got.out.dtype == torch.float16
    assert torch.equal(got.positions, ref.positions)
    torch.testing.assert_close(got.out, ref.out, rtol=2e-3, atol=2e-3)


@needs_triton
def test_triton_position_ties_across_blocks():
    """Identical keys at 3, 20 and 40 (different blocks of 16 in every pass): k=2, l=0 must read
    3 and 20; the second selection pass has to break the tie between three equal candidates."""
    q, K, V, vm = random_case(1, 3, 1, 48, 16, seed=7)
    best = q[0].sum(0) * 3  # a key with a large score for every head of the group
    for p in (3, 20, 40):
        K[0, 0, p] = best
    for impl in (sparq_attention_reference,
                 lambda *a, **kw: sparq_attention_triton(*a, **kw, block_s=16, select_block=16,
                                                         row_chunk=4)):
        res = impl(q, K, V, vm, k=2, r=16, l=0)
        assert res.positions.tolist() == [[[3, 20]]]


def test_head_without_mass_on_components_gets_tau_one():
    q = torch.tensor([[[5.0, 0, 0, 0], [0, 0, 0, 1.0]]])  # r=1 keeps component 0: head 1 has none
    K = torch.randn(1, 1, 6, 4)
    res = sparq_attention_reference(q, K, K, K.mean(2), k=3, r=1, l=0)
    assert res.tau[0, 1].item() == 1.0
    assert torch.isfinite(res.out).all()
    assert res.scores[0, 1].tolist() == pytest.approx([1 / 6] * 6)


def test_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(sparq_triton, "sparq_attention_reference", lambda *a, **k: calls.append("ref"))
    monkeypatch.setattr(sparq_triton, "sparq_attention_triton", lambda *a, **k: calls.append("triton"))
    q, K, V, vm = (t.cpu() for t in worked_example())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    sparq_attention(q, K, V, vm, 3, 1, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    sparq_attention(q, K, V, vm, 3, 1, 1)
    sparq_attention(q.double(), K.double(), V.double(), vm.double(), 3, 1, 1)
    assert calls == ["ref", "triton" if sparq_triton.HAS_TRITON else "ref", "ref"]


def test_transfer_bytes_app_c():
    t = sparq_transfer_bytes(1024, 64, k=128, r=16)
    assert t["dense"] == (2 * 1024 * 64 + 2 * 64) * 2          # Eq. C1, 2-byte elements
    assert t["sparq"] == (1024 * 16 + 2 * 128 * 64 + 4 * 64) * 2  # Eq. C2
    assert t["ratio"] == pytest.approx(66048 / 262400)
    big = sparq_transfer_bytes(16384, 64, k=128, r=16, n_kv_heads=3, batch=64)
    assert big["dense"] == 3 * 64 * 2 * (2 * 16384 * 64 + 128)
    assert sparq_transfer_bytes(10, 4, k=50, r=9)["sparq"] == (10 * 4 + 2 * 10 * 4 + 16) * 2


def test_rejects_bad_arguments():
    q, K, V, vm = worked_example()
    with pytest.raises(ValueError):
        sparq_attention_reference(q, K, V, vm, k=0, r=1, l=0)
    with pytest.raises(ValueError):
        sparq_attention_reference(q[:, :, :3], K, V, vm, k=2, r=1, l=0)


if sparq_triton.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _top_n_probe(bits_ptr, out_ptr, n, N: tl.constexpr):
        offs = tl.arange(0, N)
        sel = sparq_triton._top_n_mask(tl.load(bits_ptr + offs), offs, n)
        tl.store(out_ptr + offs, sel.to(tl.int32))


@needs_triton
@pytest.mark.parametrize("bits,n,expect", [
    ([5, 7, 5, 5, 3, 5, -1, 7], 3, [1, 7, 0]),        # two 7s, then the earliest 5
    ([5, 7, 5, 5, 3, 5, -1, 7], 4, [1, 7, 0, 2]),
    ([5, 7, 5, 5, 3, 5, -1, 7], 2, [1, 7]),           # exact count: the search stops early
    ([5, 5, 5, 5, 5, 5, 5, 5], 2, [0, 1]),            # all tied: exactly n, earliest first
    ([2, -1, -1, 1, -1, -1, -1, -1], 5, [0, 3]),      # fewer valid than n: all valid
    ([2, 4, 3, 1, 0, 0, 0, 0], 0, []),
])
def test_top_n_mask_selects_exactly_n_earliest_on_ties(bits, n, expect):
    b = torch.tensor(bits, dtype=torch.int32, device=DEV)
    out = torch.zeros(8, dtype=torch.int32, device=DEV)
    _top_n_probe[(1,)](b, out, n, N=8)
    assert sorted(torch.nonzero(out).flatten().tolist()) == sorted(expect)


def test_reference_rows_with_lengths_equal_calls_on_truncated_caches():
    """``lengths`` lets one call serve a prompt's queries: each row as if its cache ended at its length."""
    g = torch.Generator().manual_seed(11)
    B, H_q, H_kv, S, d, k, r, l = 4, 6, 2, 23, 16, 6, 4, 2
    q = torch.randn(B, H_q, d, generator=g, dtype=torch.float64)
    K = torch.randn(1, H_kv, S, d, generator=g, dtype=torch.float64).expand(B, -1, -1, -1)
    V = torch.randn(1, H_kv, S, d, generator=g, dtype=torch.float64).expand(B, -1, -1, -1)
    lengths = torch.tensor([6, 9, 17, 23])
    v_mean = torch.stack([V[b, :, : int(n)].mean(1) for b, n in enumerate(lengths)])
    batched = sparq.sparq_attention_reference(q, K, V, v_mean, k, r, l, lengths=lengths)
    for b, n in enumerate(lengths.tolist()):
        alone = sparq.sparq_attention_reference(q[b:b + 1], K[b:b + 1, :, :n], V[b:b + 1, :, :n], v_mean[b:b + 1],
                                                k, r, l)
        torch.testing.assert_close(batched.out[b], alone.out[0])
        assert torch.equal(batched.positions[b], alone.positions[0])
        torch.testing.assert_close(batched.alpha[b], alone.alpha[0])
        torch.testing.assert_close(batched.scores[b, :, :n], alone.scores[0])
        assert (batched.scores[b, :, n:] == 0).all()
    with pytest.raises(ValueError, match="lengths"):
        sparq.sparq_attention_reference(q, K, V, v_mean, k, r, l, lengths=torch.tensor([5, 9, 17, 23]))


@needs_triton
@pytest.mark.parametrize("H_q,H_kv,S,d,k,r,l,block,sel_block,lengths", [
    (6, 2, 23, 16, 6, 4, 2, 16, 8, [6, 9, 17, 23]),              # a row of exactly k (alpha 1)
    (9, 3, 300, 64, 40, 8, 10, 64, 64, [40, 41, 63, 64, 65, 300]),  # lengths at block edges
    (3, 3, 77, 16, 30, 5, 0, 16, 16, [77, 30, 31, 50]),           # G=1, no window
])
@pytest.mark.parametrize("twice", [False, True], ids=["K", "K+K_t"])
def test_triton_rows_with_lengths_match_reference(H_q, H_kv, S, d, k, r, l, block, sel_block, lengths, twice):
    """The prompt path's call: one cache (batch stride 0) read by queries at several positions.
    Whole blocks and selection chunks past a row's length must leave that row untouched."""
    B = len(lengths)
    q, K, V, _ = random_case(B, H_q, H_kv, S, d, seed=S + B)
    K, V = K[:1].expand(B, -1, -1, -1), V[:1].expand(B, -1, -1, -1)
    v_mean = torch.stack([V[b, :, :n].mean(1) for b, n in enumerate(lengths)])
    ref = sparq_attention_reference(q, K, V, v_mean, k, r, l, lengths=lengths)
    K_t = K.transpose(-1, -2).contiguous() if twice else None
    got = sparq_attention_triton(q, K, V, v_mean, k, r, l, K_t=K_t, lengths=torch.tensor(lengths), block_s=block,
                                 select_block=sel_block)
    assert torch.equal(got.positions, ref.positions)
    torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.alpha, ref.alpha, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.out, ref.out, rtol=1e-5, atol=1e-5)
    assert (got.alpha[torch.tensor(lengths) == k] == 1).all()
    with pytest.raises(ValueError, match="lengths"):
        sparq_attention_triton(q, K, V, v_mean, k, r, l, lengths=torch.tensor([k - 1] + lengths[1:]))
