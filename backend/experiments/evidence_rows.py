"""Why each answer of a task leaderboard was right or wrong: its evidence (``analysis/evidence.py``) followed through
the stored traces of every row, and over a task whether holding the evidence predicts the score.

Computed from the store alone: a leaderboard row's run id is a share link whose manifest names the row's trace and
Full's (``runs.put_link``); nothing is run again. A row whose traces the store no longer holds is left out, and
counted.

    python -m backend evidence --leaderboard out/smol-niah/leaderboard.csv [--out DIR]
"""
from __future__ import annotations

import json
from collections.abc import Sequence

import pandas as pd

from ..analysis.evidence import Evidence, follow, locate, verdict
from ..runs import link_key
from ..traces.store import TraceStore, load_trace
from ..traces.trace import Trace

HELD = 0.5  # a sample's evidence counts as held when at least this share of it was read as the answer began
COLUMNS = ["model", "task", "length", "setting", "sample", "policy", "ratio", "spec", "score", "evidence_tokens",
           "missing", "held", "lost_layers", "attention", "full_attention", "attention_top_k", "verdict"]


def sample_evidence(tokenizer, full: Trace, references: Sequence[str], context_end: int | None) -> Evidence:
    """The references' tokens in the sample's prompt (Full's trace holds its tokens), before ``context_end``."""
    n_prompt = int(full.meta.get("n_prompt") or len(full.tokens))
    end = n_prompt if context_end is None or context_end <= 0 else min(int(context_end), n_prompt)
    return locate(tokenizer, full.tokens[:n_prompt], references, end)


def explain(tokenizer, rows: Sequence[tuple[str, Trace, float | None]], full: Trace, references: Sequence[str],
            context_end: int | None) -> tuple[Evidence, list[dict]]:
    """Per (name, trace, score): the held share, the layers that lost all evidence, the answer's attention on it
    beside Full's, and the verdict; Full's own row first."""
    evidence = sample_evidence(tokenizer, full, references, context_end)
    reference = follow(full, evidence)
    out = []
    for name, trace, score in [("Full", full, None), *rows]:
        mine = reference if trace is full else follow(trace, evidence)
        out.append({"name": name, "evidence_tokens": len(evidence.positions), "missing": ", ".join(evidence.missing),
                    "held": mine.held_share(reference), "lost_layers": int(mine.lost_layers(reference).sum()),
                    "attention": mine.mean_attention, "full_attention": reference.mean_attention,
                    "attention_top_k": mine.attention_top_k,
                    "verdict": verdict(name, mine, reference, evidence, score, context_end)})
    return evidence, out


def _manifest(store: TraceStore, run_id: str) -> dict | None:
    data = store.get(link_key(run_id)) if isinstance(run_id, str) and run_id else None
    try:
        return json.loads(data.decode("utf-8")) if data is not None else None
    except (UnicodeDecodeError, ValueError):
        return None


def evidence_frame(df: pd.DataFrame, store: TraceStore, tokenizer) -> tuple[pd.DataFrame, int]:
    """One row per leaderboard row whose traces are stored (``COLUMNS``), and how many were not."""
    out, missing = [], 0
    keys = ["model", "task", "length", "setting", "sample"]
    for sample, rows in df.groupby(keys, sort=False):
        manifests = {i: _manifest(store, str(row.run_id)) for i, row in rows.iterrows()}
        full_key = next((m["full_key"] for m in manifests.values() if m), None)
        full = load_trace(store, full_key) if full_key else None
        if full is None:
            missing += len(rows)
            continue
        asked = []
        for i, row in rows.iterrows():
            manifest = manifests[i]
            trace = full if row.policy == "full" else (load_trace(store, manifest["keys"][0])
                                                       if manifest and manifest["keys"] else None)
            if trace is None:
                missing += 1
                continue
            asked.append((i, trace, float(row.score)))
        first = rows.iloc[0]
        context_end = int(first.context_tokens) if pd.notna(first.get("context_tokens")) else None
        evidence, explained = explain(tokenizer, [(rows.loc[i, "policy"], t, s) for i, t, s in asked], full,
                                      json.loads(first.references), context_end)
        for (i, _, score), row in zip(asked, explained[1:]):
            source = rows.loc[i]
            out.append({**dict(zip(keys, sample)), "policy": source.policy, "ratio": source.ratio, "spec": source.spec,
                        "score": score, **{k: row[k] for k in COLUMNS if k in row}})
    return pd.DataFrame(out, columns=COLUMNS), missing


def evidence_summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per task, length, setting, policy and ratio: the mean score and held share, the answer's attention on the
    evidence beside Full's, and the samples where holding did not predict the answer: held but answered wrong,
    or lost but answered right (through another layer, or a guess)."""
    held = frame["held"] >= HELD
    right = frame["score"] >= 0.5
    frame = frame.assign(held_wrong=held & ~right, lost_right=~held & right, agrees=held == right)
    return (frame.groupby(["task", "length", "setting", "policy", "ratio"], sort=False, dropna=False)
            .agg(samples=("score", "size"), score=("score", "mean"), held=("held", "mean"),
                 attention=("attention", "mean"), full_attention=("full_attention", "mean"),
                 held_wrong=("held_wrong", "sum"), lost_right=("lost_right", "sum"), agrees=("agrees", "mean"))
            .reset_index())


def predicts(frame: pd.DataFrame) -> float:
    """The share of rows (Full's left out) where holding the evidence (``HELD``) and a right answer go together."""
    rows = frame[frame["policy"] != "full"]
    return float(((rows["held"] >= HELD) == (rows["score"] >= 0.5)).mean()) if len(rows) else float("nan")

