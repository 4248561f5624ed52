"""Numbers computed from traces alone: a metric never re-runs the model."""
from __future__ import annotations

import numpy as np

from .trace import Trace


def _counted(trace: Trace, values: np.ndarray) -> np.ndarray:
    """The positions metrics count: all of a scored text, or only Full's continuation in generate mode."""
    return values[trace.meta["score_start"]:]


def perplexity(trace: Trace) -> float:
    """exp of the mean negative log-prob of the counted tokens."""
    return float(np.exp(-_counted(trace, trace.logprobs).astype(np.float64).mean()))


def mean_kl_to_full(trace: Trace) -> float:
    """Mean KL(Full || policy) of the next-token distributions over the counted positions (nats)."""
    return float(_counted(trace, trace.kl_to_full).astype(np.float64).mean())


def top1_agreement(trace: Trace, full: Trace) -> float:
    """Share of counted positions where the policy's most likely next token is Full's."""
    if not np.array_equal(trace.scored_ids, full.scored_ids):
        raise ValueError("top-1 agreement needs both traces scored on the same text")
    return float((_counted(trace, trace.top1_ids) == _counted(full, full.top1_ids)).mean())


def summary_row(trace: Trace, full: Trace) -> dict:
    return {"ppl": perplexity(trace), "kl_to_full": mean_kl_to_full(trace), "top1_agreement": top1_agreement(trace, full)}
