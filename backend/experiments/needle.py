"""Needle in a haystack: one cell per (context length, needle depth), every policy in one run.

The haystack, for a cell (length L, depth d, seed s), deterministic from (L, d, s) alone:

* **Filler**: sentences of the shipped public-domain corpora (the inaugural addresses, then the State of
  the Union addresses; ``texts.py``), in order, starting at a sentence chosen by the seed, as many as fit.
* **Needle**: ``NEEDLE`` holding a random number of 5 to 7 digits (drawn from the seed, the length and the
  depth), inserted between two filler sentences at the fraction ``d`` of them (0 = first, 1 = last).
* **Question** at the end: ``QUESTION``. The whole is one user turn of the model's chat template; a base
  model (no chat template) reads it as is, followed by ``BASE_CUE`` for it to complete.
* **Length**: the prompt takes ``L - new_tokens`` tokens (within a few), so prompt and answer fill ``L``:
  at the model's context (8192) the answer still fits.

Every policy of the grid is a row of one generate-mode run per cell (Full is the reference row), through
the store, so a re-run replays. The answer is the greedy continuation; a cell is found when the
needle's number appears in it.
"""
from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import lru_cache

import pandas as pd

from ..engine.models import LoadedModel
from ..policies import parse_spec
from ..runs import ENGINE_VERSION, replay_or_compute
from ..traces.store import TraceStore
from ..texts import corpus_files, corpus_text

NEEDLE = "The secret number is {number}."
QUESTION = "What is the secret number mentioned in the text above? Answer with the number only."
BASE_CUE = "\nAnswer: The secret number is"  # a base model (no chat template) completes the answer instead
NEW_TOKENS = 16  # the greedy answer: enough for a 7-digit number and a few words around it
COLUMNS = ["policy", "budget", "spec", "length", "depth", "found", "answer", "number", "tokens", "seed"]


@dataclass(frozen=True)
class Cell:
    """One retrieval: a haystack of ``length`` tokens (prompt and answer) with the needle at ``depth``."""

    length: int
    depth: float
    seed: int = 0

    def number(self) -> str:
        rng = random.Random(f"needle:{self.seed}:{self.length}:{self.depth}")
        digits = rng.randint(5, 7)
        return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


@lru_cache(maxsize=1)
def filler_sentences() -> tuple[str, ...]:
    """The shipped corpora as sentences (a plain split at . ! ? followed by space; good enough for filler)."""
    text = " ".join(corpus_text(corpus, name) for corpus in ("inaugural", "state_union")
                    for name in corpus_files(corpus))
    return tuple(s for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s) > 1)


def haystack(lm: LoadedModel, cell: Cell, new_tokens: int = NEW_TOKENS) -> tuple[str, list[int]]:
    """The cell's prompt text and its token ids (chat template applied): ``cell.length - new_tokens`` tokens,
    or fewer by less than a sentence (whole sentences only)."""
    target = cell.length - new_tokens
    if target < 32:
        raise ValueError(f"a needle cell needs length >= {32 + new_tokens}, got {cell.length}")
    sentences = filler_sentences()
    start = random.Random(f"filler:{cell.seed}").randrange(len(sentences))

    def build(count: int) -> tuple[str, list[int]]:
        filler = [sentences[(start + i) % len(sentences)] for i in range(count)]
        at = round(cell.depth * count)
        body = " ".join(filler[:at] + [NEEDLE.format(number=cell.number())] + filler[at:])
        text = f"{body}\n\n{QUESTION}" + ("" if lm.chats else BASE_CUE)
        return text, lm.encode(text, chat=True)

    # The most whole sentences that fit: double until too long, then bisect (a dozen encodes at 8k tokens).
    fits, over = 0, 1
    while len(build(over)[1]) <= target:
        fits, over = over, over * 2
    while over - fits > 1:
        middle = (fits + over) // 2
        fits, over = (middle, over) if len(build(middle)[1]) <= target else (fits, middle)
    text, ids = build(fits)
    return text, ids


def found(answer: str, number: str) -> bool:
    """Does the greedy answer hold the needle's number (as a whole number, not inside a longer one)?"""
    return re.search(rf"(?<!\d){number}(?!\d)", answer.replace(",", "")) is not None


def run_cell(lm: LoadedModel, cell: Cell, specs: Sequence[str], store: TraceStore | None,
             new_tokens: int = NEW_TOKENS) -> list[dict]:
    """One cell: every spec as a row of one generate-mode run (nothing recorded); one result row per spec. A
    spec with a ratio takes its budget from the cell's prompt."""
    _, ids = haystack(lm, cell, new_tokens)
    policies = [parse_spec(spec, len(ids)) for spec in specs]
    asked = [(spec, policy) for spec, policy in zip(specs, policies) if policy.name != "full"]
    result = replay_or_compute(lm, [s for s, _ in asked], [p for _, p in asked], ids, "generate", new_tokens, store,
                          record_layers=())
    by_spec = dict(zip([s for s, _ in asked], result.traces))
    rows = []
    for spec, policy in zip(specs, policies):
        trace = result.full if policy.name == "full" else by_spec[spec]
        answer = lm.tokenizer.decode(trace.generated_ids, skip_special_tokens=True).strip()
        rows.append({"policy": policy.name, "budget": getattr(policy, "budget", None), "spec": spec,
                     "length": cell.length, "depth": cell.depth, "found": found(answer, cell.number()),
                     "answer": answer, "number": cell.number(), "tokens": len(ids), "seed": cell.seed})
    return rows


def cells(lengths: Sequence[int], depths: Sequence[float], seeds: Sequence[int] = (0,)) -> list[Cell]:
    """Every (length, depth, seed), in that order."""
    return [Cell(int(length), float(depth), int(seed)) for length in lengths for depth in depths for seed in seeds]


def cell_dict(cell: Cell) -> dict:
    return asdict(cell)


def needle_jobs(model: str, specs: Sequence[str], lengths: Sequence[int], depths: Sequence[float],
                seeds: Sequence[int] = (0,), new_tokens: int = NEW_TOKENS) -> list[dict]:
    """The grid's jobs (``backend.experiments.grid``), one per cell, every spec a row of it: what ``python -m backend
    needle`` and the app's grid both run, so equal grids share their checkpoint keys and store entries.
    SpecError for a spec that does not parse."""
    versions = {spec: type(parse_spec(spec)).version for spec in specs}
    return [{"kind": "needle", "model": model, "engine": ENGINE_VERSION, "versions": versions,
             "payload": {"cell": cell_dict(cell), "specs": list(specs), "new_tokens": new_tokens}}
            for cell in cells(lengths, depths, seeds)]


def needle_frame(results: Sequence[Sequence[dict]]) -> pd.DataFrame:
    """The rows of every job (``run_grid``'s result) as ``grid.csv``'s table: model, then ``COLUMNS``."""
    df = pd.DataFrame([row for rows in results for row in rows], columns=["model", *COLUMNS])
    df["budget"] = df["budget"].astype("Int64")
    return df
