"""``prefill``, SparQ's, Quest's and the oracle's choice of how a generate-mode run reads its prompt: select at every
query (the default) or read it exactly and select only while decoding, as the papers' QA runs serve."""
import numpy as np
import pytest

from backend.policies import SparQ, parse_spec
from backend.engine.runner import compute_traces


@pytest.mark.parametrize("spec", ["sparq:budget=6,r=3,prefill=dense", "quest:budget=8,page_size=2,dense_layers=0,prefill=dense",
                                  "oracle:budget=8,prefill=dense"])
def test_a_dense_prefill_reads_the_prompt_exactly_and_selects_while_decoding(tiny, text_ids, spec):
    """prefill=dense: the prompt's queries read everything (so the first answer token is Full's, and every prompt
    prediction equals Full's), the answer's queries select as before; prefill=select differs from Full there."""
    prompt = text_ids[:30]
    dense_spec, select_spec = spec, spec.replace(",prefill=dense", "")
    (dense, select), full = compute_traces(tiny, [dense_spec, select_spec], [parse_spec(dense_spec), parse_spec(select_spec)],
                                prompt, "generate", 6, chunk=8, record_layers=())
    n = len(prompt)
    assert dense.generated_ids[0] == full.generated_ids[0]
    np.testing.assert_array_equal(dense.logprobs[: n - 1], full.logprobs[: n - 1])
    assert not np.array_equal(select.logprobs[: n - 1], full.logprobs[: n - 1])  # the choice matters
    causal = np.tril(np.ones((n, n), bool))
    for layer in range(tiny.n_layers):
        assert (dense.reads(layer, slice(0, n), slice(0, n)) == causal).all()
        decoding = dense.reads(layer, slice(n, len(dense.tokens)))
        assert (decoding.sum(-1) <= 8).all()  # every answer query reads its budget, not the whole prompt


def test_a_dense_prefill_is_a_prompt_mode_no_op(tiny, text_ids):
    """Prompt mode has no prompt: every token selects, whatever ``prefill`` says."""
    (dense, select), _ = compute_traces(tiny, ["d", "s"], [SparQ(budget=6, r=3, prefill="dense"), SparQ(budget=6, r=3)],
                             text_ids, record_layers=())
    np.testing.assert_array_equal(dense.logprobs, select.logprobs)
    assert (dense.stats["alpha"][:, 6:] < 1).all()
    (dense, select), _ = compute_traces(tiny, ["d", "s"], [parse_spec("oracle:budget=6,prefill=dense"),
                                                           parse_spec("oracle:budget=6")], text_ids, record_layers=())
    np.testing.assert_array_equal(dense.logprobs, select.logprobs)


def test_a_dense_prompt_records_alpha_one_and_dense_transfer(tiny, text_ids):
    """A prompt read exactly reads as Full's (``SelectionPolicy.read_as_full``): alpha and agreement 1 and the dense
    transfer for both figures; the answer's queries, past the budget, select and fetch less than dense."""
    prompt = text_ids[:30]
    (trace,), _ = compute_traces(tiny, ["s"], [SparQ(budget=8, r=4, prefill="dense")], prompt, "generate", 4, chunk=8,
                                 record_layers=())
    n, stats = len(prompt), trace.stats  # [layer, step, ...]
    assert (stats["alpha"][:, :n] == 1).all() and (stats["topk_agreement"][:, :n] == 1).all()
    transfer = stats["transfer_bytes"]
    assert transfer.shape[1] > n
    assert (transfer[:, :n, 0] == transfer[:, :n, 1]).all()
    assert (transfer[:, n:, 0] < transfer[:, n:, 1]).all()


def test_prefill_must_be_select_or_dense():
    with pytest.raises(ValueError, match="prefill must be one of"):
        parse_spec("sparq:prefill=sparse")
    with pytest.raises(ValueError, match="prefill must be one of"):
        parse_spec("quest:prefill=full")
