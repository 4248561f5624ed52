"""The limits every request meets: the Space's, which keep a shared 2-vCPU server responsive, and the command
line's, which fit the machine its user owns.

Texts may fill the model's context (8,192 tokens for the default model, 32,768 for Gemma 3 270M). What a
run may cost is bounded in **row-tokens**: each policy's row costs its length in tokens (twice for KVzip, whose reconstruction pass
re-reads the text), and a row that reads every key for every query (oracle, SparQ, ReAttention, Quest)
costs more as the text grows, ``length * length / SELECTION_UNIT`` when that is more. On a 2-vCPU Space,
32k row-tokens is four eviction policies at 8k
tokens (or eight at 4k, or one selection policy at 5.8k): a few minutes of work and under 6 GB, so the
queue moves. The Space's visitors pick among the packaged models and the operator's ``KVLENS_MODELS``.

The command line (``Limits.for_machine``) lets its user name any model and bounds a run by the machine's
memory instead: as many row-tokens as fit in it at the model's price (``RowPrice``, from its shapes), texts as
long as the model reads. Either way an operator may change a limit with ``KVLENS_MAX_<FIELD>`` (e.g.
``KVLENS_MAX_ROW_TOKENS=100000``); visitors cannot. Full is free everywhere: it is the reference row every run
computes anyway.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

MODELS_ENV = "KVLENS_MODELS"  # the operator's models for the Space, comma-separated (hub ids or local paths)
UNBOUNDED_TOKENS = 2 ** 31 - 1  # prompt_tokens where the model's context alone bounds a text (the command line's)
FLOAT_BYTES = 4  # float32: the command line's default dtype, and what the logits are computed in
# A row's keys and values, times this: the cache's quarter of spare room, generate mode's fork of the cache (the
# scoring copy beside the decoding one), the Full row beside the counted ones and the process around them. The
# default model peaked at 192 KB a row-token at 8k (32k row-tokens under 6 GB): four times its 45 KB of keys and
# values, plus its logits' share.
KV_PEAK = 4
STATE_BYTES = 12  # per token, layer and KV head: a policy's running score (float64) and the trace's drop step (int32)
LOGIT_COPIES = 4  # the LM head's output, its soft-capping, its log-softmax and its product with Full's probabilities
ACTIVATIONS = 16  # hidden-size vectors a block keeps per position: residual stream, norms, projections, the MLP's


@dataclass(frozen=True)
class RowPrice:
    """The memory one row of a run takes on a model, from the model's shapes: ``per_token`` for every token it
    reads (its keys and values in every layer, and its policy's state), ``per_row`` once whatever the length (the
    logits of a slice of positions over the whole vocabulary, and a block's activations). Gemma's 262k-token
    vocabulary makes its rows dear; SmolLM2's three KV heads in 30 layers, its tokens."""

    per_token: int
    per_row: int

    @classmethod
    def of(cls, config) -> "RowPrice":
        """The price of a model by its transformers config: layers, KV heads, head size, hidden size, vocabulary."""
        from .engine import DEFAULT_CHUNK, LM_HEAD_CHUNK  # positions per forward call, per LM-head call

        layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        keys_and_values = 2 * layers * kv_heads * head_dim * FLOAT_BYTES
        logits = LM_HEAD_CHUNK * config.vocab_size * FLOAT_BYTES * LOGIT_COPIES
        activations = DEFAULT_CHUNK * config.hidden_size * FLOAT_BYTES * ACTIVATIONS
        return cls(per_token=KV_PEAK * keys_and_values + layers * kv_heads * STATE_BYTES,
                   per_row=logits + activations)

    def row_token(self, length: int) -> int:
        """Bytes one row-token takes in rows of ``length`` tokens: a row's fixed part is shared by its tokens, so
        on short texts a large vocabulary costs the most."""
        return self.per_token + -(-self.per_row // max(1, length))


def machine_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class Limits:
    prompt_tokens: int = 32768  # tokens of the text (chat template included); the model's context bounds it too
    text_chars: int = 192 * 1024  # characters, checked before tokenizing (32k tokens of English take ~160k)
    new_tokens: int = 256  # generate mode
    policies: int = 8  # policies side by side in one run
    # One run: the sum of its rows' costs (row_cost). None: as many as the machine's memory holds at the model's price.
    row_tokens: int | None = 32 * 1024
    sweep_row_tokens: int | None = 64 * 1024  # one sweep: the same over its (policy, budget) pairs; None: twice that
    models: tuple[str, ...] | None = None  # the models a request may name; None: any the machine can load

    @classmethod
    def settings(cls) -> list[str]:
        """The ``KVLENS_MAX_<FIELD>`` variable of every numeric limit."""
        return [f"KVLENS_MAX_{field.name.upper()}" for field in fields(cls) if field.type in NUMERIC]

    @classmethod
    def from_env(cls, environ=os.environ) -> "Limits":
        """The Space's limits: defaults with ``KVLENS_MAX_<FIELD>`` overrides, and the packaged models plus
        ``KVLENS_MODELS``; ValueError names a malformed variable."""
        from .engine.models import PACKAGED

        operator = tuple(m.strip() for m in environ.get(MODELS_ENV, "").split(",") if m.strip())
        return cls._overridden(cls(models=tuple(dict.fromkeys([*PACKAGED, *operator]))), environ)

    @classmethod
    def for_machine(cls, environ=os.environ) -> "Limits":
        """The command line's limits: any model, texts up to the model's context, and as many row-tokens as the
        machine's memory holds; ``KVLENS_MAX_<FIELD>`` still overrides."""
        machine = cls(prompt_tokens=UNBOUNDED_TOKENS, text_chars=16 * 2 ** 20, new_tokens=4096, policies=64,
                      row_tokens=None, sweep_row_tokens=None, models=None)
        return cls._overridden(machine, environ)

    def prompt_tokens_in_words(self) -> str:
        """The prompt-token limit as a message says it: "32,768 tokens", or the model's context where that alone
        bounds a text."""
        if self.prompt_tokens >= UNBOUNDED_TOKENS:
            return "as many tokens as the model reads"
        return f"{self.prompt_tokens:,} tokens"

    def row_token_limit(self, price: RowPrice | None, length: int, sweep: bool = False,
                        memory: int | None = None) -> int:
        """The row-tokens one run (or ``sweep``) may use on rows of ``length`` tokens of a model of ``price``: the
        limit set, or where it is None as many as ``memory`` (default: the machine's) holds, never fewer than the
        Space's; the Space's too while the model is not known (``price`` None)."""
        limit, floor = (self.sweep_row_tokens, Limits.sweep_row_tokens) if sweep else \
            (self.row_tokens, Limits.row_tokens)
        if limit is not None:
            return limit
        if price is None:
            return floor
        fitting = (machine_memory() if memory is None else memory) // price.row_token(length)
        return max(floor, 2 * fitting if sweep else fitting)

    @classmethod
    def _overridden(cls, limits: "Limits", environ) -> "Limits":
        changes = {}
        for field in fields(cls):
            if field.type not in NUMERIC:
                continue
            name = f"KVLENS_MAX_{field.name.upper()}"
            text = environ.get(name)
            if text is None:
                continue
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"{name}={text!r} must be a positive integer")
            changes[field.name] = int(text)
        return replace(limits, **changes)


NUMERIC = ("int", "int | None")  # the limits' field types an operator may set

# A selection row costs length * length / SELECTION_UNIT row-tokens when that is more. Its reads are spans
# (traces/spans.py), 12 bytes each and ~36 while a trace is assembled; SparQ at 8k on the default model records
# 1.3-1.6 x 10^8 of them and peaked at 8.5 GB (ratio 0.875), under the 12.2 GB its 65,536 row-tokens are priced at.
SELECTION_UNIT = 1024


def row_cost(policy, length: int) -> int:
    """Row-tokens of one policy's row over ``length`` tokens: linear when its work per step is bounded by the
    budget (eviction, compression, StreamingLLM's window; the Full row is the plain model's and not
    counted), once more per extra pass over the text (KVzip), quadratic beyond SELECTION_UNIT when every
    query reads every key (``policy.reads_every_key``)."""
    per_pass = max(length, length * length // SELECTION_UNIT) if policy.reads_every_key else length
    return per_pass * (1 + policy.extra_passes)


def counted(policies) -> list:
    """The rows a request pays for: Full is free, the reference row every run computes anyway."""
    return [p for p in policies if p.kind != "full"]


def rows_cost(policies, length: int) -> int:
    """Row-tokens of ``policies`` over ``length`` tokens (Full free): what a request is checked against."""
    return sum(row_cost(p, length) for p in counted(policies))


def longest_fitting(policies, limit: int) -> int:
    """The most tokens ``policies`` may read within ``limit`` row-tokens (row costs grow with the length)."""
    lo, hi = 0, max(1, limit)  # every counted row costs at least its length
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if rows_cost(policies, mid) <= limit else (lo, mid - 1)
    return lo


def most_fitting(policies, length: int, limit: int) -> int:
    """How many of ``policies``' counted rows fit within ``limit`` at ``length`` tokens, cheapest first."""
    spent, fitting = 0, 0
    for cost in sorted(row_cost(p, length) for p in counted(policies)):
        spent += cost
        if spent > limit:
            break
        fitting += 1
    return fitting
