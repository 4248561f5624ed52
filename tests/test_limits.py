"""What a row-token costs on each model, priced by the model's own shapes (no model names), and the command line's
limits, which fit the machine's memory at that price."""
import os

import pytest
from transformers import AutoConfig

from backend import api
from backend.api import RunRequest
from backend.limits import Limits, RowPrice

# The two packaged models' shapes, as their configs give them.
SMOLLM2 = AutoConfig.for_model("llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                               num_attention_heads=9, num_key_value_heads=3)
GEMMA3_270M = AutoConfig.for_model("gemma3_text", vocab_size=262144, hidden_size=640, num_hidden_layers=18,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=256)


def test_a_row_token_is_priced_by_the_models_shapes():
    # 2 layers, 1 KV head of 8 dimensions, hidden size 16, 100 tokens in the vocabulary. Per token a row holds its
    # keys and values (2 x 2 layers x 1 head x 8 float32 = 128 bytes), four times over, and 12 bytes of policy
    # state a layer and KV head; once per row, the logits of 64 positions (64 x 100 float32, four copies) and a
    # block's activations (256 positions x 16 float32, 16 vectors each).
    price = RowPrice.of(AutoConfig.for_model("llama", vocab_size=100, hidden_size=16, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=1))
    assert (price.per_token, price.per_row) == (4 * 128 + 2 * 12, 64 * 100 * 4 * 4 + 256 * 16 * 4 * 16)
    assert price.row_token(1000) == price.per_token + -(-price.per_row // 1000)  # a row's fixed part, shared
    assert price.row_token(1) == price.per_token + price.per_row


def test_gemma_3_270m_pays_for_its_vocabulary_per_row_and_smollm2_for_its_cache_per_token():
    smollm2, gemma = RowPrice.of(SMOLLM2), RowPrice.of(GEMMA3_270M)
    assert smollm2.row_token(8192) == pytest.approx(192 * 1024, rel=0.03)  # the default model, as measured at 8k
    assert gemma.per_row > 4 * smollm2.per_row  # the logits of 262,144 tokens against 49,152
    assert gemma.per_token < smollm2.per_token  # one KV head of 256 in 18 layers, against three of 64 in 30
    for length in (256, 2048, 4096):  # so Gemma's row-token costs more, the more so the shorter the text
        assert gemma.row_token(length) > smollm2.row_token(length)


def test_the_command_line_fits_its_row_tokens_to_the_machine_at_the_models_price():
    machine, space = Limits.for_machine({}), Limits.from_env({})
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    gemma = RowPrice.of(GEMMA3_270M)
    assert machine.models is None and machine.policies > space.policies and machine.new_tokens > space.new_tokens
    assert machine.row_token_limit(gemma, 2048) == max(space.row_tokens, memory // gemma.row_token(2048))
    big = 2 ** 40
    assert machine.row_token_limit(gemma, 2048, memory=big) == big // gemma.row_token(2048)
    assert machine.row_token_limit(gemma, 2048, sweep=True, memory=big) == 2 * (big // gemma.row_token(2048))
    assert machine.row_token_limit(RowPrice.of(SMOLLM2), 2048, memory=big) > big // gemma.row_token(2048)
    assert machine.row_token_limit(gemma, 2048, memory=2 ** 20) == space.row_tokens  # never below the Space's
    assert machine.row_token_limit(None, 2048) == space.row_tokens  # the model not known yet
    assert space.row_token_limit(gemma, 2048) == space.row_tokens  # the Space's is a number, whatever the model
    operator = Limits.for_machine({"KVLENS_MAX_ROW_TOKENS": "5000"})  # the operator decides
    assert operator.row_tokens == 5000 and operator.row_token_limit(gemma, 2048, memory=big) == 5000


def test_a_request_on_the_command_line_is_checked_at_its_models_price(tiny_session, monkeypatch):
    from backend import limits as limits_module
    from backend.engine.models import DEFAULT_MODEL, LOADED

    monkeypatch.setattr(limits_module, "machine_memory", lambda: 2 ** 40)
    lm = LOADED[DEFAULT_MODEL]
    cost = api.cost(RunRequest(prompt="the cat sat on the mat", specs=["tova:budget=4"], mode="prompt"),
                    Limits.for_machine({}))
    assert cost.limit == 2 ** 40 // RowPrice.of(lm.model.config).row_token(cost.length)
