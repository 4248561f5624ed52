"""Rows that read as Full take Full's prefill (``Policy.first_departure``, ``PolicyCache.share``): an eviction
policy reads every token until its budget fills, a compression policy in generate mode until the prompt (or a
query-agnostic run's context) ends, so the row stays out of the batch until then and follows Full's queries, keys
and values. Every trace must be the same to the
bit with the sharing on and off, for every policy, on every family's test model and on both packaged models."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from backend.engine import attention
from backend.engine.attention import PolicyCache, RowLayerState
from backend.engine.models import GEMMA_MODEL, shared_model
from backend.engine.runner import compute_traces
from backend.policies import POLICIES, SnapKV, parse_spec
from tests.conftest import make_tiny
from tests.test_families import FAMILIES, IDS, refused, tiny_family


def traces(monkeypatch, lm, specs, ids, share: bool, context_end=None, max_new_tokens=6):
    monkeypatch.setattr(PolicyCache, "share", share)
    return compute_traces(lm, specs, [parse_spec(s, context_end or len(ids)) for s in specs], ids, mode="generate",
                          max_new_tokens=max_new_tokens, context_end=context_end)


def assert_same(shared, alone) -> None:
    """Every array and the metadata of each trace, to the bit."""
    for one, other in zip(shared, alone):
        assert one.meta == other.meta
        mine, theirs = one.arrays(), other.arrays()
        assert sorted(mine) == sorted(theirs), one.spec
        for name in mine:
            np.testing.assert_array_equal(mine[name], theirs[name], err_msg=f"{one.spec}: {name}")


def assert_scored_alike(monkeypatch, lm, specs, ids, **kwargs) -> None:
    """Prompt mode: every trace, Full's too, the same to the bit with the sharing on and off."""
    runs = []
    for share in (True, False):
        monkeypatch.setattr(PolicyCache, "share", share)
        runs.append(compute_traces(lm, specs, [parse_spec(s, len(ids)) for s in specs], ids, mode="prompt", **kwargs))
    (shared, full_shared), (alone, full_alone) = runs
    assert_same([*shared, full_shared], [*alone, full_alone])


def block_sizes(monkeypatch) -> list[tuple[int, int]]:
    """(rows, tokens) of every forward call's block in layer 0 from here on."""
    sizes = []
    forward = attention.PolicyCache.attend

    def counted(cache, layer, query, *args, **kwargs):
        if layer == 0:
            sizes.append((query.shape[0], query.shape[2]))
        return forward(cache, layer, query, *args, **kwargs)

    monkeypatch.setattr(attention.PolicyCache, "attend", counted)
    return sizes


def every_policy(lm, context: int) -> list[str]:
    """Every registered policy at half the context's tokens (or its own settings), where it runs on this model."""
    return [POLICIES[name].for_ratio(0.5, context).spec() for name in POLICIES
            if name != "full" and not refused(lm, name)]


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("context_end", [None, 14])
def test_every_policy_reads_the_same_with_and_without_full_s_prefill(family, context_end, monkeypatch):
    lm = tiny_family(family)
    specs = every_policy(lm, context_end or len(IDS))
    shared = traces(monkeypatch, lm, specs, IDS, True, context_end)
    alone = traces(monkeypatch, lm, specs, IDS, False, context_end)
    assert_same([*shared[0], shared[1]], [*alone[0], alone[1]])


@pytest.mark.parametrize("family", ["llama", "gemma2", "gemma3_text", "qwen3"])
@pytest.mark.parametrize("mode", ["generate", "prompt"])
def test_a_compression_row_whose_block_only_reads_skips_its_walk_and_reads_the_same(family, mode, monkeypatch):
    """A block in which no query compresses or is in a compression's window (a decoding step of SnapKV, Knorm, ...,
    most of Full's continuation scored) is read without the walk: every trace is the same to the bit with that
    path on and off, and the path is taken. Every policy compresses every 8 tokens of a text and every 6 of an
    answer, so blocks that compress and blocks that only read alternate."""
    lm = tiny_family(family)
    specs = [f"{s}{',' if ':' in s else ':'}interval=8,every=6" for s in every_policy(lm, len(IDS))
             if parse_spec(s).kind == "compression"]
    only_reads, taken = RowLayerState._only_reads, []

    def counted(state, *args):
        taken.append(only_reads(state, *args))
        return taken[-1]

    def run():  # layer 0 recorded (a recorded block is walked), the others not
        found, full = compute_traces(lm, specs, [parse_spec(s, 14 if mode == "generate" else len(IDS)) for s in specs],
                                     IDS, mode=mode, max_new_tokens=10, chunk=2, record_layers=(0,),
                                     context_end=14 if mode == "generate" else None)
        return [*found, full]

    monkeypatch.setattr(RowLayerState, "_only_reads", counted)
    fast = run()
    monkeypatch.setattr(RowLayerState, "_only_reads", lambda state, *args: False)
    assert any(taken) and not all(taken)
    assert_same(fast, run())


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_a_text_scored_teacher_forced_reads_the_same_with_and_without_full_s_prefill(family, monkeypatch):
    """Prompt mode: an eviction row follows Full until its budget fills; one whose budget the text never fills
    never joins the batch, and its trace, recorded keys included, is Full's reading."""
    lm = tiny_family(family)
    assert_scored_alike(monkeypatch, lm, every_policy(lm, len(IDS)) + ["h2o:budget=64", "tova:budget=8"], IDS)


@pytest.mark.parametrize("packaged", ["default", pytest.param("gemma", marks=pytest.mark.slow)])
def test_the_packaged_models_read_the_same_with_and_without_full_s_prefill(packaged, default_lm, monkeypatch):
    """In float32 and bfloat16-trained weights, with the rows Full's batch computes row by row: a row's numbers do not
    depend on which rows share its batch."""
    lm = default_lm if packaged == "default" else shared_model(GEMMA_MODEL)
    ids = lm.encode("The pass code is 4821. " * 6 + "Remember it well, and tell it when asked. What is the code?")
    end = len(ids) - 8
    specs = [name for name in ("snapkv:budget=16", "pyramidkv:budget=16", "knorm:budget=16", "think:budget=16",
                               "kivi", "tova:budget=16", "kvzip:budget=16", "quest:budget=16")
             if not refused(lm, name.split(":")[0])]
    for context_end in (None, end):
        shared = traces(monkeypatch, lm, specs, ids, True, context_end, max_new_tokens=4)
        alone = traces(monkeypatch, lm, specs, ids, False, context_end, max_new_tokens=4)
        assert_same([*shared[0], shared[1]], [*alone[0], alone[1]])
    # A text scored whose last block is short (2 tokens), Full alone in the model until its end.
    assert_scored_alike(monkeypatch, lm, ["tova:budget=64", "h2o:budget=64", "tova:budget=32"], ids[:18], chunk=8)


def test_rows_that_read_as_full_stay_out_of_the_batch_until_they_depart(tiny, text_ids, monkeypatch):
    """TOVA first drops after its 10th query, SnapKV, Knorm and KVzip (after its second pass) compress once the
    context (24 tokens) is read: the first block carries Full alone, the next two Full and TOVA, the rest every row.
    With the sharing off, every block carries every row."""
    sizes = block_sizes(monkeypatch)
    specs = ["snapkv:budget=12", "tova:budget=10", "knorm:budget=12", "kvzip:budget=12"]
    (snap, _, knorm, kvzip), _ = compute_traces(tiny, specs, [parse_spec(s) for s in specs], text_ids[:30],
                                                mode="generate", max_new_tokens=3, chunk=8, context_end=24)
    assert sizes[:3] == [(1, 8), (2, 8), (2, 8)]  # the context's blocks
    assert {rows for rows, _ in sizes[3:]} == {5}  # the question, then the answers: every row
    monkeypatch.setattr(PolicyCache, "share", False)
    sizes.clear()
    compute_traces(tiny, specs, [parse_spec(s) for s in specs], text_ids[:30], mode="generate", max_new_tokens=3,
                   chunk=8, context_end=24)
    assert {rows for rows, _ in sizes} == {5}
    # What they read: every earlier token until the context's end, less from then on.
    for trace in (snap, knorm, kvzip):
        reads = trace.reads(0)  # [H, steps, positions]
        causal = np.tril(np.ones((24, 24), bool))
        assert (reads[:, :24, :24] == causal).all() and not reads[:, :24, 24:].any(), trace.spec
        assert (reads[:, 24:].sum(-1) < np.arange(25, reads.shape[1] + 1)).all(), trace.spec


def test_a_policy_that_compresses_before_its_declared_departure_is_caught(tiny, text_ids, monkeypatch):
    """The engine follows a row only while its policy keeps the promise ``first_departure`` makes."""

    class Early(SnapKV):
        def compresses_after(self, t, n_prompt):
            return t == 15 or super().compresses_after(t, n_prompt)

    with pytest.raises(RuntimeError, match="compresses before its first departure"):
        compute_traces(tiny, ["early"], [Early(budget=12)], text_ids[:30], mode="generate", max_new_tokens=2,
                       context_end=24)


def test_an_eviction_policy_that_drops_before_its_declared_departure_is_caught(tiny, text_ids):
    from backend.policies import TOVA

    class Early(TOVA):
        def first_departure(self, n_prompt):
            return self.budget + 4

    with pytest.raises(RuntimeError, match="drops a token before its first departure"):
        compute_traces(tiny, ["early"], [Early(budget=8)], text_ids[:30], mode="generate", max_new_tokens=2,
                       chunk=4)


def test_a_row_departs_where_its_policy_first_reads_less():
    snap = SnapKV(budget=12)
    assert snap.first_departure(24) == 24 and snap.first_departure(None) == 0  # prompt mode: every interval
    assert parse_spec("kvzip:budget=12").first_departure(24) == 24  # its second pass comes after the context
    assert parse_spec("kvzip:budget=12").first_departure(None) == 0  # prompt mode: a pass every interval
    assert parse_spec("tova:budget=12").first_departure(None) == 12  # the query after the one that fills it
    assert parse_spec("quest:budget=32").first_departure(24) == 32  # its own page and the one before: all
    assert parse_spec("quest:budget=40").first_departure(None) == 32  # two whole pages of 16
    assert parse_spec("quest:budget=32,prefill=dense").first_departure(48) == 48  # the prompt read exactly
    assert parse_spec("sparq:budget=32").first_departure(24) == 32 == parse_spec("oracle:budget=32").first_departure(8)
    assert parse_spec("oracle:budget=32,prefill=dense").first_departure(48) == 48
    assert parse_spec("streamingllm:budget=32").first_departure(None) == 32
    # Chunks of 16 from global + local = 48 (64 - 2 x 8): the one ending at 64 reads every token, the next votes.
    assert parse_spec("reattention:budget=64").first_departure(None) == 64
    # global + local = 18, spans of 2 x 3: the chunk [18, 22) ends within the budget, [22, 26) does not.
    assert parse_spec("reattention:budget=24,global_size=2,span=3,topk=2,chunk=4").first_departure(None) == 22


SELECTING = ["oracle:budget=10", "sparq:budget=10", "quest:budget=14,page_size=4,dense_layers=0",
             "streamingllm:budget=10,sinks=2", "reattention:budget=24,global_size=2,span=3,topk=2,chunk=4"]


@pytest.mark.parametrize("mode", ["prompt", "generate"])
def test_a_selection_row_reads_as_full_until_its_departure_then_reads_less(tiny, text_ids, mode, monkeypatch):
    """Each selection policy's first departure is where its queries first read less than every earlier token: the
    row stays out of the batch until the block that holds it, every query before it reads everything (as Full's, with
    the figures an attending policy records for such a query), and the query at it reads less. The same traces to the
    bit with the sharing off."""
    sizes = block_sizes(monkeypatch)
    policies = [parse_spec(s) for s in SELECTING]
    context_end = 30 if mode == "generate" else None
    found, _ = compute_traces(tiny, SELECTING, policies, text_ids, mode=mode, chunk=4, max_new_tokens=4,
                              context_end=context_end)
    departures = [p.first_departure(context_end) for p in policies]
    assert departures == [10, 10, 12, 10, 22]
    ends = np.cumsum([tokens for _, tokens in sizes])
    for rows, end in zip((rows for rows, _ in sizes), ends):  # Full, then each row from its departure's block on
        print(rows, end)
    for trace, departure in zip(found, departures):
        reads = trace.reads(1)  # [H, steps, positions]
        causal = np.tril(np.ones((departure, departure), bool))
        assert (reads[:, :departure, :departure] == causal).all() and not reads[:, :departure, departure:].any()
        assert reads[:, departure, : departure + 1].sum(-1).min() < departure + 1, trace.spec
    sparq, quest = found[1].stats, found[2].stats
    assert (sparq["alpha"][:, :10] == 1).all() and (sparq["topk_agreement"][:, :10] == 1).all()  # [layer, step, head]
    assert (quest["pages_read"][:, :12] == (np.arange(12) // 4 + 1)[None, :, None]).all()
    monkeypatch.setattr(PolicyCache, "share", False)
    alone, _ = compute_traces(tiny, SELECTING, policies, text_ids, mode=mode, chunk=4, max_new_tokens=4,
                              context_end=context_end)
    assert_same(found, alone)


def test_a_run_without_full_s_row_shares_nothing(tiny, text_ids, monkeypatch):
    """Benchmarks run policies without the reference row (``reference=False``): no row is Full's to follow, so every
    row computes its own prefill, as with the sharing off."""
    from backend.engine.runner import generate

    specs = ["tova:budget=8", "snapkv:budget=12"]
    runs = []
    for share in (True, False):
        monkeypatch.setattr(PolicyCache, "share", share)
        cache, outputs, _ = generate(tiny, text_ids[:30], [parse_spec(s) for s in specs], 4, chunk=8, reference=False)
        runs.append((outputs, [cache.evicted_at(row) for row in range(len(specs))]))
    assert runs[0][0] == runs[1][0]
    for shared, alone in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(shared, alone)


def test_a_block_of_a_few_tokens_carries_enough_rows_for_products_of_four(text_ids, monkeypatch):
    """No row departs from Full in a text shorter than its budget, so Full goes alone, but the last block of 2
    tokens carries two rows: products of 4 rows, whose rounding is that of any larger batch (MKL on AMD multiplies
    1 to 3 rows with other kernels), as is its one prediction's (``runner._log_softmax`` makes up the rows). In
    float32, the traces are the same to the bit with the sharing on and off."""
    sizes = block_sizes(monkeypatch)
    assert_scored_alike(monkeypatch, make_tiny(dtype=torch.float32), ["tova:budget=64", "h2o:budget=64",
                                                                      "tova:budget=32"], text_ids[:18], chunk=8)
    assert sizes[:3] == [(1, 8), (1, 8), (2, 2)] and {rows for rows, _ in sizes[3:]} == {4}


# Run in a fresh interpreter: the first matrix product comes after ``import backend``, as in every front end.
FIRST_ROW_BY_BATCH = """import torch
import backend
from backend.engine.attention import FEWEST_PRODUCT_ROWS
torch.manual_seed(0)
weight, rows = torch.randn(576, 1536), torch.randn(75, 576)
first = (rows[:FEWEST_PRODUCT_ROWS] @ weight)[:1]
print(sum(not torch.equal((rows[:m] @ weight)[:1], first) for m in range(FEWEST_PRODUCT_ROWS, 76)))"""


def test_a_rows_product_does_not_depend_on_how_many_rows_share_its_batch():
    """What the to-the-bit tests above rest on, and on an AVX-512 machine MKL gives only in its strict mode, which
    ``import backend`` sets (where MKL has not started): with a thread per process, as the suite's workers run, a
    row's product by SmolLM2's shapes is the same in a batch of ``FEWEST_PRODUCT_ROWS`` to 75 rows (and, on Intel's
    processors, of fewer)."""
    env = {key: value for key, value in os.environ.items() if key != "MKL_CBWR"}
    result = subprocess.run([sys.executable, "-c", FIRST_ROW_BY_BATCH], capture_output=True, text=True, timeout=120,
                            env={**env, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0 and result.stdout.strip() == "0", (result.stdout, result.stderr[-500:])
