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
memory instead: row-tokens as many as ``ROW_TOKEN_BYTES`` each fit in it, texts as long as the model reads.
Either way an operator may change a limit with ``KVLENS_MAX_<FIELD>`` (e.g. ``KVLENS_MAX_ROW_TOKENS=100000``);
visitors cannot. Full is free everywhere: it is the reference row every run computes anyway.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

MODELS_ENV = "KVLENS_MODELS"  # the operator's models for the Space, comma-separated (hub ids or local paths)
ROW_TOKEN_BYTES = 192 * 1024  # peak memory one row-token takes, measured at 8k (32k row-tokens peak under 6 GB)


@dataclass(frozen=True)
class Limits:
    prompt_tokens: int = 32768  # tokens of the text (chat template included); the model's context bounds it too
    text_chars: int = 192 * 1024  # characters, checked before tokenizing (32k tokens of English take ~160k)
    new_tokens: int = 256  # generate mode
    policies: int = 8  # policies side by side in one run
    row_tokens: int = 32 * 1024  # one run: the sum of its rows' costs (row_cost)
    sweep_row_tokens: int = 64 * 1024  # one sweep: the same over its (policy, budget) pairs
    models: tuple[str, ...] | None = None  # the models a request may name; None: any the machine can load

    @classmethod
    def settings(cls) -> list[str]:
        """The ``KVLENS_MAX_<FIELD>`` variable of every numeric limit."""
        return [f"KVLENS_MAX_{field.name.upper()}" for field in fields(cls) if field.type == "int"]

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
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        row_tokens = max(cls.row_tokens, memory // ROW_TOKEN_BYTES)
        machine = cls(prompt_tokens=2 ** 31 - 1, text_chars=16 * 2 ** 20, new_tokens=4096, policies=64,
                      row_tokens=row_tokens, sweep_row_tokens=2 * row_tokens, models=None)
        return cls._overridden(machine, environ)

    @classmethod
    def _overridden(cls, limits: "Limits", environ) -> "Limits":
        changes = {}
        for field in fields(cls):
            if field.type != "int":
                continue
            name = f"KVLENS_MAX_{field.name.upper()}"
            text = environ.get(name)
            if text is None:
                continue
            if not text.strip().isdigit() or int(text) < 1:
                raise ValueError(f"{name}={text!r} must be a positive integer")
            changes[field.name] = int(text)
        return replace(limits, **changes)


SELECTION_UNIT = 1024  # a selection row costs length * length / SELECTION_UNIT row-tokens when that is more


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
