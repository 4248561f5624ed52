"""``prefill``, SparQ's, Quest's and the oracle's choice of how a generate-mode run reads its prompt: select at every
query (the default) or read it exactly and select only while decoding, as the papers' QA runs serve."""
import numpy as np
import pytest
import torch

from backend.policies import SparQ, parse_spec
from backend.policies.base import Block
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


def test_a_dense_prompt_block_records_alpha_one_and_dense_transfer():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((6, 5, 16), (2, 30, 16), (2, 30, 16)))
    block = Block(q=q, k=k, v=v, first=25, scaling=0.25, n_prompt=30)
    _, result = SparQ(budget=8, r=4, prefill="dense").attend_block({}, block)
    logits = (q.view(2, 3, 5, 16) @ k.transpose(-1, -2)[:, None]) * 0.25
    visible = torch.arange(30)[None, :] <= torch.arange(25, 30)[:, None]
    expected = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1) @ v[:, None]
    torch.testing.assert_close(result.out, expected.permute(2, 0, 1, 3).reshape(5, 6, 16))
    assert (result.stats["alpha"] == 1).all() and (result.stats["topk_agreement"] == 1).all()
    assert (result.stats["transfer_bytes"][:, 0] == result.stats["transfer_bytes"][:, 1]).all()
    _, decoding = SparQ(budget=8, r=4, prefill="dense").attend_block({}, Block(q=q, k=k, v=v, first=25, scaling=0.25,
                                                                                n_prompt=29))
    assert (decoding.reads.sum(-1) == 8).all()  # a block reaching past the prompt selects


def test_prefill_must_be_select_or_dense():
    with pytest.raises(ValueError, match="prefill must be one of"):
        parse_spec("sparq:prefill=sparse")
    with pytest.raises(ValueError, match="prefill must be one of"):
        parse_spec("quest:prefill=full")
