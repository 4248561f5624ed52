"""The decoder families table of docs/models.md: for each family's tiny random-weight model (the same models as
tests/test_families.py), how far Full is from the plain model, how many policies at a budget above the length
equal Full, and how many give the same result on the prompt path as token by token. The plain model is
transformers' own eager attention.

    python -m benchmarks.families
"""
from __future__ import annotations

import numpy as np

from backend.engine.runner import compute_traces, score_text
from backend.policies import POLICIES
from tests.test_families import FAMILIES, IDS, NAMES, plain_logprobs, refused, tiny_family


def main() -> None:
    print("| family | Full vs plain model (max abs log-prob) | every policy at full budget = Full | "
          "prompt path = token loop |")
    print("|---|---:|---|---|")
    for family in FAMILIES:
        lm = tiny_family(family)
        (full,), _ = compute_traces(lm, ["full"], [POLICIES["full"]()], IDS, record_layers=())
        gap = float(np.abs(full.logprobs - plain_logprobs(lm)).max())
        equal, same, skipped = 0, 0, [name for name in NAMES if refused(lm, name)]
        ran = [name for name in NAMES if name not in skipped]
        for name in ran:
            (trace,), reference = compute_traces(lm, [name], [POLICIES[name].for_budget(64)], IDS, record_layers=())
            equal += bool(np.abs(trace.logprobs - reference.logprobs).max() <= 1e-9)
            policy = POLICIES[name].for_budget(6)
            _, whole, _ = score_text(lm, IDS, [policy], chunk=len(IDS))
            _, single, _ = score_text(lm, IDS, [policy], chunk=1)
            same += bool(np.abs(whole["logprobs"] - single["logprobs"]).max() <= 1e-9)
        refusal = f" ({', '.join(skipped)} refused: windows or soft-capping)" if skipped else ""
        print(f"| {family} | {gap:.1e} | {equal}/{len(ran)}{refusal} | {same}/{len(ran)} |", flush=True)


if __name__ == "__main__":
    main()
