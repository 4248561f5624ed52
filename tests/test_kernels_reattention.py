"""ReAttention selection: hand-worked nominations, votes, spans, ties; Triton == reference.

Run the Triton part on CPU with TRITON_INTERPRET=1 (it is skipped without CUDA or the interpreter).
"""
import pytest
import torch

from kernels import reattention, reattention_triton
from kernels.reattention import (chunk_groups, reattention_layout, reattention_select_chunks,
                                reattention_select_reference, rerotate_positions)
from kernels.reattention_triton import reattention_select, reattention_select_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
HAS_KERNEL = reattention_triton.HAS_TRITON and (torch.cuda.is_available()
                                         or __import__("os").environ.get("TRITON_INTERPRET") == "1")
needs_triton = pytest.mark.skipif(not HAS_KERNEL, reason="needs CUDA or TRITON_INTERPRET=1")


def triton_small_blocks(*args, **kw):
    return reattention_select_triton(*args, **kw, block_s=4)  # several blocks even for tiny S


IMPLS = [pytest.param(reattention_select_reference, id="reference"),
         pytest.param(triton_small_blocks, id="triton", marks=needs_triton)]

FIELDS = ["positions", "counts", "centres", "votes", "head_positions"]


def line_example():
    """S=10, global 2, local 2 -> middle 2..7. q = [1, 0], so the score is K[:, 0]:
    positions 0..9 score [9, 9, 1, 5, 3, 5, 2, 0, 9, 9]; the 9s are global/local, never candidates.
    Middle ranking: 3 (5) and 5 (5) tie -> 3 first; then 5, 4 (3), 6 (2), 2 (1), 7 (0).
    """
    K = torch.zeros(1, 1, 10, 2)
    K[0, 0, :, 0] = torch.tensor([9.0, 9, 1, 5, 3, 5, 2, 0, 9, 9])
    q = torch.tensor([[[1.0, 0.0]]])
    return q.to(DEV), K.to(DEV)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("topk,span,centres,positions", [
    (1, 1, [3], [3]),                  # tie 3 vs 5: earlier wins
    (2, 1, [3, 5], [3, 5]),
    (3, 1, [3, 5, 4], [3, 4, 5]),
    (2, 3, [3, 5], [2, 3, 4, 5, 6]),   # spans 2..4 and 4..6 overlap at 4: merged
    (1, 4, [3], [2, 3, 4]),            # span 1..4 (c - 2 .. c + 1) clipped at the global prefix
    (6, 2, [3, 5, 4, 6, 2, 7], [2, 3, 4, 5, 6, 7]),  # span 6..7 of 7 clipped at the local suffix
])
def test_single_head_topk_span_merge(impl, topk, span, centres, positions):
    q, K = line_example()
    sel = impl(q, K, 2, 2, span, topk)
    assert sel.centres.tolist() == [[centres]]
    assert sel.row(0, 0).tolist() == positions
    assert sel.counts.tolist() == [[len(positions)]]
    assert sel.votes.tolist() == [[[1] * len(centres)]]


@pytest.mark.parametrize("impl", IMPLS)
def test_head_scores_are_float64(impl):
    """Position 4 scores 1e8 + 1 and position 3 scores 1e8: equal in float32 (the earlier, 3, would
    win), distinct in float64 (4 wins). Both inputs are exact in float32."""
    K = torch.zeros(1, 1, 8, 2)
    K[0, 0, 3] = torch.tensor([1e8, 0.0])
    K[0, 0, 4] = torch.tensor([1e8, 1.0])
    q = torch.tensor([[[1.0, 1.0]]])
    sel = impl(q.to(DEV), K.to(DEV), 1, 1, 1, 1)
    assert sel.head_scores.dtype == torch.float64
    assert sel.head_positions.tolist() == [[[4]]]
    assert sel.head_scores.tolist() == [[[1e8 + 1]]]


def vote_example():
    """G=3 query heads share one KV head; q_g = e_g, so head g scores column g of K. S=8, no
    global/local. Each head nominates 2 (per_head_k=2):
      head 0: col0 [0,5,4,0,0,0,0,0] -> 1 (5), 2 (4)
      head 1: col1 [0,0,6,3,0,0,0,0] -> 2 (6), 3 (3)
      head 2: col2 [0,0,1,0,0,0,3,0] -> 6 (3), 2 (1)
    Votes: 2 -> 3; 1, 3, 6 -> 1 each, best scores 5, 3, 3. Ranking: 2, 1, then 3 and 6 tie on
    votes and score -> 3 (earlier) before 6.
    """
    K = torch.zeros(1, 1, 8, 3)
    K[0, 0, :, 0] = torch.tensor([0.0, 5, 4, 0, 0, 0, 0, 0])
    K[0, 0, :, 1] = torch.tensor([0.0, 0, 6, 3, 0, 0, 0, 0])
    K[0, 0, :, 2] = torch.tensor([0.0, 0, 1, 0, 0, 0, 3, 0])
    q = torch.eye(3)[None]
    return q.to(DEV), K.to(DEV)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("topk,centres,votes", [
    (1, [2], [3]),
    (2, [2, 1], [3, 1]),
    (3, [2, 1, 3], [3, 1, 1]),
    (4, [2, 1, 3, 6], [3, 1, 1, 1]),
    (5, [2, 1, 3, 6, -1], [3, 1, 1, 1, 0]),  # only 4 distinct nominations exist
])
def test_votes_across_group(impl, topk, centres, votes):
    q, K = vote_example()
    sel = impl(q, K, 0, 0, 1, topk, per_head_k=2)
    assert sel.head_positions.tolist() == [[[1, 2], [2, 3], [6, 2]]]
    assert sel.centres.tolist() == [[centres]]
    assert sel.votes.tolist() == [[votes]]
    assert sel.row(0, 0).tolist() == sorted(c for c in centres if c >= 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_exact_ties_repeated_keys(impl):
    """The best key repeated at 10, 11, 21 and 30 (blocks of 4 from 4: 10/11 share a block,
    21 and 30 are in others). Earlier positions must win every tie, for every head."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 16, generator=g)
    q[0, 1] = q[0, 0]
    q[0, 2] = q[0, 0]  # identical heads: identical nominations, 3 votes each
    K = torch.randn(1, 1, 40, 16, generator=g) * 0.1
    for p in (10, 11, 21, 30):
        K[0, 0, p] = q[0, 0] * 4
    q, K = q.to(DEV), K.to(DEV)
    sel = impl(q, K, 4, 4, 1, 3, per_head_k=2)
    assert sel.head_positions.tolist() == [[[10, 11]] * 3]
    assert sel.centres.tolist() == [[[10, 11, -1]]]
    assert sel.votes.tolist() == [[[3, 3, 0]]]
    sel = impl(q[:, :1], K, 4, 4, 1, 3)  # one head: its own top 3
    assert sel.centres.tolist() == [[[10, 11, 21]]]


@pytest.mark.parametrize("impl", [pytest.param(reattention_select_reference, id="reference"),
                                  pytest.param(reattention_select_triton, id="triton", marks=needs_triton)])
def test_equal_keys_score_equal_wherever_they_sit(impl):
    """One key repeated every 7 positions over a 704-key middle, 16 query heads per KV head: a plain float64
    matrix product scores some copies an ulp apart on the CPU (its tiles), and a later copy would win the tie.
    Only the first two copies may be nominated."""
    g = torch.Generator().manual_seed(728)
    q, K = torch.randn(1, 48, 64, generator=g), torch.randn(1, 3, 712, 64, generator=g)
    for h in range(3):
        K[0, h, 9::7] = q[0, 16 * h: 16 * (h + 1)].sum(0) * 3  # the best key for the group's heads together
    sel = impl(q.to(DEV), K.to(DEV), 4, 4, 1, 2)
    copies = set(range(9, 708, 7))
    nominated = {p for p in sel.head_positions.flatten().tolist() if p in copies}
    assert nominated == {9, 16}


def test_equal_keys_get_bitwise_equal_scores():
    """The scores both the reference and the batched chunks call rank (``_scores``)."""
    g = torch.Generator().manual_seed(728)
    q, K = torch.randn(3, 16, 64, generator=g), torch.randn(3, 704, 64, generator=g)
    K[:, 5::7] = K[:, :1]
    scores = reattention._scores(q.to(DEV), K.to(DEV))  # [H_kv, 16, 704]
    assert torch.equal(scores[..., 5::7], scores[..., :1].expand(-1, -1, len(range(5, 704, 7))))


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_middle(impl):
    q, K = line_example()
    sel = impl(q, K, 5, 5, 3, 2)
    assert sel.counts.tolist() == [[0]]
    assert sel.positions.shape == (1, 1, 0)
    assert sel.centres.tolist() == [[[-1, -1]]]


def random_case(B, H_q, H_kv, S, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H_q, d, generator=g)
    K = torch.randn(B, H_kv, S, d, generator=g)
    return q.to(DEV), K.to(DEV)


@needs_triton
@pytest.mark.parametrize("B,H_q,H_kv,S,d,glob,loc,span,topk,per_head,block", [
    (2, 3, 1, 300, 16, 4, 20, 3, 5, None, 64),   # G=3, d=16, middle not a multiple of the block
    (1, 9, 3, 400, 64, 32, 50, 8, 6, 4, 128),    # default model heads, paper-like settings
    (3, 2, 2, 77, 64, 2, 2, 1, 3, None, 32),     # G=1, batch 3
    (2, 6, 2, 203, 16, 0, 0, 5, 12, 9, 16),      # no global/local, per-head k < k'
    (1, 3, 1, 50, 16, 10, 10, 4, 8, 40, 16),     # per-head k > block: whole blocks are candidates
])
def test_triton_matches_reference(B, H_q, H_kv, S, d, glob, loc, span, topk, per_head, block):
    q, K = random_case(B, H_q, H_kv, S, d, seed=S)
    ref = reattention_select_reference(q, K, glob, loc, span, topk, per_head)
    got = reattention_select_triton(q, K, glob, loc, span, topk, per_head, block_s=block)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f
    torch.testing.assert_close(got.head_scores, ref.head_scores, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("H_q,H_kv,first,chunks,glob,loc,span,topk,max_scores", [
    (9, 3, 20, [(20, 24), (24, 28), (28, 32), (32, 35)], 2, 8, 2, 3, 1 << 24),  # a short last chunk
    (4, 1, 10, [(10, 14), (14, 18)], 4, 4, 3, 4, 1 << 24),   # the first chunk's middle (2) is under topk (4)
    (6, 2, 30, [(s, s + 1) for s in range(30, 40)], 3, 5, 1, 2, 500),  # decoding steps, in groups of 2
    (9, 3, 0, [(0, 10), (10, 14), (14, 18), (18, 21)], 2, 8, 2, 3, 1079),  # the opening, then in groups of 2 and 1
])
def test_chunks_at_once_select_as_each_chunk_alone(H_q, H_kv, first, chunks, glob, loc, span, topk, max_scores):
    """Every chunk of a block selected in one batched call equals the reference run on each chunk alone, its
    queries and the group's heads voting together over keys 0..e-1; repeated keys make exact ties."""
    g = torch.Generator().manual_seed(H_q + first)
    end = chunks[-1][1]
    q = torch.randn(H_q, end - first, 16, generator=g)
    K = torch.randn(H_kv, end + 3, 16, generator=g)  # keys past a chunk's end must not count
    K[:, 7] = K[:, 5]
    K[:, 12] = K[:, 5]
    q, K = q.to(DEV), K.to(DEV)
    got = reattention_select_chunks(q, K, chunks, first, glob, loc, span, topk, max_scores=max_scores)
    assert got.shape == (len(chunks), H_kv, end + 3)
    for c, (s, e) in enumerate(chunks):
        voters = q[:, s - first: e - first].reshape(1, -1, 16)
        ref = reattention_select_reference(voters, K[None, :, :e], glob, loc, span, topk)
        for h in range(H_kv):
            assert torch.nonzero(got[c, h]).flatten().tolist() == ref.row(0, h).tolist(), (c, h)


def test_chunk_groups_pad_no_chunk_to_a_wider_ones_size():
    opening, chunk = (2644, 3000), (16, 500)  # (rows, columns): a prompt's opening chunk, then 16-query chunks
    assert chunk_groups([opening, chunk, chunk, chunk], 16 * 500 * 2) == [(0, 1), (1, 3), (3, 4)]
    assert chunk_groups([chunk, chunk, opening], 16 * 500 * 2) == [(0, 2), (2, 3)]  # over the limit, alone
    assert chunk_groups([chunk, (4, 900), chunk], 16 * 900 * 3) == [(0, 3)]  # padded: 3 x 16 rows x 900 columns
    assert chunk_groups([chunk, (4, 900), chunk], 16 * 900 * 3 - 1) == [(0, 2), (2, 3)]
    assert chunk_groups([], 10) == []


@needs_triton
def test_the_kernel_selects_a_decoding_step_as_the_chunks_call_does():
    """On a GPU a block of one chunk (a decoding step) takes the kernel; its selection, read as a mask as the
    policy reads it, equals the batched call's."""
    g = torch.Generator().manual_seed(3)
    q, K = torch.randn(9, 1, 16, generator=g).to(DEV), torch.randn(3, 90, 16, generator=g).to(DEV)
    kernel = reattention_select_triton(q.reshape(1, 9, 16), K[None], 4, 20, 3, 4, block_s=16)
    assert torch.equal(kernel.mask(0, 90), reattention_select_chunks(q, K, [(89, 90)], 89, 4, 20, 3, 4)[0])


@needs_triton
def test_triton_half_inputs():
    q, K = random_case(2, 9, 3, 260, 64, seed=1)
    q, K = q.half(), K.half()
    ref = reattention_select_reference(q, K, 8, 16, 4, 6)
    got = reattention_select_triton(q, K, 8, 16, 4, 6, block_s=64)
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(ref, f)), f


def test_dispatch(monkeypatch):
    calls = []
    monkeypatch.setattr(reattention_triton, "reattention_select_reference", lambda *a: calls.append("ref"))
    monkeypatch.setattr(reattention_triton, "reattention_select_triton", lambda *a: calls.append("triton"))
    q, K = (t.cpu() for t in line_example())
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reattention_select(q, K, 2, 2, 1, 1)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reattention_select(q, K, 2, 2, 1, 1)
    assert calls == ["ref", "triton" if reattention_triton.HAS_TRITON else "ref"]


def test_rerotate_and_layout():
    assert rerotate_positions(5).tolist() == [0, 1, 2, 3, 4]
    original, new = reattention_layout(torch.tensor([3, 5]), S=10, global_size=2, local_size=2)
    assert original.tolist() == [0, 1, 3, 5, 8, 9]
    assert new.tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("shape,k", [((1, 3, 48, 1000), 2), ((2, 3, 9, 37), 7), ((1, 1, 1, 5), 5)])
@pytest.mark.parametrize("levels", [None, 3], ids=["distinct", "many-ties"])
def test_ranked_top_equals_the_head_of_a_stable_sort(shape, k, levels):
    """The reference's per-head nominations: the first k of a stable descending sort (earlier wins ties)."""
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(shape, generator=g, dtype=torch.float64) if levels is None else \
        torch.randint(0, levels, shape, generator=g).double()
    values, indices = reattention._ranked_top(scores, k)
    ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    assert torch.equal(indices, ranked.indices[..., :k]) and torch.equal(values, ranked.values[..., :k])
    assert reattention._ranked_top(scores, 0)[1].shape == shape[:-1] + (0,)
