"""The one set of limits every front end (app, CLI, sweep) enforces, so a public Space stays responsive.

Texts may fill the default model's context (8192 tokens). What a run may cost is bounded in
**row-tokens**: each policy's row costs its length in tokens (twice for KVzip, whose reconstruction pass
re-reads the text), and a row that reads every key for every query (oracle, SparQ, ReAttention, Quest)
costs more as the text grows, ``length * length / SELECTION_UNIT`` when that is more. On a 2-vCPU Space,
32k row-tokens is four eviction policies at 8k
tokens (or eight at 4k, or one selection policy at 5.8k): a few minutes of work and under 6 GB, so the
queue moves. An operator may change any limit with an environment variable ``KVLENS_MAX_<FIELD>``
(e.g. ``KVLENS_MAX_ROW_TOKENS=100000`` on a workstation); visitors cannot.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace


@dataclass(frozen=True)
class Limits:
    prompt_tokens: int = 8192  # tokens of the text (chat template included); the model's context bounds it too
    text_chars: int = 64 * 1024  # characters, checked before tokenizing (8192 tokens of English take ~40k)
    new_tokens: int = 256  # generate mode
    policies: int = 8  # policies side by side in one run
    row_tokens: int = 32 * 1024  # one run: the sum of its rows' costs (row_cost)
    sweep_row_tokens: int = 64 * 1024  # one sweep: the same over its (policy, budget) pairs

    @classmethod
    def from_env(cls, environ=os.environ) -> "Limits":
        """Defaults, with ``KVLENS_MAX_<FIELD>`` overrides; ValueError names a malformed one."""
        changes = {}
        for field in fields(cls):
            name = f"KVLENS_MAX_{field.name.upper()}"
            text = environ.get(name)
            if text is None:
                continue
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"{name}={text!r} must be a positive integer")
            changes[field.name] = int(text)
        return replace(cls(), **changes)


SELECTION_UNIT = 1024  # a selection row costs length * length / SELECTION_UNIT row-tokens when that is more


def row_cost(policy, length: int) -> int:
    """Row-tokens of one policy's row over ``length`` tokens: linear when its work per step is bounded by the
    budget (eviction, compression, StreamingLLM's window; the Full row is the plain model's and not
    counted), once more per extra pass over the text (KVzip), quadratic beyond SELECTION_UNIT when every
    query reads every key (``policy.reads_every_key``)."""
    per_pass = max(length, length * length // SELECTION_UNIT) if policy.reads_every_key else length
    return per_pass * (1 + policy.extra_passes)
